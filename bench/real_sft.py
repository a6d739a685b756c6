"""Chat SFT on a real pretrained model (issue 43, items 2 and 5): SmolLM2-135M-Instruct (examples/real_model.py)
instruction-tuned on examples/data/pirate_chat.jsonl (48 questions answered in one voice: "Arr, 'tis Paris,
matey!"), every weight against LoRA r=16 on q and v and LoRA r=16 on every linear layer, each with `etrain finetune
--data` as a user runs it.

Per method: the held-out answers' loss before (the base) and after, and the share of full fine-tuning's fall that
each LoRA reaches; the base's general loss (docs/architecture.md, which it never trains on) before and after; how many
held-out questions `etrain generate --chat` answers in the voice; the run's wall time.
Rounds interleave the methods; the results file holds each figure's median and spread.

    python bench/real_sft.py [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rounds import publish, summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import real_model  # noqa: E402

from etrain.core.models.shared import inputs_and_targets, next_token_loss  # noqa: E402
from etrain.data.shards import ShardReader  # noqa: E402
from etrain.data.tokenizer import file_codec  # noqa: E402
from etrain.driver.generate import generate, load  # noqa: E402

DATA = ROOT / "examples" / "data" / "pirate_chat.jsonl"
GENERAL = ROOT / "docs" / "architecture.md"
SEQ = 128
EVAL_FRACTION = 0.1
METHODS = {
    "full": ["finetune.method=full", "optim.lr=2e-5"],
    "lora": [
        "finetune.method=lora",
        "finetune.lora.rank=16",
        'finetune.lora.targets=["attn.q","attn.v"]',
        "optim.lr=1e-3",
    ],
    "lora_all": [
        "finetune.method=lora",
        "finetune.lora.rank=16",
        'finetune.lora.targets=["attn.q","attn.k","attn.v","attn.o","mlp.gate","mlp.up","mlp.down"]',
        "optim.lr=1e-3",
    ],
}
LORAS = ("lora", "lora_all")


def loss_on(model, rows: np.ndarray) -> float:
    with torch.no_grad():
        x, y = inputs_and_targets(torch.from_numpy(rows.astype(np.int64)))
        return float(np.mean([next_token_loss(model.logits(a), b).item() for a, b in zip(x.split(4), y.split(4))]))


def general_rows(model_dir: Path) -> np.ndarray:
    codec = file_codec(str(model_dir))
    ids = np.array(codec.encode(GENERAL.read_text()), dtype=np.int64)
    n = min(16, len(ids) // (SEQ + 1))
    return ids[: n * (SEQ + 1)].reshape(n, SEQ + 1)


def voiced(loaded) -> tuple[int, int]:
    """Held-out questions whose greedy chat answer is in the trained voice (starts "Arr"), of all held out."""
    from etrain.data import chat

    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    questions = [records[i]["messages"][0]["content"] for i in chat.held_out(len(records), EVAL_FRACTION)]
    codec, hits = loaded.codec, 0
    for q in questions:
        tokens = generate(loaded.model, chat.prompt_tokens(loaded.tokenizer_dir, q), 12, eos=codec.eos)
        hits += codec.decode(tokens).strip().startswith("Arr")
    return hits, len(questions)


def run(method: str, model_dir: Path, root: Path, steps: int, round_: int) -> dict:
    sets = [
        f"model.seq_len={SEQ}",
        f"train.steps={steps}",
        "train.global_batch=8",
        "train.micro_batch=4",
        f"train.eval_every={steps}",
        "train.eval_samples=1000",
        f"checkpoint.every={steps}",
        "optim.warmup_steps=2",
        f"data.eval_fraction={EVAL_FRACTION}",
        "cluster.num_workers=2",
        "cluster.warm_pool=0",
        f"run.root={root}",
        f"run.name={method}-{round_}",
        *METHODS[method],
    ]
    cmd = ["etrain", "finetune", "--config", "tiny", "--from", str(model_dir), "--data", str(DATA), "--no-progress"]
    started = time.perf_counter()
    done = subprocess.run([*cmd, *[x for s in sets for x in ("--set", s)]], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    manifest = done.stderr.split("chat data: ")[1].split("\n")[0]
    run_dir = root / f"{method}-{round_}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = load(str(run_dir), torch.device("cpu"))
    hits, asked = voiced(trained)
    return {
        "answer_loss": [r for r in records if r["kind"] == "eval"][-1]["eval_loss"],
        "general_loss": loss_on(trained.model, general_rows(model_dir)),
        "voiced": hits,
        "asked": asked,
        "trainable": sum(p.numel() for p in trained.model.parameters() if p.requires_grad)
        if method == "full"
        else None,
        "wall_s": wall,
        "manifest": manifest,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "real_sft.json"))
    args = parser.parse_args()
    model_dir = real_model.build(real_model.CACHE / "smollm2-135m-instruct")
    base = load(str(model_dir), torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[dict]] = {m: [] for m in METHODS}
        for r in range(args.rounds):
            for method in METHODS if r % 2 == 0 else reversed(list(METHODS)):
                runs[method].append(run(method, model_dir, Path(tmp), args.steps, r))
                print(method, r, json.dumps({k: v for k, v in runs[method][-1].items() if k != "manifest"}), flush=True)
        manifest = runs["full"][0]["manifest"]
        eval_rows = ShardReader(manifest, "eval")
        before = {
            "answer_loss": loss_on(base.model, eval_rows.get(np.arange(len(eval_rows)))),
            "general_loss": loss_on(base.model, general_rows(model_dir)),
            "voiced": voiced(base)[0],
        }
    figures = {m: summary([{k: v for k, v in r.items() if k != "manifest"} for r in rs]) for m, rs in runs.items()}
    fall = {m: (before["answer_loss"] - figures[m]["answer_loss"]["median"]) for m in ("full", *LORAS)}
    report = {
        "shown": {
            "base": before,
            "answer_loss": {m: figures[m]["answer_loss"] for m in METHODS},
            "general_loss_rise": {
                m: figures[m]["general_loss"]["median"] / before["general_loss"] - 1 for m in METHODS
            },
            "share_of_full_fall": {m: fall[m] / fall["full"] for m in LORAS},
            "voiced": {m: figures[m]["voiced"] for m in METHODS},
        },
        "figures": figures,
        "config": {"steps": args.steps, "rounds": args.rounds, "seq_len": SEQ, "methods": METHODS},
    }
    publish(report, "shown", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
