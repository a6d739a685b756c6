import pytest
import torch

from etrain.cli import main
from etrain.core.config import load_config
from etrain.core.models import make_model
from etrain.core.models.gpt.model import GPT


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_shapes_and_loss(positions):
    cfg = load_config("tiny", [f"model.positions={positions}"]).model
    model = GPT(cfg)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 3, cfg.seq_len))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    # Untrained, the prediction is near uniform over the byte vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_weight_tying_shares_one_tensor():
    cfg = load_config("tiny").model
    tied = GPT(cfg)
    assert tied.head.weight is tied.embed.weight
    untied = GPT(cfg.model_copy(update={"tie_weights": False}))
    assert untied.num_params() == tied.num_params() + cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_causal_future_tokens_do_not_change_the_past(positions):
    cfg = load_config("tiny", [f"model.positions={positions}"]).model
    model = GPT(cfg).eval()
    idx = torch.randint(0, 256, (1, 32))
    changed = idx.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[0, :20], b[0, :20], atol=1e-6)
    assert not torch.allclose(a[0, 20:], b[0, 20:])


def test_rotary_makes_order_matter():
    cfg = load_config("tiny").model
    model = GPT(cfg).eval()
    idx = torch.tensor([[1, 2, 3, 4]])
    a, _ = model(idx)
    b, _ = model(idx.flip(1))
    assert not torch.allclose(a[0, -1], b[0, -1])


def test_gpu_1b_preset_has_about_a_billion_parameters():
    cfg = load_config("gpu-1b").model
    with torch.device("meta"):
        n = GPT(cfg).num_params()
    assert 1.0e9 < n < 1.5e9


def test_the_8b_preset_fits_an_80_gb_gpu_only_sharded(capsys):
    """Issue 29, item 7: ~8 B parameters, whose weights, gradients and AdamW state (16 bytes each) fit no 80 GB rank
    whole, and do sharded over the preset's 8 ranks per replica, activations of a micro-batch included."""
    cfg = load_config("gpu-8b")
    with torch.device("meta"):
        assert GPT(cfg.model).num_params() == cfg.model.param_count()
    assert 7.5e9 < cfg.model.param_count() < 8.5e9
    whole = load_config("gpu-8b", ["parallel.shard=1", "cluster.num_workers=2"])
    state = ("weights", "gradients", "optimizer")
    assert sum(whole.rank_memory()[k] for k in state) > 80e9
    sharded = sum(cfg.rank_memory()[k] for k in state)
    assert sharded <= 1.01 * sum(whole.rank_memory()[k] for k in state) / 8
    assert cfg.worker_memory() < 80e9
    assert main(["config", "--config", "gpu-8b"]) == 0
    shown = capsys.readouterr().err
    assert "per worker in a layout of tp 1 × pp 1 × shard 8 (weights 3.75, gradients 3.75, optimizer 7.50" in shown


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"], ["parallel.shard=2"], ["comm.zero=true"]])
def test_a_layout_divides_what_a_rank_holds(layout):
    """The per-rank estimate follows the layout: each of these holds less state than a whole-model worker."""
    whole = load_config("small", ["cluster.num_workers=2"]).rank_memory()
    part = load_config("small", ["cluster.num_workers=2", *layout]).rank_memory()
    assert part["optimizer"] < whole["optimizer"]
    if layout != ["comm.zero=true"]:
        assert part["weights"] < whole["weights"] and part["gradients"] < whole["gradients"]


def test_a_checkpoint_with_the_older_fused_qkv_weight_loads_into_separate_projections():
    cfg = load_config("tiny").model
    torch.manual_seed(0)
    model = GPT(cfg)
    old = {}
    for name, t in model.state_dict().items():  # the layout written before q, k and v were apart
        if ".attn.q." in name:
            base = name.replace(".q.weight", "")
            old[f"{base}.qkv.weight"] = torch.cat([model.state_dict()[f"{base}.{p}.weight"] for p in "qkv"])
        elif not any(f".attn.{p}." in name for p in "kv"):
            old[name] = t
    fresh = GPT(cfg)
    fresh.load_state_dict(old)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    assert torch.equal(fresh(idx)[0], model(idx)[0])


def test_the_llama3_8b_preset_is_llama_3_8b_and_fits_sharded(capsys):
    """Llama 3 8B's shape: 8,030,261,248 parameters (its published count), counted by arithmetic as the model holds
    them; whole it fits no 80 GB rank with its AdamW state, sharded over 8 ranks it does."""
    cfg = load_config("llama3-8b")
    with torch.device("meta"):
        assert make_model(cfg.model).num_params() == cfg.model.param_count() == 8_030_261_248
    whole = load_config("llama3-8b", ["parallel.shard=1", "cluster.num_workers=2"])
    assert sum(whole.rank_memory()[k] for k in ("weights", "gradients", "optimizer")) > 80e9
    assert cfg.worker_memory() < 80e9
    assert main(["config", "--config", "llama3-8b"]) == 0
    assert "8,030,261,248 parameters" in capsys.readouterr().err
