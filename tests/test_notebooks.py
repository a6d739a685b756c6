"""The notebooks, executed top to bottom on the session's Ray instance with tiny budgets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
import ray
import torch
import transformers
import yaml
from nbclient import NotebookClient
from tokenizers import Tokenizer

from etrain.core import checkpoint
from etrain.core.checkpoint import checkpoint_uri, load_latest
from etrain.core.config import validate
from etrain.core.finetune import build_model, load_trained_state
from etrain.core.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("ray_session")


def execute(name: str, env: dict[str, str], tmp: Path) -> nbformat.NotebookNode:
    """Run it top to bottom; its temporary directories go under `tmp`, and it must leave none behind."""
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} is committed with outputs"
    tmp.mkdir()
    env = env | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "TMPDIR": str(tmp)}  # the kernel inherits them
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert not [p for p in tmp.iterdir() if p.name.startswith("etrain-")], f"{name} left its temporary run behind"
    text = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not any("IProgress" in t or "TqdmWarning" in t for t in text), f"{name}: progress bars fell back to text"
    return nb


def images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


SMALL = json.dumps(["data.corpus_bytes=1500000", "data.shard_bytes=200000"])  # the session's corpus


def test_quickstart_notebook_trains_and_plots(data_dir, tmp_path):
    nb = execute(
        "01_quickstart.ipynb",
        {"ETRAIN_NB_STEPS": "30", "ETRAIN_NB_DATA": data_dir, "ETRAIN_NB_SET": SMALL},
        tmp_path / "tmp",
    )
    assert images(nb) == 2  # the loss, the report's step-time plot
    # One progress bar, a widget that updates in place (it was 423 outputs of text); the events as lines.
    training = next(c for c in nb.cells if c.cell_type == "code" and "train(cfg, run_dir)" in c.source)
    bars = [o for o in training.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in training.outputs)
    assert len(bars) == 1 and "%|" not in text, [o.get("output_type") for o in training.outputs]
    assert all(line.startswith("step ") for line in text.splitlines()), text


def test_elastic_notebook_scales_out_loses_a_worker_scales_in_and_plots(data_dir, tmp_path):
    nb = execute(
        "02_elastic.ipynb",
        {"ETRAIN_NB_STEPS": "90", "ETRAIN_NB_DATA": data_dir, "ETRAIN_NB_SET": SMALL},
        tmp_path / "tmp",
    )
    assert images(nb) == 1  # throughput and world size; the notebook asserts the changes and the sample count itself


def test_hpo_notebook_searches_and_plots(data_dir, tmp_path):
    env = {"ETRAIN_NB_TRIALS": "2", "ETRAIN_NB_STEPS": "8", "ETRAIN_NB_DATA": data_dir, "ETRAIN_NB_SET": SMALL}
    nb = execute("03_hpo.ipynb", env, tmp_path / "tmp")
    assert images(nb) == 3  # history, importances, learning curve


def test_finetune_notebook_fine_tunes_exports_and_runs_ppo(data_dir, tmp_path):
    env = {"ETRAIN_NB_STEPS": "20", "ETRAIN_NB_FT_STEPS": "10", "ETRAIN_NB_PPO_STEPS": "3", "ETRAIN_NB_DATA": data_dir}
    nb = execute("04_finetune.ipynb", env | {"ETRAIN_NB_SET": SMALL}, tmp_path / "tmp")
    # the learning curves, PPO's reward and KL; the notebook asserts the parameter share and the merged logits
    assert images(nb) == 2


def test_bring_your_model_notebook_takes_a_directory_in_trains_and_gives_it_back(tmp_path):
    """docs/models.md's "Bring your model", as the notebook runs it with the page's commands: a tiny random Llama made
    by examples/tiny_llama.py, a corpus prepared with its tokenizer, continued pre-training, LoRA on the result, a
    merged export back to a Hugging Face directory whose logits in `transformers` are the LoRA run's, and a greedy
    continuation that `transformers` generates token for token."""
    work = tmp_path / "work"
    work.mkdir()
    fast = json.dumps(["cluster.warm_pool=0", "train.eval_every=0", "checkpoint.every=0", "cluster.num_workers=1"])
    nb = execute("05_bring_your_model.ipynb", {"ETRAIN_NB_STEPS": "10", "ETRAIN_NB_WORK": str(work),
                                               "ETRAIN_NB_SET": fast}, tmp_path / "tmp")  # fmt: skip
    assert images(nb) == 1  # the two runs' losses
    losses = {
        run: [r["loss"] for r in read_jsonl(work / "runs" / run / "metrics.jsonl") if r["kind"] == "train"]
        for run in ("llama-cpt", "llama-lora")
    }
    assert len(losses["llama-cpt"]) == len(losses["llama-lora"]) == 10
    assert losses["llama-cpt"][-1] < losses["llama-cpt"][0]  # every weight, from a random model: it learns at once
    out = work / "models" / "tiny-llama-tuned"
    assert (out / "tokenizer.json").read_text() == (work / "corpus" / "tokenizer.json").read_text()

    run_dir = work / "runs" / "llama-lora"
    cfg = validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    ours = build_model(cfg).eval()  # the base run's weights with the LoRA run's adapters
    load_trained_state(ours, checkpoint.model_weights(load_latest(checkpoint_uri(cfg, run_dir)).parts))
    lora_b = {n: t for n, t in ours.state_dict().items() if n.endswith(".lora_b")}  # started at zero
    assert any(n.endswith("attn.o.lora_b") for n in lora_b) and all(t.abs().sum() > 0 for t in lora_b.values())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.logits(tokens), rtol=1e-4, atol=1e-5)

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.encode("Elastic training").ids
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=0)
    printed = "".join(o.get("text", "") for o in nb.cells[-3].outputs if o.get("name") == "stdout")
    continued = "Elastic training" + tok.decode(want[0, len(prompt) :].tolist())  # after export's own lines
    assert printed.rstrip().endswith(continued.rstrip()) and len(continued) > len("Elastic training"), printed
