"""One prepared GPU check, without Ray: plain torch against our worker's step on one GPU.

Ray does not travel to the machine that lends a GPU for a few minutes, so this runs a worker's step code as it
is (etrain/worker/compute.py on the data-parallel engine at one rank, with the per-step work the actor adds:
its commit, its report's byte counts and peak memory) against the loop a user would write in plain torch, on the
same model, weights and rows:

- the GPT of etrain/configs/gpu-125m.yaml (12 x 768, 1,024 tokens) and a Llama of the same width (GQA, SwiGLU), in bf16
  autocast and in fp16 with GradScaler: tokens/s of ours over plain's, and each one's loss after every step
  (the same code path must give the same losses);
- plain torch with fused AdamW beside them: what `fused=True` would buy our optimizer (not used yet);
- MFU of each from the device table (etrain/core/flops.py);
- a reading of NVML by the health source the node's telemetry actor uses (etrain/core/telemetry_sources.py).

    python bench/gpu.py                              # on one GPU: about 4 min, writes bench/results/gpu.json
    python bench/gpu.py --device cpu --out ''        # the smoke test: every path on CPU, a tiny model

Rounds are interleaved (`--rounds`, 3): each variant once a round, its figure the median with its spread.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from etrain.core.config import Config, load_config  # noqa: E402
from etrain.core.finetune import build_model  # noqa: E402
from etrain.core.flops import flops_per_token, peak_flops  # noqa: E402
from etrain.core.models import make_model  # noqa: E402
from etrain.core.optim import make_optimizer, make_param_groups, make_scheduler, optimizer_defaults  # noqa: E402
from etrain.core.telemetry_sources import NvmlSource  # noqa: E402
from etrain.worker.compute import train_on  # noqa: E402
from etrain.worker.data_parallel import DataParallel  # noqa: E402
from etrain.worker.engine import peak_rss  # noqa: E402
from etrain.worker.injection import Injected  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu.json"
MODELS = {"gpt": [], "llama": ["model.family=llama", "model.n_kv_head=4"]}
PRECISIONS = ("bf16", "fp16")


def config(model: str, precision: str, args) -> Config:
    if args.device == "cpu":  # the smoke test: the same paths on a model that runs in seconds
        shape = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.seq_len=32", "model.vocab_size=256"]
        batch = ["train.global_batch=4", "train.micro_batch=2"]
    else:
        shape = ["model.vocab_size=32768"]  # a subword vocabulary's head, not the byte tokenizer's
        batch = [f"train.global_batch={args.batch}", f"train.micro_batch={args.micro_batch}"]
    steps = f"train.steps={(args.warmup + args.steps) * 4}"  # the schedule well inside its warm-up and decay
    overrides = [
        *shape,
        *batch,
        *MODELS[model],
        f"train.precision={precision}",
        steps,
        "cluster.num_workers=1",
        "cluster.max_workers=1",
    ]
    if args.device == "cpu" and model == "llama":
        overrides.append("model.n_kv_head=2")
    return load_config("gpu-125m", overrides)


def batches(cfg: Config, device: torch.device, count: int) -> list[torch.Tensor]:
    """Random tokens, the same for every loop: a step's cost does not depend on what the tokens say."""
    g = torch.Generator().manual_seed(cfg.train.seed)
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    return [torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device) for _ in range(count)]


def ours(cfg: Config, device: torch.device):
    """The worker's step: the engine at rank 0 of a world of 1 (no DDP), compute.py's `train_on`, then what the
    actor does after it each step (etrain/worker/actor.py `train_step`)."""
    engine, injected = DataParallel(cfg, device), Injected()
    engine.join(0, 1)

    def step(n: int, batch: torch.Tensor) -> float:
        done = train_on(engine, batch, n, cfg.train.global_batch, 1.0, math.inf, injected)
        engine.committed(n)
        engine.optimizer_bytes(), engine.param_bytes(), peak_rss()
        return done.loss

    return step


def plain(cfg: Config, device: torch.device, fused: bool = False):
    """The loop a user writes: accumulate micro-batches (each sample's loss weighing 1/batch, as ours), unscale,
    clip, step, schedule. The loss stays on the device, so the host never waits for the GPU."""
    model = build_model(cfg).to(device)
    if fused:
        optimizer = torch.optim.AdamW(make_param_groups(model, cfg.optim), **optimizer_defaults(cfg.optim), fused=True)
    else:
        optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]

    def step(n: int, batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for chunk in batch.split(cfg.train.micro_batch):
            with torch.autocast(device.type, dtype=dtype):
                _, loss = model(chunk[:, :-1], chunk[:, 1:])
            weighted = loss * len(chunk) / len(batch)
            scaler.scale(weighted).backward()
            total += weighted.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        return total

    return step


LOOPS = {"plain": plain, "ours": ours, "fused": lambda cfg, device: plain(cfg, device, fused=True)}


def measure(loop: str, cfg: Config, device: torch.device, args) -> dict:
    rows = batches(cfg, device, args.warmup + args.steps)
    step = LOOPS[loop](cfg, device)
    losses = [step(n, batch) for n, batch in enumerate(rows[: args.warmup], 1)]  # kernels, allocator, autograd
    sync(device)
    started = time.perf_counter()
    losses += [step(n, batch) for n, batch in enumerate(rows[args.warmup :], args.warmup + 1)]
    sync(device)
    elapsed = time.perf_counter() - started
    with torch.device("meta"):
        params = make_model(cfg.model).num_params()
    tokens_per_s = args.steps * cfg.train.global_batch * cfg.model.seq_len / elapsed
    peak = peak_flops(device, cfg.train.precision)
    return {
        "tokens_per_s": tokens_per_s,
        "step_s": elapsed / args.steps,
        "mfu": flops_per_token(cfg.model, params) * tokens_per_s / peak if peak else None,
        "params": params,
        "losses": [float(x) for x in losses],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvml() -> dict:
    """What the health source reads on this machine: a Reading's fields, or why there is none."""
    from dataclasses import asdict

    reading = NvmlSource().read("bench")
    return asdict(reading) if reading is not None else {"unavailable": "no NVIDIA driver or GPU here"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="sequences per step (GPU)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--out", default=str(RESULTS), help="'' writes nothing")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "bench/gpu.py: no CUDA device here; run it on a GPU machine, or with --device cpu as a smoke test\n")
    device = torch.device(args.device)
    started = time.time()
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for model in args.models:
            for precision in PRECISIONS:
                cfg = config(model, precision, args)
                for loop in LOOPS:  # plain, ours, fused: the same weights and rows
                    r = measure(loop, cfg, device, args)
                    runs.setdefault(f"{model}/{precision}/{loop}", []).append(r)
                    print(
                        f"round {round_} {model:5s} {precision} {loop:5s} {r['tokens_per_s']:12,.0f} tokens/s  "
                        f"loss {r['losses'][-1]:.4f}  ({time.time() - started:.0f} s)",
                        flush=True,
                    )
    report = summarize(runs, args, device)
    print(json.dumps(report["ratios"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"written: {args.out}")


def summarize(runs: dict[str, list[dict]], args, device: torch.device) -> dict:
    def median(key: str, what: str) -> float | None:
        values = [r[what] for r in runs[key] if r[what] is not None]
        return statistics.median(values) if values else None

    figures, ratios = {}, {}
    for key, rs in runs.items():
        figures[key] = {
            "tokens_per_s": {"median": median(key, "tokens_per_s"), "spread": _spread(rs, "tokens_per_s")},
            "step_s": median(key, "step_s"),
            "mfu": median(key, "mfu"),
            "params": rs[0]["params"],
            "last_loss": rs[0]["losses"][-1],
        }
    for model in args.models:
        for precision in PRECISIONS:
            base = f"{model}/{precision}"
            plain = figures[f"{base}/plain"]["tokens_per_s"]["median"]
            ratios[f"{base}: ours / plain"] = figures[f"{base}/ours"]["tokens_per_s"]["median"] / plain
            ratios[f"{base}: fused / plain"] = figures[f"{base}/fused"]["tokens_per_s"]["median"] / plain
            ours, mine = runs[f"{base}/ours"][0]["losses"], runs[f"{base}/plain"][0]["losses"]
            ratios[f"{base}: largest loss gap, ours vs plain"] = max(abs(a - b) / abs(b) for a, b in zip(ours, mine))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "args": vars(args),
        "ratios": ratios,
        "figures": figures,
        "nvml": nvml(),
        "without_ray": "ray" not in sys.modules,
        "sharded_engine": "not built yet: FSDP2 is the next issue's engine; add it here when it lands",
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }


def _spread(runs: list[dict], key: str) -> list[float]:
    return [min(r[key] for r in runs), max(r[key] for r in runs)]


if __name__ == "__main__":
    main()
