"""The Guard over sharded training: FSDP2 (``fully_shard``), tensor parallel (``parallelize_module``),
FSDP×TP and HSDP -- every model whose parameters are DTensors.

Each rank's detectors work on what that rank holds and computes: ABFT checks the GEMMs the rank
runs (under FSDP2 the unsharded weights its forward and backward use; under tensor parallel the
GEMMs of its local shards, an event naming the element in shard and global coordinates), the
state checksums hash its local shards of the weights and Adam moments, the non-finite detector
reads its local gradient shards, and a rollback restores its own local shards (the snapshot
ring holds them, nothing is gathered). Only what must be global is reduced, in one small gather
a step: the world-mean loss and the global gradient norm (squared local norms summed over the
shards, a replicated shard counted once). Then, per step, on every rank:

1. the ranks' findings are shared (one all-reduce of a count; an object gather only when there
   is something to share) -- so every rank holds the same list and takes the same actions;
2. any finding but a state checksum's makes every rank replay the step together (the replay is a
   collective: FSDP2 gathers, TP reduces); a finding the replay does not reproduce anywhere is
   ``transient`` and the clean re-execution is kept (``recompute``), one that comes back is
   ``reproducible``; a world finding (a spike of the global norm) names the rank whose replayed
   gradients differ, when exactly one does;
3. the policy's actions apply on every rank. ``quarantine`` cannot exclude a rank that owns a
   shard nobody else holds: the guard stops cleanly instead (:attr:`ShardedRanks.stop`), the
   ledger names the device, and the engine exits with ``ExitCode.GUARD_STOPPED``. A site the
   ledger finds ``persistent`` (``strikes`` findings) stops the run the same way.

Settings that cannot be guarded correctly over sharded parameters are refused before training,
by name (:func:`check_sharded`).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sdcscope.common.modules import CHANNELS_FIRST, weight_in_out
from sdcscope.common.tensors import is_dtensor, local, shard_coords
from sdcscope.detect import Event
from sdcscope.guard.actions import PRIORITY
from sdcscope.guard.replay import replay_step
from sdcscope.localize.ledger import LEDGER_FILE, Ledger, device_id

if TYPE_CHECKING:
    from sdcscope.guard.config import GuardConfig
    from sdcscope.guard.session import StepGrads, StepSession

log = logging.getLogger("sdcscope.guard.sharded")

WORLD_DETECTORS = ("spike",)
"""Detectors fed with world values (the global loss and gradient norm): every rank finds the same,
so the world keeps one copy, about no rank until a replay names one."""
UNSUPPORTED = {
    "metrics": "per-step metrics read whole parameters and gradients; over shards they would be each "
    "rank's partial values; set metrics: null",
    "zclip": "ZClip clips by a gradient norm it computes itself, which over shards is each rank's own "
    "norm (ranks would clip differently); set zclip: null and clip in before_step with a DTensor-aware "
    "clip_grad_norm_",
    "qk_clip": "each rank sees only its own heads' attention logits, and rescaling on some ranks would "
    "split the shards; set qk_clip: null",
    "invariants": "the invariant checker traces whole tensors in one process; drop invariants",
}
"""Guard settings refused over sharded parameters, and why."""
STOP = "no rank can be excluded: each owns a shard no other rank holds"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2, tensor parallel, HSDP)."""
    return any(is_dtensor(p) for p in model.parameters())


def tensor_parallel_layers(model: nn.Module) -> list[str]:
    """Modules whose ``weight`` is split by tensor parallelism (a DTensor that is not one of
    FSDP2's own shards of a plain parameter): their GEMMs run on local shards inside DTensor's
    dispatch, where ABFT reads them for a split ``nn.Linear`` only (:func:`abft_targets`)."""
    fsdp_own: set[int] = set()
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        for fp in getattr(group, "fsdp_params", ()) or ():
            if not fp.is_dtensor:
                fsdp_own.add(id(fp.sharded_param))
    return [
        name
        for name, m in model.named_modules()
        if is_dtensor(getattr(m, "weight", None)) and id(m.weight) not in fsdp_own
    ]


def abft_targets(model: nn.Module, config: Any) -> list[str]:
    """The tensor-parallel layers the ABFT ``config`` would check but cannot (see
    :func:`tensor_parallel_layers`): ABFT checks a split ``nn.Linear`` on each rank's local shards
    (:mod:`sdcscope.detect.abft.tensorparallel`); any other split module it targets (a
    convolution, transformers' ``Conv1D``) runs its GEMM inside DTensor's dispatch unchecked."""
    tp = tensor_parallel_layers(model)
    if config is None or not tp:
        return []
    kinds = config.kinds

    def targeted(m: nn.Module) -> bool:  # as ABFTDetector picks its layers
        return ("linear" in kinds and (isinstance(m, nn.Linear) or weight_in_out(m))) or (
            "conv" in kinds and isinstance(m, CHANNELS_FIRST)
        )

    picked = [
        n
        for n in tp
        if (config.targets is None or any(fnmatch.fnmatchcase(n, pat) for pat in config.targets))
        and targeted(model.get_submodule(n))
    ]
    return [n for n in picked if not _tp_linear(model.get_submodule(n))]


def _tp_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` computing x·Wᵀ + b with W stored (out, in): ABFT maps its local GEMM."""
    return isinstance(module, nn.Linear) and not weight_in_out(module)


def check_sharded(config: GuardConfig, *, scaler: Any = None, ddp: Any = None, model: nn.Module | None = None) -> None:
    """Refuse (ValueError, naming the setting) what the Guard cannot do correctly over sharded
    parameters, before any step."""
    tp = [] if model is None else abft_targets(model, config.abft)
    if tp:
        raise ValueError(
            f"guard abft cannot check tensor-parallel layers ({', '.join(tp[:4])}{', ...' if len(tp) > 4 else ''}): "
            "only a split nn.Linear (ColwiseParallel, RowwiseParallel) is checked on each rank's local shards; "
            "the GEMMs of these run inside DTensor's dispatch; leave them out with abft: {targets: [...]} "
            "or set abft: null"
        )
    for name, why in UNSUPPORTED.items():
        if getattr(config, name) is not None:
            raise ValueError(f"guard {name} is not supported over sharded (DTensor) parameters: {why}")
    if scaler is not None:
        raise ValueError(
            "Guard scaler= is not supported over sharded (DTensor) parameters: train in bf16 "
            "(FSDP2's MixedPrecisionPolicy) instead of fp16 with a GradScaler"
        )
    if ddp is not None:
        raise ValueError("a DDP wrapper around sharded (DTensor) parameters is not a topology the guard knows")
    if config.ranks is None:
        raise ValueError(
            "guard ranks: null cannot watch a sharded run: every rank must take the same decision, "
            "which the ranks section provides; give ranks: {} for the defaults"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("a model with DTensor parameters needs an initialized torch.distributed process group")


def sharded_rank(rank: int | None) -> int:
    """This process's rank in the world (a given ``rank`` must be it)."""
    own = dist.get_rank()
    if rank is not None and rank != own:
        raise ValueError(f"rank={rank!r} is not this process's rank {own} in the world")
    return own


def comm_device() -> torch.device:
    """Where this world's collectives take their tensors: the current CUDA device under nccl."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replicas(p: torch.Tensor, world: int) -> int:
    """How many ranks hold the same values as this rank's part of ``p``: a DTensor's size of the
    mesh dims it is replicated over (those it is sharded over split it); a plain tensor in a
    sharded model (one tensor parallelism leaves alone) is alike on every rank."""
    if not is_dtensor(p):
        return world
    mesh = p.device_mesh
    n = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            n *= mesh.size(dim)
    return n * (world // mesh.size())  # ranks outside the mesh hold their own copy


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _replica_key(params: list[torch.Tensor]) -> tuple:
    """This rank's coordinates on the mesh dims its replicated parameters are split over (the
    ranks sharing a key hold copies of the same shards)."""
    key = []
    for p in params:
        if is_dtensor(p):
            coord = p.device_mesh.get_coordinate() or []
            key.append(tuple(c for c, pl in zip(coord, p.placements) if not pl.is_replicate()))
    return tuple(key)


class ShardedRanks:
    """The Guard's rank section over sharded parameters (``guard.ranks``; ``sharded`` is True)."""

    sharded = True

    def __init__(self, guard: Any, config: Any, *, run_dir: str | Path | None, ledger: str | Path | None) -> None:
        self.guard = guard
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        params = guard.session.params
        self.named = dict(guard.model.named_parameters())
        # shards other ranks hold too (HSDP's replicate dim; a TP group's whole parameters), and
        # this rank's place among their holders: ranks with the same key must hold the same bits
        self.replicated = [p for p in params if replicas(p, self.world) > 1]
        self.keys: list[Any] = [None] * self.world
        dist.all_gather_object(self.keys, _replica_key(self.replicated))
        self.carry: list[Event] = []
        self.weights = torch.tensor([1.0 / replicas(p, self.world) for p in params], dtype=torch.float64)
        self.quarantined: list[int] = []  # nothing can be excluded: the run stops instead
        self.stop: str | None = None
        """Why the guard stopped the run (None: it did not); the same on every rank."""
        self.devices = [None] * self.world
        dist.all_gather_object(self.devices, f"{device_id(next(iter(params)).device)}/rank{self.rank}")
        path = Path(ledger) if ledger is not None else Path(run_dir) / LEDGER_FILE if run_dir is not None else None
        self.ledger = Ledger(path, writer=self.rank == 0, entries=Ledger.read(path))

    # -- the world values of the cheap detectors ---------------------------------------------
    def world_values(self, loss: torch.Tensor, grads: StepGrads | None) -> tuple[float, float | None]:
        """``(world-mean loss, global gradient norm squared)`` from every rank's loss and squared
        local norms (each shard counted once), the same bits on every rank."""
        sq = torch.zeros((), dtype=torch.float64)
        if grads is not None and grads.sq is not None:
            w = self.weights[grads.idx].to(grads.sq.device)
            sq = (grads.sq * w).sum()
        dev = comm_device()
        row = torch.stack([loss.detach().to(dev, torch.float64).reshape(()), sq.to(dev)])
        rows = [torch.zeros(2, dtype=torch.float64, device=dev) for _ in range(self.world)]
        dist.all_gather(rows, row)
        losses, sqs = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
        loss_v = math.fsum(losses) / self.world if all(map(math.isfinite, losses)) else math.nan
        total = math.fsum(sqs) if all(map(math.isfinite, sqs)) else math.inf
        return loss_v, (None if grads is None or grads.sq is None else total)

    # -- the world's decision ----------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Nothing to prepare: the shared values travel in :meth:`world_values` and :meth:`decide`."""

    def share(self, local: list[Event]) -> list[Event]:
        """Every rank's findings, in rank order, on every rank; world findings kept once."""
        if self.carry:  # the last replica check's findings: every rank holds them, rank 0 shares them
            local = local + (self.carry if self.rank == 0 else [])
            self.carry = []
        for e in local:  # name a stored shard in global coordinates too
            if e.detector == "state_checksum":
                tensor = str(e.evidence.get("tensor") or e.module or "").split(":")[0]
                coords = shard_coords(self.named.get(tensor)) if tensor in self.named else None
                if coords is not None:
                    e.evidence = {**e.evidence, "shard": coords}
        count = torch.tensor([len(local)], dtype=torch.int64, device=comm_device())
        dist.all_reduce(count)
        if int(count) == 0:
            return []
        lists: list[Any] = [None] * self.world
        dist.all_gather_object(lists, [e.to_dict() for e in local])
        events = []
        for r, records in enumerate(lists):
            for d in records:
                e = Event(**{k: d.get(k) for k in Event.__dataclass_fields__ if k in d})
                if e.detector in WORLD_DETECTORS:
                    if r != 0:
                        continue
                    e.rank = None
                elif e.rank is None:
                    e.rank = r
                events.append(e)
        return events

    def decide(
        self, session: StepSession, loss: Any, rerun: Any, local: list[Event]
    ) -> tuple[list[str], list[Event], Any, list[Event]]:
        """``(actions, most decisive first; the world's findings; the loss to report; the guard's
        stop event, if it stops)``, the same on every rank. ``rerun()``: the step's forward and
        backward again (a collective)."""
        g, step = self.guard, session.step
        events = self.share(local)
        if not events:
            return [], [], loss, []
        if any(e.detector == "state_checksum" for e in events):
            # the step ran on corrupted state somewhere: its other findings are its consequences
            # (the gradients reach every rank), and a replay would repeat them; the state decides
            events = [e for e in events if e.detector == "state_checksum"]
        replay: dict[str, Any] = {}
        if any(e.detector != "state_checksum" for e in events) and g.config.replay and rerun is not None:
            recheckable = any(e.detector in ("abft", "nonfinite") for e in events)
            replay, loss = self._replay(session, loss, rerun, recheckable)
        actions: list[str] = []
        for e in events:
            if e.detector != "state_checksum":
                finding = e.verdict
                e.verdict = replay.get("verdict", "unverified")
                e.evidence = {**e.evidence, "finding": finding, **({"replay": replay} if replay else {})}
                if e.rank is None and len(replay.get("differing_ranks", ())) == 1:
                    e.rank = replay["differing_ranks"][0]  # a world finding: the rank whose replay differs
                    e.module = e.module or replay["first_differing_grad"].get(str(e.rank))
            chosen = []
            for a in g.config.policy.actions_for(e.detector, e.verdict):
                if a == "quarantine":
                    self._stop(f"policy: {e.detector}: {e.verdict} on rank {e.rank}: {STOP}")
                    a = "veto"
                chosen += [a] if a not in chosen else []
            note = self._note(e)
            if note is not None and note.persistent and not self.stop:
                self._stop(f"persistent fault at {note.site} on rank {e.rank} ({note.strikes} strikes): {STOP}")
                chosen = ["veto"]
            e.action = ", ".join(chosen)
            actions += [a for a in chosen if a not in actions and a in PRIORITY]
        extra = []
        if self.stop:
            actions = [a for a in actions if a != "recompute"] + ([] if "veto" in actions else ["veto"])
            evidence = {"reason": self.stop, "ledger": None if self.ledger.path is None else str(self.ledger.path)}
            extra.append(Event(step, "guard", "stopped", rank=None, evidence=evidence, action="stop"))
        if "rollback" in actions and g.ring.latest() is None:
            actions.remove("rollback")
            actions += [] if "veto" in actions else ["veto"]
        return sorted(actions, key=PRIORITY.index), events, loss, extra

    def _replay(self, session: StepSession, loss: Any, rerun: Any, recheckable: bool) -> tuple[dict, Any]:
        """Every rank replays the step; the world's verdict from every rank's replay."""
        mine, new_loss = replay_step(session, loss, rerun, recheckable)
        results: list[Any] = [None] * self.world
        dist.all_gather_object(results, mine)
        differing = [r for r, x in enumerate(results) if x.get("differing_grads")]
        if any(x["verdict"] == "unverified" for x in results):
            verdict = "unverified"
        elif any(x.get("replay_detections") for x in results):
            verdict = "reproducible"
        elif any(x["verdict"] == "transient" for x in results):
            verdict = "transient"
        else:
            verdict = "reproducible"
        replay = {
            "verdict": verdict,
            "ranks": {str(r): x["verdict"] for r, x in enumerate(results)},
            "differing_ranks": differing,
            "first_differing_grad": {
                str(r): (results[r].get("first_differing_grad") or "").rpartition(".")[0] or None for r in differing
            },
            "replay_detections": sum(x.get("replay_detections", 0) for x in results),
        }
        if verdict == "reproducible":
            replay["evidence"] = next((x["evidence"] for x in results if x.get("evidence")), None)
        return replay, new_loss

    def _note(self, e: Event):
        if e.rank is None or not 0 <= e.rank < self.world:
            return None
        return self.ledger.note(self.devices[e.rank], e, rank=e.rank)

    def _stop(self, why: str) -> None:
        if self.stop is None:
            self.stop = why
            log.error("guard: stopping the run: %s", why)

    def end(self, step: int, *, verify: bool = False) -> None:
        """After the update, every ``hash_every`` steps: the replicas of a replicated shard (HSDP's
        replicate dim, TP's whole parameters) are compared. A mismatch is carried into the next
        step's decision as a state finding (a rollback on every rank), naming the rank the
        majority outvotes when there are 3 or more replicas (with 2 no copy can be preferred)."""
        every = self.config.hash_every
        if not self.replicated or not every or (step + 1) % every and not verify:
            return
        mine = torch.stack(
            [local(p).detach().reshape(-1).view(_INT[p.element_size()]).sum(dtype=torch.int64) for p in self.replicated]
        )
        mine = mine.to(comm_device())
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        groups: dict[tuple, list[int]] = {}
        for r, key in enumerate(self.keys):
            groups.setdefault(key, []).append(r)
        for ranks in groups.values():
            digests = {r: tuple(rows[r].tolist()) for r in ranks}
            counts = {d: sum(1 for x in digests.values() if x == d) for d in set(digests.values())}
            if len(counts) < 2:
                continue
            top = max(counts.values())
            majority = [d for d, n in counts.items() if n == top]
            outvoted = [r for r, d in digests.items() if len(majority) == 1 and d != majority[0]]
            evidence = {"replica_mismatch": ranks, "outvoted": outvoted, "replicas": len(ranks)}
            for r in outvoted or [None]:
                self.carry.append(
                    Event(step + 1, "state_checksum", "corrupt", rank=r, evidence=dict(evidence), action=None)
                )

    def close(self) -> None:
        self.ledger.save()


def sharded_guard_config(config: GuardConfig, kind: str) -> GuardConfig:
    """The engine's guard settings for ``--parallel kind`` (GPT workload): the sections refused
    over shards (:data:`UNSUPPORTED`) switched off, each named in a log line. ABFT keeps its
    targets: under tensor parallelism each rank checks the local GEMMs of the split linears, the
    attention products of its own heads and the head."""
    changes = {}
    for name in UNSUPPORTED:
        if getattr(config, name) is not None:
            changes[name] = None
            log.warning("guard %s is off under --parallel %s: %s", name, kind, UNSUPPORTED[name])
    if config.ranks is None:
        raise ValueError("guard ranks: null cannot watch a sharded run; give ranks: {} for the defaults")
    return replace(config, **changes)
