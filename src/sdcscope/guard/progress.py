"""Progress since the latest snapshot: when the next snapshot is due, and when training has stalled.

A snapshot is taken only from a state that made progress without findings; after a rollback the
loop re-runs the steps since the snapshot, and those count as progress only once training gets
further than it had. Steps without progress in a row (vetoed, rolled back, re-run in vain) make
:attr:`Guard.stalled <sdcscope.guard.Guard.stalled>`.
"""

from __future__ import annotations


class Progress:
    def __init__(self) -> None:
        self.snapshot_due = False  # a plain loop's next snapshot: taken when its next step begins
        self.since_snapshot = 0  # updates applied since the training state was the latest snapshot's
        self.furthest = 0  # the most of those reached since that snapshot was taken
        self.rerun = 0  # applied steps since a rollback that have not got further yet
        self.idle = 0  # steps in a row without progress
        self.discarded_steps = 0  # steps whose update the guard vetoed or rolled back

    def took_snapshot(self) -> None:
        """The training state is the latest snapshot's: progress is counted from here."""
        self.since_snapshot = self.furthest = self.rerun = 0

    def rolled_back(self) -> None:
        self.since_snapshot = 0

    def count(self, applied: bool, discarded: bool, rolled_back: bool, stall_after: int | None) -> bool:
        """Count one step; True when this step starts a stall of ``stall_after`` steps (once per
        streak). After a rollback the steps re-run since the snapshot count as idle if the next
        rollback comes before training got any further; an applied step beyond the furthest
        point ends the streak."""
        before = self.idle
        if applied:
            self.since_snapshot += 1
            if self.since_snapshot > self.furthest:
                self.furthest, self.idle, self.rerun = self.since_snapshot, 0, 0
            else:
                self.rerun += 1
            return False
        self.discarded_steps += discarded
        self.idle += 1
        if rolled_back:  # the steps re-run since the last rollback were in vain
            self.idle += self.rerun
            self.rerun = 0
        return stall_after is not None and before < stall_after <= self.idle
