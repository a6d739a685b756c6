"""`etrain ppo`: a trained model aligned to a reward with PPO (etrain/core/ppo.py)."""

from __future__ import annotations

from etrain.cli.jobs import from_base
from etrain.cli.options import add_base, add_config, add_progress, command


def add_command(sub) -> None:
    p = command(
        sub,
        "ppo",
        cmd_ppo,
        "align a trained model to a reward with PPO (LoRA by default); resume with etrain train",
        "etrain ppo --from runs/base --reward brackets --set train.steps=100",
        "etrain ppo --from runs/base --reward my_reward.py:score --set finetune.method=full --set optim.lr=1e-4",
    )
    add_config(p)
    add_base(p, "the policy's starting point and the frozen reference")
    p.add_argument(
        "--reward",
        required=True,
        metavar="NAME_OR_FILE.py:function",
        help="a built-in task (digits, brackets, length) or a function (prompt, response) -> float",
    )
    add_progress(p)


def cmd_ppo(args, started_at: float) -> int:
    from etrain.core.rewards import load, resolve

    reward = load(resolve(args.reward)).name  # a reward that cannot be loaded: refused first, in one line
    return from_base(args, args.source, args.set, started_at, {"ppo.reward": reward})
