"""Chat fixtures: a small BPE with chat specials, two real templates (ChatML as SmolLM2 and Qwen2 write it, and
Llama 3's header form) and a tokenizer directory holding them as a Hugging Face model keeps them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from etrain.data.tokenizer import FILE, TokenizerFile

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
        "'<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}
EOS = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
WORDS = "the cat sat on a mat what is two plus three five seven answer please tell me why sky blue yes no".split()


def tokenizer(vocab_size: int = 320) -> TokenizerFile:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["user assistant system helpful"] * 5, trainer)
    return TokenizerFile(tok.to_str())


def model_dir(out: Path, template: str, where: str = "config", tok: TokenizerFile | None = None) -> Path:
    """A tokenizer directory with `template`, in tokenizer_config.json (`where` = "config") or chat_template.jinja."""
    out.mkdir(parents=True, exist_ok=True)
    (out / FILE).write_text((tok or tokenizer()).text)
    config = {"eos_token": EOS[template], "bos_token": "<|begin_of_text|>"}
    if where == "config":
        config["chat_template"] = TEMPLATES[template]
    else:
        (out / "chat_template.jinja").write_text(TEMPLATES[template])
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def conversation(rng: random.Random) -> list[dict]:
    """A drawn conversation: perhaps a system turn, then one to three user/assistant exchanges."""
    said = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))  # noqa: E731
    messages = [{"role": "system", "content": said()}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": said()}, {"role": "assistant", "content": said()}]
    return messages
