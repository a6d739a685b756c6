"""README.md's "Bring your model", as written, on the session's Ray: a tiny random Llama made by
examples/tiny_llama.py, a corpus prepared with its tokenizer, continued pre-training on two data-parallel workers,
LoRA on the result, a merged export back to a Hugging Face directory whose logits in `transformers` are the run's,
and a greedy continuation of a prompt that `transformers` generates token for token."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import transformers
import yaml

from app.cli import main
from app.core import checkpoint
from app.core.checkpoint import checkpoint_uri, load_latest
from app.core.config import validate
from app.core.finetune import build_model, load_trained_state
from app.core.lora import merged_state

from runs import FAST, ROOT, records

pytestmark = pytest.mark.usefixtures("ray_session")
WORDS = "elastic training keeps going when a node is lost and the warm pool fills the gap in seconds".split()


def test_bring_your_model_as_the_readme_writes_it(tmp_path, monkeypatch, capsys):
    """In a directory of its own, as the README's commands run; the data's path absolute, as the session's Ray
    workers started elsewhere (`etrain train` alone starts its Ray where it runs)."""
    monkeypatch.chdir(tmp_path)
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_llama.py"), "models/tiny-llama"])
    assert made.returncode == 0
    rng = random.Random(0)
    (tmp_path / "docs").mkdir()
    for i in range(24):  # prose the quality filters keep
        text = " ".join(rng.choice(WORDS) for _ in range(400))
        (tmp_path / "docs" / f"d{i}.txt").write_text("\n".join(text[j : j + 80] for j in range(0, len(text), 80)))
    fast = [item for override in FAST for item in ("--set", override)]
    assert main([
        "prepare", "docs/", "--out", "corpus/", "--set", "prepare.tokenizer=models/tiny-llama",
        "--set", "model.seq_len=128", "--set", "data.eval_fraction=0.2", "--no-progress",
    ]) == 0  # fmt: skip
    assert main([
        "train", "--init-from", "models/tiny-llama", "--config", "tiny",
        "--set", f"data.source={tmp_path}/corpus/manifest.json",
        "--set", "model.seq_len=128", "--set", "run.name=llama-cpt", "--set", "train.steps=10", *fast,
        "--set", "cluster.num_workers=2", "--set", "run.root=runs", "--no-progress",
    ]) == 0  # fmt: skip
    assert main([
        "finetune", "--from", "runs/llama-cpt", "--set", "run.name=llama-lora", "--set", "train.steps=10",
        "--set", "cluster.num_workers=1", "--set", "optim.lr=1e-2", "--no-progress",
    ]) == 0  # fmt: skip
    for run in ("llama-cpt", "llama-lora"):
        losses = [r["loss"] for r in records(tmp_path / "runs" / run, "train")]
        assert len(losses) == 10 and losses[-1] < losses[0], run
    out = "models/tiny-llama-tuned"
    assert main(["export", "runs/llama-lora", "--merge", "--format", "hf", "--out", out]) == 0
    assert (tmp_path / out / "tokenizer.json").read_text() == (tmp_path / "corpus" / "tokenizer.json").read_text()

    run_dir = tmp_path / "runs" / "llama-lora"
    cfg = validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    ours = build_model(cfg).eval()  # the base run's weights with the LoRA run's adapters
    load_trained_state(ours, checkpoint.model_weights(load_latest(checkpoint_uri(cfg, run_dir)).parts))
    assert any(n.endswith("attn.o.lora_a") for n in ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.logits(tokens), rtol=1e-4, atol=1e-5)
    assert set(merged_state(ours)) >= {"blocks.0.attn.o.weight"}

    capsys.readouterr()
    assert main(["generate", out, "--prompt", "Elastic training", "--max-new-tokens", "32"]) == 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / out / "tokenizer.json"))
    prompt = tok.encode("Elastic training").ids
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=0)
    assert capsys.readouterr().out.strip() == "Elastic training" + tok.decode(want[0, len(prompt) :].tolist())
