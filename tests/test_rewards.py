"""PPO's reward tasks and sampling: each built-in score on responses written by hand, a user's function loaded by
path with its errors named, and sampling that is seeded and follows the model."""

from __future__ import annotations

import random

import pytest
import torch

from app.core.config import ConfigError, load_config
from app.core.model import GPT, sample
from app.core.rewards import TASKS, brackets, digits, length, load

pytestmark = pytest.mark.unit


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
    from app.cli import main

    assert main(["ppo", "--from", str(tmp_path), "--reward", "sentiment"]) == 2
    assert "name a built-in task (digits, brackets, length) or FILE.py:function" in capsys.readouterr().err
