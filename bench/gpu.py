"""One prepared GPU check, without Ray: plain torch against our worker's step on one GPU (an H200, in under 5 min).

Ray does not travel to the machine that lends a GPU for a few minutes, so this runs a worker's step code as it
is (etrain/worker/compute.py on the data-parallel engine at one rank, with the per-step work the actor adds:
its commit, its report's byte counts and peak memory) against the loop a user would write in plain torch, on the
same model, weights and rows:

- Llama 3.2 1B and 3B's shapes (16 x 2048 and 28 x 3072, 32 and 24 heads over 8 key/value heads, SwiGLU 8192, a
  tied 128,256-token head, rope theta 500,000) with random weights, in bf16 autocast on 2,048 tokens: tokens/s of
  ours over plain's (target >= 0.95) and MFU (target >= 0.35; torchtitan's published eager Llama 3.1 8B is about
  33% on H100s);
- the GPT of etrain/configs/gpu-125m.yaml (12 x 768, 1,024 tokens) and a Llama of the same width (GQA, SwiGLU), in
  bf16 autocast and in fp16 with GradScaler: small models, whose short steps weigh our per-step work the most;
  each loop's loss after every step (the same code path must give the same losses);
- plain torch with fused AdamW beside them: what `fused=True` would buy our optimizer (not used yet);
- MFU by torchtitan's count of FLOPs and by ours (`flops_counts`), against the device table's dense peak
  (etrain/core/flops.py: 989.4 TFLOP/s bf16 on an H200);
- each variant's peak GPU memory beside what the memory model predicts (etrain/core/config/memory.py);
- a reading of NVML by the health source the node's telemetry actor uses (etrain/core/telemetry_sources.py).

    python bench/gpu.py                               # one H200: about 3.5 min, writes bench/results/gpu.json
    python bench/gpu.py --models gpt llama llama-1b   # an 80 GB GPU: the 3B's ~83 GB does not fit it
    python bench/gpu.py --device cpu --out ''         # the smoke test: every path on CPU, tiny models, seconds

Rounds are interleaved (`--rounds`, 3): each variant once a round, its figure the median with its spread. After
each round a line gives the time so far and the time to go; no round starts that would end past `--budget-s`
(285: the lent machine's few minutes), and the report says how many ran.

Time on an H200, estimated (none has run yet): a 1B step (16 x 2,048 tokens) is ~0.8 s at 35% MFU (8.2 GFLOP a
token), a 3B step (8 x 2,048) ~1.0 s (21.4 GFLOP a token), a 125M step (32 x 1,024) ~0.1 s; a round is 3 loops of
7 steps (1B) and of 6 (3B), and 12 variants of 13 steps on the small models, ~60 s with building and freeing
(~80 s at 25% MFU), so 3 rounds and the start take ~3-4 min. Weights are drawn on the GPU (`random_model`), not on
the CPU as a worker does: there the 3B's take ~10 ns a parameter (30 s on this project's machine), nine times over.
"""

from __future__ import annotations

import time

STARTED = time.time()  # the budget counts the imports too

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from etrain.core.config import Config, load_config  # noqa: E402
from etrain.core.flops import flops_per_token, peak_flops  # noqa: E402
from etrain.core.models import make_model  # noqa: E402
from etrain.core.models.shared import LanguageModel  # noqa: E402
from etrain.core.optim import make_optimizer, make_param_groups, make_scheduler, optimizer_defaults  # noqa: E402
from etrain.core.telemetry_sources import NvmlSource  # noqa: E402
from etrain.worker.compute import train_on  # noqa: E402
from etrain.worker.data_parallel import DataParallel  # noqa: E402
from etrain.worker.engine import peak_rss  # noqa: E402
from etrain.worker.injection import Injected  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu.json"
PRECISIONS = ("bf16", "fp16")
TARGETS = {"ours / plain": 0.95, "mfu": 0.35}  # issue 44; MFU for the models whose `mfu_target` is set


@dataclass(frozen=True)
class Model:
    """A model this check runs: a preset and overrides, its precisions, and on a GPU the batch (sequences a step,
    a micro-batch's) and steps (`warmup`, then `steps` timed) that fit its memory and the time budget."""

    preset: str
    family: str
    overrides: tuple[str, ...]
    precisions: tuple[str, ...]
    batch: int
    micro_batch: int
    warmup: int
    steps: int
    mfu_target: bool = False


SUBWORD = ("model.vocab_size=32768",)  # a subword vocabulary's head, not the byte tokenizer's
# Llama 3.2 on llama3-8b.yaml's family settings (a 128,256-token vocabulary, 8 key/value heads, rope theta 500,000
# with Llama 3.1's scaling, RMSNorm eps 1e-5), with 3.2's MLP width, scaling factor and tied head; one GPU.
LLAMA_3_2 = ("model.ffn_dim=8192", "model.tie_weights=true", "model.rope_scaling.factor=32.0", "parallel.shard=1")


def llama_3_2(layers: int, width: int, heads: int, batch: int, micro_batch: int, steps: int) -> Model:
    """A Llama 3.2 shape in bf16, held to the MFU target."""
    shape = (*LLAMA_3_2, f"model.n_layer={layers}", f"model.d_model={width}", f"model.n_head={heads}")
    return Model("llama3-8b", "llama", shape, ("bf16",), batch, micro_batch, warmup=2, steps=steps, mfu_target=True)


# Peak memory, estimated (measure() records it, and the memory model's prediction, per variant): 16 bytes a
# parameter for fp32 weights, gradients and AdamW's moments, 2 for the bf16 copies autocast keeps for the backward,
# and activations. Those were counted on CPU with saved-tensor hooks at 2,048 tokens: ~133 KB a token a layer at
# 1B's width, ~169 KB at 3B's (the residual stream and RMSNorm in fp32, each linear's own bf16 copy of its input,
# SwiGLU's four 8,192-wide tensors), plus ~1.3 MB a token for the logits (bf16, their fp32 copy, log-softmax's).
# 1B (1.236e9): 19.8 + 2.5 + 8,192 tokens x (16 x 133 KB + 1.3 MB) = 28 GB -> ~50 GB.
# 3B (3.213e9): 51.4 + 6.4 + 4,096 tokens x (28 x 169 KB + 1.3 MB) = 25 GB -> ~83 GB; a micro-batch of 4 would
# be ~108 GB before the allocator's slack, too near the H200's 141 GB. No activation checkpointing here (the config
# has none). The foreach AdamW step adds one fp32 temporary (4 bytes a parameter) once the activations are gone.
MODELS = {
    "gpt": Model("gpu-125m", "gpt", SUBWORD, PRECISIONS, batch=32, micro_batch=16, warmup=3, steps=10),
    "llama": Model(
        "gpu-125m", "llama", (*SUBWORD, "model.n_kv_head=4"), PRECISIONS, batch=32, micro_batch=16, warmup=3, steps=10
    ),
    "llama-1b": llama_3_2(layers=16, width=2048, heads=32, batch=16, micro_batch=4, steps=5),
    "llama-3b": llama_3_2(layers=28, width=3072, heads=24, batch=8, micro_batch=2, steps=4),
}
CPU_MODELS = ("gpt", "llama")  # the big ones' paths on CPU are the small Llama's at another shape


def config(name: str, precision: str, args) -> Config:
    model = MODELS[name]
    if args.device == "cpu":  # the smoke test: the same paths on a model that runs in seconds
        shape = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.seq_len=32", "model.vocab_size=256"]
        shape += ["model.n_kv_head=2", "model.ffn_dim=128"] if model.family == "llama" else []
        batch = ["train.global_batch=4", "train.micro_batch=2"]
    else:
        shape = []
        batch = [f"train.global_batch={args.batch or model.batch}"]
        batch.append(f"train.micro_batch={args.micro_batch or model.micro_batch}")
    warmup, steps = schedule(name, args)
    overrides = [
        f"model.family={model.family}",
        *model.overrides,
        *shape,
        *batch,
        f"train.precision={precision}",
        f"train.steps={(warmup + steps) * 4}",  # the schedule well inside its warm-up and decay
        "cluster.num_workers=1",
        "cluster.max_workers=1",
    ]
    return load_config(model.preset, overrides)


def schedule(name: str, args) -> tuple[int, int]:
    """(warm-up steps, timed steps): the model's own on a GPU, 2 and 3 on CPU, unless --warmup or --steps says."""
    model = MODELS[name]
    warmup, steps = (model.warmup, model.steps) if args.device == "cuda" else (2, 3)
    return (warmup if args.warmup is None else args.warmup, steps if args.steps is None else args.steps)


def batches(cfg: Config, device: torch.device, count: int) -> list[torch.Tensor]:
    """Random tokens, the same for every loop: a step's cost does not depend on what the tokens say."""
    g = torch.Generator().manual_seed(cfg.train.seed)
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    return [torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device) for _ in range(count)]


def random_model(cfg: Config, device: torch.device) -> LanguageModel:
    """The model with its weights drawn on `device` from the run's seed: the same for every loop, so ours and plain
    give the same losses. Drawn as the run's initial weights are distributed (N(0, 0.02), residual projections
    scaled by 1/sqrt(2 x layers), norms 1, biases 0), not as they are made (etrain/core/models/shared.py draws each
    tensor on the CPU from its name, ~30 s for the 3B): the step's cost does not depend on the values."""
    with torch.device("meta"):
        model = make_model(cfg.model)
    model.materialize(device)  # ties the head again, fills the rotary tables
    g = torch.Generator(device).manual_seed(cfg.train.seed)
    residual = cfg.model.spec.residual
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head once, as the embedding
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.model.n_layer) if name.endswith(residual) else 0.02
                p.normal_(0.0, std, generator=g)
    return model


class BenchEngine(DataParallel):
    """The data-parallel engine as a worker builds it, but for its weights: `random_model`'s."""

    def build_model(self) -> LanguageModel:
        return random_model(self.cfg, self.device)


def ours(cfg: Config, device: torch.device):
    """The worker's step: the engine at rank 0 of a world of 1 (no DDP), compute.py's `train_on`, then what the
    actor does after it each step (etrain/worker/actor.py `train_step`)."""
    engine, injected = BenchEngine(cfg, device), Injected()
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
    model = random_model(cfg, device)
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


def flops_counts(model: LanguageModel) -> dict[str, float]:
    """Training FLOPs per token, counted two ways. torchtitan's: 6·N + 12·l·h·q·t (l layers, h heads, q a head's
    width, t tokens a sequence; 12 for attention's two matmuls forward and backward, the causal mask not discounted),
    N the parameters less the embedding tables, whose lookups multiply nothing, unless the output head shares them
    (pytorch/torchtitan, torchtitan/models/utils.py: `get_nparams_and_active_nparams` and
    `quadratic_attention_flops_per_token`; before them `get_dense_model_nparams_and_flops`, which subtracted a tied
    table too and so left the head's matmul out). Ours (etrain/core/flops.py) counts every parameter: the two
    differ by 6 x an untied model's embedding tables, and for the tied models here not at all."""
    cfg, head = model.cfg, {id(p) for p in model.head.parameters()}
    tables = {id(p): p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    params = model.num_params()
    lookups = sum(n for key, n in tables.items() if key not in head)
    attention = 12 * cfg.n_layer * cfg.n_head * cfg.head_width * cfg.seq_len
    return {"torchtitan": 6 * (params - lookups) + attention, "etrain": flops_per_token(cfg, params)}


@functools.cache
def device_peak(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s (a GPU outside flops.py's table is timed: once, not per variant)."""
    return peak_flops(device, precision)


def measure(loop: str, cfg: Config, device: torch.device, warmup: int, steps: int) -> dict:
    rows = batches(cfg, device, warmup + steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = LOOPS[loop](cfg, device)
    losses = [step(n, batch) for n, batch in enumerate(rows[:warmup], 1)]  # kernels, allocator, autograd
    sync(device)
    started = time.perf_counter()
    losses += [step(n, batch) for n, batch in enumerate(rows[warmup:], warmup + 1)]
    sync(device)
    elapsed = time.perf_counter() - started
    with torch.device("meta"):
        model = make_model(cfg.model)
    flops = flops_counts(model)
    tokens_per_s = steps * cfg.train.global_batch * cfg.model.seq_len / elapsed
    peak = device_peak(device, cfg.train.precision)
    return {
        "tokens_per_s": tokens_per_s,
        "step_s": elapsed / steps,
        "mfu": flops["torchtitan"] * tokens_per_s / peak if peak else None,
        "mfu_etrain": flops["etrain"] * tokens_per_s / peak if peak else None,
        "flops_per_token": flops,
        "params": model.num_params(),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "predicted_memory_bytes": cfg.worker_memory(),
        "batch": [cfg.train.global_batch, cfg.train.micro_batch, cfg.model.seq_len],
        "losses": [float(x) for x in losses],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Give back what a variant held (weights, gradients, AdamW's state: ~58 GB for the 3B) before the next one
    builds its own; the allocator's cache too, so each variant's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def nvml() -> dict:
    """What the health source reads on this machine: a Reading's fields, or why there is none."""
    from dataclasses import asdict

    reading = NvmlSource().read("bench")
    return asdict(reading) if reading is not None else {"unavailable": "no NVIDIA driver or GPU here"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, help="timed steps per run (after --warmup); each model's own if unset")
    p.add_argument("--warmup", type=int, help="untimed steps first; each model's own if unset")
    p.add_argument("--batch", type=int, help="sequences per step (GPU); each model's own if unset")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (GPU); each model's own if unset")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help=f"all on a GPU, {' and '.join(CPU_MODELS)} on CPU")
    p.add_argument("--budget-s", type=float, default=285.0, help="start no round that would end later than this")
    p.add_argument("--out", default=str(RESULTS), help="'' writes nothing")
    args = p.parse_args(argv)
    args.models = args.models or list(MODELS if args.device == "cuda" else CPU_MODELS)
    return args


def main() -> None:
    args = parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA device here; run it on a GPU machine, or with --device cpu as a smoke test",
            file=sys.stderr,
        )
        sys.exit(2)
    device = torch.device(args.device)
    runs: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}
    rounds_s: list[float] = []
    for round_ in range(args.rounds):
        if rounds_s and time.time() - STARTED + rounds_s[-1] > args.budget_s:
            print(f"stopping after {round_} rounds: another (~{rounds_s[-1]:.0f} s) would end past --budget-s")
            break
        began = time.time()
        run_round(round_, args, device, runs, failed)
        rounds_s.append(time.time() - began)
        elapsed, left = time.time() - STARTED, args.rounds - round_ - 1
        eta = f"~{left * rounds_s[-1]:.0f} s to go" if left else "done"
        print(f"round {round_}: {rounds_s[-1]:.0f} s; {elapsed:.0f} s so far, {eta}", flush=True)
    report = summarize(runs, failed, args, device, rounds_s)
    print(json.dumps(report["ratios"], indent=1))
    for key, target in report["targets"].items():
        value = "no figure" if target["value"] is None else f"{target['value']:.3f}"
        print(f"{key}: {value} {({True: 'met', False: 'MISSED', None: ''})[target['met']]}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"written: {args.out}")


def run_round(round_: int, args, device: torch.device, runs: dict, failed: dict) -> None:
    """Each model, precision and loop once. A variant out of memory is reported and its model left out from then
    on (an 80 GB GPU and the 3B), so the rest of the check still runs in the machine's few minutes."""
    for name in args.models:
        for precision in MODELS[name].precisions:
            cfg, (warmup, steps) = config(name, precision, args), schedule(name, args)
            for loop in LOOPS:  # plain, ours, fused: the same weights and rows
                key = f"{name}/{precision}/{loop}"
                if any(k.startswith(f"{name}/") for k in failed):
                    continue
                try:
                    r = measure(loop, cfg, device, warmup, steps)
                except torch.OutOfMemoryError as e:
                    failed[key] = str(e).splitlines()[0]
                    print(f"round {round_} {key}: out of memory; {name} left out from here", flush=True)
                    r = None
                free(device)
                if r is None:
                    continue
                runs.setdefault(key, []).append(r)
                mfu = "" if r["mfu"] is None else f"MFU {r['mfu']:.3f}  "
                memory = "" if r["peak_memory_bytes"] is None else f"peak {r['peak_memory_bytes'] / 1e9:.1f} GB  "
                print(
                    f"round {round_} {name:8s} {precision} {loop:5s} {r['tokens_per_s']:12,.0f} tokens/s  {mfu}"
                    f"{memory}loss {r['losses'][-1]:.4f}  ({time.time() - STARTED:.0f} s)",
                    flush=True,
                )


def summarize(runs: dict[str, list[dict]], failed: dict[str, str], args, device: torch.device, rounds_s) -> dict:
    figures = {key: figure(rs) for key, rs in runs.items()}
    ratios = {}
    for base in dict.fromkeys(key.rpartition("/")[0] for key in runs):  # model/precision, in the order run
        if not all(f"{base}/{loop}" in runs for loop in LOOPS):
            continue
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
        "targets": targets(args, figures, ratios),
        "figures": figures,
        "mfu": {
            "formula": "torchtitan's: 6·N + 12·l·h·q·t, N the parameters less untied embedding tables (flops_counts)",
            "source": "pytorch/torchtitan torchtitan/models/utils.py (get_nparams_and_active_nparams, "
            "quadratic_attention_flops_per_token)",
            "also": "mfu_etrain: etrain/core/flops.py flops_per_token (every parameter); equal for tied heads",
            "peak_flops": {p: device_peak(device, p) for p in PRECISIONS},
        },
        "time": {"total_s": time.time() - STARTED, "rounds_s": rounds_s, "budget_s": args.budget_s},
        "failed": failed,
        "nvml": nvml(),
        "without_ray": "ray" not in sys.modules,
        "sharded_engine": "not here: FSDP2 (parallel.shard, etrain/worker/laid_out.py) needs a group of ranks",
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }


def figure(runs: list[dict]) -> dict:
    """A variant's figures over its rounds: medians, the spread of tokens/s, the highest peak memory."""

    def median(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    first, peaks = runs[0], [r["peak_memory_bytes"] for r in runs if r["peak_memory_bytes"] is not None]
    return {
        "tokens_per_s": {"median": median("tokens_per_s"), "spread": _spread(runs, "tokens_per_s")},
        "step_s": median("step_s"),
        "mfu": median("mfu"),
        "mfu_etrain": median("mfu_etrain"),
        "flops_per_token": first["flops_per_token"],
        "params": first["params"],
        "peak_memory_bytes": max(peaks, default=None),
        "predicted_memory_bytes": first["predicted_memory_bytes"],
        "batch, micro-batch, tokens": first["batch"],
        "rounds": len(runs),
        "last_loss": first["losses"][-1],
    }


def targets(args, figures: dict, ratios: dict) -> dict:
    """Each target with its figure and whether it is met (None: no figure, as MFU on CPU)."""

    def held(value: float | None, floor: float) -> dict:
        return {"value": value, "met": None if value is None else value >= floor}

    out = {}
    for name in args.models:
        for precision in MODELS[name].precisions:
            base = f"{name}/{precision}"
            floor = TARGETS["ours / plain"]
            out[f"{base}: ours / plain >= {floor}"] = held(ratios.get(f"{base}: ours / plain"), floor)
            if MODELS[name].mfu_target:
                floor = TARGETS["mfu"]
                out[f"{base}: MFU of ours >= {floor}"] = held(figures.get(f"{base}/ours", {}).get("mfu"), floor)
    return out


def _spread(runs: list[dict], key: str) -> list[float]:
    return [min(r[key] for r in runs), max(r[key] for r in runs)]


if __name__ == "__main__":
    main()
