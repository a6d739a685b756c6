"""The Llama family and tokenizers, side by side in one run, in interleaved rounds (medians with min and max):

1. speed: tokens/s of a Llama model in our trainer (one worker, 2 threads) against the same model in a plain torch
   loop on the same samples (target >= 0.9x), and against a GPT of equal parameter count in our trainer. Each
   variant runs in a fresh process of its own.
2. tokenize: documents encoded as `etrain prepare` packs them (TokenizerFile.encode_documents) against `tokenizers`'
   own `encode_batch` on the same documents (target >= 0.8x), one call per document (how prepare packed before),
   and the byte tokenizer; then `etrain prepare` end to end with the BPE file against bytes, on Ray Data.
3. lora: LoRA against full fine-tuning of Llama-shaped models of two sizes, each pre-trained here on the embedded
   corpus (Python's standard library) and fine-tuned on prose (the installed packages' descriptions): eval loss,
   LoRA's gap to full, the trainable share.

    python bench/models.py [--rounds 3] [--only speed tokenize lora] [--out bench/results/models.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from rounds import in_own_process, interleaved, publish, summary

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 5  # steps left out of tokens/s (allocator, first touch)
LLAMA = ["model.family=llama", "model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.n_kv_head=2"]
SIZES = {  # Llama-shaped models of the lora section: the llama-tiny preset's, and 4x its width and depth product
    "2x128": ["model.n_layer=2", "model.d_model=128"],
    "4x256": ["model.n_layer=4", "model.d_model=256"],
}
FINETUNE = {  # the lrs of bench/finetune.py's sweep on the tiny GPT (full 2e-3, LoRA rank 8 on q, k, v, o 2e-2)
    "full": ["finetune.method=full", "optim.lr=2e-3"],
    "lora": ["finetune.method=lora", "optim.lr=2e-2"],
}


# -- 1. speed: each variant in its own process (`--variant NAME`) -------------------------------------------------


def gpt_of_equal_size() -> list[str]:
    """A GPT as deep and wide as LLAMA, its MLP's width chosen so that the two hold the same number of parameters
    (GPT: 4·d with biases and LayerNorms; Llama: SwiGLU's three matrices, GQA's narrower k and v)."""
    from etrain.core.config import load_config
    from etrain.core.models import make_model

    def count(cfg) -> int:
        import torch

        with torch.device("meta"):
            return make_model(cfg.model).num_params()

    target = count(load_config("llama-tiny", LLAMA))
    shape = [o for o in LLAMA if not o.startswith(("model.family", "model.n_kv_head", "model.d_model"))]
    # GPT's MLP is fixed at 4·d: match the count with its width instead
    widths = range(128, 512, 8)  # head widths even (rotary)
    best = min(widths, key=lambda d: abs(count(load_config("tiny", [*shape, f"model.d_model={d}"])) - target))
    return [*shape, f"model.d_model={best}"]


def speed_config(variant: str, args):
    from etrain.core.config import load_config

    model = LLAMA if variant != "ours_gpt" else gpt_of_equal_size()
    return load_config(
        "llama-tiny" if variant != "ours_gpt" else "tiny",
        [*model, "model.seq_len=128", f"train.steps={args.steps}", "train.global_batch=16", "train.micro_batch=16",
         "train.eval_every=0", "checkpoint.every=0", "cluster.num_workers=1", "cluster.cpus_per_worker=2",
         f"data.cache_dir={args.data}", f"run.root={tempfile.mkdtemp(prefix='etrain-bench-models-')}"],
    )  # fmt: skip


def run_plain(args) -> dict:
    """The Llama model in a plain torch loop: the same samples in the same order, AdamW, clipping, the schedule."""
    import torch
    from throughput import plain_loop

    from etrain.core.models import make_model

    cfg = speed_config("plain_llama", args)
    torch.manual_seed(cfg.train.seed)
    model = make_model(cfg.model)
    return {"times": plain_loop(cfg, model, threads=2), "params": model.num_params()}


def run_ours(variant: str, args) -> dict:
    from etrain.core.models import make_model
    from etrain.core.records import read_jsonl
    from etrain.driver.job import new_run_dir, train

    cfg = speed_config(variant, args)
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    times = [r["time"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return {"times": times, "params": make_model(cfg.model).num_params()}


def speed(variant: str, args) -> dict:
    """tokens/s past the warm-up steps, and the model's parameter count."""
    out = in_own_process(__file__, ["--variant", variant, "--steps", str(args.steps), "--data", args.data], variant)
    times = out["times"]
    tokens = 16 * 128 * (len(times) - 1 - WARMUP)
    return {"tokens_per_s": tokens / (times[-1] - times[WARMUP]), "params": out["params"]}


def bench_speed(args) -> dict:
    runs = interleaved(
        args.rounds,
        ["plain_llama", "ours_llama", "ours_gpt"],
        lambda v: speed(v, args),
        lambda v, r: f"{v:12s} {r['tokens_per_s']:8.0f} tokens/s  ({r['params']:,} parameters)",
    )
    figures = {v: summary(r) for v, r in runs.items()}
    med = {v: f["tokens_per_s"]["median"] for v, f in figures.items()}
    return {
        "what": f"tokens/s past {WARMUP} warm-up steps of {args.steps}, batch 16 x 128 tokens, one process of 2 "
        f"threads; Llama {' '.join(LLAMA)}, the GPT as deep, its width matched to the same parameter count",
        "figures": figures,
        "ratios": {
            "ours_llama_vs_plain_llama": med["ours_llama"] / med["plain_llama"],
            "ours_llama_vs_ours_gpt_equal_params": med["ours_llama"] / med["ours_gpt"],
        },
        "targets": {"ours_llama_vs_plain_llama": ">= 0.9"},
    }


# -- 2. tokenize -----------------------------------------------------------------------------------------------------


def encode_rates(texts: list[str], tok) -> dict:
    """MB of text per second, each way of encoding the same documents, in this process."""
    import numpy as np

    from etrain.data import tokenizer

    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    ways = {
        "library_batch": lambda: tok.tokenizer.encode_batch(texts, add_special_tokens=True),
        "ours_batch": lambda: tok.encode_documents(texts),
        "ours_per_document": lambda: [np.array([*tok.tokenizer.encode(t).ids, tok.eos]) for t in texts],
        "bytes": lambda: [np.append(tokenizer.encode(t), np.uint8(tokenizer.EOT)) for t in texts],
    }
    ways["library_batch"]()  # the BPE's cache of words filled before any way is timed
    rates = {}
    for name, way in ways.items():
        started = time.perf_counter()
        way()
        rates[f"{name}_mb_per_s"] = megabytes / (time.perf_counter() - started)
    return rates


def bench_tokenize(args, root: Path) -> dict:
    import ray
    from finetune import package_descriptions

    from etrain.core.config import load_config
    from etrain.data import tokenizer
    from etrain.data.prepare import prepare

    source = package_descriptions(root / "packages.jsonl")
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    tok = tokenizer.train_bpe(iter(texts), args.vocab)
    (root / "bpe").mkdir()
    (root / "bpe" / "tokenizer.json").write_text(tok.text)
    megabytes = source.stat().st_size / 1e6
    batch = texts * 4  # a few MB: seconds, not milliseconds, per way
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    logging.getLogger("ray.data").setLevel(logging.WARNING)

    def end_to_end(spec: str) -> float:
        cfg = load_config("tiny", [f"prepare.tokenizer={spec}"])
        started = time.perf_counter()
        prepare([str(source)], str(root / f"out-{time.monotonic_ns()}"), cfg, progress=False)
        return megabytes / (time.perf_counter() - started)

    end_to_end("bytes")  # Ray Data's first start, outside the timing
    runs = []
    for r in range(args.rounds):
        rates = encode_rates(batch, tok)
        rates |= {"prepare_bytes_mb_per_s": end_to_end("bytes"), "prepare_bpe_mb_per_s": end_to_end(str(root / "bpe"))}
        runs.append(rates)
        print(f"round {r + 1}  " + "  ".join(f"{k} {v:.2f}" for k, v in rates.items()), flush=True)
    ray.shutdown()
    figures = summary(runs)
    med = {k: v["median"] for k, v in figures.items()}
    return {
        "what": f"{len(texts)} documents ({megabytes:.1f} MB of prose and markdown), a byte-level BPE of {args.vocab} "
        f"learned from them; in-process encoding of the documents x4, and `etrain prepare` of them on Ray Data "
        "(2 CPUs) end to end",
        "figures": figures,
        "ratios": {
            "ours_vs_library_batch": med["ours_batch_mb_per_s"] / med["library_batch_mb_per_s"],
            "per_document_vs_library_batch": med["ours_per_document_mb_per_s"] / med["library_batch_mb_per_s"],
            "prepare_bpe_vs_bytes": med["prepare_bpe_mb_per_s"] / med["prepare_bytes_mb_per_s"],
        },
        "targets": {"ours_vs_library_batch": ">= 0.8"},
    }


# -- 3. lora ---------------------------------------------------------------------------------------------------------


def bench_lora(args, root: Path) -> dict:
    import ray
    from finetune import base_eval_loss, measured, package_descriptions

    from etrain.core.config import load_config
    from etrain.core.finetune import build_model, finetune_config
    from etrain.data.prepare import prepare
    from etrain.driver.job import new_run_dir, train

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    common = [f"run.root={root}", f"data.cache_dir={args.data}", "train.eval_every=0"]
    bases, before = {}, {}
    corpus = root / "packages"
    for size, shape in SIZES.items():
        started = time.perf_counter()
        cfg = load_config("llama-tiny", [*common, *shape, f"run.name=base-{size}", f"train.steps={args.base_steps}",
                                         "checkpoint.every=" + str(args.base_steps)])  # fmt: skip
        bases[size] = new_run_dir(cfg)
        train(cfg, bases[size], progress=False)
        if not corpus.exists():
            prepare([str(package_descriptions(root / "packages.jsonl"))], str(corpus), cfg, progress=False)
        manifest = str(corpus / "manifest.json")
        before[size] = base_eval_loss(finetune_config(str(bases[size]), None, [f"data.source={manifest}"]), manifest)
        print(f"base {size}: {args.base_steps} steps, eval loss on the prose {before[size]:.4f} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip

    def finetune(variant: str) -> dict:
        size, method = variant.split("/")
        cfg = finetune_config(
            str(bases[size]), None,
            [*FINETUNE[method], f"data.source={manifest}", f"train.steps={args.steps}", f"run.root={root}",
             f"run.name={size}-{method}-{time.monotonic_ns()}", "checkpoint.every=0", "cluster.warm_pool=0"],
        )  # fmt: skip
        run_dir = new_run_dir(cfg)
        train(cfg, run_dir, progress=False)
        model = build_model(cfg)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {"trainable_params": trainable, "params": model.num_params(), **measured(run_dir)}

    variants = [f"{size}/{method}" for size in SIZES for method in FINETUNE]
    runs = interleaved(
        args.rounds,
        variants,
        finetune,
        lambda v, r: f"{v:12s} eval loss {r['eval_loss']:.4f}  {r['step_s']:.3f} s/step",
    )
    ray.shutdown()
    figures = {v: summary(r) for v, r in runs.items()}
    med = {v: {k: f["median"] for k, f in fig.items()} for v, fig in figures.items()}
    per_size = {
        size: {
            "params": med[f"{size}/full"]["params"],
            "base_eval_loss": before[size],
            "full_eval_loss": med[f"{size}/full"]["eval_loss"],
            "lora_eval_loss": med[f"{size}/lora"]["eval_loss"],
            "lora_eval_loss_vs_full": med[f"{size}/lora"]["eval_loss"] / med[f"{size}/full"]["eval_loss"] - 1,
            "lora_trainable_share": med[f"{size}/lora"]["trainable_params"] / med[f"{size}/full"]["params"],
            "lora_step_time_vs_full": med[f"{size}/lora"]["step_s"] / med[f"{size}/full"]["step_s"],
        }
        for size in SIZES
    }
    return {
        "what": f"Llama-shaped bases pre-trained {args.base_steps} steps on the embedded corpus, fine-tuned "
        f"{args.steps} steps on the installed packages' descriptions, 2 workers; LoRA rank 8 on attn.q/k/v/o",
        "figures": figures,
        "per_size": per_size,
    }


# -- the driver ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=["speed", "tokenize", "lora"], help="run only these sections")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (speed: 60, lora: 150)")
    parser.add_argument("--base-steps", type=int, default=300, help="pre-training steps of each lora base")
    parser.add_argument("--vocab", type=int, default=4096, help="the BPE's vocabulary (tokenize)")
    parser.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "etrain-bench-data"))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one speed variant, in this process
    parser.add_argument("--out", default=str(RESULTS / "models.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    if args.variant:
        args.steps = args.steps or 60
        print(json.dumps(run_plain(args) if args.variant == "plain_llama" else run_ours(args.variant, args)))
        sys.exit(0)
    sections = args.only or ["speed", "tokenize", "lora"]
    report = {"when": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="etrain-bench-models-") as tmp:
        if "speed" in sections:
            report["speed"] = bench_speed(argparse.Namespace(**{**vars(args), "steps": args.steps or 60}))
        if "tokenize" in sections:
            report["tokenize"] = bench_tokenize(args, Path(tmp))
        if "lora" in sections:
            lora_args = argparse.Namespace(**{**vars(args), "steps": args.steps or 150})
            report["lora"] = bench_lora(lora_args, Path(tmp))
    report["ratios"] = {
        **{f"speed.{k}": v for k, v in report.get("speed", {}).get("ratios", {}).items()},
        **{f"tokenize.{k}": v for k, v in report.get("tokenize", {}).get("ratios", {}).items()},
        **{f"lora.{s}": v for s, v in report.get("lora", {}).get("per_size", {}).items()},
    }
    return publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
