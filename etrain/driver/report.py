"""Run summary from the run directory's metrics: what `summary.json` and `etrain report` show; and the run report,
plots and one HTML page made from the same records (matplotlib is imported only when a report is made)."""

from __future__ import annotations

import base64
import html
import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from etrain.core.comm_model import advise
from etrain.core.config import ConfigError
from etrain.core.goodput import time_split
from etrain.core.records import STEP_PARTS, read_jsonl, steady_tokens_per_s

if TYPE_CHECKING:
    from matplotlib.figure import Figure


REASON_COLORS = {
    "start": "tab:gray",
    "scale-out": "tab:green",
    "scale-in": "tab:orange",
    "recover": "tab:red",
    "preemption": "tab:purple",
    "drain": "tab:brown",  # a node at risk (etrain/control/health_watch.py)
}
# they sum to step_time_s (the stall came before)
SPLIT = tuple(f"{part}_s" for part in STEP_PARTS if part != "checkpoint_stall")


def write_report(run_dir: Path, out_dir: Path | None = None) -> dict:
    """PNG plots and one report.html with them inline, so the page alone can be attached or mailed."""
    run_dir = Path(run_dir)
    records = _load(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = _of(records, "train")[0]["time"]
    events = _membership_events(records, t0)
    layout = _layout(run_dir)
    figures = {
        "loss": _loss(records),
        "throughput": _throughput(records, t0, events),
        "data_wait": _data_wait(records),
        "world_size": _world_size(records, t0, layout["ranks"]),
        "grad_norm": _grad_norm(records),
    }
    if any("reward" in r for r in _of(records, "train")):  # a PPO run
        figures["ppo"] = _ppo(records)
    split = time_split(read_jsonl(run_dir / "metrics.jsonl"))  # every record: the redone steps' first try too
    figures["time"] = _time(split)
    plots = {name: out_dir / f"{name}.png" for name in figures}
    for name, fig in figures.items():
        fig.savefig(plots[name])
    summary = _summary(records, layout) | {"communication": _communication(run_dir, records), "time": split}
    page = out_dir / "report.html"
    page.write_text(_html(run_dir.name, summary, plots))
    return {"html": page, "plots": plots, "summary": summary, "events": events}


def _layout(run_dir: Path) -> dict:
    """The run's parallel section (config.yaml), with its ranks per replica; a whole model per worker without one."""
    import yaml

    path = run_dir / "config.yaml"
    saved = (yaml.safe_load(path.read_text()) or {}).get("parallel") if path.is_file() else None
    layout = {"tp": 1, "pp": 1, "shard": 1, "microbatches": 1, "schedule": "1f1b"} | (saved or {})
    return layout | {"ranks": layout["tp"] * layout["pp"] * layout["shard"]}


def _communication(run_dir: Path, records: list[dict]) -> dict | None:
    """Whether communication bounds the run, and what another mode would save (etrain/core/comm_model.py)."""
    import yaml

    path = run_dir / "config.yaml"
    comm = ((yaml.safe_load(path.read_text()) or {}).get("comm") if path.is_file() else None) or {}
    return advise(
        _of(records, "train"),
        comm.get("topk_ratio", 0.1),
        (comm.get("diloco") or {}).get("inner_steps", 16),
        gathered=comm.get("compression") == "topk",
    )


def _load(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; pass a run directory, the one `etrain train` printed")
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass a run directory, the one `etrain train` printed")
    records = _once_per_step(read_jsonl(path))
    if not _of(records, "train"):
        raise ConfigError(f"no steps recorded yet in {path}; make the report once the run has committed a step")
    return records


def _once_per_step(records: list[dict]) -> list[dict]:
    """Each step drawn once: a train record at or before a step already seen starts the run over from
    there (a resume moves the records it redoes aside itself; a run directory written before it did,
    or by two drivers at once, must still not draw a line back in time)."""
    kept, last = [], 0
    for r in records:
        if r.get("kind") == "train" and r["step"] <= last:
            kept = [k for k in kept if k.get("kind") not in ("train", "eval") or k["step"] < r["step"]]
        if r.get("kind") == "train":
            last = r["step"]
        kept.append(r)
    return kept


def _of(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("kind") == kind]


def _label(m: dict) -> str:
    return f"{m.get('reason')} {m.get('world_before')}→{m.get('world_after')}"


def _membership_events(records: list[dict], t0: float) -> list[tuple[float, str]]:
    """A membership record has no time and is written after the first step that follows the change: the change sits at
    the end of its step, the latest train record of that step before it (a rewind restarts the clock at its step);
    with none (a start at step 0), at the next train record."""
    events, ended, pending, last = [], {}, [], t0
    for r in records:
        kind = r.get("kind")
        if kind == "train":
            ended[r["step"]] = last = r["time"]
            events += [(last - t0, _label(m)) for m in pending]
            pending = []
        elif kind in ("resume", "rollback", "outer"):
            ended = {r["step"]: r["time"]}
        elif kind == "membership" and r.get("step") in ended:
            events.append((ended[r["step"]] - t0, _label(r)))
        elif kind == "membership":
            pending.append(r)
    events += [(last - t0, _label(m)) for m in pending]
    return sorted(events, key=lambda e: e[0])


def _figure(size: tuple[float, float] = (8, 3.5)) -> Figure:
    """A figure on its own Agg canvas: no pyplot, no backend switch for whoever imported matplotlib before us."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set(xticks=[], yticks=[])


def _decades(values) -> float:
    positive = [v for v in values if v > 0]
    return math.log10(max(positive) / min(positive)) if positive else 0.0


def _loss(records: list[dict]) -> Figure:
    """Train and eval loss on the same axes: the gap between them is the overfitting signal."""
    ax = (fig := _figure()).subplots()
    train = [r for r in _of(records, "train") if r.get("loss") is not None]
    evals = [r for r in _of(records, "eval") if r.get("eval_loss") is not None]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=4, label="eval")
    if not train and not evals:
        _empty(ax, "loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="Loss")
    ax.legend()
    return fig


def _throughput(records: list[dict], t0: float, events: list[tuple[float, str]]) -> Figure:
    """Against wall time, so each membership change shows what it cost and what the new world size runs at."""
    ax = (fig := _figure()).subplots()
    train = [r for r in _of(records, "train") if r.get("tokens_per_s") is not None]
    ax.plot([r["time"] - t0 for r in train], [r["tokens_per_s"] for r in train], ".-", lw=1, ms=3, label="tokens/s")
    for t, label in events:
        color = REASON_COLORS.get(label.split()[0], "black")
        ax.axvline(t, color=color, ls="--", lw=1)
        ax.text(
            t,
            0.97,
            label,
            transform=ax.get_xaxis_transform(),
            rotation=90,
            ha="right",
            va="top",
            fontsize=8,
            color=color,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1},
        )
    saved = [r["time"] - t0 for r in _of(records, "checkpoint")]
    if saved:
        ax.vlines(saved, 0, 0.05, transform=ax.get_xaxis_transform(), color="0.4", lw=1.5, label="checkpoint")
    ax.set_ylim(0, 1.5 * max([r["tokens_per_s"] for r in train], default=1))  # headroom: the labels sit above the line
    ax.set(xlabel="wall time since the first step (s)", ylabel="tokens/s", title="Throughput and membership changes")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def _data_wait(records: list[dict]) -> Figure:
    """Data wait alone (log scale when it spans decades, so loader stalls stand out), then the whole step split:
    whether a slow step waited on data, compute or the all-reduce."""
    train = [r for r in _of(records, "train") if r.get("data_wait_s") is not None]
    split = [r for r in train if r.get("compute_s") is not None]  # a run before "update" and "dispatch": 0 of each
    fig = _figure((8, 6) if split else (8, 3.5))
    axes = fig.subplots(2 if split else 1, 1, sharex=True, squeeze=False)[:, 0]
    wait = [r["data_wait_s"] * 1000 for r in train]
    axes[0].plot([r["step"] for r in train], wait, ".-", lw=1, ms=3)
    if not train:
        _empty(axes[0], "data wait")
    elif _decades(wait) > 2:
        axes[0].set_yscale("log")
    axes[0].set(ylabel="data wait (ms)", title="Data wait per step")
    if split:
        ax, steps, bottom = axes[1], [r["step"] for r in split], np.zeros(len(split))
        for key in SPLIT:
            ms = np.array([r.get(key, 0.0) * 1000 for r in split])
            ax.bar(steps, ms, width=1.0, bottom=bottom, lw=0, label=key.removesuffix("_s").replace("_", " "))
            bottom += ms
        title, top = "Step time split", 1.3 * np.percentile(bottom, 98)
        if bottom.max() > top:  # a warm-up step would flatten the rest: clip it, and say so
            ax.set_ylim(0, top)
            title += f" ({int((bottom > top).sum())} step(s) clipped, up to {bottom.max():.0f} ms)"
        ax.set(ylabel="step time (ms)", title=title)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    axes[-1].set_xlabel("step")
    return fig


def _world_size(records: list[dict], t0: float, ranks: int) -> Figure:
    """A train record's world ran the step that ended at its time, hence where="pre". With a layout, the replicas on
    the right-hand axis: the unit the group grows and shrinks by."""
    from matplotlib.ticker import MaxNLocator

    ax = (fig := _figure()).subplots()
    train = _of(records, "train")
    ax.step([r["time"] - t0 for r in train], [r["world_size"] for r in train], where="pre", label="world size")
    wanted = _of(records, "autoscale")
    if wanted:
        until = max(train[-1]["time"], wanted[-1]["time"]) - t0  # the last wish holds to the end
        ax.step(
            [r["time"] - t0 for r in wanted] + [until],
            [r["wanted"] for r in wanted] + [wanted[-1]["wanted"]],
            where="post",
            ls="--",
            label="wanted",
        )
        ax.legend()
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max([r["world_size"] for r in train] + [r["wanted"] for r in wanted]) + 1)
    ax.set(xlabel="wall time since the first step (s)", ylabel="workers", title="World size")
    if ranks > 1:
        right = ax.secondary_yaxis("right", functions=(lambda w: w / ranks, lambda r: r * ranks))
        right.set_ylabel(f"replicas ({ranks} workers each)")
        right.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _grad_norm(records: list[dict]) -> Figure:
    """The distribution (its tail is what the outlier guard trips on), then per step with skipped and outlier steps."""
    fig = _figure()
    hist, series = fig.subplots(1, 2, width_ratios=[2, 1])
    done = [r for r in _of(records, "train") if 0 < (r.get("grad_norm") or 0) < math.inf]  # fp16 overflow steps: inf
    norms = [r["grad_norm"] for r in done]
    log = _decades(norms) > 1
    if not norms:
        _empty(hist, "finite grad norm")
    hist.hist(norms, bins=np.geomspace(min(norms), max(norms), 40) if log else 40)
    series.plot([r["step"] for r in done], norms, lw=0.8)
    if log:
        hist.set_xscale("log")
        series.set_yscale("log")
    for marked, style, label in (
        ([r for r in done if r.get("skipped")], "rx", "skipped"),
        (_of(records, "outlier"), "o", "outlier"),
    ):
        if marked:
            series.plot([r["step"] for r in marked], [r["grad_norm"] for r in marked], style, mfc="none", label=label)
            series.legend(fontsize=8)
    hist.set(xlabel="grad norm (L2, before clipping)", ylabel="steps", title="Gradient norm")
    series.set(xlabel="step", ylabel="grad norm", title="Per step")
    return fig


def _ppo(records: list[dict]) -> Figure:
    """A PPO or GRPO run's statistics per step: the reward (and the held-out one), the KL to the base and its
    coefficient, the clip fraction, the policy's entropy, the value loss (PPO's) or the KL term of the loss
    (GRPO's)."""
    fig = _figure((10, 6))
    axes = fig.subplots(2, 3).flatten()
    train = [r for r in _of(records, "train") if "reward" in r]
    steps = [r["step"] for r in train]
    held_out = [r for r in _of(records, "eval") if r.get("eval_reward") is not None]
    panels = [
        ("reward", "mean reward"),
        ("kl", "KL to the base (nats/response)"),
        ("kl_coef", "KL coefficient"),
        ("clip_fraction", "clip fraction"),
        ("entropy", "entropy (nats/token)"),
        ("value_loss", "value loss") if train and "value_loss" in train[0] else ("kl_loss", "KL term of the loss (k3)"),
    ]
    for ax, (key, title) in zip(axes, panels):
        ax.plot(steps, [r[key] for r in train], lw=1, label="rollouts")
        ax.set(xlabel="step", title=title)
    if held_out:
        axes[0].plot([r["step"] for r in held_out], [r["eval_reward"] for r in held_out], "o-", ms=4, label="held out")
        axes[0].legend(fontsize=8)
    return fig


def _time(split: dict) -> Figure:
    """The run's wall time: the steps' productive time, then each cause of badput, as one stacked bar."""
    fig = _figure((10, 2.6))
    ax = fig.subplots()
    parts = {"productive": split["productive_s"], **split["badput_s"]}
    left = 0.0
    for name, seconds in parts.items():
        shown = max(seconds, 0.0)
        ax.barh(0, shown, left=left, label=f"{name.replace('_', ' ')} {seconds:.1f} s")
        left += shown
    goodput = "–" if split["goodput"] is None else f"{split['goodput']:.1%}"
    ax.set(xlabel="seconds", yticks=[], title=f"Wall time {split['wall_s']:.1f} s: goodput {goodput}")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return fig


def _time_mean(records: list[dict], key: str) -> float | None:
    """Weighted by step time: the run's overall rate, not a mean over steps of unequal length."""
    have = [r for r in records if r.get(key) is not None and r.get("step_time_s")]
    return sum(r[key] * r["step_time_s"] for r in have) / sum(r["step_time_s"] for r in have) if have else None


def _summary(records: list[dict], layout: dict) -> dict:
    train = _of(records, "train")
    done = [r for r in train if r.get("loss") is not None]
    steady = done[1:] or done  # the first step pays for warm-up
    evals = [r for r in _of(records, "eval") if r.get("eval_loss") is not None]
    changes = Counter(r.get("reason") for r in _of(records, "membership"))
    return {
        "steps": train[-1]["step"],
        "final_loss": done[-1]["loss"] if done else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "mean_tokens_per_s": steady_tokens_per_s(train),
        "mean_mfu": _time_mean(steady, "mfu"),
        "membership": dict(changes),
        # each step's own count: a run resumed in another layout ran its earlier steps in that one
        "layout": layout
        | {"replicas": sorted({r.get("replicas") or r["world_size"] // layout["ranks"] for r in train})},
        "checkpoints": len(_of(records, "checkpoint")),
        "checkpoints_failed": len(_of(records, "checkpoint_failed")),
        "recoveries": changes["recover"] + len(_of(records, "resume")) + len(_of(records, "rollback")),
    }


def _html(name: str, summary: dict, plots: dict[str, Path]) -> str:
    def num(v, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    rows = [
        ("steps", summary["steps"]),
        ("final loss", num(summary["final_loss"], ".4f")),
        ("final eval loss", num(summary["final_eval_loss"], ".4f")),
        ("mean tokens/s (after step 1)", num(summary["mean_tokens_per_s"], ",.0f")),
    ]
    if summary["mean_mfu"] is not None:
        rows.append(("mean MFU (after step 1)", num(summary["mean_mfu"], ".1%")))
    lay = summary["layout"]
    if lay["ranks"] > 1:
        pipeline = f", {lay['schedule']} over {lay['microbatches']} micro-batches" if lay["pp"] > 1 else ""
        fewest, most = lay["replicas"][0], lay["replicas"][-1]
        counts = str(most) if fewest == most else f"{fewest}–{most}"
        shard = f" × shard {lay['shard']}" if lay.get("shard", 1) > 1 else ""
        rows.append(("layout", f"tp {lay['tp']} × pp {lay['pp']}{shard}{pipeline}; replicas {counts}"))
    rows += [
        ("membership changes", ", ".join(f"{k} {v}" for k, v in summary["membership"].items()) or "none"),
        ("checkpoints committed", summary["checkpoints"]),
        ("checkpoints failed", summary["checkpoints_failed"]),
        ("recoveries (recover, resume, rollback)", summary["recoveries"]),
    ]
    if summary.get("communication"):
        rows.append(("communication", summary["communication"]["advice"]))
    split = summary.get("time")
    if split and split["goodput"] is not None:
        lost = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in split["badput_s"].items() if abs(v) >= 0.05)
        rows.append(
            ("goodput (productive step time / wall time)", f"{split['goodput']:.1%} of {split['wall_s']:.1f} s")
        )
        rows.append(("badput by cause", lost or "none"))
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    images = "\n".join(
        f'<p><img alt="{html.escape(k)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></p>'
        for k, p in plots.items()
    )
    title = html.escape(f"Run report: {name}")
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title>\n<style>'
        "body{font-family:sans-serif;max-width:860px;margin:auto} th{text-align:left;padding-right:2em} "
        "img{max-width:100%}"
        f"</style></head>\n<body>\n<h1>{title}</h1>\n<table>\n{table}\n</table>\n{images}\n</body></html>\n"
    )
