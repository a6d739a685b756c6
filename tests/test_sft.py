"""Instruction tuning from the command line (issue 43, item 2): `etrain finetune --from HF_DIR --data chat.jsonl`
on Ray renders the records with the base's template, trains on the answers alone (LoRA or every weight, drawn),
evaluates the held-out answers exactly as the mask says, and `etrain generate --chat` answers in the template."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from etrain.cli import main
from etrain.core import hf
from etrain.core.config import load_config
from etrain.core.models import make_model
from etrain.core.models.shared import inputs_and_targets, next_token_loss
from etrain.data.shards import ShardReader

from helpers import chat as fixtures
from helpers.runs import FAST, records

WORDS = ["cat", "sky", "mat", "sat", "blue", "two", "five", "seven"]


def records_for(draw: random.Random, n: int) -> list[dict]:
    """A learnable rule: the answer is yes when the question holds "cat", else no; half in each form."""
    out = []
    for i in range(n):
        words = [draw.choice(WORDS) for _ in range(draw.randint(2, 5))]
        answer = "yes" if "cat" in words else "no"
        question = "is there a cat " + " ".join(words)
        if i % 2:
            out.append({"prompt": question, "completion": answer})
        else:
            out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


def eval_loss(model, manifest: str) -> float:
    """The held-out answers' loss as a run evaluates it: each row's mean over its answers, averaged over rows."""
    reader = ShardReader(manifest, "eval")
    rows = torch.from_numpy(reader.get(np.arange(len(reader))).astype(np.int64))
    with torch.no_grad():
        return next_token_loss(model.logits(inputs_and_targets(rows)[0]), inputs_and_targets(rows)[1]).item()


@pytest.mark.usefixtures("ray_session")
def test_finetune_on_chat_data_learns_the_answers_and_generates_in_the_template(rng, tmp_path, capsys):
    template = rng.choice(sorted(fixtures.TEMPLATES))
    method = rng.choice(["lora", "full"])
    print("template", template, "method", method)
    base = fixtures.model_dir(tmp_path / "base", template)
    model_keys = ["model.family=llama", "model.vocab_size=320", "model.n_kv_head=2", "model.seq_len=128"]
    cfg = load_config("tiny", model_keys)
    torch.manual_seed(rng.randrange(2**31))
    hf.write(make_model(cfg.model).state_dict(), cfg.model, base)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records_for(random.Random(rng.randrange(2**31)), 160)))

    sets = [
        *FAST,
        "train.steps=60",
        "train.eval_every=30",
        "train.eval_samples=1000",
        "checkpoint.every=30",
        f"finetune.method={method}",
        "optim.lr=3e-3" if method == "full" else "optim.lr=2e-2",
        "optim.warmup_steps=5",
        f"run.root={tmp_path / 'runs'}",
        "run.name=sft",
    ]
    flags = [x for s in sets for x in ("--set", s)]
    assert main(["finetune", "--from", str(base), "--data", str(data), *flags, "--no-progress"]) == 0
    err = capsys.readouterr().err
    manifest = err.split("chat data: ")[1].split("\n")[0]
    assert manifest.startswith(str(tmp_path / "runs" / "chat-data" / "chat-"))
    run_dir = tmp_path / "runs" / "sft"

    before = eval_loss(hf_model(base, cfg), manifest)
    evals = records(run_dir, "eval")
    assert [r["step"] for r in evals] == [30, 60]
    from etrain.driver.generate import load

    trained = load(str(run_dir), torch.device("cpu"))
    # The run's evaluation is the answers' loss the mask defines, computed here from its checkpoint.
    assert evals[-1]["loss"] == pytest.approx(eval_loss(trained.model, manifest), rel=1e-4)
    assert evals[-1]["loss"] < 0.5 * before, (before, evals)

    capsys.readouterr()
    for question, answer in (("is there a cat cat sky", "yes"), ("is there a cat sky blue", "no")):
        assert main(["generate", str(run_dir), "--chat", "--prompt", question, "--max-new-tokens", "8"]) == 0
        said = capsys.readouterr().out
        assert said.strip() in (answer, answer + fixtures.EOS[template].strip()) or said.startswith(answer), said


def hf_model(directory, cfg):
    model = make_model(cfg.model)
    model.load_state_dict(hf.read_weights(str(directory)))
    return model.eval()
