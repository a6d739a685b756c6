"""PPO's reward tasks: programmatic ones a byte-level model can learn, or a user's Python function.

A task draws prompts from a seeded random source (so every rank and a resumed run draw the same ones) and scores a
response to a prompt. The built-in scores lie in [-1, 1]. A user's function is named as FILE.py:function and takes
(prompt, response) to a float; the file may also define `prompt(rng) -> str`, else the prompts are the digits task's.
"""

from __future__ import annotations

import importlib.util
import math
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from etrain.core.config import ConfigError
from etrain.core.errors import Failure

PAIRS = {"(": ")", "[": "]", "{": "}"}


@dataclass(frozen=True)
class Task:
    name: str
    prompt: Callable[[random.Random], str]
    score: Callable[[str, str], float]


class RewardError(Failure):
    """The reward function failed or returned something that is not a score: it is named, with the response it was
    scoring; the user's traceback is in `details` (the driver's log)."""


def score_all(task: Task, prompts: list[str], responses: list[str]) -> list[float]:
    """Each response's score: a finite number, or a RewardError that names the function and what it did."""
    scores = []
    for prompt, response in zip(prompts, responses):
        scoring = f"scoring the response {response[:40]!r} to the prompt {prompt[:40]!r}"
        try:
            value = task.score(prompt, response)
        except Exception as e:  # the user's code: its error, named, its traceback kept
            raise RewardError(
                f"reward {task.name} raised {type(e).__name__}: {e} ({scoring}); fix the function, then resume the run",
                details=traceback.format_exc(),
            ) from None
        number = float(value) if hasattr(value, "__float__") else None
        if number is None or not math.isfinite(number):
            raise RewardError(
                f"reward {task.name} returned {value!r} ({type(value).__name__}) {scoring}: a reward returns a finite "
                "number"
            )
        scores.append(number)
    return scores


def probe(task: Task, responses: int, timeout_s: float) -> None:
    """Before any worker starts: a sample prompt scored twice (the second call timed: a first call may load what the
    function needs), so that a function that fails, returns no number or is too slow is refused now (a ConfigError),
    not minutes into the run. `responses`: what the rewarder scores for a step or an evaluation, one call after the
    other; the last worker's wait, ppo.reward_timeout_s, covers all of them."""
    prompt = task.prompt(random.Random(0))
    try:
        score_all(task, [prompt], ["0"])
        started = time.perf_counter()
        score_all(task, [prompt], ["0"])
    except RewardError as e:
        raise ConfigError(str(e).replace("; fix the function, then resume the run", "")) from None
    took = time.perf_counter() - started
    if took * responses > timeout_s:
        raise ConfigError(
            f"reward {task.name} took {took:.2f} s for one response; a step's workers wait for {responses} "
            f"responses, about {took * responses:.0f} s, beyond ppo.reward_timeout_s={timeout_s:g}: make it "
            "faster, or raise ppo.reward_timeout_s (and timeouts.step_s above it)"
        )


def _code_prompt(rng: random.Random) -> str:
    return rng.choice(["x = ", "n = ", "return ", "value = ", "# port ", "id: "])


def digits(prompt: str, response: str) -> float:
    """The share of the response's characters that are digits, from -1 (none, or empty) to 1 (all)."""
    return 2 * sum(c.isdigit() for c in response) / len(response) - 1 if response else -1.0


def _bracket_prompt(rng: random.Random) -> str:
    opened = "".join(rng.choice("([{") for _ in range(rng.randint(1, 3)))
    return rng.choice(["f", "g", "x", "print"]) + "".join(o + rng.choice(["a", "0", "x", ""]) for o in opened)


def brackets(prompt: str, response: str) -> float:
    """1 when the response closes every bracket the prompt left open, in order, and opens none it leaves open;
    less by the share of brackets still open or wrongly closed at its end."""
    stack = _unclosed(prompt)
    wanted, wrong = len(stack), 0
    for c in response:
        if c in PAIRS:
            stack.append(c)
        elif c in PAIRS.values():
            if stack and PAIRS[stack[-1]] == c:
                stack.pop()
            else:
                wrong += 1
    return max(-1.0, 1.0 - 2 * (len(stack) + wrong) / max(wanted, 1))


def _unclosed(text: str) -> list[str]:
    stack: list[str] = []
    for c in text:
        if c in PAIRS:
            stack.append(c)
        elif c in PAIRS.values() and stack and PAIRS[stack[-1]] == c:
            stack.pop()
    return stack


def _length_prompt(rng: random.Random) -> str:
    return f"# {rng.randint(4, 16)} chars:\n"


def length(prompt: str, response: str) -> float:
    """1 when the response's first line has the number of characters the prompt asks for, down to -1 at twice as
    far."""
    target = int(prompt.split()[1])
    got = len(response.split("\n", 1)[0])
    return max(-1.0, 1.0 - 2 * abs(got - target) / target)


TASKS = {
    "digits": Task("digits", _code_prompt, digits),
    "brackets": Task("brackets", _bracket_prompt, brackets),
    "length": Task("length", _length_prompt, length),
}


def resolve(spec: str) -> str:
    """`spec` with a user's file as an absolute path: workers, a resumed run and the reward actor load it later,
    from directories of their own."""
    path, _, name = spec.rpartition(":")
    return f"{Path(path).expanduser().resolve()}:{name}" if path.endswith(".py") else spec


def load(spec: str) -> Task:
    """A built-in task by name, or FILE.py:function; ConfigError naming what is wrong."""
    if spec in TASKS:
        return TASKS[spec]
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise ConfigError(f"reward {spec!r}: name a built-in task ({', '.join(TASKS)}) or FILE.py:function")
    if not Path(path).is_file():
        raise ConfigError(f"reward {spec!r}: {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"etrain_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: its error, named
        raise ConfigError(f"reward {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    score = getattr(module, name, None)
    if not callable(score):
        raise ConfigError(f"reward {spec!r}: {path} defines no function {name!r}")
    prompt = getattr(module, "prompt", None)
    return Task(spec, prompt if callable(prompt) else _code_prompt, score)
