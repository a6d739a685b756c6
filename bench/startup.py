"""A real model's start, ours against a direct reader, in interleaved rounds (medians with min and max).

A 135 M-parameter Llama of SmolLM2-135M's shape (30 layers of 576, 9 heads over 3 key/value heads, SwiGLU of 1,536,
a 49,152-token tied embedding; one 540 MB model.safetensors in fp32), random weights, as a Hugging Face directory.
Each variant runs in a fresh process, timed from its launch to its first training step's end:

- ours_first: `etrain train --init-from DIR` with 2 workers on a local Ray, on a node that has not seen the
  directory (an empty digest cache: etrain/core/digests.py hashes its weights);
- ours_again: the same command again (the digest comes from the node's cache);
- plain: transformers' `from_pretrained` of the same directory, AdamW, and one step of the same rows in one
  process: the floor that a cluster's start (Ray, workers, a process group) adds to.

Ours' figure is the run's `startup_s` (summary.json: the driver's start to the first committed step), with its
phases from the start record (START_PHASES). Target (issue 44): ours ≤ 15 s on this machine.

    python bench/startup.py [--rounds 3] [--out bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rounds import interleaved, publish, summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SHAPE = ["model.family=llama", "model.n_layer=30", "model.d_model=576", "model.n_head=9", "model.n_kv_head=3",
         "model.ffn_dim=1536", "model.vocab_size=49152", "model.tie_weights=true", "model.rope_theta=100000",
         "model.seq_len=2048"]  # fmt: skip
RUN = ["train.steps=2", "train.global_batch=2", "train.micro_batch=1", "model.seq_len=128", "train.eval_every=0",
       "checkpoint.every=0", "cluster.num_workers=2", "cluster.cpus_per_worker=1", "cluster.warm_pool=0"]  # fmt: skip


def make_base(out: Path) -> Path:
    """The random-weights directory, written once per bench run."""
    import torch

    from etrain.core import hf
    from etrain.core.config import load_config
    from etrain.core.models import make_model

    cfg = load_config("llama-tiny", SHAPE)
    torch.manual_seed(0)
    model = make_model(cfg.model)
    hf.write(model.state_dict(), cfg.model, out)
    return out


def ours(args, base: Path, cache: Path) -> dict:
    """`etrain train --init-from` as a user types it; its startup_s and phases from what the run wrote."""
    root = Path(tempfile.mkdtemp(prefix="startup-ours-"))
    sets = [*RUN, f"run.root={root}", f"data.cache_dir={args.data}"]
    cmd = [
        str(Path(sys.executable).parent / "etrain"),
        "train",
        "--init-from",
        str(base),
        "--config",
        "tiny",
        "--no-progress",
    ]
    cmd += [arg for item in sets for arg in ("--set", item)]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    launched = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"etrain train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (run_dir,) = [p.parent for p in root.glob("*/summary.json")]
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    start = next(r for r in records if r["kind"] == "start")
    startup = json.loads((run_dir / "summary.json").read_text())["startup_s"]
    return {"startup_s": startup, "launch_to_first_step_s": start["time"] - launched,
            **{f"{phase}_s": s for phase, s in start["phases"].items()}}  # fmt: skip


def plain(args, base: Path) -> dict:
    """transformers' model from the directory, one AdamW step of 2 rows of 128 tokens, in a fresh process."""
    code = f"""
import time, sys
launched = float(sys.argv[1])
import torch, transformers
torch.set_num_threads(2)
model = transformers.AutoModelForCausalLM.from_pretrained({str(base)!r}, torch_dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
rows = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(0))
loss = model(input_ids=rows[:, :-1], labels=rows[:, :-1]).loss
loss.backward(); opt.step()
print(time.time() - launched)
"""
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", code, str(launched)], check=True, capture_output=True, text=True)
    return {"launch_to_first_step_s": float(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "etrain-bench-data"))
    p.add_argument("--out", default=str(RESULTS / "startup.json"), help="'' to write nothing")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    started = time.time()
    base = make_base(work / "smollm2-135m-shape")
    print(f"base written: {base} ({sum(f.stat().st_size for f in base.iterdir()) / 1e6:.0f} MB)", flush=True)
    caches = iter(range(10**6))

    def measure(variant: str) -> dict:
        if variant == "plain":
            return plain(args, base)
        cache = work / f"cache-{next(caches)}"  # ours_first: a node's first sight of the directory
        if variant == "ours_again":
            ours(args, base, cache)  # the first start fills the node's cache; the figure is the second's
        return ours(args, base, cache)

    runs = interleaved(
        args.rounds,
        ["ours_first", "ours_again", "plain"],
        measure,
        lambda v, r: (
            f"{v:10s} {r.get('startup_s', r['launch_to_first_step_s']):6.1f} s  ({time.time() - started:.0f} s)"
        ),
    )
    rows = {v: summary(rs) for v, rs in runs.items()}
    med = {v: rows[v]["launch_to_first_step_s"]["median"] for v in rows}
    report = {
        "what": "a 135 M Llama (SmolLM2-135M's shape, random fp32 weights, one 540 MB safetensors file): ours' "
        "startup_s with 2 workers (etrain train --init-from, 2 rows of 128 tokens a step) and each variant's launch "
        "to its first step's end; plain: transformers' from_pretrained and one AdamW step in one process",
        "figures": rows,
        "ratios": {
            "ours_first_startup_s": rows["ours_first"]["startup_s"]["median"],
            "ours_again_startup_s": rows["ours_again"]["startup_s"]["median"],
            "ours_again_vs_plain_launch_to_first_step": med["ours_again"] / med["plain"],
        },
        "targets": {"ours_again_startup_s": "<= 15"},
        "runs": runs,
        "command": "python bench/startup.py",
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
