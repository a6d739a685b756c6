"""A small reward model as TRL saves one (transformers' sequence classifier, one label, a tokenizer beside it),
and transformers' score of a text: what tests/test_reward_model.py holds ours to."""

from __future__ import annotations

import random

import torch
import transformers

from helpers import chat

KINDS = {
    "LlamaForSequenceClassification": transformers.LlamaConfig,
    "MistralForSequenceClassification": transformers.MistralConfig,
    "Qwen2ForSequenceClassification": transformers.Qwen2Config,
}


def reward_dir(rng: random.Random, path, template: str | None = None, labels: int = 1):
    """A small reward model as TRL saves one: transformers' classifier with one label, and a tokenizer (a chat
    template beside it where `template` names one)."""
    tok = chat.tokenizer()
    heads = rng.choice([2, 4])
    arch = rng.choice(list(KINDS))
    config = KINDS[arch](
        vocab_size=tok.vocab_size,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=rng.choice([1, 2]),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([1, heads]),
        max_position_embeddings=128,
        num_labels=labels,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    print("reward model", arch, heads, "heads, template", template)
    torch.manual_seed(rng.randrange(2**31))
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(path)
    if template:
        chat.model_dir(path, template, tok=tok)
    else:
        (path / "tokenizer.json").write_text(tok.text)
    return path, model


def theirs(model, tok, text: str, add_special_tokens: bool) -> float:
    ids = torch.tensor([tok.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()
