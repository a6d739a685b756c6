"""The model a run trains: a fresh GPT (pre-training), or a base checkpoint's weights, verified against the digest
the run recorded, with LoRA adapters on them (finetune.method=lora) or all of them trainable (full); and the part of
its state that checkpoints and peers carry (for LoRA, the adapters alone)."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Mapping
from pathlib import Path

import fsspec
import torch
import yaml
from torch import nn

from etrain.core import checkpoint
from etrain.core.config import (
    Config,
    ConfigError,
    FinetuneConfig,
    ModelConfig,
    load_config,
    override,
    raw_config,
    validate,
)
from etrain.core.lora import adapters, add_adapters, is_adapter, trainable
from etrain.core.models import make_model
from etrain.core.models.shared import LanguageModel
from etrain.core.storage import STORAGE_ERRORS, describe

VALUE_HEAD = "value_head."  # a PPO run's, trained beside the language model


def build_model(cfg: Config) -> LanguageModel:
    """Weights as every worker must start them: the same seed, the same base, the same adapters' init."""
    torch.manual_seed(cfg.train.seed)
    ft = cfg.finetune
    if ft.base is None:
        return make_model(cfg.model)
    # On the meta device the model would skip an init the base replaces (a second for 135 M parameters), but
    # the adapters, the value head and a PPO run's first sampling would then draw from another random state, and a
    # PPO run's held-out reward no longer rose in tests/test_ppo_run.py: kept until that dependence is understood.
    model = make_model(cfg.model)
    load_base(model, ft)
    if ft.method == "lora":
        add_adapters(model, ft.lora)
        if ft.adapter is not None:
            load_adapter(model, cfg)
    if cfg.ppo.reward is not None and cfg.ppo.algorithm == "ppo":  # after the adapters: it trains, whatever the
        model.add_value_head()  # method (GRPO has none)
    return model


def check_base(cfg: Config) -> None:
    """The driver's check before any worker starts: the base is there, unchanged (its files, its weights' digest),
    and fits the run's model. A base a layout wrote is read one tensor at a time, never whole."""
    weights = _verified(cfg.finetune, whole=False)
    with torch.device("meta"):
        expected = {n: t.shape for n, t in make_model(cfg.model).state_dict().items()}
    got = weights.shapes() if hasattr(weights, "shapes") else {n: t.shape for n, t in weights.items()}
    if cfg.finetune.method == "lora":  # targets that name no layer of this model
        with torch.device("meta"):
            try:
                add_adapters(make_model(cfg.model), cfg.finetune.lora)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if cfg.finetune.adapter is not None:  # present, unchanged, and of this model's adapters
        with torch.device("meta"):
            adapted = make_model(cfg.model)
            add_adapters(adapted, cfg.finetune.lora)
        load_adapter(adapted, cfg)
    if got != expected:
        differ = sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))
        raise ConfigError(
            f"finetune.base {cfg.finetune.base} holds weights of another model shape (first of {len(differ)} that "
            f"differ: {differ[0]}: {tuple(got.get(differ[0], ()))} here, {tuple(expected.get(differ[0], ()))} in the "
            "run's model); the run's model section must be the base's"
        )


def base_weights(ft: FinetuneConfig) -> dict[str, torch.Tensor]:
    """The base checkpoint's weights, whole (a data-parallel worker and the PPO scorers hold the whole model);
    refused (ConfigError) if missing, unreadable or not the ones recorded."""
    return _verified(ft, whole=True)


def base_source(ft: FinetuneConfig) -> str | Mapping[str, torch.Tensor]:
    """What a laid-out rank takes its part of the base from, never the whole model at once where the base allows:
    a layout's DCP directory (the rank reads its slices of it), a Hugging Face directory's tensors (read one at a
    time), else a whole model's file (read whole: a data-parallel run wrote it, holding the whole model). The
    driver verified the files and the digest at the job's start (check_base)."""
    from etrain.core import hf

    if hf.is_model_dir(ft.base):
        return hf.Weights(ft.base)
    with _reading("finetune.base", ft.base):
        files = checkpoint.dcp_dir(ft.base)
    return files if files is not None else base_weights(ft)


@contextlib.contextmanager
def _reading(key: str, source: str):
    """A base that cannot be read, or is not a committed checkpoint: ConfigError naming the key that points at it."""
    try:
        yield
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"{key}: {e}") from None
    except STORAGE_ERRORS as e:
        raise ConfigError(f"{key} {source} cannot be read: {describe(e)}") from None


def _verified(ft: FinetuneConfig, whole: bool) -> Mapping[str, torch.Tensor]:
    from etrain.core import hf

    if hf.is_model_dir(ft.base):  # a Hugging Face directory: its safetensors, a tensor at a time unless `whole`
        from etrain.core import digests

        _same(ft, digests.digest(ft.base))  # its files as fingerprinted, before they are read
        return hf.read_weights(ft.base) if whole else hf.Weights(ft.base)
    with _reading("finetune.base", ft.base):
        ckpt = checkpoint.load_at(ft.base)
    weights = _weights(ckpt, whole)
    _same(ft, checkpoint.weights_digest(weights))
    return weights


def _same(ft: FinetuneConfig, digest: str) -> None:
    """ConfigError unless `digest` is the base's the run recorded (finetune.base_digest)."""
    if ft.base_digest is not None and digest != ft.base_digest:
        raise ConfigError(
            f"finetune.base {ft.base} is not the checkpoint this run was made from: its weights' sha256 is "
            f"{digest[:16]}, the run recorded {ft.base_digest[:16]}; put that checkpoint back, or start a new "
            "fine-tuning run from this one with `etrain finetune --from`"
        )


def _weights(ckpt: checkpoint.Checkpoint, whole: bool) -> Mapping[str, torch.Tensor]:
    """A base's weights without a PPO run's value head: a layout's DCP files read one tensor at a time unless
    `whole`, a whole model's file at once."""
    if not whole and checkpoint.DCP in ckpt.parts:
        from etrain.core.sharded_checkpoint import SavedWeights  # torch DCP: imported only for one

        return SavedWeights(ckpt.parts[checkpoint.DCP].decode(), keep=lambda n: not n.startswith(VALUE_HEAD))
    return model_only(checkpoint.model_weights(ckpt.parts))


def load_base(model: LanguageModel, ft: FinetuneConfig) -> None:
    weights = base_weights(ft)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:  # missing, unexpected or mis-shaped tensors: another model shape
        first = str(e).splitlines()[1:2] or [str(e)]
        raise ConfigError(
            f"finetune.base {ft.base} holds weights of another model shape ({first[0].strip()}); the run's model "
            "section must be the base run's"
        ) from None


def load_adapter(model: LanguageModel, cfg: Config) -> None:
    """The PEFT adapter the run continues (finetune.adapter) into the adapters just added: refused unless it is the
    one the run recorded."""
    from etrain.core import peft_adapter

    ft = cfg.finetune
    digest, (_, tensors) = peft_adapter.digest(ft.adapter), peft_adapter.read(ft.adapter, cfg.model)
    if digest != ft.adapter_digest:
        raise ConfigError(
            f"finetune.adapter {ft.adapter} is not the adapter this run was made from: its sha256 is {digest[:16]}, "
            f"the run recorded {ft.adapter_digest[:16]}; put that adapter back, or start a new run from this one"
        )
    held = adapters(model)
    if tensors.keys() != held.keys():
        raise ConfigError(f"finetune.adapter {ft.adapter} does not hold the adapters of finetune.lora.targets")
    with torch.no_grad():
        for name, t in tensors.items():
            held[name].copy_(t)


def model_only(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights without a PPO run's value head: the language model a base is."""
    return {n: t for n, t in weights.items() if not n.startswith(VALUE_HEAD)}


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint or a peer carries of the weights: what a LoRA model trains (its adapters, and any module
    trained beside them; the base is in its own checkpoint), else every weight."""
    state = trainable(model) if adapters(model) else model.state_dict()
    return {k: v.detach() for k, v in state.items()}


def load_trained_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    if not adapters(model):
        model.load_state_dict(state)
        return
    ours = trainable(model)
    if set(state) != set(ours):
        raise ValueError(
            f"a LoRA run's state holds what it trains ({len(ours)} tensors); this one holds {len(state)}, "
            f"e.g. {sorted(set(state) ^ set(ours))[:3]}"
        )
    with torch.no_grad():
        for name, value in state.items():
            ours[name].copy_(value)


def resolve_base(source: str) -> tuple[str, str, Config | None, ModelConfig | None]:
    """`etrain finetune --from`: a run directory (its latest committed checkpoint), a checkpoint directory (its
    latest), one checkpoint's step directory, or a Hugging Face model directory. Its URI, its weights' digest, the
    config of the run that made it when there is one, and the model of a Hugging Face directory (the fine-tuning
    run takes its model section from either)."""
    from etrain.core import hf

    if "://" not in source:
        source = str(Path(source).expanduser().resolve())
    if hf.is_model_dir(source):
        from etrain.core import digests

        return source, digests.digest(source), None, hf.read_config(source)
    fs, path = fsspec.core.url_to_fs(source)
    with _reading("--from", source):
        if fs.isfile(posixpath.join(path, "config.yaml")):  # a run directory
            run_cfg = validate(yaml.safe_load(fs.cat_file(posixpath.join(path, "config.yaml"))))
            ckpt = checkpoint.load_latest(checkpoint.checkpoint_uri(run_cfg, source))
            if ckpt is None:
                raise ConfigError(f"--from {source}: the run has no committed checkpoint yet")
        elif fs.isfile(posixpath.join(path, checkpoint.COMMIT)):  # one checkpoint
            ckpt, run_cfg = checkpoint.load_at(source), None
        else:
            ckpt, run_cfg = checkpoint.load_latest(source), None
            if ckpt is None:
                raise ConfigError(
                    f"--from {source} is not a run directory (config.yaml), a directory of checkpoints with a "
                    f"committed one (step-*/{checkpoint.COMMIT}), or a checkpoint"
                )
    weights = _weights(ckpt, whole=False)
    if any(is_adapter(n) for n in weights):
        raise ConfigError(
            f"--from {source}: {ckpt.path} holds a LoRA run's adapters, not a whole model; export it with "
            "`etrain export RUN --merge --out DIR` and fine-tune from DIR"
        )
    if run_cfg is None and isinstance(ckpt.meta.get("config"), dict):  # a run's checkpoint names its config
        with contextlib.suppress(ConfigError):  # one an older version wrote may not validate: then --config's
            run_cfg = validate(ckpt.meta["config"])
    return ckpt.path.removeprefix("file://"), checkpoint.weights_digest(weights), run_cfg, None  # local: a path


def finetune_config(source: str, config: str | None, overrides: list[str], adapter: str | None = None) -> Config:
    """A fine-tuning run's config: `config`, or else the base run's own (its data, optimizer, cluster ...; not its
    name, checkpoint location or faults), with `overrides`. The model is the base's either way; with `adapter` (a
    PEFT directory), LoRA's settings are the adapter's."""
    keys = [item.partition("=")[0].strip() for item in overrides]
    if any(key.startswith("finetune.base") for key in keys):
        raise ConfigError("finetune.base is where --from points: give the run or checkpoint with --from")
    if any(key.startswith("finetune.adapter") for key in keys):
        raise ConfigError("finetune.adapter is where --adapter points: give the adapter directory with --adapter")
    base, digest, base_cfg, base_model = resolve_base(source)
    start: str | dict | None = config
    if config is None and base_cfg is not None:
        raw = base_cfg.model_dump()
        raw |= {"faults": [], "finetune": {}, "ppo": {}}
        raw["run"]["name"] = raw["checkpoint"]["uri"] = None
        start = raw
    if base_model is not None:  # a Hugging Face directory: its model, trained on sequences of model.seq_len
        start = raw_config(start) | {"model": base_model.model_dump()}
    cfg = load_config(start, overrides)
    theirs = (base_cfg.model if base_cfg is not None else base_model or cfg.model).model_dump()
    ours = cfg.model.model_dump()
    if base_model is not None and ours["seq_len"] <= theirs["seq_len"]:  # shorter sequences than its positions
        theirs["seq_len"] = ours["seq_len"]
    if ours != theirs:
        differ = ", ".join(f"model.{k}={ours[k]} (the base's: {theirs[k]})" for k in ours if ours[k] != theirs[k])
        raise ConfigError(f"{differ}: a fine-tuning run trains its base's model; leave the model section out")
    cfg = override(cfg, {"finetune.base": base, "finetune.base_digest": digest})
    return cfg if adapter is None else _with_adapter(cfg, adapter, keys)


def _with_adapter(cfg: Config, adapter: str, keys: list[str]) -> Config:
    """`cfg` continuing the PEFT adapter at `adapter`: its rank, alpha, dropout and targets (set here, never
    overridden), its path and digest."""
    from etrain.core import peft_adapter

    if cfg.finetune.method != "lora":
        raise ConfigError("--adapter continues LoRA adapters: it needs finetune.method=lora")
    fixed = [k for k in keys if k in ("finetune.lora.rank", "finetune.lora.alpha", "finetune.lora.targets")]
    if fixed:
        raise ConfigError(f"{', '.join(fixed)}: the adapter's own settings apply (adapter_config.json); leave them out")
    if "://" not in adapter:  # a local path, stored absolute (a URI as given: s3://...)
        adapter = str(Path(adapter).expanduser().resolve())
    settings, _ = peft_adapter.read(adapter, cfg.model)
    lora = {
        f"finetune.lora.{k}": v for k, v in settings.items() if k != "dropout" or "finetune.lora.dropout" not in keys
    }
    return override(cfg, lora | {"finetune.adapter": adapter, "finetune.adapter_digest": peft_adapter.digest(adapter)})
