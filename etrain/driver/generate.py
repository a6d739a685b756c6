"""`etrain generate`: text sampled from a trained model (a run's newest checkpoint, one checkpoint, or a Hugging
Face directory) with a KV cache, on CPU or one GPU, decoded with the tokenizer its data was prepared with."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from etrain.core import checkpoint, hf
from etrain.core.config import Config, ConfigError, validate
from etrain.core.finetune import build_model, load_trained_state
from etrain.core.models import make_model
from etrain.core.models.shared import KVCache, LanguageModel
from etrain.data import tokenizer


@dataclass
class Loaded:
    model: LanguageModel
    codec: tokenizer.Codec
    source: str  # what the weights came from
    tokenizer_dir: str | None = None  # where its tokenizer and chat template are kept (None: bytes)


def load(source: str, device: torch.device) -> Loaded:
    """The model and tokenizer of `source`: a Hugging Face directory (its tokenizer.json), a run directory or a
    checkpoint (the tokenizer of the data it trained on: bytes, or the file kept with its shards)."""
    if hf.is_model_dir(source):
        model = make_model(hf.read_config(source))
        weights = hf.Weights(source)
        hf.check_against(weights, {name: t.shape for name, t in model.state_dict().items()}, source)
        model.load_state_dict(hf.read_weights(source))
        _finite(model, lambda name: "{} in {}".format(*reversed(weights.where(name))))
        return Loaded(model.to(device).eval(), _codec(lambda: tokenizer.file_codec(source)), source, source)
    cfg, ckpt = _run_checkpoint(source)
    model = build_model(cfg)
    load_trained_state(model, checkpoint.model_weights(ckpt.parts))
    _finite(model, lambda name: f"{name} of {ckpt.path}")
    codec = _codec(lambda: tokenizer.for_run(cfg))
    kept = None if codec.name == tokenizer.BYTES else posixpath.dirname(codec.name)
    return Loaded(model.to(device).eval(), codec, ckpt.path, kept)


def _finite(model: LanguageModel, named: Callable[[str], str]) -> None:
    """Weights holding NaN or an infinity sample nothing but their argmax's ties: refused, the tensor named."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ConfigError(
                f"tensor {named(name)} holds NaN or infinite values: this model cannot generate (its file is damaged, "
                "or the weights diverged before they were saved)"
            )


def _codec(read: Callable[[], tokenizer.Codec]) -> tokenizer.Codec:
    try:
        return read()
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None


def _run_checkpoint(source: str) -> tuple[Config, checkpoint.Checkpoint]:
    path = Path(source).expanduser()
    if (path / "config.yaml").is_file():  # a run: its newest checkpoint that verifies (those skipped are named)
        cfg = validate(yaml.safe_load((path / "config.yaml").read_text()))
        ckpt = checkpoint.load_latest(checkpoint.checkpoint_uri(cfg, path))
        if ckpt is None:
            raise ConfigError(f"{source}: the run has no committed checkpoint yet")
        return cfg, ckpt
    if not (path / checkpoint.COMMIT).is_file():
        raise ConfigError(
            f"{source} is not a run directory, a checkpoint or a Hugging Face model directory (it holds no "
            f"config.yaml, {checkpoint.COMMIT}, or config.json beside safetensors)"
        )
    try:
        ckpt = checkpoint.load_at(str(path.resolve()))
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"checkpoint {source}: {e}") from None
    if not isinstance(ckpt.meta.get("config"), dict):
        raise ConfigError(f"{source}: the checkpoint does not name its run's config; give the run directory")
    return validate(ckpt.meta["config"]), ckpt


@torch.no_grad()
def generate(
    model: LanguageModel,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos: int | None = None,
) -> list[int]:
    """Up to `max_new_tokens` tokens after `prompt`: greedy at temperature 0, else drawn from the softmax at
    `temperature` within the smallest set of tokens whose probability reaches `top_p`; an `eos` ends it, and so
    does the model's context (the last token drawn follows model.seq_len tokens)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    caches = [KVCache() for _ in model.blocks]
    context = model.cfg.seq_len
    if not prompt or len(prompt) >= context:
        raise ConfigError(f"the prompt is {len(prompt)} tokens: it needs 1 to {context - 1} (model.seq_len={context})")
    logits = model.logits(torch.tensor([prompt], dtype=torch.long, device=device), caches)[0, -1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = _draw(logits.float(), temperature, top_p, generator)
        out.append(token)
        if token == eos or caches[0].length >= context:
            break
        logits = model.logits(torch.tensor([[token]], device=device), caches)[0, -1]
    return out


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    outside = ordered.cumsum(0) - ordered >= top_p  # past the nucleus: the top token is always inside
    ordered[outside] = 0
    return int(order[torch.multinomial(ordered / ordered.sum(), 1, generator=generator)])
