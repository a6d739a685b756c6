"""LoRA adapters as PEFT's directory (issue 43, item 3): written for a base that transformers loads, they give
PEFT's logits equal to ours; read back, a run continues them; what is not plain LoRA, or not safe to read, is
refused by name. No Ray: a run directory is written here (config.yaml and a committed checkpoint)."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from etrain.cli import main
from etrain.core import checkpoint, peft_adapter
from etrain.core.config import ConfigError, load_config
from etrain.core.finetune import build_model, check_base, finetune_config, trained_state
from etrain.core.lora import adapters
from etrain.driver.job import new_run_dir, train

TARGETS = (
    ["attn.q", "attn.v"],
    ["attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"],
    ["blocks.1.attn.q", "attn.v"],  # one layer's q alone: PEFT must be told the module, not the kind
)


def base_dir(rng, path):
    """A small Llama (or Qwen2) as transformers saves it: the base the adapters are for."""
    heads = rng.choice([2, 4])
    config = dict(
        vocab_size=256,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=rng.choice([2, 3]),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([1, heads]),
        max_position_embeddings=64,
        tie_word_embeddings=rng.random() < 0.5,
    )
    qwen = rng.random() < 0.5
    print("base", "qwen2" if qwen else "llama", config)
    torch.manual_seed(rng.randrange(2**31))
    kind = transformers.Qwen2Config if qwen else transformers.LlamaConfig
    model = transformers.AutoModelForCausalLM.from_config(kind(**config))
    model.save_pretrained(path)
    return path


def lora_run(rng, tmp_path, targets: list[str]):
    """A LoRA run on the base, with adapters as training leaves them (B no longer zero), committed at step 3."""
    base = base_dir(rng, tmp_path / "base")
    rank = rng.choice([2, 4])
    sets = ["model.seq_len=32", f"finetune.lora.rank={rank}", f"finetune.lora.alpha={rng.choice([4, 16])}"]
    cfg = finetune_config(str(base), "tiny", [*sets, f"finetune.lora.targets={json.dumps(targets)}"])
    model = build_model(cfg)
    with torch.no_grad():
        for p in adapters(model).values():
            p.normal_(0, 0.2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    meta = {"config_hash": cfg.hash(), "cursor": 0}
    checkpoint.save(str(run / "checkpoints"), 3, {"model.pt": trained_state(model)}, meta, keep=1)
    return base, run, cfg, model.eval()


@pytest.mark.parametrize("targets", TARGETS, ids=["q,v", "all-linear", "one-layer"])
def test_an_exported_adapter_gives_peft_our_logits_and_a_run_continues_it(targets, rng, tmp_path, capsys):
    base, run, cfg, ours = lora_run(rng, tmp_path, targets)
    out = tmp_path / "adapter"
    capsys.readouterr()
    assert main(["export", str(run), "--format", "peft", "--out", str(out)]) == 0
    said = json.loads(capsys.readouterr().out)
    written = json.loads((out / peft_adapter.CONFIG).read_text())
    short = {"attn.q": "q_proj", "attn.k": "k_proj", "attn.v": "v_proj", "attn.o": "o_proj"}
    short |= {"mlp.gate": "gate_proj", "mlp.up": "up_proj", "mlp.down": "down_proj"}
    if all(t in short for t in targets):
        assert said["adapters"] == len(targets) * cfg.model.n_layer
        assert written["target_modules"] == sorted(short[t] for t in targets)
    else:  # PEFT would put a kind on every layer: the modules by name
        assert said["adapters"] == 1 + cfg.model.n_layer
        assert "model.layers.1.self_attn.q_proj" in written["target_modules"]
    assert said["format"] == "peft"
    assert written["r"] == cfg.finetune.lora.rank and written["base_model_name_or_path"] == str(base)

    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), out).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rng.randrange(99)))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.logits(tokens))

    again = finetune_config(str(base), "tiny", ["model.seq_len=32"], adapter=str(out))
    assert again.finetune.lora.rank == cfg.finetune.lora.rank and again.finetune.lora.alpha == cfg.finetune.lora.alpha
    assert sorted(again.finetune.lora.targets) == sorted(targets) and again.finetune.adapter == str(out)
    check_base(again)
    with torch.no_grad():
        torch.testing.assert_close(build_model(again).eval().logits(tokens), ours.logits(tokens))
    assert again.hash() != cfg.hash()  # a run from an adapter is another run
    assert load_config("tiny").hash() == load_config("tiny", ["finetune.adapter=null"]).hash()

    with pytest.raises(ConfigError, match="the adapter's own settings apply"):
        finetune_config(str(base), "tiny", ["model.seq_len=32", "finetune.lora.rank=8"], adapter=str(out))
    tensors = load_file(out / peft_adapter.WEIGHTS)
    next(iter(tensors.values())).add_(1.0)
    save_file(tensors, out / peft_adapter.WEIGHTS)
    with pytest.raises(ConfigError, match="not the adapter this run was made from"):
        check_base(again)


def test_export_peft_refuses_what_it_cannot_write(rng, tmp_path):
    base, run, cfg, _ = lora_run(rng, tmp_path, ["attn.q"])
    assert main(["export", str(run), "--format", "peft", "--merge", "--out", str(tmp_path / "a")]) == 2
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.yaml").write_text(load_config("tiny").to_yaml())
    assert main(["export", str(plain), "--format", "peft", "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def crafted(tmp_path, rng):
    """A valid adapter directory to spoil, and the model it fits."""
    base, run, cfg, _ = lora_run(rng, tmp_path, ["attn.q", "attn.v"])
    out = tmp_path / "adapter"
    assert main(["export", str(run), "--format", "peft", "--out", str(out)]) == 0
    return out, cfg


@pytest.mark.parametrize(
    "spoil, named",
    [
        (lambda d: d.joinpath(peft_adapter.CONFIG).unlink(), "has no adapter_config.json"),
        (lambda d: d.joinpath(peft_adapter.CONFIG).write_text("{not json"), "is not valid JSON"),
        (lambda d: _config(d, use_dora=True), "'use_dora': True"),
        (lambda d: _config(d, use_rslora=True), "'use_rslora': True"),
        (lambda d: _config(d, rank_pattern={"q_proj": 4}), "rank_pattern"),
        (lambda d: _config(d, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda d: _config(d, peft_type="IA3"), "'peft_type': 'IA3'"),
        (lambda d: _config(d, r=0), "r=0"),
        (lambda d: _pickle_instead(d), "is a pickle, which is never read"),
        (lambda d: d.joinpath(peft_adapter.WEIGHTS).write_bytes(b"\x00" * 64), "not a readable safetensors file"),
        (lambda d: _tensors(d, extra=True), "is no LoRA weight"),
        (lambda d: _tensors(d, drop_b=True), "lora_A or lora_B alone"),
    ],
    ids=["no-config", "bad-json", "dora", "rslora", "rank-pattern", "modules-to-save", "ia3", "r0", "pickle",
         "not-safetensors", "unknown-tensor", "half-pair"],
)  # fmt: skip
def test_a_crafted_or_unsupported_adapter_is_refused_by_name(spoil, named, rng, tmp_path):
    out, cfg = crafted(tmp_path, rng)
    spoil(out)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        peft_adapter.read(out, cfg.model)


def _config(directory, **change):
    path = directory / peft_adapter.CONFIG
    path.write_text(json.dumps(json.loads(path.read_text()) | change))


def _pickle_instead(directory):
    import pickle

    tensors = load_file(directory / peft_adapter.WEIGHTS)
    (directory / peft_adapter.WEIGHTS).unlink()
    (directory / "adapter_model.bin").write_bytes(pickle.dumps(tensors))


def _tensors(directory, extra=False, drop_b=False):
    tensors = load_file(directory / peft_adapter.WEIGHTS)
    if extra:
        tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(2, 2)
    if drop_b:
        tensors.pop(next(k for k in sorted(tensors) if k.endswith("lora_B.weight")))
    save_file(tensors, directory / peft_adapter.WEIGHTS)


@pytest.mark.usefixtures("ray_session")
def test_a_run_on_ray_continues_an_exported_adapter_from_the_command_line(make_cfg, tmp_path, capsys):
    """The round trip through real runs: a Llama base, a LoRA run on it, its adapters exported as PEFT's, and
    `etrain finetune --from BASE --adapter DIR` on the workers; at an lr of 1e-12 its one step leaves the adapters
    where the file put them, so its own export equals the file (a fresh start would have B = 0)."""
    from helpers.runs import run

    base = run(make_cfg, "llama-base", "model.family=llama", "model.n_kv_head=2", "train.steps=4")
    lora = finetune_config(str(base), None, ["train.steps=4", "checkpoint.every=4", "optim.lr=1e-2", "run.name=l"])
    run_dir = new_run_dir(lora)
    train(lora, run_dir, progress=False)
    first = tmp_path / "first"
    assert main(["export", str(run_dir), "--format", "peft", "--out", str(first)]) == 0
    exported = load_file(first / peft_adapter.WEIGHTS)
    assert all(t.abs().sum() > 0 for t in exported.values())  # trained: B is no longer zero

    sets = ["train.steps=1", "checkpoint.every=1", "optim.lr=1e-12", "optim.weight_decay=0", f"run.root={tmp_path}"]
    sets = [x for s in [*sets, "run.name=continued"] for x in ("--set", s)]
    capsys.readouterr()
    assert main(["finetune", "--from", str(base), "--adapter", str(first), *sets, "--no-progress"]) == 0
    assert f"run directory: {tmp_path}" in capsys.readouterr().err
    (continued,) = [d for d in tmp_path.iterdir() if (d / "config.yaml").is_file()]
    second = tmp_path / "second"
    assert main(["export", str(continued), "--format", "peft", "--out", str(second)]) == 0
    again = load_file(second / peft_adapter.WEIGHTS)
    assert again.keys() == exported.keys()
    for name, t in exported.items():
        torch.testing.assert_close(again[name], t, rtol=0, atol=1e-9)


def test_an_adapter_on_s3_is_continued_as_a_local_one(s3_bucket, rng, tmp_path):
    import fsspec

    base, run, cfg, ours = lora_run(rng, tmp_path, ["attn.q", "attn.v"])
    out = tmp_path / "adapter"
    assert main(["export", str(run), "--format", "peft", "--out", str(out)]) == 0
    uri = f"{s3_bucket}/adapters/a"
    fsspec.filesystem("s3").put(str(out) + "/", uri.removeprefix("s3://") + "/", recursive=True)
    remote = finetune_config(str(base), "tiny", ["model.seq_len=32"], adapter=uri)
    assert remote.finetune.adapter == uri and remote.finetune.adapter_digest == peft_adapter.digest(out)
    check_base(remote)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(build_model(remote).eval().logits(tokens), ours.logits(tokens))
    with pytest.raises(ConfigError, match=r"has no adapter_config.json \(no such directory\)"):
        peft_adapter.read(f"{s3_bucket}/adapters/missing", cfg.model)
