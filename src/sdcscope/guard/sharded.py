"""The Guard over split training: FSDP2 (``fully_shard``), tensor parallel (``parallelize_module``),
FSDP×TP and HSDP -- every model whose parameters are DTensors --, expert parallelism (an MoE's
experts sharded over ranks, tokens moved by all-to-all) and pipeline stages (``pp``, ``fsdp+pp``:
a replay runs the whole schedule). Each rank owns a part no other rank holds, so one side decides
for all of them.

Each rank's detectors work on what that rank holds and computes: ABFT checks the GEMMs the rank
runs (under FSDP2 the unsharded weights its forward and backward use; under tensor parallel the
GEMMs of its local shards, an event naming the element in shard and global coordinates), the
state checksums hash its local shards of the weights and Adam moments, the non-finite detector
reads its local gradient shards, and a rollback restores its own local shards (the snapshot
ring holds them, nothing is gathered). Only what must be global is reduced, in one small gather
a step: the world-mean loss and the global gradient norm (squared local norms summed over the
shards, a replicated shard counted once, by the world's placement arithmetic). In the one
decision loop (:meth:`StepSession.decide <sdcscope.guard.session.StepSession.decide>`) this
side supplies, per step and on every rank:

1. the ranks' findings are shared (one all-reduce of a count; an object gather only when there
   is something to share) -- so every rank holds the same list and takes the same actions; a
   step on corrupted state is decided by the state checksums alone, and one whose all-gather or
   all-to-all or pipeline send/recv delivered other bits than were sent by that link alone (the
   rest are its consequences);
2. any finding but a state checksum's makes every rank replay the step together (the replay is a
   collective: FSDP2 gathers, TP reduces); a finding the replay does not reproduce anywhere is
   ``transient`` and the clean re-execution is kept (``recompute``), one that comes back is
   ``reproducible``; a world finding (a spike of the global norm) names the rank whose replayed
   gradients differ, when exactly one does, and a finding whose replay ABFT (escalated to every
   GEMM by any finding) catches a GEMM on one rank names that rank and layer;
3. the policy's actions apply on every rank. ``quarantine`` cannot exclude a rank that owns a
   shard nobody else holds: the guard stops cleanly instead (:attr:`ShardedRanks.stop`), the
   ledger names the device, and the engine exits with ``ExitCode.GUARD_STOPPED``. A site the
   ledger finds ``persistent`` (``strikes`` findings) stops the run the same way.

What a sharded world cannot run is in :data:`~sdcscope.common.world.SUPPORT`
(:func:`~sdcscope.guard.world.fit_config`); ABFT targets it cannot check are refused by name
(:func:`check_abft`).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sdcscope.common.modules import CHANNELS_FIRST, weight_in_out
from sdcscope.common.world import World, is_dtensor, local, shard_coords
from sdcscope.detect import Event
from sdcscope.guard.replay import replay_step
from sdcscope.guard.world import WorldSide, apply_replay, finite_mean, recheckable
from sdcscope.localize.ledger import LEDGER_FILE, Ledger, device_id

if TYPE_CHECKING:
    from sdcscope.guard.session import StepGrads, StepSession

log = logging.getLogger("sdcscope.guard.sharded")

WORLD_DETECTORS = ("spike",)
"""Detectors fed with world values (the global loss and gradient norm): every rank finds the same,
so the world keeps one copy, about no rank until a replay names one."""
STOP = {
    "sharded": "no rank can be excluded: each owns a shard no other rank holds",
    "expert": "no rank can be excluded: each owns experts no other rank holds",
    "pipeline": "no rank can be excluded: each holds a pipeline stage no other rank holds",
}
"""Why a split world stops where another would leave a rank out."""


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


def check_abft(model: nn.Module, config: Any) -> None:
    """Refuse (ValueError, naming the layers) ABFT targets of a tensor-parallel model it cannot check."""
    tp = abft_targets(model, config)
    if tp:
        raise ValueError(
            f"guard abft cannot check tensor-parallel layers ({', '.join(tp[:4])}{', ...' if len(tp) > 4 else ''}): "
            "only a split nn.Linear (ColwiseParallel, RowwiseParallel) is checked on each rank's local shards; "
            "the GEMMs of these run inside DTensor's dispatch; leave them out with abft: {targets: [...]} "
            "or set abft: null"
        )


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ShardedRanks(WorldSide):
    """The Guard's sharded side: world values, shared findings and a replay every rank runs."""

    detect_on_corrupt_state = True  # the detectors' world values are collectives: every rank runs them

    def __init__(
        self, guard: Any, world: World, config: Any, *, run_dir: str | Path | None, ledger: str | Path | None
    ) -> None:
        super().__init__(guard, world)
        check_abft(guard.model, guard.config.abft)
        self.config = config
        self.rank, self.size = world.rank, world.size
        params = guard.session.params
        self.weights = world.replica_weights(params)  # each replicated shard counted once
        self.named = dict(guard.model.named_parameters())
        # shards other ranks hold too (HSDP's replicate dim; a TP group's whole parameters), and
        # this rank's place among their holders: ranks with the same key must hold the same bits
        self.replicated = [p for p in params if world.replicas(p) > 1]
        self.keys: list[Any] = [None] * self.size
        dist.all_gather_object(self.keys, (world.replica_key(self.replicated), len(self.replicated)))
        # a pipeline's stages hold different parameters (a middle stage may hold no copy): every rank
        # takes part in the check when any rank has copies, its row padded to the longest
        self.width = max(n for _, n in self.keys)
        self.keys = [key if n else None for key, n in self.keys]
        self.carry: list[Event] = []
        self.persistent: set[int] = set()  # ids of this step's findings the ledger found persistent
        self.devices = [None] * self.size
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
        dev = self.world.comm_device()
        rows = self.world.gather(torch.stack([loss.detach().to(dev, torch.float64).reshape(()), sq.to(dev)]))
        losses = [float(rows[r][0]) for r in self.world.loss_ranks]  # a pipeline's: its last stage's
        sqs = [float(r[1]) for r in rows]
        total = math.fsum(sqs) if all(map(math.isfinite, sqs)) else math.inf
        return finite_mean(losses), (None if grads is None or grads.sq is None else total)

    def own_overflow(self, sq: torch.Tensor | None) -> bool:
        """The ranks whose own shards' norms overflowed name the parameters."""
        return sq is not None and not bool(torch.isfinite(sq).all())

    # -- the world's decision ----------------------------------------------------------------
    def share(self, session: StepSession, local_events: list[Event], rank_replay: Any) -> list[Event]:
        """Every rank's findings, in rank order, on every rank; world findings kept once. A step
        that ran on corrupted state somewhere is decided by the state alone: its other findings are
        its consequences (the gradients reach every rank), and a replay would repeat them."""
        local_events = list(local_events)
        if self.carry:  # the last replica check's findings: every rank holds them, rank 0 shares them
            local_events += self.carry if self.rank == 0 else []
            self.carry = []
        for e in local_events:  # name a stored shard in global coordinates too
            if e.detector == "state_checksum":
                tensor = str(e.evidence.get("tensor") or e.module or "").split(":")[0]
                coords = shard_coords(self.named.get(tensor)) if tensor in self.named else None
                if coords is not None:
                    e.evidence = {**e.evidence, "shard": coords}
        count = torch.tensor([len(local_events)], dtype=torch.int64, device=self.world.comm_device())
        dist.all_reduce(count)
        if int(count) == 0:
            return []
        lists: list[Any] = [None] * self.size
        dist.all_gather_object(lists, [e.to_dict() for e in local_events])
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
                if self.world.pipeline and e.rank is not None:  # a pipeline's events name the stage
                    e.evidence = {**e.evidence, "stage": self.world.stage.stage_of_rank(e.rank)}
                events.append(e)
        if any(e.detector == "state_checksum" for e in events):
            events = [e for e in events if e.detector == "state_checksum"]
        elif any(_link(e) for e in events):  # corrupted bits delivered: the rest is their consequence
            events = [e for e in events if _link(e)]
        return events

    def replay(self, session: StepSession, events: list[Event], loss: Any, rerun: Any) -> Any:
        """Every rank replays the step (a collective: FSDP2 gathers, TP reduces); the world's
        verdict from every rank's replay; findings that name the same place once."""
        replay: dict[str, Any] = {}
        if self.should_replay(events, rerun):
            mine, loss = replay_step(session, loss, rerun, recheckable(events))
            results: list[Any] = [None] * self.size
            dist.all_gather_object(results, mine)
            replay = world_replay(results)
        apply_replay(events, replay)
        seen: set[tuple] = set()
        events[:] = [e for e in events if not ((key := (e.detector, e.rank, e.module)) in seen or seen.add(key))]
        return loss

    def judge(self, session: StepSession, events: list[Event]) -> None:
        """The ledger's strikes per rank: a site it finds persistent stops the run."""
        self.persistent = set()
        for e in events:
            note = self._note(e)
            if note is not None and note.persistent and not self.stop:
                self.halt(
                    f"persistent fault at {note.site} on {self._where(e.rank)} ({note.strikes} strikes): {self._stop}"
                )
                self.persistent.add(id(e))

    def translate(self, session: StepSession, e: Event, chosen: list[str]) -> list[str]:
        """``quarantine`` cannot exclude a rank that owns a shard nobody else holds: the run stops."""
        if id(e) in self.persistent:
            return ["veto"]
        out: list[str] = []
        for a in chosen:
            if a == "quarantine":
                self.halt(f"policy: {e.detector}: {e.verdict} on {self._where(e.rank)}: {self._stop}")
                a = "veto"
            out += [a] if a not in out else []
        return out

    def stop_evidence(self) -> dict[str, Any]:
        return {"ledger": None if self.ledger.path is None else str(self.ledger.path)}

    def _where(self, rank: int | None) -> str:
        if self.world.pipeline and rank is not None:
            return f"rank {rank} (pipeline stage {self.world.stage.stage_of_rank(rank)})"
        return f"rank {rank}"

    @property
    def _stop(self) -> str:
        return STOP[self.world.kind]

    def _note(self, e: Event):
        if e.rank is None or not 0 <= e.rank < self.size:
            return None
        return self.ledger.note(self.devices[e.rank], e, rank=e.rank)

    def end(self, step: int, *, verify: bool = False) -> None:
        """After the update, every ``hash_every`` steps: the replicas of a replicated shard (HSDP's
        replicate dim, TP's whole parameters) are compared. A mismatch is carried into the next
        step's decision as a state finding (a rollback on every rank), naming the rank the
        majority outvotes when there are 3 or more replicas (with 2 no copy can be preferred)."""
        every = self.config.hash_every
        if not self.width or not every or (step + 1) % every and not verify:
            return
        dev = self.world.comm_device()
        words = [local(p).detach().reshape(-1).view(_INT[p.element_size()]) for p in self.replicated]
        sums = [w.sum(dtype=torch.int64) for w in words]
        mine = torch.zeros(self.width, dtype=torch.int64, device=dev)
        if sums:
            mine[: len(sums)] = torch.stack(sums).to(dev)
        rows = self.world.gather(mine)
        groups: dict[tuple, list[int]] = {}
        for r, key in enumerate(self.keys):
            if key is not None:  # a rank without copies compares nothing
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


def _link(e: Event) -> bool:
    """An exact link finding: an all-gather, an all-to-all or a pipeline send/recv delivered other
    bits than its sender sent."""
    return e.detector == "collectives" and e.evidence.get("collective") in ("all_gather", "all_to_all", "send_recv")


def world_replay(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The world's replay evidence from every rank's (in rank order): ``unverified`` if any rank
    could not replay, ``reproducible`` if any rank's checks fired again, ``transient`` if a rank's
    results differed, else ``reproducible`` (an identical re-execution everywhere)."""
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
        "caught": {str(r): x["detected_in"] for r, x in enumerate(results) if x.get("detected_in")},
    }
    if verdict == "reproducible":
        replay["evidence"] = next((x["evidence"] for x in results if x.get("evidence")), None)
    return replay
