"""One rank's part of a model replica laid out over parallel.tp × parallel.pp × parallel.shard ranks
(etrain/core/parallel.py).

No rank holds the whole model: the worker knows only the model's structure (on the meta device) until it joins a
group; then it builds its part at the place (stage, shard, tp_rank) its rank gives, gives it storage, and takes its
values (the run's initial weights, made tensor by tensor; or a checkpoint's, or a twin's, after joining). Only the
part's state is kept when it leaves (the part is bound to the group's mesh): a re-formed group puts it at the same
place, or it takes the state of its twin (the same place in another replica)."""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import Future, wait

import torch
import torch.distributed as dist

from etrain.core import sharded_checkpoint as dcp
from etrain.core.checkpoint import DCP
from etrain.core.finetune import base_source
from etrain.core.layout_state import load_full, load_local, local_state
from etrain.core.models import make_model
from etrain.core.models.shared import InitialWeights, LanguageModel, inputs_and_targets
from etrain.core.optim import by_name, make_optimizer, make_scheduler, whole_groups
from etrain.core.parallel import Replica, ReplicaBroken, make_mesh
from etrain.worker.engine import Engine, snapshot
from etrain.worker.injection import Injected


class LaidOut(Engine):
    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.replica: Replica | None = None  # in a group: this rank's part
        self.save_group = None  # the first replica's ranks, which write a checkpoint with DCP
        self.saving: Future | None = None  # that save, in the background: finished before the group goes
        self.stager = None  # the host buffers its saves copy the part into, kept while the group lasts
        self.held: dict | None = None  # out of a group: the part's state, as layout_state.local_state

    def build_model(self) -> LanguageModel:
        """The model's structure only: each rank makes its part when it joins."""
        with torch.device("meta"):
            return make_model(self.cfg.model)

    def warm_up(self) -> None:
        """Nothing to warm: the part exists only in a group."""

    def join(self, rank: int, world: int) -> int:
        """Make this rank's part of the model: with the run's initial weights (or its base's) on a fresh worker,
        with what it held in the last group when its place is the same. Elsewhere its state is of no use: -1, and
        the coordinator copies the twin's."""
        self.rank, self.world = rank, world
        par = self.cfg.parallel
        model = self.build_model()
        param_dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else None  # FSDP's compute dtype
        self.replica = Replica(model, make_mesh(world, par, self.device.type), par, self.device, param_dtype)
        self.replica.model.materialize(self.device)
        # every rank makes every group, in one order; gloo: DCP stages on the host
        self.save_group = dist.new_group(list(range(par.ranks)), backend="gloo")
        self.stager = dcp.stager()
        self.optimizer = make_optimizer(self.replica.model, self.cfg.optim)
        schedule = self.scheduler.state_dict() if self.held is None else self.held["scheduler"]
        self.scheduler = make_scheduler(self.optimizer, self.cfg.optim, self.cfg.train.steps)
        self.scheduler.load_state_dict(schedule)
        if self.held is None:
            self._initial()
        elif tuple(self.held["at"]) == self.replica.at.place:
            load_local(self.replica, self.optimizer, self.held)
        else:
            self.applied = -1
        self.model, self.held = self.replica.model, None
        return self.applied

    def _initial(self) -> None:
        """Give the part the weights a fresh run starts from: made one tensor at a time, or a base's (each rank
        reading its slices of a layout's, the tensors of a Hugging Face directory one at a time)."""
        ft = self.cfg.finetune
        source = base_source(ft) if ft.base is not None else InitialWeights(self.cfg.model, self.cfg.train.seed)
        if isinstance(source, str):
            dcp.load_weights(self.replica.model, source)
        else:
            load_full(self.replica, self.optimizer, {"model": source, "optim": {}})

    def leave(self, failed: bool) -> None:
        """Keep the part's state, not the part: its mesh goes with the group (after a sharded save in flight,
        which writes with the group's ranks, unless a collective failed)."""
        if self.saving is not None and not failed:
            wait([self.saving])
        if self.stager is not None:
            self.stager.close()  # a save still writing keeps what it staged
        self.saving = self.save_group = self.stager = None
        if self.replica is not None:
            self.held = local_state(self.replica, self.optimizer) | {"scheduler": self.scheduler.state_dict()}
            # `held` has the part's values: the next group builds the part afresh
            self.replica = self.model = self.optimizer = self.scheduler = None
        if not failed:
            self.rank, self.world = -1, 0

    def forward_backward(self, rows: torch.Tensor, global_batch: int, injected: Injected) -> tuple[float, float]:
        """This rank's part of the replica's step, then the gradients summed over the tied pair and the replicas
        and clipped by the whole model's norm. The step's loss is given by rank 0 alone (every rank knows it)."""
        if injected.slowdown > 1 or injected.poisoned:
            raise ValueError("fault kinds slow, nan and spike are not injected into a laid-out replica")
        try:
            with self.autocast():
                loss = self.replica.forward_backward(
                    *inputs_and_targets(rows), len(rows) / global_batch, self.cfg.train.micro_batch
                )
        except ReplicaBroken as e:
            self._exit_if_others_go_on(e)
            raise
        grad_norm = self.replica.sync_and_clip(self.cfg.optim.grad_clip or float("inf"))
        return (loss if self.rank == 0 else 0.0), grad_norm

    def _exit_if_others_go_on(self, error: ReplicaBroken) -> None:
        """A rank whose replica lost a rank in its forward or backward exits. Its replica is out of the group
        anyway, and its state lives on in its twins; alive, it would hold the ranks of the other replicas in
        their gradient all-reduce until timeouts.collective_s: once DTensor is loaded, destroying a gloo group
        does not close its connections (measured on torch 2.13), and only the process's end does."""
        if self.world > self.cfg.parallel.ranks:
            print(f"rank {self.rank}: {error}; exiting, so that the other replicas go on at once", flush=True)
            os._exit(1)

    def evaluate(self, rows: torch.Tensor) -> tuple[float, int]:
        """Every rank of the replica runs it; the replica's first rank answers."""
        with self.autocast():
            mean = self.replica.evaluate(*inputs_and_targets(rows), self.cfg.train.micro_batch)
        first = self.replica.at.place == (0, 0, 0)
        return (mean * len(rows), len(rows)) if first else (0.0, 0)

    def state(self) -> dict:
        """This rank's part, for its twin."""
        return local_state(self.replica, self.optimizer) | self.schedule_state()

    def load(self, state: dict, step: int) -> None:
        """A twin's part (a state with "at"), a laid-out run's checkpoint (its DCP files, from any layout: this rank
        reads the slices it holds), or a whole model's (a data-parallel run's checkpoint, or one of a layout before
        DCP): this rank's part."""
        if "at" in state:
            load_local(self.replica, self.optimizer, state)
        elif "dcp" in state:
            dcp.load(self.model, self.optimizer, state["dcp"], self.replica.tied)
        else:
            whole = {"model": state["model"], "optim": self._by_name(state["optimizer"])}
            load_full(self.replica, self.optimizer, whole)
        self.load_schedule(state, step)
        self.applied = step

    def checkpoint_parts(self, level: str, path: str) -> tuple[dict, dict | None]:
        """The first replica's ranks each write the tensors they hold with DCP (a TP slice, an FSDP shard, a
        pipeline stage's blocks; DCP writes a tensor two ranks hold once), in the background once copied to host
        memory, and rank 0 the schedule: no rank gathers the whole model. It resumes in any layout, and in a
        data-parallel run. The other replicas hold the same state and take no part. Full checkpoints only (the
        config refuses checkpoint.light_every here: a light one is the whole model's changed tensors)."""
        if self.replica.at.replica != 0:
            return {}, None
        uri = posixpath.join(path, DCP)
        state = dcp.state_dict(self.model, self.optimizer, self.replica.tied)
        if self.saving is not None:  # the staging buffers are the last save's until it is written
            wait([self.saving])
        self.saving = dcp.save(state, uri, self.save_group, self.stager)
        group_rank, saving = dist.get_rank(self.save_group), self.saving

        def written() -> dict:
            saving.result()
            return dcp.written(uri, group_rank)

        parts: dict = {"dcp": written}
        if group_rank == 0:
            parts["extra.pt"] = snapshot(self.schedule_state())
        return parts, None

    def _by_name(self, optimizer_state: dict) -> dict:
        """A whole model's optimizer state by parameter name (layout_state's form)."""
        return by_name(optimizer_state, whole_groups(self.cfg.model, self.cfg.optim))
