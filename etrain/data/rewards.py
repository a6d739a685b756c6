"""PPO's and GRPO's reward tasks: programmatic ones a byte-level model can learn, a user's Python function, or a
reward model.

A task draws prompts from a seeded random source (so every rank and a resumed run draw the same ones) and scores a
response to a prompt. The built-in scores lie in [-1, 1]. A user's function is named as FILE.py:function and takes
(prompt, response) to a float; the file may also define `prompt(rng) -> str`, else the prompts are the digits task's.
A reward model is a Hugging Face sequence-classification directory (reward_model.py), scored in batches.

Or the prompts come from a file (ppo.prompts, JSON lines: {"prompt": ..., "answer": ...}): rollouts draw from its
records, evaluations from the ones it holds out (every tenth), and a record's answer goes to a reward that takes a
third argument, as the built-in `exact` does (a verifiable reward: the response's first line is the answer).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec

from etrain.core.config import ConfigError
from etrain.core.errors import Failure
from etrain.core.storage import STORAGE_ERRORS, describe
from etrain.data.reward_model import RewardModel, is_reward_model

PAIRS = {"(": ")", "[": "]", "{": "}"}


@dataclass(frozen=True)
class Task:
    name: str
    prompt: Callable[[random.Random], str]
    score: Callable[[str, str], float]
    held_out: Callable[[random.Random], str] | None = None  # the evaluations' prompts, where they are others
    batch: Callable[[list[str], list[str]], list[float]] | None = None  # scores many at once (a reward model)


HELD_OUT_EVERY = 10  # a prompt file's records held out for evaluations: the 10th, the 20th... (its last if fewer)


class RewardError(Failure):
    """The reward function failed or returned something that is not a score: it is named, with the response it was
    scoring; the user's traceback is in `details` (the driver's log)."""


def score_all(task: Task, prompts: list[str], responses: list[str]) -> list[float]:
    """Each response's score: a finite number, or a RewardError that names the function and what it did."""
    batched = task.batch(prompts, responses) if task.batch is not None else None  # a reward model's: our code
    scores = []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        scoring = f"scoring the response {response[:40]!r} to the prompt {prompt[:40]!r}"
        try:
            value = task.score(prompt, response) if batched is None else batched[i]
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


def exact(prompt: str, response: str, answer: str) -> float:
    """1 when the response's first line, stripped, is the record's answer; else 0 (a verifiable reward)."""
    return float(response.split("\n", 1)[0].strip() == str(answer).strip())


TASKS = {
    "digits": Task("digits", _code_prompt, digits),
    "brackets": Task("brackets", _bracket_prompt, brackets),
    "length": Task("length", _length_prompt, length),
}
CHECKERS = {"exact": exact}  # rewards of a prompt file's answers: (prompt, response, answer)


def resolve(spec: str) -> str:
    """`spec` with a user's file as an absolute path: workers, a resumed run and the reward actor load it later,
    from directories of their own."""
    path, _, name = spec.rpartition(":")
    if path.endswith(".py"):
        return f"{Path(path).expanduser().resolve()}:{name}"
    local = Path(spec).expanduser()
    return str(local.resolve()) if "://" not in spec and local.is_dir() else spec  # a reward model's directory


def load(spec: str, prompts: str | None = None, scoring: bool = True) -> Task:
    """A built-in task by name, FILE.py:function or a reward model's directory, on its own prompts or a prompt
    file's (`prompts`); ConfigError naming what is wrong. Without `scoring` (a worker, which draws the prompts and
    leaves the scores to the rewarder) a reward model is not loaded."""
    task = _load(spec, scoring)
    if prompts is None:
        if spec in CHECKERS:
            raise ConfigError(f"reward {spec} checks each prompt's answer: give a prompt file of answers (--prompts)")
        return task
    records = read_prompts(prompts)
    held = {i for i in range(len(records)) if (i + 1) % HELD_OUT_EVERY == 0} or {len(records) - 1}
    answers = {r["prompt"]: r.get("answer") for r in records}
    takes_answer = _takes_answer(task.score)
    if takes_answer and (missing := [n for n, r in enumerate(records, 1) if "answer" not in r]):
        raise ConfigError(f"reward {spec} checks answers, and ppo.prompts {prompts} record {missing[0]} has none")
    # the record's answer goes with its prompt (prompts are unique in a file)
    score = (lambda prompt, response: task.score(prompt, response, answers[prompt])) if takes_answer else task.score
    return Task(
        task.name,
        _drawing([r for i, r in enumerate(records) if i not in held]),
        score,
        _drawing([r for i, r in enumerate(records) if i in held]),
        None if takes_answer else task.batch,
    )


def _scored_elsewhere(prompt: str, response: str) -> float:
    raise RuntimeError("a reward model scores on the rewarder actor (etrain/control/scorers.py), not here")


def _drawing(records: list[dict]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(records)["prompt"]


def _takes_answer(score: Callable) -> bool:
    """Whether a reward takes (prompt, response, answer)."""
    try:
        inspect.signature(score).bind("prompt", "response", "answer")
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): called as (prompt, response)
        return False
    return True


def read_prompts(uri: str) -> list[dict]:
    """A prompt file's records, local or at a URI: JSON lines of {"prompt": text, "answer": text or number}, at
    least two (one is held out), no prompt twice; ConfigError naming the line that is not."""
    try:
        with fsspec.open(uri, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"ppo.prompts {uri} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"ppo.prompts {uri} is not UTF-8 text ({e})") from None
    except STORAGE_ERRORS as e:
        raise ConfigError(f"ppo.prompts {uri} cannot be read: {describe(e)}") from None
    records, seen = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"ppo.prompts {uri} line {n} is not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ConfigError(f'ppo.prompts {uri} line {n}: a record is {{"prompt": "...", "answer": "..."}}')
        if "answer" in record and not isinstance(record["answer"], str | int | float):
            raise ConfigError(f"ppo.prompts {uri} line {n}: an answer is text or a number")
        if record["prompt"] in seen:
            raise ConfigError(f"ppo.prompts {uri} line {n} repeats the prompt of line {seen[record['prompt']]}")
        seen[record["prompt"]] = n
        records.append(record)
    if len(records) < 2:
        raise ConfigError(f"ppo.prompts {uri} holds {len(records)} prompts: it needs two at least (one is held out)")
    return records


def _load(spec: str, scoring: bool = True) -> Task:
    if spec in TASKS:
        return TASKS[spec]
    if is_reward_model(spec):
        if not scoring:
            return Task(spec, _code_prompt, _scored_elsewhere)
        model = RewardModel(spec)
        one = lambda prompt, response: model.score([prompt], [response])[0]  # noqa: E731
        return Task(spec, _code_prompt, one, batch=model.score)
    if spec in CHECKERS:
        return Task(spec, _code_prompt, CHECKERS[spec])
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise ConfigError(
            f"reward {spec!r}: name a built-in task ({', '.join(TASKS)}), a checker of --prompts' answers "
            f"({', '.join(CHECKERS)}), FILE.py:function or a Hugging Face sequence-classification directory"
        )
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
