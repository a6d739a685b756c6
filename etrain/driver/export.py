"""`etrain export`: a run's trained model as plain weights in a directory laid out as a run's (config.yaml and
checkpoints/), so `etrain finetune --from` takes it as a base, and torch.load(weights_only=True) reads its
model.pt; or, for the Llama family, as a Hugging Face directory that `transformers` loads (etrain/core/hf.py). A LoRA
run's adapters are merged into its base, or written alone as a PEFT adapter directory (etrain/core/peft_adapter.py)."""

from __future__ import annotations

import os
from pathlib import Path

from etrain.core import checkpoint
from etrain.core.config import ConfigError, override, validate
from etrain.core.errors import UsageError
from etrain.core.finetune import build_model, load_trained_state
from etrain.core.lora import merged_state
from etrain.core.models import FAMILIES


def export(run_dir: Path, out: Path, merge: bool, format: str = "run") -> dict:
    """Write the run's latest committed weights under `out` (new or empty), as a run's directory or (`format` hf)
    a Hugging Face one. What was written, as a dict."""
    import yaml

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); give the directory a run printed")
    cfg = validate(yaml.safe_load(saved.read_text()))
    if format == "peft" and not cfg.finetune.lora_on:
        raise UsageError(f"{run_dir} is no LoRA run: --format peft writes a LoRA run's adapters (use run or hf)")
    if format == "peft" and merge:
        raise UsageError("--format peft writes the adapters alone: leave --merge out (or merge with --format hf)")
    if cfg.finetune.lora_on and not merge and format != "peft":
        raise UsageError(
            f"{run_dir} is a LoRA run: its checkpoints hold only adapters; add --merge to write them merged into "
            "its base as plain weights, or write them as a PEFT adapter directory with --format peft"
        )
    if format in ("hf", "peft") and cfg.model.spec.hf is None:
        with_format = ", ".join(name for name, spec in FAMILIES.items() if spec.hf)
        raise UsageError(
            f"{run_dir} trains model.family={cfg.model.family}, which has no Hugging Face architecture; "
            f"--format {format} writes model.family={with_format} runs (export it with --format run)"
        )
    if out.is_symlink() and not out.exists():
        raise UsageError(
            f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist: name a new directory, or "
            "the link's target (nothing is written through a dangling link)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty directory; name a new one (nothing is overwritten)")
    ckpt = checkpoint.load_latest(checkpoint.checkpoint_uri(cfg, run_dir))
    if ckpt is None:
        raise ConfigError(f"{run_dir} has no committed checkpoint to export yet")
    model = build_model(cfg)
    load_trained_state(model, checkpoint.model_weights(ckpt.parts))
    if format == "peft":
        from etrain.core import peft_adapter

        written = peft_adapter.write(model, cfg.model, cfg.finetune.lora, out, cfg.finetune.base)
        return {"out": str(out), "format": "peft", "step": ckpt.meta["step"], "base": cfg.finetune.base, **written}
    state = merged_state(model) if cfg.finetune.lora_on else model.state_dict()
    state = {k: v for k, v in state.items() if not k.startswith("value_head.")}  # a PPO run's critic: not the model
    step = ckpt.meta["step"]
    if format == "hf":
        from etrain.core import hf

        hf.write(state, cfg.model, out)
        copied = _copy_tokenizer(cfg, out)
        return {
            "out": str(out),
            "format": "hf",
            "step": step,
            "merged": cfg.finetune.lora_on,
            "tensors": len(state),
            "tokenizer": copied,
        }
    # a plain model's config: no base, its checkpoints beside it
    cleared = ("finetune.base", "finetune.base_digest", "ppo.reward", "checkpoint.uri")
    plain = override(cfg, {**dict.fromkeys(cleared), "faults": []})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(plain.to_yaml())
    meta = {"config_hash": plain.hash(), "cursor": 0, "exported_from": str(run_dir), "merged": cfg.finetune.lora_on}
    path = checkpoint.save(str(out / "checkpoints"), step, {"model.pt": state}, meta, keep=1)
    return {"out": str(out), "checkpoint": path, "step": step, "merged": cfg.finetune.lora_on, "tensors": len(state)}


def _copy_tokenizer(cfg, out: Path) -> str | None:
    """The tokenizer the run's data was prepared with, beside the weights (what `transformers` and `etrain generate`
    decode with), with its tokenizer_config.json and chat template where the data kept them; None for bytes, which
    no tokenizer file describes."""
    import posixpath

    from etrain.data.shards import read_manifest
    from etrain.data.tokenizer import FILE, with_companions

    if cfg.data.source == "embedded" or not isinstance(read_manifest(cfg.data.source).get("tokenizer"), dict):
        return None
    source = posixpath.join(posixpath.dirname(cfg.data.source), FILE)
    for name, body in with_companions(source).items():
        (out / name).write_bytes(body)
    return source
