"""Gradient sync for DDP: torch's communication hooks plus our top-k, all counting the bytes they send.

A hook runs per bucket in the autograd thread while the backward pass goes on, so
communication overlaps compute; `GradSync.take_stats` reads what the hooks sent since
the last take, and when the last bucket was ready (≈ local backward done).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from etrain.worker.link import Link

MODES = ("none", "fp16", "bf16", "powersgd", "topk")
SEGMENT = 32768  # top-k picks per segment, so a local index fits an int16 (sent as bytes: gloo has no int16)
_FP16_MAX = torch.finfo(torch.float16).max
_TORCH_HOOKS = {
    "none": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


class GradSync:
    """Installs the configured DDP communication hook and counts what it sends.

    fp16/bf16/powersgd are torch's hooks; top-k is ours (torch has no sparsifying hook),
    with error feedback: what a step does not send is added to the next step's gradient.

    Top-k's residuals are part of the run's state, like the optimizer's: a step's residuals
    count once the step does (`commit`: a failed step is redone from the ones before it);
    they are stamped with the step of the state they belong to, keyed by parameter so they
    survive a new DDP, rescaled when the group's size changes (`regroup`), written to checkpoints
    (`saved`) and taken back from them (`loaded`). PowerSGD's state is torch's, per bucket, and is rebuilt per group.
    """

    def __init__(self, mode: str, topk_ratio: float = 0.1, powersgd_rank: int = 2, start: int = 0):
        if mode not in MODES:
            raise ValueError(f"unknown gradient compression {mode!r}; one of {MODES}")
        self.mode, self.topk_ratio, self.powersgd_rank = mode, topk_ratio, powersgd_rank
        # Plain all-reduce for the first `start` steps: early gradients change fast, and what top-k holds
        # back then arrives stale (measured on the tiny GPT: it shrinks top-k's loss gap by more than half).
        self.start = start
        self.step = 0  # the step in flight (`begin`); 0 before the first
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> flat error not yet sent
        self.held_at = -1  # the step of the state the residuals belong to (the worker's `applied` at commit)
        self.units = 0  # the size of the group they were made in: each rank's residual weighs 1/units in the mean
        self._next: dict[torch.Tensor, torch.Tensor] = {}  # the step in flight's, kept by `commit`
        self._carried: list[dict[str, torch.Tensor]] | None = None  # a checkpoint's, by rank, for the next group
        self._lock = threading.Lock()  # hooks count in the autograd thread, take_stats reads in the caller's
        self._comm = self._dense = 0
        self._last_ready: float | None = None
        self._one_thread: ThreadPoolExecutor | None = None  # see _in_order
        self.die_in_allreduce = False  # a fault (etrain/control/faults.py): exit once the first bucket is on its way
        self.link: Link | None = None  # a simulated link (fault kind link): each bucket's collective lasts its time
        self._world = 1
        self._powersgd: powersgd.PowerSGDState | None = None
        self._group_steps = 0  # steps begun in this group

    def register(self, ddp: DDP) -> None:
        """Install the hook on a new DDP; call once per DDP, before its first backward."""
        group = ddp.process_group
        self._world, self._group_steps = group.size(), 0
        if self.mode == "powersgd":
            # Its start counts the run's steps (`begin` sets torch's counter), not each group's own; but torch needs
            # 2 steps of plain all-reduce on every new DDP (it rebuilds its buckets after the first).
            self._powersgd = state = powersgd.PowerSGDState(
                group, matrix_approximation_rank=self.powersgd_rank, start_powerSGD_iter=max(2, self.start)
            )
            hook = (
                self._in_order(powersgd.powerSGD_hook) if dist.get_backend(group) == "gloo" else powersgd.powerSGD_hook
            )
            ddp.register_comm_hook(state, self._counted(hook, powersgd_bytes))
        elif self.mode == "topk":
            ddp.register_comm_hook(group, self._counted(self._topk_hook, self._topk_bytes))
        else:
            ddp.register_comm_hook(group, self._counted(_TORCH_HOOKS[self.mode], self._cast_bytes))

    def begin(self, step: int) -> None:
        """Step `step` (the run's step number, 1-based as in its records) starts: every rank decides alike by it,
        joiners too."""
        self.step, self._next = step, {}
        self._group_steps += 1
        if self._powersgd is not None:
            self._powersgd.iter = step - 1 if self._group_steps > 2 else 0

    def commit(self, applied: int, sent: bool = True) -> None:
        """The step succeeded and the state is now at `applied`. `sent`: its gradient was applied; an outlier's
        skipped step leaves the residuals as they were, so the spike is not carried into the next steps."""
        if sent:
            self.residuals.update(self._next)
        self._next, self.held_at = {}, applied

    def loaded(self, step: int, carried: list[dict[str, torch.Tensor]] | None = None) -> None:
        """A state at `step` replaced the model's: a checkpoint's residuals (one per rank that wrote it) go with it,
        adopted by `regroup`; without them, this worker's own are kept only if they belong to that state."""
        if carried is not None:
            self.residuals, self._carried, self.held_at = {}, carried, step
        elif self.held_at != step:
            self.residuals = {}

    def regroup(self, rank: int, world: int, named: list[tuple[str, torch.Tensor]], applied: int) -> None:
        """Residuals for this rank of a group of `world` over the state at `applied`.

        The mean over ranks carries (1/units) x the sum of the residuals. A rank that stays keeps its own,
        times world/units: its share of the mean stays the same; a joiner starts with none, and a leaver's or a
        lost rank's share goes with it. A checkpoint's go back to their ranks at the same size; at another,
        every rank takes their mean, which keeps the sum the mean carries."""
        if self._carried is not None:
            saved = self._carried[rank] if len(self._carried) == world else _mean(self._carried)
            self.residuals = {p: saved[n].to(p.device) for n, p in named if n in saved}
            self._carried = None
        elif self.held_at != applied:  # made for another state (this worker trained alone since, or was reloaded)
            self.residuals = {}
        elif self.units and world != self.units:
            for residual in self.residuals.values():
                residual.mul_(world / self.units)
        self.units, self.held_at = world, applied

    def saved(self, named: list[tuple[str, torch.Tensor]], applied: int) -> dict[str, torch.Tensor]:
        """This rank's residuals of the state at `applied` by parameter name, on CPU: its part of a checkpoint
        (empty before compression starts, or for a joiner that has sent nothing yet)."""
        if self.held_at != applied:
            return {}
        return {n: self.residuals[p].detach().to("cpu", copy=True) for n, p in named if p in self.residuals}

    def drop(self) -> None:
        """Alone in a group: nothing is compressed, and what is unsent has no one to go to."""
        self.residuals, self._carried = {}, None

    def take_stats(self) -> dict:
        """Bytes this worker handed to collectives since the last take, against what plain all-reduce would send."""
        with self._lock:
            stats = {"comm_bytes": self._comm, "dense_bytes": self._dense, "last_ready": self._last_ready}
            self._comm = self._dense = 0
            self._last_ready = None
        return stats

    def _counted(self, hook, sent_bytes):
        """Wrap `hook` to count; bytes are computed before it runs, as PowerSGD's hook advances its own step."""

        def counted_hook(state, bucket):  # unannotated: DDP rejects the string annotations of __future__
            sent = sent_bytes(state, bucket)
            with self._lock:
                self._comm += sent
                self._dense += bucket.buffer().nbytes
                self._last_ready = time.perf_counter()
            future = hook(state, bucket)
            if self.link is not None:
                gathered = self.mode == "topk" and self.step > self.start
                until = self.link.book(sent, self._world, "allgather" if gathered else "allreduce")
                future = self.link.delay(future, until)
            if self.die_in_allreduce:  # the collective has started: peers are mid-all-reduce with this rank
                os._exit(1)
            return future

        return counted_hook

    def _in_order(self, hook):
        """Run `hook` for one bucket after another on one thread of ours, so the backward pass goes on meanwhile.

        PowerSGD starts its second and third all-reduce in callbacks, which gloo runs on whichever
        of its threads finished the first; with two buckets in flight each rank would start them in
        its own order, and gloo aborts on the mismatch. (NCCL completes a future when its work is
        queued on the stream, so there the callbacks run at once, in bucket order: left as torch has it.)
        """
        self._one_thread = self._one_thread or ThreadPoolExecutor(1, thread_name_prefix="powersgd")

        def ordered_hook(state, bucket):
            fut = torch.futures.Future()
            self._one_thread.submit(_settle, fut, hook, state, bucket)
            return fut

        return ordered_hook

    def _cast_bytes(self, _, bucket: dist.GradBucket) -> int:
        """fp16/bf16 all-reduce 2 bytes an element; none, the buffer as it is."""
        buffer = bucket.buffer()
        return buffer.numel() * 2 if self.mode in ("fp16", "bf16") else buffer.nbytes

    def _topk_bytes(self, _, bucket: dist.GradBucket) -> int:
        if self.step <= self.start:
            return bucket.buffer().nbytes
        return 4 * sum(topk_kept(p.numel(), self.topk_ratio) for p in bucket.parameters())

    def _topk_hook(self, group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Send each parameter's largest entries per segment (+ residual), gathered from every rank and averaged.

        Per parameter, not per bucket: DDP lays its buckets out anew after a new group's first step, and a
        selection that followed the buckets would differ between a resumed run and one that went on."""
        if self.step <= self.start:
            return default_hooks.allreduce_hook(group, bucket)
        buffer, params, ratio = bucket.buffer(), bucket.parameters(), self.topk_ratio
        sizes = [p.numel() for p in params]  # bucket.parameters() is in the order of their slices of the buffer
        parts = []
        for p, grad in zip(params, buffer.split(sizes)):
            payload, self._next[p] = topk_compress(grad + self.residuals[p] if p in self.residuals else grad, ratio)
            parts.append(payload)
        payload = torch.cat(parts)
        world = group.size()
        gathered = payload.new_empty(world * payload.numel())
        fut = dist.all_gather_into_tensor(gathered, payload, group=group, async_op=True).get_future()
        return fut.then(lambda _: topk_decompress_parts(gathered, sizes, ratio, world).to(buffer.dtype).div_(world))


def _mean(ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The residuals' sum over the ranks that saved them over their number (a rank without one counts as zero)."""
    names = {n for r in ranks for n in r}
    return {n: sum(r[n] for r in ranks if n in r) / len(ranks) for n in names}


def _settle(fut: torch.futures.Future, hook, state, bucket: dist.GradBucket) -> None:
    try:
        fut.set_result(hook(state, bucket).wait())
    except Exception as e:  # DDP raises it in the backward pass
        fut.set_exception(e)


def powersgd_bytes(state: powersgd.PowerSGDState, bucket: dist.GradBucket) -> int:
    """What torch's powerSGD_hook will all-reduce for this bucket (mirrors its torch 2.13 source).

    Before `start_powerSGD_iter` the whole bucket; after, per tensor viewed as (shape[0], -1):
    P and Q, rank*(n+m) elements, when that saves `min_compression_rate`, else the tensor itself.
    """
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buffer.nbytes
    elements = 0
    for tensor in bucket.gradients():
        n, m = tensor.view(tensor.shape[0], -1).shape
        rank = min(n, m, state.matrix_approximation_rank)
        compress = (n + m) * rank * state.min_compression_rate < n * m  # powerSGD_hook._should_compress
        elements += (n + m) * rank if compress else n * m
    return elements * buffer.element_size()


def _blocks(numel: int, ratio: float) -> list[tuple[int, int, int, int]]:
    """(start, segments, segment length, kept per segment): the full segments, then the tail."""
    full, tail = divmod(numel, SEGMENT)
    blocks = [(0, full, SEGMENT)] if full else []
    blocks += [(full * SEGMENT, 1, tail)] if tail else []
    return [(start, rows, cols, min(cols, math.ceil(ratio * cols))) for start, rows, cols in blocks]


def topk_kept(numel: int, ratio: float) -> int:
    """Entries top-k sends for a bucket of `numel`: the payload is 4 bytes per entry."""
    return sum(rows * k for _, rows, _, k in _blocks(numel, ratio))


def _segment_starts(numel: int, ratio: float) -> torch.Tensor:
    """Start of the segment of each kept entry, in payload order: local index + this = flat index."""
    starts = [
        (start + SEGMENT * torch.arange(rows)).repeat_interleave(k) for start, rows, _, k in _blocks(numel, ratio)
    ]
    return torch.cat(starts)


def topk_compress(g: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 payload, residual): per segment the largest |g|, as int16 local indices then fp16 values.

    The residual is g minus exactly what was sent, fp16 rounding and clamping included,
    so sent + residual == g. A non-finite entry is sent as is (a GradScaler sees the
    overflow and skips the step) and is not carried into the next step.
    """
    local = []
    for start, rows, cols, k in _blocks(g.numel(), ratio):
        segments = g[start : start + rows * cols].view(rows, cols)
        local.append(segments.abs().topk(k, dim=1, sorted=False).indices.flatten())
    local = torch.cat(local)
    at = local + _segment_starts(g.numel(), ratio).to(g.device)
    kept = g[at].float()
    values = kept.clamp(-_FP16_MAX, _FP16_MAX).where(kept.isfinite(), kept).half()
    residual = g.clone()
    residual[at] = (kept - values.float()).to(g.dtype)
    payload = torch.cat([local.to(torch.int16).view(torch.uint8), values.view(torch.uint8)])
    return payload, residual.nan_to_num_(0.0, 0.0, 0.0)


def topk_decompress_parts(gathered: torch.Tensor, sizes: list[int], ratio: float, world: int) -> torch.Tensor:
    """Sum of every rank's payload for tensors of `sizes` sent one after the other, as one dense fp32 tensor."""
    per_rank = gathered.view(world, -1)
    out, start = [], 0
    for numel in sizes:
        length = 4 * topk_kept(numel, ratio)
        out.append(topk_decompress(per_rank[:, start : start + length].flatten(), numel, ratio))
        start += length
    return torch.cat(out)


def topk_decompress(gathered: torch.Tensor, numel: int, ratio: float) -> torch.Tensor:
    """Sum of every rank's payload as a dense fp32 tensor, added in rank order so every rank gets the same bits."""
    k = topk_kept(numel, ratio)
    at_start = _segment_starts(numel, ratio).to(gathered.device)
    dense = torch.zeros(numel, device=gathered.device)
    for payload in gathered.view(-1, 4 * k):
        local = payload[: 2 * k].view(torch.int16).long()
        dense.index_add_(0, local + at_start, payload[2 * k :].view(torch.float16).float())
    return dense
