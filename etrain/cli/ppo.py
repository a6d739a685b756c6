"""`etrain ppo` and `etrain grpo`: a trained model aligned to a reward, with PPO (etrain/core/ppo.py) or GRPO
(etrain/core/grpo.py)."""

from __future__ import annotations

from pathlib import Path

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
        "etrain ppo --from runs/base --reward exact --prompts sums.jsonl --set train.steps=200",
    )
    add_rl_options(p)
    p = command(
        sub,
        "grpo",
        cmd_grpo,
        "align a trained model to a reward with GRPO: --group responses a prompt, each scored against its group's, "
        "no value head (LoRA by default); resume with etrain train",
        "etrain grpo --from runs/base --reward exact --prompts sums.jsonl --set train.steps=200",
        "etrain grpo --from runs/base --reward digits --group 16 --set ppo.rollouts=64",
    )
    add_rl_options(p)
    p.add_argument(
        "--group",
        type=int,
        default=8,
        metavar="G",
        help="responses sampled per prompt (ppo.group; ppo.rollouts, the responses a step, a multiple of it)",
    )


def add_rl_options(p) -> None:
    add_config(p)
    add_base(p, "the policy's starting point and the frozen reference")
    p.add_argument(
        "--reward",
        required=True,
        metavar="NAME_OR_FILE.py:function",
        help="a built-in task (digits, brackets, length; exact: the answer of --prompts) or a function (prompt, "
        "response) -> float, or (prompt, response, answer) with --prompts",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='the prompts, {"prompt": ..., "answer": ...} a line (local or a URI); every tenth is held out for '
        "evaluations (default: the reward task's own)",
    )
    add_progress(p)


def cmd_ppo(args, started_at: float, overrides: list[str] | None = None) -> int:
    from etrain.data.rewards import load, resolve

    prompts = args.prompts if args.prompts is None or "://" in args.prompts else str(Path(args.prompts).resolve())
    reward = load(resolve(args.reward), prompts).name  # a reward or prompts that cannot be loaded: refused first
    then = {"ppo.reward": reward} | ({"ppo.prompts": prompts} if prompts else {})
    return from_base(args, args.source, [*(overrides or []), *args.set], started_at, then)


def cmd_grpo(args, started_at: float) -> int:
    """PPO's run with ppo.algorithm=grpo; the group --set ppo.group names wins over --group."""
    return cmd_ppo(args, started_at, ["ppo.algorithm=grpo", f"ppo.group={args.group}"])
