"""Replay: re-execute a step from its pre-step state (same data, same RNG) and compare.

A different result proves a transient fault (the clean re-run is kept); the same result points at
the data or a persistent fault. The guard's step protocol (:mod:`sdcscope.guard.session`) calls
:func:`replay_step` when a detector fired.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from sdcscope.common.world import local
from sdcscope.detect.protocol import CheckView
from sdcscope.inject import reexecution

if TYPE_CHECKING:
    from sdcscope.guard.session import StepSession

REPLAY_RTOL = 1e-4
"""A replay on CPU must reproduce the step bit for bit. Elsewhere kernels may reduce in a
different order on each run (atomics, split-K): there a loss or gradient counts as reproduced
when ``‖first − replay‖ ≤ REPLAY_RTOL·‖first‖`` (a finding a replay re-checks, ABFT's or the
non-finite detector's, does not depend on it)."""


def rng_state(cuda: list[int]) -> tuple:
    """The CPU generator's state and those of the CUDA devices ``cuda``: a replay draws the same
    dropout masks wherever the model runs."""
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in cuda]


def set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)


def reproduced(first: torch.Tensor, again: torch.Tensor | None) -> bool:
    """Whether a replay reproduced a gradient (bitwise on CPU, else within :data:`REPLAY_RTOL`)."""
    if again is None:
        return False
    first, again = local(first), local(again)  # a DTensor gradient: this rank's shard, no collective
    if first.is_sparse:
        first, again = first.to_dense(), again.to_dense()
    if torch.equal(first, again):
        return True
    if first.device.type == "cpu":
        return False
    return float(torch.linalg.vector_norm(first - again)) <= REPLAY_RTOL * float(torch.linalg.vector_norm(first))


def replay_step(
    session: StepSession, loss: Any, rerun: Callable[[], torch.Tensor], recheckable: bool = False
) -> tuple[dict[str, Any], Any]:
    """Re-run the session's step with ``rerun()`` and compare with the first run: ``(the replay's
    evidence, the loss to report)``. The detectors registered with ``recheck`` check the re-executed
    step again. ``recheckable``: a finding the replay checks again (ABFT, non-finite) fired; if it
    does not fire again the fault was transient, even when its effect was masked (identical results)."""
    guard, step = session.guard, session.step
    named = [(n, p) for n, p in guard.model.named_parameters() if p.grad is not None]
    first_grads = {n: p.grad.detach().clone() for n, p in named}
    first_loss = None if loss is None else float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    after_rng = rng_state(session.cuda)
    set_rng_state(session.rng)
    try:
        session.restore_buffers()  # else the step's forward pass would update them twice
        for detector in guard.detectors.values():  # ABFT: the layers this step checked, not the next step's sample
            if hasattr(detector, "begin_step"):
                detector.begin_step(step)
        if guard.metrics is not None:  # the step's row: the re-execution's forward alone
            guard.metrics.restart_step()
        with reexecution():
            new_loss = rerun()
        view = CheckView(step, new_loss, guard.model, replay=True)
        again = [
            e
            for name, detector in guard.detectors.items()
            if guard.registrations[name].recheck
            for e in detector.check(view)
        ]
    except Exception as exc:  # the replay itself failed: report, decide without it
        set_rng_state(after_rng)
        guard.internal_error("replay", exc)
        return {"verdict": "unverified", "error": repr(exc)}, loss
    new_value = float(new_loss)
    session.grads = None  # the gradients are the re-execution's now
    differs = [
        n for n, p in guard.model.named_parameters() if n in first_grads and not reproduced(first_grads[n], p.grad)
    ]
    tol = 0.0 if not session.cuda or first_loss is None else REPLAY_RTOL * abs(first_loss)
    loss_differs = first_loss is not None and not (  # without the loop's loss, the gradients decide
        new_value == first_loss
        or abs(new_value - first_loss) <= tol
        or (math.isnan(new_value) and math.isnan(first_loss))
    )
    transient = (differs or loss_differs or recheckable) and not again
    result = {
        "verdict": "transient" if transient else "reproducible",
        "loss_first": first_loss,
        "loss_replay": new_value,
        "first_differing_grad": differs[0] if differs else None,
        "differing_grads": len(differs),
        "replay_detections": len(again),
    }
    caught = list(dict.fromkeys(e.module for e in again if e.detector == "abft" and e.module))
    if caught:  # the GEMMs the replay's checks caught: where a fault surfacing elsewhere acts
        result["detected_in"] = caught[:4]
    if not transient:
        if again and (differs or loss_differs):
            result["evidence"] = "the fault acted again on re-execution: a persistent fault"
        elif any(e.detector == "spike" for e in again) or not again:
            result["evidence"] = "identical re-execution: the data or the optimization, not the hardware"
    return result, new_loss
