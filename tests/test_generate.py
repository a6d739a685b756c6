"""Sampling (driver/generate.py): the KV cache gives what recomputing the whole sequence gives, for each family and
position kind (drawn from a printed seed); a Hugging Face Llama generates what `transformers` generates, greedily;
`etrain generate` on a Hugging Face directory with its tokenizer; prompts that do not fit are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from etrain.cli import main
from etrain.core import hf
from etrain.core.config import ConfigError, ModelConfig
from etrain.core.models import make_model
from etrain.data import tokenizer
from etrain.driver.generate import _draw, generate

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
    from etrain.driver.generate import load

    loaded = load(str(tmp_path), torch.device("cpu"))
    assert loaded.codec.eos == tok.eos
    assert generate(loaded.model, prompt, 24, eos=loaded.codec.eos) == want

    assert main(["generate", str(tmp_path), "--prompt", "the cat sat", "--max-new-tokens", "24"]) == 0
    # The text as printed: a decoded tail that ends in whitespace keeps it.
    assert capsys.readouterr().out == "the cat sat" + tok.decode(want) + "\n"


LLAMA = ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=32, vocab_size=300)


def hf_dir(tmp_path) -> Path:
    """A tiny Llama as a Hugging Face directory (one shard and its index), with a tokenizer."""
    torch.manual_seed(0)
    out = tmp_path / "llama"
    hf.write(make_model(LLAMA).state_dict(), LLAMA, out)
    tok = tokenizer.train_bpe(iter(["the cat sat on the mat. " * 4] * 8), LLAMA.vocab_size)
    (out / tokenizer.FILE).write_text(tok.text)
    return out


SHARD = "model-00001-of-00001.safetensors"


def _garble_header(d: Path) -> str:
    data = (d / SHARD).read_bytes()
    n = int.from_bytes(data[:8], "little")
    (d / SHARD).write_bytes(data[:8] + b"{" + b" " * (n - 1) + data[8 + n :])
    return f"{d / SHARD} is not a safetensors file: its header is not JSON"


def _bad_entry(d: Path) -> str:
    data = (d / SHARD).read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    head["model.norm.weight"]["shape"] = "32"
    body = json.dumps(head).encode()  # offsets count from the header's end: they hold at its new length
    (d / SHARD).write_bytes(len(body).to_bytes(8, "little") + body + data[8 + n :])
    return "tensor model.norm.weight's header entry is not a dtype, shape and byte range"


def _index_not_json(d: Path) -> str:
    (d / hf.INDEX).write_text("{not json")
    return f"{d / hf.INDEX} is not JSON"


def _index_outside(d: Path) -> str:
    index = json.loads((d / hf.INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "../../elsewhere.safetensors"
    (d / hf.INDEX).write_text(json.dumps(index))
    return "tensor lm_head.weight is in '../../elsewhere.safetensors', not a .safetensors file beside the index"


def _missing_tensor(d: Path) -> str:
    index = json.loads((d / hf.INDEX).read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (d / hf.INDEX).write_text(json.dumps(index))
    return "holds no tensor model.layers.1.mlp.down_proj.weight, which its config.json's model needs"


def _wrong_shape(d: Path) -> str:
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(config))
    needs = "its config.json's model needs (48, 32)"
    return f"{d / SHARD}: tensor model.layers.0.mlp.gate_proj.weight has shape (128, 32), {needs}"


def _nan_weights(d: Path) -> str:
    state = {LLAMA.spec.hf.our_name(k): v for k, v in load_file(d / SHARD).items()}
    state["blocks.1.attn.q.weight"][3, 4] = float("nan")
    hf.write(state, LLAMA, d)
    return f"tensor model.layers.1.self_attn.q_proj.weight in {d / SHARD} holds NaN or infinite values"


@pytest.mark.parametrize(
    "damage",
    [_garble_header, _bad_entry, _index_not_json, _index_outside, _missing_tensor, _wrong_shape, _nan_weights],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_damaged_model_directory_is_refused_in_one_line_naming_the_file_and_tensor(tmp_path, capsys, damage):
    """Issue 41, defect 7: a garbled header raised a bare JSONDecodeError naming no file; a missing or mis-shaped
    tensor was named by our internal names; NaN weights generated nothing, silently."""
    d = hf_dir(tmp_path)
    said = damage(d)
    assert main(["generate", str(d), "--prompt", "the cat", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "option, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"), ("--top-p", "nan")]
)
def test_a_sampling_option_that_is_not_a_finite_number_in_range_is_refused(tmp_path, capsys, option, value):
    """Issue 41, defect 7: `--temperature nan` raised a raw RuntimeError mid-sampling and `inf` was taken."""
    d = hf_dir(tmp_path)
    assert main(["generate", str(d), "--prompt", "the cat", option, value]) == 2
    assert "--temperature must be a finite number >= 0" in capsys.readouterr().err
