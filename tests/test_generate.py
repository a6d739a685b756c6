"""Sampling (app/generate.py): the KV cache gives what recomputing the whole sequence gives, for each family and
position kind (drawn from a printed seed); a Hugging Face Llama generates what `transformers` generates, greedily;
`etrain generate` on a Hugging Face directory with its tokenizer; prompts that do not fit are refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from app.cli import main
from app.core.config import ConfigError, ModelConfig
from app.core.model import make_model
from app.generate import _draw, generate
from pipelines import tokenizer

VARIANTS = {
    "gpt-rotary": dict(),
    "gpt-learned": dict(positions="learned"),
    "llama-gqa": dict(family="llama", n_kv_head=2),
    "llama-scaled": dict(family="llama", n_kv_head=1, rope_scaling={"original_max_position_embeddings": 8}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_kv_cache_gives_what_recomputing_the_sequence_gives(variant, rng):
    torch.manual_seed(rng.randrange(2**31))
    model = make_model(ModelConfig(n_layer=2, n_head=4, d_model=32, seq_len=40, vocab_size=50, **VARIANTS[variant]))
    prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
    cached = generate(model.eval(), prompt, 20)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):  # no cache: the whole sequence each time, causally
            seq.append(int(model.logits(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == seq[len(prompt) :]
    sampled = generate(model, prompt, 20, temperature=1.0, top_p=0.9, seed=3)
    assert sampled == generate(model, prompt, 20, temperature=1.0, top_p=0.9, seed=3)  # a seed draws the same
    assert len(generate(model, [1] * 35, 20)) == 6  # the context ends it: the last token follows 40 of them


def test_top_p_draws_only_within_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    assert {_draw(logits, 1.0, 0.7, g) for _ in range(300)} == {0, 1}
    assert {_draw(logits, 1.0, 0.4, g) for _ in range(50)} == {0}
    assert _draw(logits, 0.0, 1.0, g) == 0


def test_a_prompt_that_does_not_fit_is_refused():
    model = make_model(ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=16, vocab_size=20)).eval()
    for prompt in ([], [1] * 16):
        with pytest.raises(ConfigError, match=r"the prompt is \d+ tokens: it needs 1 to 15 \(model.seq_len=16\)"):
            generate(model, prompt, 4)


def test_a_hugging_face_llama_generates_what_transformers_generates(rng, tmp_path, capsys):
    texts = ["the cat sat on the mat and the dog sat on the log. " * 4] * 10
    tok = tokenizer.train_bpe(iter(texts), 300)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=rng.choice([1, 2, 4]), max_position_embeddings=128, eos_token_id=tok.eos,
    )  # fmt: skip
    torch.manual_seed(rng.randrange(2**31))
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tok.text)
    prompt = tok.tokenizer.encode("the cat sat").ids
    # Both stop at the end-of-text token when greedy decoding draws it, and keep it.
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    from app.generate import load

    loaded = load(str(tmp_path), torch.device("cpu"))
    assert loaded.codec.eos == tok.eos
    assert generate(loaded.model, prompt, 24, eos=loaded.codec.eos) == want

    assert main(["generate", str(tmp_path), "--prompt", "the cat sat", "--max-new-tokens", "24"]) == 0
    # The text as printed: a decoded tail that ends in whitespace keeps it.
    assert capsys.readouterr().out == "the cat sat" + tok.decode(want) + "\n"
