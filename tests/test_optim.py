"""The lr schedules against torch's own schedulers, and the optimizer the config names."""

from __future__ import annotations

import pytest
import torch

from etrain.core.config import ConfigError, load_config
from etrain.core.models.gpt.model import GPT
from etrain.core.optim import lr_factor, make_optimizer, make_scheduler


@pytest.mark.parametrize("t_0, t_mult", [(7, 1), (5, 2), (3, 3)])
def test_cosine_restarts_after_the_warm_up_are_torchs_cosine_annealing_warm_restarts(t_0, t_mult):
    overrides = ["optim.schedule=cosine_restarts", "optim.warmup_steps=4", f"optim.t_0={t_0}", f"optim.t_mult={t_mult}"]
    cfg = load_config("tiny", overrides).optim
    ours = [cfg.lr * lr_factor(step, cfg, total_steps=10) for step in range(4 + 200)]
    assert ours[:4] == pytest.approx([cfg.lr * (s + 1) / 4 for s in range(4)])  # the linear warm-up
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    torchs = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=t_0, T_mult=t_mult, eta_min=cfg.min_lr)
    theirs = []
    for _ in range(200):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        torchs.step()
    assert ours[4:] == pytest.approx(theirs, rel=1e-12, abs=0)
    restarts = [s for s in range(5, 204) if ours[s] > ours[s - 1]]
    expected, start, length = [], 4, t_0
    while start + length < 204:
        start += length
        expected.append(start)
        length *= t_mult
    assert restarts == expected  # back to lr at each cycle's start, and only there


def test_the_default_schedule_is_one_cosine_to_min_lr():
    cfg = load_config("tiny", ["optim.warmup_steps=0"]).optim
    assert lr_factor(0, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(100, cfg, 100) == pytest.approx(cfg.min_lr / cfg.lr)
    assert all(lr_factor(s + 1, cfg, 100) <= lr_factor(s, cfg, 100) for s in range(100))


def test_lamb_is_pytorch_optimizers_with_decoupled_decay_on_matrices_only():
    cfg = load_config("tiny", ["optim.name=lamb", "optim.weight_decay=0.2"])
    model = GPT(cfg.model)
    opt = make_optimizer(model, cfg.optim)
    assert type(opt).__name__ == "Lamb" and type(opt).__module__.startswith("pytorch_optimizer")
    decay = [g["weight_decay"] for g in opt.param_groups]
    assert decay == [0.2, 0.0] and all(g["weight_decouple"] for g in opt.param_groups)
    assert make_scheduler(opt, cfg.optim, 100).get_last_lr()[0] == pytest.approx(cfg.optim.lr / cfg.optim.warmup_steps)


def test_lamb_is_refused_with_a_layout_by_name():
    with pytest.raises(ConfigError, match="optim.name=lamb with parallel.tp"):
        load_config("tiny", ["optim.name=lamb", "parallel.tp=2", "cluster.num_workers=2"])
