"""PPO's reward tasks and sampling: each built-in score on responses written by hand, a user's function loaded by
path with its errors named, and sampling that is seeded and follows the model."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from etrain.core.config import ConfigError, load_config
from etrain.core.models.gpt.model import GPT
from etrain.core.models.shared import sample
from etrain.data import tokenizer
from etrain.data.rewards import TASKS, RewardError, Task, brackets, digits, length, load, probe, score_all


def test_digits_scores_the_share_of_digits():
    assert digits("x = ", "1234") == 1.0 and digits("x = ", "ab") == -1.0 and digits("x = ", "") == -1.0
    assert digits("x = ", "12ab") == 0.0


def test_brackets_rewards_closing_what_the_prompt_left_open_in_order():
    assert brackets("f([a", "])") == 1.0
    assert brackets("f([a", ")]") == -1.0  # both wrong
    assert brackets("f([a", "]") == 0.0  # one of two still open
    assert brackets("f(", ")(") == -1.0  # closed, then one opened and left open
    assert brackets("f()(", ")") == 1.0  # what the prompt closed itself does not count


def test_length_rewards_a_first_line_of_the_asked_length():
    assert length("# 8 chars:\n", "abcdefgh\nmore") == 1.0
    assert length("# 8 chars:\n", "abcd") == 0.0 and length("# 8 chars:\n", "a" * 30) == -1.0


def test_prompts_are_drawn_from_the_seed_alone():
    for task in TASKS.values():
        a = [task.prompt(random.Random(7)) for _ in range(3)]
        assert a == [task.prompt(random.Random(7)) for _ in range(3)]
        assert -1.0 <= task.score(a[0], "x") <= 1.0


def test_a_users_reward_function_is_loaded_by_path_and_its_errors_are_named(tmp_path):
    user = tmp_path / "mine.py"
    user.write_text("def vowels(prompt, response):\n    return sum(c in 'aeiou' for c in response) / 10\n")
    task = load(f"{user}:vowels")
    assert task.score("p", "aeiou") == 0.5 and task.prompt(random.Random(0)) == TASKS["digits"].prompt(random.Random(0))
    with pytest.raises(ConfigError, match="defines no function 'nothing'"):
        load(f"{user}:nothing")
    with pytest.raises(ConfigError, match="does not exist"):
        load(f"{tmp_path / 'gone.py'}:f")
    with pytest.raises(ConfigError, match="name a built-in task"):
        load("sentiment")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module\n")
    with pytest.raises(ConfigError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load(f"{broken}:f")


def test_sampling_is_seeded_and_at_a_low_temperature_follows_the_model():
    torch.manual_seed(0)
    model = GPT(load_config("tiny").model).eval()
    prompts = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    a = sample(model, prompts, 6, 1.0, torch.Generator().manual_seed(2))
    b = sample(model, prompts, 6, 1.0, torch.Generator().manual_seed(2))
    assert a.shape == (3, 11) and torch.equal(a, b) and torch.equal(a[:, :5], prompts)
    greedy = sample(model, prompts, 1, 1e-4, torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(greedy[:, -1], model.logits(prompts)[:, -1].argmax(-1))


def test_etrain_ppo_refuses_a_reward_it_cannot_load_before_anything_starts(tmp_path, capsys):
    from etrain.cli import main

    assert main(["ppo", "--from", str(tmp_path), "--reward", "sentiment"]) == 2
    said = capsys.readouterr().err
    assert "name a built-in task (digits, brackets, length), a checker of --prompts' answers (exact), " in said


def _task(tmp_path, body: str) -> Task:
    user = tmp_path / "user_reward.py"
    user.write_text(
        "import time\n\n\ndef score(prompt, response):\n" + "".join(f"    {line}\n" for line in body.split("\n"))
    )
    return load(f"{user}:score")


@pytest.mark.parametrize(
    "body, said",
    [
        ("return None", "returned None (NoneType)"),
        ("return 'good'", "returned 'good' (str)"),
        ("return float('nan')", "returned nan (float)"),
        ("return 1 / len(prompt[:0])", "raised ZeroDivisionError: division by zero"),
    ],
    ids=["none", "string", "nan", "raises"],
)
def test_a_reward_that_fails_or_returns_no_number_is_named_with_the_response_it_scored(tmp_path, body, said):
    """Issue 27, defect 8: a reward returning None or a string failed with a bare float() error that named no
    function, and one that raised left no traceback anywhere."""
    task = _task(tmp_path, body)
    with pytest.raises(RewardError) as failed:
        score_all(task, ["x = "], ["12"])
    assert f"reward {task.name} {said}" in str(failed.value) and "'12'" in str(failed.value)
    if "raised" in said:  # the user's own traceback, for the driver's log
        assert 'user_reward.py", line 5, in score' in failed.value.details
    with pytest.raises(ConfigError, match=re.escape(said)):  # and before a run starts, the driver's probe says it
        probe(task, 16, 60)


def test_numbers_of_any_kind_are_scores():
    import numpy as np

    task = Task("mixed", TASKS["digits"].prompt, lambda p, r: {"a": np.float32(0.5), "b": 2, "c": True}[r])
    assert score_all(task, ["x"] * 3, ["a", "b", "c"]) == [0.5, 2.0, 1.0]


def test_the_driver_refuses_a_reward_too_slow_for_its_timeout_before_anything_starts(tmp_path):
    """Issue 27, defect 3: a reward of 5 s per call ran step 0's evaluation past timeouts.step_s, and the workers
    were killed as hung. One probe call: a reward whose worker calls cannot finish within ppo.reward_timeout_s is
    refused, naming it, its time and the key."""
    task = _task(tmp_path, "time.sleep(0.2)\nreturn 0.0")
    said = (
        r"reward .*:score took [\d.]+ s for one response; .* 32 responses, about \d+ s, beyond ppo.reward_timeout_s=5"
    )
    with pytest.raises(ConfigError, match=said):
        probe(task, 32, 5)
    probe(task, 4, 5)  # 0.8 s of 5: fine


def test_a_ppo_config_says_why_it_needs_checkpoints_and_a_reward_timeout_inside_the_step():
    ppo = ["ppo.reward=digits", "finetune.base=/runs/base", "finetune.base_digest=abc"]
    with pytest.raises(ConfigError, match="needs checkpoint.every > 0: a worker lost in a PPO step sends the run back"):
        load_config("tiny", [*ppo, "checkpoint.every=0"])
    with pytest.raises(ConfigError, match="ppo.reward_timeout_s=200 must be below timeouts.step_s=180"):
        load_config("tiny", [*ppo, "ppo.reward_timeout_s=200"])


def test_etrain_ppo_refuses_a_base_whose_tokenizer_it_cannot_read_before_anything_starts(tmp_path, capsys):
    """Issue 41, defect 5: PPO's text goes through the run's tokenizer, a Hugging Face base's own. A base with no
    tokenizer.json, or one with more tokens than the model has embeddings, is refused before Ray (exit 2), and no
    run directory is left."""
    import subprocess
    import sys

    from etrain.cli import main

    from helpers.runs import ROOT

    base = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_llama.py"), str(base)], check=True, cwd=ROOT)
    text = (base / "tokenizer.json").read_text()
    (base / "tokenizer.json").unlink()
    ppo = ["ppo", "--from", str(base), "--reward", "digits", "--set", f"run.root={tmp_path / 'runs'}"]
    assert main(ppo) == 2
    assert f"PPO's prompts and responses go through the run's tokenizer: {base} holds no tokenizer.json" in (
        capsys.readouterr().err
    )
    bigger = tokenizer.train_bpe(iter((ROOT / "README.md").read_text().split("\n\n")), vocab_size=1024)
    assert bigger.vocab_size > 512 and text != bigger.text  # the model's embeddings: 512
    (base / "tokenizer.json").write_text(bigger.text)
    assert main(ppo) == 2
    assert f"the run's tokenizer ({base}/tokenizer.json) has {bigger.vocab_size} tokens, more than" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "runs").exists()


def prompt_file(path, records: list) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def test_a_prompt_file_gives_the_prompts_holds_out_every_tenth_and_hands_the_answer_to_a_checker(tmp_path, rng):
    """Issue 43, item 4: {"prompt", "answer"} lines; rollouts draw from nine in ten, evaluations from the rest, and
    `exact` (or a user's function of three arguments) scores a response against its prompt's answer."""
    n = rng.choice([2, 7, 10, 23, 40])
    sums = [(rng.randrange(50), rng.randrange(50)) for _ in range(n)]
    records = [{"prompt": f"{a}+{b}={' ' * i}", "answer": str(a + b)} for i, (a, b) in enumerate(sums)]
    print("records", n)
    task = load("exact", prompt_file(tmp_path / "p.jsonl", records))
    held = {r["prompt"] for i, r in enumerate(records) if (i + 1) % 10 == 0} or {records[-1]["prompt"]}
    drawn = {task.prompt(random.Random(i)) for i in range(400)}
    assert drawn == {r["prompt"] for r in records} - held  # every training prompt, and none held out
    assert {task.held_out(random.Random(i)) for i in range(200)} == held
    assert [task.prompt(random.Random(5)) for _ in range(3)] == [task.prompt(random.Random(5))] * 3  # seeded
    record = rng.choice(records)
    assert score_all(task, [record["prompt"]] * 3, [record["answer"], f" {record['answer']} \nmore", "x"]) == [1, 1, 0]

    user = tmp_path / "checker.py"
    user.write_text("def close(prompt, response, answer):\n    return -abs(float(response or 0) - float(answer))\n")
    mine = load(f"{user}:close", str(tmp_path / "p.jsonl"))
    assert score_all(mine, [record["prompt"]], [str(int(record["answer"]) + 2)]) == [-2.0]
    assert load("digits", str(tmp_path / "p.jsonl")).score("x", "12") == 1.0  # a two-argument reward gets none


@pytest.mark.parametrize(
    "lines, said",
    [
        (['{"prompt": "a"}'], "holds 1 prompts: it needs two at least"),
        (['{"prompt": "a"}', "{not json"], "line 2 is not JSON"),
        (['{"prompt": "a"}', '{"text": "b"}'], 'line 2: a record is {"prompt"'),
        (['{"prompt": "a"}', '{"prompt": "b", "answer": [1]}'], "line 2: an answer is text or a number"),
        (['{"prompt": "a"}', "", '{"prompt": "a"}'], "line 3 repeats the prompt of line 1"),
    ],
    ids=["one", "not-json", "no-prompt", "answer-list", "repeated"],
)
def test_a_prompt_file_that_is_not_one_is_refused_naming_its_line(tmp_path, lines, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        load("digits", prompt_file(tmp_path / "bad.jsonl", lines))


def test_a_checker_needs_answers_and_a_prompt_file(tmp_path):
    with pytest.raises(ConfigError, match="give a prompt file of answers"):
        load("exact")
    path = prompt_file(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(ConfigError, match="record 2 has none"):
        load("exact", path)
    with pytest.raises(ConfigError, match="does not exist"):
        load("digits", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="ppo.prompts are a PPO run's"):
        load_config("tiny", [f"ppo.prompts={path}"])
