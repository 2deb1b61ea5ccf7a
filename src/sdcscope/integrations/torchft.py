"""The Guard in a torchft replica group: a verdict keeps the step out of every group, a persistent
one takes the group out of the quorum.

::

    from sdcscope.integrations.torchft import FTGuard       # pip install 'sdcscope[torchft]'

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, ...)
    guard = Guard(model, optimizer, config, run_dir="out/sdc", loss_fn=loss_fn)
    ft = FTGuard(guard, manager)
    for step, batch in enumerate(data):
        ft.begin(step, batch)                 # the step's quorum, then the guard's begin
        loss = loss_fn(model, batch)
        loss.backward()                       # this group's own gradients
        ft.step(loss)                         # True: every group committed the step
        if ft.left:                           # a persistent fault: this group left the quorum
            break

Each replica group's guard judges the gradients the group computed itself, before they are
averaged with the other groups' (the model is not wrapped in torchft's DDP: :meth:`FTGuard.step`
averages the gradients through ``manager.allreduce``, once, after the guard's decision), so a
replay re-runs the group's own step without a collective. The guard decides as in one process,
in its one decision loop; what differs is the world's side (:class:`ReplicaGroupSide`): a
discarded step (a veto; a rollback, which would move this group's weights back alone, is a veto
here) travels to every group in the same all-reduce as the gradients, and each group then calls
``manager.report_error`` so that ``should_commit()`` is False on all of them -- torchft's own way to
skip a step, which leaves every group's weights and step count as they were. A persistent verdict
(the ledger's strikes; the policy's ``quarantine``) is a veto and a stop: the group still shares
its verdict for the step, then shuts its manager down, so the lighthouse drops it from the
quorum (after its heartbeat timeout) and the other groups train on without it.

Supported: one process per replica group (``rank 0`` of a group of one); a group of several ranks
would need the rank guard inside it. Not handled yet: a group that joins late and heals from a
peer (torchft's recovery) gets weights its guard did not see applied, which its state checksums
would take for corruption.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    from torchft import Manager
except ImportError as exc:
    raise ImportError(
        "sdcscope.integrations.torchft needs the 'torchft' package: pip install 'sdcscope[torchft]'"
    ) from exc

from sdcscope.guard import Guard
from sdcscope.guard.session import check_loss
from sdcscope.guard.world import Solo, WorldSide

__all__ = ["FTGuard", "ReplicaGroupSide", "VerdictError"]

log = logging.getLogger("sdcscope.integrations.torchft")

LEAVE = "a persistent fault: the step is vetoed in every replica group and this group leaves the quorum"
ONE_STEP = "a rollback would move this replica group's weights back alone: the step is vetoed in every group"


class VerdictError(RuntimeError):
    """What ``manager.report_error`` gets: a guard's verdict (this group's or a peer group's)."""


class ReplicaGroupSide(Solo):
    """The guard's side in one torchft replica group: one process's ledger and strikes; a
    rollback becomes a veto (a step no group commits leaves every group where it was), a
    quarantine a veto and a stop (the adapter then leaves the quorum)."""

    def __init__(self, solo: Solo) -> None:
        WorldSide.__init__(self, solo.guard, solo.world)
        self.strikes = solo.strikes

    def translate(self, session, e, chosen: list[str]) -> list[str]:
        if "quarantine" in chosen:
            e.evidence = {**e.evidence, "quarantine": LEAVE}
        if "rollback" in chosen:
            e.evidence = {**e.evidence, "rollback": ONE_STEP}
        out = {"rollback": ["veto"], "quarantine": ["veto", "stop"]}
        return list(dict.fromkeys(x for a in chosen for x in out.get(a, [a])))

    def stop_reason(self, e) -> str:
        return f"{super().stop_reason(e)}; the replica group leaves the quorum"


class FTGuard:
    """Drives ``guard`` (built on this replica group's model and optimizer, one process) with
    torchft's ``manager``; see the module for the loop. ``left``: why this group left the quorum
    (None while it trains)."""

    def __init__(self, guard: Guard, manager: Manager) -> None:
        if not isinstance(guard, Guard):
            raise TypeError(f"FTGuard needs a sdcscope Guard, got {type(guard).__name__}")
        if not isinstance(manager, Manager):
            raise TypeError(f"FTGuard needs a torchft.Manager, got {type(manager).__name__}")
        if not isinstance(guard.ranks, Solo):
            raise ValueError(
                f"FTGuard guards a replica group of one process; this guard's world is {guard.world.kind!r} "
                "(build the Guard without ddp=, one per replica group)"
            )
        guard.ranks = ReplicaGroupSide(guard.ranks)
        self.guard, self.manager = guard, manager
        self.params = [p for p in guard.model.parameters() if p.requires_grad]
        self.left: str | None = None
        self.committed: list[int] = []
        """The steps every replica group committed."""

    def begin(self, step: int, batch: Any = None) -> None:
        """Before the forward pass: the step's quorum (torchft's ``start_quorum``), then the
        guard's begin (``batch``: the step's data, which a replay runs again)."""
        if self.left is not None:
            raise RuntimeError(f"this replica group left the quorum ({self.left}); end its training loop")
        self.manager.start_quorum()
        self.guard.begin(step, batch)

    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """After the backward pass: the guard's decision on this group's gradients, the verdicts
        and gradients of every group in one all-reduce, then the step, committed by every group
        or by none; True when committed. A persistent verdict shuts this group's manager down
        after the step (:attr:`left`)."""
        check_loss(loss)
        g, s, m = self.guard, self.guard.session, self.manager
        applied, loss = s.check(loss, g.step_replay())  # the plain loop's side; the group's side has no rollback
        if not applied.discarded:
            s.before_update()
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in self.params]
            + [torch.tensor([float(applied.discarded)])]
        )
        m.allreduce(flat).wait()  # the average over the groups: > 0 when any group discarded
        vetoed = applied.discarded or float(flat[-1]) > 0
        if vetoed:
            who = "this replica group's guard" if applied.discarded else "another replica group's guard"
            m.report_error(VerdictError(f"step {s.step}: {who} vetoed the step"))
        commit = m.should_commit()
        if commit:
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
                offset += n
            _, row = s.update(g.optimizer.step, loss)
            s.end(applied=True, row=row, logged=None if loss is None else {"loss": loss})
            self.committed.append(s.step)
        else:
            s.clear_grads()
            s.end(applied=False)
        if g.stopped and self.left is None:
            self.leave(g.stop_reason or "the guard stopped")
        return commit

    def leave(self, why: str) -> None:
        """Take this replica group out of the quorum: its manager stops (no more heartbeats), and
        the lighthouse forms the next quorums without it."""
        self.left = why
        log.warning("replica group leaves the torchft quorum: %s", why)
        self.manager.shutdown(wait=False)
