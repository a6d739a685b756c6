"""Each model family's spec (etrain/core/models/<family>/__init__.py) holds to the model it builds: the arithmetic
the config does without torch, the tensor-parallel plan, LoRA's targets, the residual projections, the presets and
the Hugging Face names all name what the torch module has. Shapes drawn from a seed, printed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from etrain.core.config import ModelConfig, load_config
from etrain.core.models import FAMILIES, make_model
from etrain.core.models.shared import Rotary

PRESETS = Path(__file__).resolve().parents[1] / "etrain" / "configs"


def drawn(name: str, rng: random.Random) -> ModelConfig:
    """A small model of family `name`: the shared keys drawn, and every key the family reads set or left unset."""
    heads = rng.choice([2, 4])
    shape = {"family": name, "n_layer": rng.randint(1, 3), "n_head": heads, "d_model": heads * rng.choice([8, 16])}
    shape |= {"seq_len": 16, "vocab_size": rng.choice([64, 256]), "tie_weights": rng.random() < 0.5}
    choices = {"n_kv_head": [None, 1, heads], "ffn_dim": [None, 48], "head_dim": [None, 8], "rope_theta": [None, 5e5]}
    choices |= {"norm_eps": [None, 1e-6], "qkv_bias": [False, True], "o_bias": [False, True], "mlp_bias": [False, True]}
    shape |= {key: rng.choice(choices[key]) for key in FAMILIES[name].keys if key in choices}
    return ModelConfig(**{k: v for k, v in shape.items() if v is not None})


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("seed", [5, 42, 2026])
def test_a_familys_spec_names_what_its_model_has(name, seed):
    rng = random.Random(seed)
    cfg = drawn(name, rng)
    print(f"seed={seed} family={name} model={cfg.model_dump(exclude_defaults=True)}")
    spec, model = FAMILIES[name], make_model(cfg)
    params = dict(model.named_parameters())
    assert cfg.param_count() == model.num_params()
    block = dict(model.blocks["0"].named_modules())
    assert cfg.block_params() == sum(p.numel() for p in model.blocks["0"].parameters())
    assert spec.norm_params(cfg) == sum(p.numel() for p in model.norm.parameters())
    for part, (fan_in, fan_out) in spec.block_linears(cfg).items():
        assert isinstance(block[part], nn.Linear) and block[part].weight.shape == (fan_out, fan_in), part
    linears = {n for n, m in block.items() if isinstance(m, nn.Linear)}
    assert linears == set(spec.block_linears(cfg)), "block_linears names every linear layer of a block"
    assert set(spec.tp_plan) == linears and set(spec.tp_plan.values()) <= {"col", "row"}
    assert set(spec.lora_targets) <= linears
    assert all(f"blocks.0.{r}" in params for r in spec.residual)
    assert set(spec.keys) <= set(ModelConfig.model_fields)
    if spec.hf is not None:
        theirs = {spec.hf.their_name(n) for n in model.state_dict()}
        assert {spec.hf.our_name(t) for t in theirs} == set(model.state_dict()), "the names go both ways"
        written = spec.hf.write_config(cfg)
        back = spec.hf.read_config(written, "config.json", written["architectures"][0])
        shapes = {n: t.shape for n, t in model.state_dict().items()}
        with torch.device("meta"):
            assert {n: t.shape for n, t in make_model(back).state_dict().items()} == shapes, "config.json both ways"
        assert (back.seq_len, back.tie_weights, back.n_layer) == (cfg.seq_len, cfg.tie_weights, cfg.n_layer)


def test_every_preset_is_listed_by_its_family():
    for path in sorted(PRESETS.glob("*.yaml")):
        family = (yaml.safe_load(path.read_text()).get("model") or {}).get("family", "gpt")
        assert path.stem in FAMILIES[family].presets, f"{path.name} trains {family}: list it in that family's spec"
    for name, spec in FAMILIES.items():
        for preset in spec.presets:
            assert load_config(preset).model.family == name, preset


def test_a_family_not_in_the_registry_is_refused_naming_the_families():
    with pytest.raises(ValueError, match=r"model.family=qwen9 is not a family here; the families: gpt, llama"):
        load_config("tiny", ["model.family=qwen9"])


@pytest.mark.parametrize("seed", [3, 17])
def test_one_rotary_rotates_neighbours_or_halves_alike(seed):
    """The two layouts are one rotation with the head's dimensions ordered differently: GPT's pair (2i, 2i+1) is
    Llama's (i, i + D/2)."""
    rng = random.Random(seed)
    cfg = ModelConfig(n_head=2, d_model=2 * rng.choice([8, 16, 32]), seq_len=16)
    print(f"seed={seed} head_width={cfg.head_width}")
    x = torch.randn(2, 2, 16, cfg.head_width, generator=torch.Generator().manual_seed(seed))
    d = cfg.head_width
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))  # neighbours' pairs laid out as halves
    start = rng.randint(0, 8)
    neighbours, halves = Rotary(cfg, "neighbours"), Rotary(cfg, "halves")
    torch.testing.assert_close(neighbours(x[..., :8, :], start)[..., order], halves(x[..., :8, order], start))
