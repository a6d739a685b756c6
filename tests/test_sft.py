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
from etrain.data import chat
from etrain.data.shards import ShardReader

from helpers import chat as fixtures
from helpers.runs import FAST, records

# On a random base, adapters on attention alone learn too slowly for a short test: every linear layer
EVERY_LINEAR = json.dumps(["attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"])
QA = {
    "what colour is the sky": "blue",
    "what is two plus three": "five",
    "where sat the cat": "on a mat",
    "is the sky blue": "yes",
    "is two plus three seven": "no",
}


def records_for(draw: random.Random, n: int) -> list[dict]:
    """Questions and their answers, drawn; half in each form, some with a system turn."""
    out = []
    for i in range(n):
        question = draw.choice(sorted(QA))
        if i % 2:
            out.append({"prompt": question, "completion": QA[question]})
            continue
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": QA[question]}]
        system = [{"role": "system", "content": "answer briefly"}] if draw.random() < 0.5 else []
        out.append({"messages": system + messages})
    return out


def eval_loss(model, manifest: str) -> float:
    """The held-out answers' loss as a run evaluates it: each row's mean over its answers, averaged over rows."""
    reader = ShardReader(manifest, "eval")
    rows = torch.from_numpy(reader.get(np.arange(len(reader))).astype(np.int64))
    with torch.no_grad():
        x, y = inputs_and_targets(rows)
        return next_token_loss(model.logits(x), y).item()


@pytest.mark.usefixtures("ray_session")
def test_finetune_on_chat_data_learns_the_answers_and_generates_in_the_template(rng, tmp_path, capsys):
    """Every weight, then LoRA, on the same data (the template drawn): each run's last evaluation is the held-out
    answers' loss the mask defines, computed here from its checkpoint. Full fine-tuning learns the answers: below half
    the base's loss, and `generate --chat` answers both questions right. LoRA's loss falls too, less: on a random
    base its frozen (tied) head caps how sure it can get."""
    template = rng.choice(sorted(fixtures.TEMPLATES))
    print("template", template)
    base = fixtures.model_dir(tmp_path / "base", template)
    cfg = load_config("tiny", ["model.family=llama", "model.vocab_size=320", "model.n_kv_head=2", "model.seq_len=128"])
    torch.manual_seed(rng.randrange(2**31))
    hf.write(make_model(cfg.model).state_dict(), cfg.model, base)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records_for(random.Random(rng.randrange(2**31)), 160)))
    from etrain.driver.generate import load

    before = None
    for method, keys, bound in (
        ("full", ["optim.lr=3e-3"], 0.5),
        ("lora", ["optim.lr=5e-3", f"finetune.lora.targets={EVERY_LINEAR}"], 0.8),
    ):
        sets = [
            *FAST,
            "train.steps=60",
            "train.eval_every=30",
            "train.eval_samples=1000",
            "checkpoint.every=30",
            "optim.warmup_steps=5",
            f"finetune.method={method}",
            *keys,
            f"run.root={tmp_path / 'runs'}",
            f"run.name={method}",
        ]
        flags = [x for s in sets for x in ("--set", s)]
        capsys.readouterr()
        assert main(["finetune", "--from", str(base), "--data", str(data), *flags, "--no-progress"]) == 0
        manifest = capsys.readouterr().err.split("chat data: ")[1].split("\n")[0]
        assert manifest.startswith(str(tmp_path / "runs" / "chat-data" / "chat-"))
        before = before or eval_loss(hf_model(base, cfg), manifest)
        run_dir = tmp_path / "runs" / method
        evals = records(run_dir, "eval")
        assert [r["step"] for r in evals] == [30, 60]
        trained = load(str(run_dir), torch.device("cpu"))
        assert evals[-1]["eval_loss"] == pytest.approx(eval_loss(trained.model, manifest), rel=1e-4), method
        assert evals[-1]["eval_loss"] < bound * before, (method, before, evals)
    # both runs read the one prepared copy
    assert len(list((tmp_path / "runs" / "chat-data").iterdir())) == 1

    exported = tmp_path / "exported"  # the template travels to the Hugging Face directory with the tokenizer
    assert main(["export", str(tmp_path / "runs" / "full"), "--format", "hf", "--out", str(exported)]) == 0
    assert chat.read_template(str(exported)).text == fixtures.TEMPLATES[template]
    for question in random.Random(rng.randrange(2**31)).sample(sorted(QA), 2):
        answer = QA[question]
        for model in (tmp_path / "runs" / "full", exported):
            capsys.readouterr()
            assert main(["generate", str(model), "--chat", "--prompt", question]) == 0
            assert capsys.readouterr().out == answer + "\n", model


def hf_model(directory, cfg):
    model = make_model(cfg.model)
    model.load_state_dict(hf.read_weights(str(directory)))
    return model.eval()
