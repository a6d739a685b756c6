"""LoRA adapters as PEFT's directory (adapter_config.json and adapter_model.safetensors), out and in: the form
Hugging Face users share adapters in, which `peft.PeftModel.from_pretrained(base, DIR)` puts on a transformers model.
Ours are PEFT's own LoRA (A kaiming-initialised, B zero, the update scaled by alpha / r), so only names change: a
module is named as the family's Hugging Face format names it (etrain/core/models/<family>/hf.py), which a family
without one does not have. What PEFT writes beyond plain LoRA (DoRA, rsLoRA's scale, per-module ranks, whole modules
saved beside the adapters) is refused by name on the way in, and never written: nothing here runs code from a file
(JSON and safetensors only)."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from pathlib import Path

import fsspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from etrain.core.config import ConfigError, LoraConfig, ModelConfig
from etrain.core.lora import LoRALinear
from etrain.core.storage import STORAGE_ERRORS, describe

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's own prefix on the base's module names, as saved
KEY = re.compile(r"base_model\.model\.(.+)\.lora_(A|B)\.weight")
# adapter_config.json keys whose value other than this one changes what the adapters compute
PLAIN = {
    "peft_type": "LORA",
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "lora_bias": False,
}


def write(model: torch.nn.Module, args: ModelConfig, lora: LoraConfig, out: Path, base: str | None) -> dict:
    """The adapters of `model` (a LoRA run's) as a PEFT directory under `out` (new or empty); what was written."""
    fmt = args.spec.hf
    if fmt is None:
        raise ConfigError(
            f"model.family={args.family} has no Hugging Face format: PEFT names an adapter's module as the base's "
            "transformers model does (export it merged: --merge)"
        )
    if lora.also_train:
        raise ConfigError(
            f"this run also trains {lora.also_train} in full (finetune.lora.also_train), which a PEFT adapter "
            "directory of plain LoRA does not hold: export it merged (--merge)"
        )
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    modules = {name: fmt.their_name(f"{name}.weight").removesuffix(".weight") for name in adapted}
    tensors = {}
    for name, m in adapted.items():
        tensors[f"{PREFIX}{modules[name]}.lora_A.weight"] = m.lora_a.detach().to("cpu", copy=True).contiguous()
        tensors[f"{PREFIX}{modules[name]}.lora_B.weight"] = m.lora_b.detach().to("cpu", copy=True).contiguous()
    config = {
        **PLAIN,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": _targets(list(modules.values()), args.n_layer),
        "init_lora_weights": True,
        "inference_mode": True,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {"adapters": len(adapted), "target_modules": config["target_modules"], "r": lora.rank}


def _targets(modules: list[str], layers: int) -> list[str]:
    """PEFT's target_modules: the kinds of module adapted (q_proj, v_proj...) where each is adapted in every one of
    the model's `layers`, else the modules' full names (PEFT takes a name that equals a module's, or ends one after
    a dot: a kind names it in every layer)."""
    kinds = sorted({m.rsplit(".", 1)[-1] for m in modules})
    every = all(m.startswith("model.layers.") for m in modules) and len(modules) == len(kinds) * layers
    return kinds if every else sorted(modules)


def digest(directory: str | Path) -> str:
    """sha256 of the adapter's weights file: what a run records, so that a changed adapter is refused."""
    return hashlib.sha256(_read(directory, WEIGHTS)).hexdigest()


def _read(directory: str | Path, name: str) -> bytes:
    """One file of an adapter directory, local or at a URI (s3://...): ConfigError naming it when it is missing
    or cannot be read."""
    fs, root = fsspec.core.url_to_fs(str(directory))
    path = posixpath.join(root, name)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        found = sorted(posixpath.basename(p) for p in fs.ls(root, detail=False)) if fs.isdir(root) else None
        why = " (no such directory)" if found is None else f" (it holds {found})"
        if name == WEIGHTS and found and "adapter_model.bin" in found:
            why += ": an adapter_model.bin is a pickle, which is never read (save it with safe_serialization)"
        raise ConfigError(f"{directory} is not a PEFT adapter directory: it has no {name}{why}") from None
    except STORAGE_ERRORS as e:
        raise ConfigError(f"{directory}: {name} cannot be read: {describe(e)}") from None


def read(directory: str | Path, args: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA directory (local or at a URI) for a model of `args`: its LoRA settings as our finetune.lora keys
    (rank, alpha, dropout, targets: our module names) and its tensors by our parameter names
    (`blocks.0.attn.q.lora_a`...). ConfigError naming what is wrong or not supported."""
    fmt = args.spec.hf
    if fmt is None:
        raise ConfigError(f"model.family={args.family} has no Hugging Face format, so no PEFT adapter fits it")
    where = f"{directory}/{CONFIG}"
    try:
        config = json.loads(_read(directory, CONFIG))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where} holds no JSON object")
    if differ := {k: config[k] for k, v in PLAIN.items() if k in config and not _same(config[k], v)}:
        raise ConfigError(f"{where}: {differ} is not plain LoRA, which is all this trainer's adapters are")
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    where = f"{directory}/{WEIGHTS}"
    try:
        saved = load(_read(directory, WEIGHTS))
    except SafetensorError as e:
        raise ConfigError(f"{where} is not a readable safetensors file ({e})") from None
    tensors, modules = {}, set()
    for key, t in saved.items():
        m = KEY.fullmatch(key)
        ours = fmt.our_name(f"{m[1]}.weight") if m else None
        if ours is None:
            raise ConfigError(f"{where}: tensor {key!r} is no LoRA weight of a {args.family} model's module")
        module = ours.removesuffix(".weight")
        modules.add(module)
        tensors[f"{module}.lora_{m[2].lower()}"] = t
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{directory}/{CONFIG}: r={rank!r} is not a positive whole number")
    for module in sorted(modules):
        a, b = tensors.get(f"{module}.lora_a"), tensors.get(f"{module}.lora_b")
        if a is None or b is None:
            raise ConfigError(f"{where}: module {fmt.their_name(module + '.weight')} has lora_A or lora_B alone")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ConfigError(f"{where}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} are not of r={rank}")
    settings = {
        "rank": rank,
        "alpha": float(config.get("lora_alpha", 8)),
        "dropout": float(config.get("lora_dropout") or 0.0),
        "targets": _ours(sorted(modules), args.n_layer),
    }
    return settings, tensors


def _same(value, plain) -> bool:
    """A setting as plain LoRA has it; off written as false, null, {} or [] alike."""
    return value == plain or (not value and not plain)


def _ours(modules: list[str], layers: int) -> list[str]:
    """finetune.lora.targets for the adapted modules: a kind (attn.q) where every block has one, else the names."""
    kinds = {}
    for module in modules:
        m = re.fullmatch(r"blocks\.\d+\.(.+)", module)
        kinds.setdefault(m[1] if m else module, []).append(module)
    out = []
    for kind, names in kinds.items():
        out += [kind] if len(names) == layers and names != [kind] else names
    return sorted(out)
