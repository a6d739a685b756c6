"""PPO on a real local Ray, from a tiny model trained here: the held-out reward rises while the KL to the base stays
bounded, the records carry the step's statistics, and a PPO run that dies resumes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from etrain.cli import main
from etrain.control.control import JobError
from etrain.core import checkpoint
from etrain.core.config import override
from etrain.core.finetune import finetune_config
from etrain.data.reward_model import RewardModel
from etrain.driver.job import new_run_dir, train
from etrain.driver.report import write_report

from helpers.reward_model import reward_dir, theirs
from helpers.runs import etrain_lines, records, run

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 16
PPO = [f"train.steps={STEPS}", "train.eval_every=8", "ppo.rollouts=32", "ppo.response_len=8", "optim.lr=1e-2"]
PPO += ["optim.warmup_steps=0", "checkpoint.every=4", "ppo.eval_prompts=64"]


def ppo_config(base_run: Path, *overrides: str):
    return override(finetune_config(str(base_run), None, [*PPO, *overrides]), {"ppo.reward": "digits"})


@pytest.fixture(scope="module")
def base_run(make_cfg_module) -> Path:
    return run(make_cfg_module, "ppo-base", "train.steps=100")  # enough to put digits after "x = " at times


@pytest.fixture(scope="module")
def reference(base_run) -> Path:
    cfg = ppo_config(base_run, "run.name=ppo")
    train(cfg, run_dir := new_run_dir(cfg), progress=False)
    return run_dir


def test_ppo_raises_the_held_out_reward_and_holds_the_kl_at_its_target(reference):
    """The KL target is ppo.kl_target = 6 nats per response. Issue 27, defect 16: with Ziegler's law alone (beta
    moves at most 0.2 × 32/10,000 a step) the KL ran to 10-14 nats within 16 steps, and the old bound (10) passed
    on one machine and failed on another: the trajectory is the same only on the same CPU kernels (run with
    ATEN_CPU_CAPABILITY=default, the same commit diverges at step 7), because a float rounded otherwise samples
    another token. So nothing here rests on the trajectory but what holds for any of them: (1) each step's
    coefficient is the law's, from its own rollouts' KL; (2) the law holds the KL under twice the target, which a
    step would have to overshoot in one update from below the target (the largest one-step rise seen in 7 runs of
    3 seeds at two learning rates was 4 nats, of the 6 it takes; the highest KL 9.3); (3) the held-out reward
    rises: 64 prompts × 8 tokens give its mean a sampling spread of about 0.05, and a rise of 0.3 is far beyond it
    (0.54 to 0.63 in those runs)."""
    evals, steps = records(reference, "eval"), records(reference, "train")
    assert [e["step"] for e in evals] == [0, 8, 16]
    target, gain = 6.0, 4.0
    for r in steps:  # (1) the coefficient applied: the slow base, boosted by the step's own overshoot
        assert r["kl_coef"] == pytest.approx(r["kl_base"] * max(1.0, r["kl"] / target) ** gain, rel=1e-9), r
    assert all(0 <= r["kl"] < 2 * target for r in steps), [r["kl"] for r in steps]  # (2) nats per response
    before, after = evals[0]["eval_reward"], evals[-1]["eval_reward"]
    assert after - before > 0.3, (before, after)  # (3)
    assert all({"reward", "kl", "kl_coef", "clip_fraction", "entropy", "value_loss"} <= r.keys() for r in steps)
    assert steps[0]["clip_fraction"] < 0.5
    assert write_report(reference)["plots"]["ppo"].stat().st_size > 0  # etrain report plots them


def test_a_ppo_run_that_dies_resumes_bitwise(base_run, reference):
    cfg = ppo_config(base_run, "run.name=ppo-killed", "cluster.max_recoveries=0", "faults=[{rank: 1, step: 10}]")
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="max_recoveries"):
        train(cfg, run_dir, progress=False)
    train(ppo_config(base_run, "run.name=ppo-killed"), run_dir, resume=True, progress=False)
    ours, theirs = records(run_dir, "train"), records(reference, "train")
    assert [(r["loss"], r["reward"], r["kl_coef"]) for r in ours] == [
        (r["loss"], r["reward"], r["kl_coef"]) for r in theirs
    ]
    assert records(run_dir, "resume")[0]["step"] == 8


def test_a_worker_lost_mid_step_sends_the_run_back_to_its_checkpoint_and_it_learns_the_same(base_run, reference):
    """The lost rank dies inside the first update's all-reduce: the survivors may have begun the step's updates, so
    the run goes back to the checkpoint before it, a pool worker takes the rank's place, and the steps after it come
    out as the uninterrupted run's. (The fault waits for a ready pool worker: recovered at another size, the rollouts
    would be split otherwise.)"""
    fault = "faults=[{rank: 1, step: 10, kind: kill_in_allreduce, ready_pool: true}]"
    train(cfg := ppo_config(base_run, "run.name=ppo-lost", fault), run_dir := new_run_dir(cfg), progress=False)
    failed = records(run_dir, "rollback")[0]["reached_step"] + 1
    assert failed >= 10 and records(run_dir, "rollback")[0]["step"] == (failed - 1) // 4 * 4
    assert [r["reason"] for r in records(run_dir, "membership")] == ["recover"]
    ours, theirs = records(run_dir, "train"), records(reference, "train")
    assert [(r["loss"], r["reward"]) for r in ours] == [(r["loss"], r["reward"]) for r in theirs]


def test_a_ppo_run_commits_each_checkpoint_as_it_trains_and_resumes_from_the_newest(base_run, reference, rng):
    """Issue 27, defect 2: a PPO checkpoint was committed only when the next save began, so a run stopped between
    two saves resumed from the one before (from step 0, redoing everything), evaluated step 0 twice, and its status
    named no checkpoint. A save is committed once a step reports its writer done: the run's writer (rank 0) killed
    as step newest + 3 begins (two steps after the save of step `newest`: time for a few MB to be written) leaves
    that save committed. Before the fix the run went back to newest - 4, or failed with none."""
    newest = rng.randrange(0, STEPS - 3, 4)
    common = ["run.name=ppo-stopped"]
    cfg = ppo_config(base_run, *common, "cluster.max_recoveries=0", f"faults=[{{rank: 0, step: {newest + 3}}}]")
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="max_recoveries"):
        train(cfg, run_dir, progress=False)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["last_checkpoint"]["step"] == newest, status["last_checkpoint"]
    train(ppo_config(base_run, *common), run_dir, resume=True, progress=False)
    assert records(run_dir, "resume")[0]["step"] == newest
    assert [e["step"] for e in records(run_dir, "eval")] == [0, 8, 16]  # step 0's once, whatever the resume
    ours, theirs = records(run_dir, "train"), records(reference, "train")
    assert [(r["step"], r["loss"], r["reward"]) for r in ours] == [(r["step"], r["loss"], r["reward"]) for r in theirs]
    assert json.loads((run_dir / "status.json").read_text())["last_checkpoint"]["step"] == STEPS


@pytest.mark.parametrize(
    "body, said",
    [
        ("time.sleep(0.02 * len(response))\nreturn 0.0", "did not score 32 responses within ppo.reward_timeout_s=3"),
        ("return 1 / (len(response) < 2)", "raised ZeroDivisionError: division by zero"),
    ],
    ids=["slow", "raises"],
)
def test_a_reward_that_is_slow_or_fails_in_a_run_ends_it_in_one_line_naming_the_reward(
    base_run, tmp_path, capsys, body, said
):
    """Issue 27, defects 3 and 8. Each reward passes the driver's probe (a one-character response) and then fails
    at step 0's evaluation: a slow one was taken for hung workers (killed, rolled back, then "no worker left"), one
    that raised left no traceback. Now the run ends at once with one line naming the reward and what it did, no
    worker is replaced, and the driver's log has the details. (A reward returning None, a bare float() error before,
    fails on the same path: test_rewards names it.)"""
    user = tmp_path / "user_reward.py"
    user.write_text("import time\n\n\ndef score(prompt, response):\n" + "".join(f"    {x}\n" for x in body.split("\n")))
    name = f"ppo-bad-reward-{len(body)}"
    sets = [x for item in [*PPO, f"run.name={name}", "ppo.reward_timeout_s=3"] for x in ("--set", item)]
    code = main(["ppo", "--from", str(base_run), "--reward", f"{user}:score", *sets, "--no-progress"])
    err = etrain_lines(capsys.readouterr().err)
    assert code == 1, err
    line = next(x for x in err.splitlines() if x.startswith("etrain: training failed:"))
    assert f"reward {user}:score {said}" in line, err
    run_dir = base_run.parent / name
    assert not records(run_dir, "membership")[1:], records(run_dir, "membership")  # no worker taken for hung
    details = Path(err.split("(details: ")[1].split(")")[0]).read_text()
    assert f"{user}:score" in details
    if "raised" in said:
        assert 'user_reward.py", line 5, in score' in details


def test_ppo_from_a_hugging_face_directory_rolls_out_in_its_own_tokenizer(make_cfg, tmp_path):
    """Issue 41, defect 5: `etrain ppo --from DIR` with a Hugging Face base whose tokenizer is a 512-token BPE
    (examples/tiny_llama.py) failed its first step after Ray started (its responses decoded as bytes: `bytes must
    be in range(0, 256)`). Its prompts and responses now go through the base's tokenizer.json, and it trains."""
    import subprocess
    import sys

    from helpers.runs import ROOT

    base = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_llama.py"), str(base)], check=True, cwd=ROOT)
    data = make_cfg().data
    settings = [
        "train.steps=2", "train.eval_every=2", "cluster.num_workers=1", "ppo.rollouts=8", "ppo.response_len=8",
        "ppo.eval_prompts=8", f"run.root={tmp_path / 'runs'}", "run.name=hf-ppo", f"data.cache_dir={data.cache_dir}",
        f"data.corpus_bytes={data.corpus_bytes}", f"data.shard_bytes={data.shard_bytes}",
    ]  # fmt: skip
    args = ["ppo", "--from", str(base), "--reward", "digits", "--no-progress"]
    assert main([*args, *(a for s in settings for a in ("--set", s))]) == 0
    run_dir = tmp_path / "runs" / "hf-ppo"
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2] and all(-1 <= r["reward"] <= 1 for r in steps)
    assert records(run_dir, "eval")[-1]["eval_reward"] is not None


def test_ppo_draws_its_prompts_from_a_file_and_hands_each_answer_to_the_checker(base_run, tmp_path, capsys):
    """Issue 43, item 4: `etrain ppo --prompts FILE.jsonl` with a reward of three arguments. The checker, in the
    rewarder actor, refuses a prompt that is not the file's or an answer that is not its prompt's (the run would
    end naming it) and notes each prompt it scores: rollouts and evaluations drew from the file, the evaluations
    from its held-out tenth."""
    rows = [{"prompt": f"x = {i} + ", "answer": str(i)} for i in range(30)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = tmp_path / "seen.txt"
    user = tmp_path / "checker.py"
    user.write_text(
        f"PROMPTS = {dict((r['prompt'], r['answer']) for r in rows)!r}\n\n\n"
        "def check(prompt, response, answer):\n"
        "    assert PROMPTS[prompt] == answer, (prompt, answer)\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(prompt + '\\n')\n"
        "    return float(response.strip() == answer)\n"
    )
    sets = [*PPO, "train.steps=2", "train.eval_every=2", "checkpoint.every=2", "ppo.eval_prompts=16"]
    sets += ["run.name=ppo-prompts", "ppo.rollouts=16"]
    sets = [x for item in sets for x in ("--set", item)]
    code = main(["ppo", "--from", str(base_run), "--reward", f"{user}:check", "--prompts", str(prompts), *sets])
    assert code == 0, capsys.readouterr().err
    scored = set(seen.read_text().splitlines())
    held = {r["prompt"] for i, r in enumerate(rows) if (i + 1) % 10 == 0}
    assert scored <= {r["prompt"] for r in rows} and scored & held and scored - held
    evals = records(base_run.parent / "ppo-prompts", "eval")
    assert [e["step"] for e in evals] == [0, 2] and all(0 <= e["eval_reward"] <= 1 for e in evals)


GRPO = ["ppo.algorithm=grpo", "ppo.group=4"]


@pytest.fixture(scope="module")
def grpo_reference(base_run) -> Path:
    cfg = ppo_config(base_run, "run.name=grpo", *GRPO)
    train(cfg, run_dir := new_run_dir(cfg), progress=False)
    return run_dir


def test_grpo_raises_the_held_out_reward_with_no_value_head(grpo_reference):
    """Issue 43, item 4: GRPO's step (4 responses a prompt, advantages within each group, the KL in the loss) raises
    the held-out reward as PPO's does (the same bound, the same spread: 64 prompts), trains no value head, and its
    records carry GRPO's loss parts: the KL term (k3, never negative) in place of the value loss."""
    evals, steps = records(grpo_reference, "eval"), records(grpo_reference, "train")
    assert [e["step"] for e in evals] == [0, 8, 16]
    assert evals[-1]["eval_reward"] - evals[0]["eval_reward"] > 0.3, evals
    assert all("value_loss" not in r and r["kl_loss"] >= 0 and "policy_loss" in r for r in steps)
    state = checkpoint.model_weights(checkpoint.load_latest(str(grpo_reference / "checkpoints")).parts)
    assert any("lora_a" in k for k in state) and not any(k.startswith("value_head.") for k in state)
    assert write_report(grpo_reference)["plots"]["ppo"].stat().st_size > 0  # its loss parts plotted


def test_a_worker_lost_mid_grpo_step_goes_back_and_learns_the_same(base_run, grpo_reference, rng):
    """A drawn rank dies inside a drawn step's first update: the run goes back to its checkpoint and every step
    after comes out as the uninterrupted run's (each group's responses redone once, on one worker)."""
    rank, step = rng.randrange(2), rng.randrange(9, STEPS)
    print(f"rank {rank}, step {step}")
    fault = f"faults=[{{rank: {rank}, step: {step}, kind: kill_in_allreduce, ready_pool: true}}]"
    cfg = ppo_config(base_run, "run.name=grpo-lost", *GRPO, fault)
    train(cfg, run_dir := new_run_dir(cfg), progress=False)
    assert [r["reason"] for r in records(run_dir, "membership")] == ["recover"]
    ours, theirs = records(run_dir, "train"), records(grpo_reference, "train")
    assert [(r["loss"], r["reward"], r["kl_loss"]) for r in ours] == [
        (r["loss"], r["reward"], r["kl_loss"]) for r in theirs
    ]


def test_grpo_from_the_command_line_scores_with_a_reward_model_directory(base_run, rng, tmp_path, capsys):
    """`etrain grpo --reward DIR`: the rewarder actor loads a Hugging Face sequence-classification directory and
    scores every rollout and evaluation with it. Its layers are made to pass each token's embedding through
    unchanged (their outputs zero) and every token's embedding is one vector, so the model scores any text the same
    known number: every step's mean reward and the held-out reward must be it."""
    path, model = reward_dir(rng, tmp_path / "rm")
    with torch.no_grad():
        model.model.embed_tokens.weight[:] = torch.randn(model.config.hidden_size)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    score = theirs(model, RewardModel(str(path)).tokenizer, "anything at all", True)
    sets = [*PPO, "train.steps=2", "train.eval_every=2", "checkpoint.every=2", "ppo.eval_prompts=8"]
    sets += ["run.name=grpo-rm", "ppo.rollouts=16"]
    sets = [x for item in sets for x in ("--set", item)]
    code = main(["grpo", "--from", str(base_run), "--reward", str(path), "--group", "4", *sets])
    assert code == 0, capsys.readouterr().err
    run_dir = base_run.parent / "grpo-rm"
    assert [r["reward"] for r in records(run_dir, "train")] == pytest.approx([score] * 2, abs=1e-5)
    assert [e["eval_reward"] for e in records(run_dir, "eval")] == pytest.approx([score] * 2, abs=1e-5)
    assert all(r["kl_loss"] >= 0 for r in records(run_dir, "train"))  # GRPO's run
