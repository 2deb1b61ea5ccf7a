"""The token-permutation check of mixture-of-experts layers: a dropped or duplicated token in
dispatch is caught exactly, in its step, and the event names the layer and the expert.

An MoE layer's dispatch (a module with ``is_dispatch``, :func:`sdcscope.common.modules.is_dispatch`)
moves bits unchanged: each token row goes, as it is, to the slots of the experts the router chose
for it. So the check is exact, with no tolerance (DESIGN: collectives that move bits are checked
by integer-view checksums). For every dispatch call, from the router's choice ``experts`` [N, k]
and the source rows ``x`` [N, d] alone:

* **counts**: the slots each expert received against the router's choices per expert;
* **checksum**: per expert, the sum over its slots of a row signature -- Σ_j (j+1)·bits(row_j), the
  row's elements read as integers (wrapping in int64) -- against the same sum over the source
  rows of the tokens routed to it. The sum is order-free (no sort is trusted), exact, and moves
  by a non-zero amount for a flipped bit, a zeroed (dropped) row or another token's row in a
  slot (a duplicate), unless two token rows are bit-identical (then nothing changed).

The check runs in a forward hook placed after any injector's (which prepends its own), records
on the device and is judged once per step in :meth:`DispatchCheck.check` (one host sync). An
expert-parallel dispatch (an all-to-all) keeps this contract on each rank's local view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sdcscope.common.graph import in_backward
from sdcscope.common.modules import is_dispatch, match_modules
from sdcscope.common.validate import check_bool
from sdcscope.detect.events import Event
from sdcscope.detect.protocol import CheckView, Registration, register
from sdcscope.detect.signatures import INT_VIEW


@dataclass(kw_only=True)
class DispatchConfig:
    """Which dispatch modules are checked (module-name patterns; ``None``: every one)."""

    targets: tuple[str, ...] | None = None
    include_eval: bool = False
    """Also check forward passes autograd does not record (evaluation under ``torch.no_grad()``)."""

    def __post_init__(self) -> None:
        if self.targets is not None:
            if isinstance(self.targets, str):
                self.targets = (self.targets,)
            if not isinstance(self.targets, (list, tuple)) or not all(isinstance(t, str) for t in self.targets):
                raise TypeError(
                    f"dispatch targets={self.targets!r} must be a module-name pattern, a list of them or null"
                )
            self.targets = tuple(self.targets)
            if not self.targets:
                raise ValueError("dispatch targets is empty; give module-name patterns, or null for every dispatch")
        check_bool("include_eval", self.include_eval)


def row_signatures(t: torch.Tensor) -> torch.Tensor:
    """``Σ_j (j+1)·bits(t[i, j])`` per row of a 2-D tensor, its elements read as integers of their
    own width, in int64 (wrapping): exact, and it sees an element that moved within a row."""
    ints = t.detach().contiguous().view(INT_VIEW[t.element_size()]).to(torch.int64)
    w = torch.arange(1, t.shape[-1] + 1, device=t.device, dtype=torch.int64)
    return (ints * w).sum(-1)


class DispatchCheck:
    """Checks every call of the model's MoE dispatches (see the module docstring); the guard's
    detector ``dispatch`` (``check(view)``, :mod:`sdcscope.detect.protocol`)."""

    name = "dispatch"

    def __init__(self, model: nn.Module, config: DispatchConfig | None = None, *, rank: int | None = None) -> None:
        self.config = config or DispatchConfig()
        self.rank = rank
        self.modules = match_modules(model, self.config.targets, where=is_dispatch, option="dispatch targets")
        """The checked dispatch modules by name (none: a model without MoE layers, nothing to do)."""
        self._handles: list = []
        self._records: list[tuple] = []  # (module, call, counts, want counts, sums, want sums)
        self._calls: dict[str, int] = {}  # forward calls of each dispatch since the step began
        self._error: Exception | None = None
        self.checks_run = 0

    def attach(self) -> DispatchCheck:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._records.clear()

    def begin_step(self, step: int) -> None:
        """Before a forward pass of ``step`` (a replay's too): calls are numbered from 0 again."""
        self._records.clear()
        self._calls.clear()
        self._error = None

    def _hook(self, name: str):
        """The forward hook of dispatch ``name``. It runs eagerly (under ``torch.compile``, at a
        graph break: the dispatch's data-dependent counts break the graph there anyway), and an
        error in it never reaches the user's forward: :meth:`check` raises it (the guard reports
        an ``internal_error`` event)."""

        def hook(module, args, out):
            if in_backward() or not (module.training or torch.is_grad_enabled() or self.config.include_eval):
                return None  # a checkpoint's recompute (its first pass was checked), an evaluation
            try:
                x, experts = args[0], args[1]
                rows, _, counts = out
                call = self._calls.get(name, 0)
                self._calls[name] = call + 1
                with torch.no_grad():
                    self._records.append((name, call, *_expected(x, experts, module.n_expert, rows, counts)))
            except Exception as exc:
                self._error = self._error or exc
            return None

        return torch.compiler.disable(hook)

    def check(self, view: CheckView | int) -> list[Event]:
        """Judge the calls recorded since the last check (one host sync) -> one event per
        dispatch call whose counts or checksums differ, naming the first differing expert."""
        step = view.step if isinstance(view, CheckView) else int(view)
        records, self._records = self._records, []
        self._calls.clear()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"dispatch check failed on step {step}; its records were dropped: {error!r}") from error
        if not records:
            return []
        self.checks_run += len(records)
        bad = torch.stack([(c != wc).any() | (s != ws).any() for _, _, c, wc, s, ws in records]).tolist()
        events = []
        for differs, (name, call, counts, want_counts, sums, want_sums) in zip(bad, records):
            if not differs:
                continue
            counts, want_counts = counts.tolist(), want_counts.tolist()
            sums, want_sums = sums.tolist(), want_sums.tolist()
            wrong = [e for e in range(len(want_counts)) if counts[e] != want_counts[e] or sums[e] != want_sums[e]]
            e = wrong[0]
            verdict = "count_mismatch" if counts != want_counts else "token_mismatch"
            events.append(
                Event(
                    step,
                    self.name,
                    verdict,
                    module=name,
                    rank=self.rank,
                    index=(e,),
                    evidence={
                        "expert": e,
                        "experts": wrong,
                        "count": counts[e],
                        "expected_count": want_counts[e],
                        "checksum": sums[e],
                        "expected_checksum": want_sums[e],
                        "call": call,
                    },
                )
            )
        return events


def _expected(x, experts, n_expert: int, rows, counts) -> tuple[torch.Tensor, ...]:
    """(counts, expected counts, per-expert checksums, expected ones) of one dispatch call. Slots
    lost or added (fewer or more rows than token choices) leave the checksums at zero: every
    expert that should have had tokens differs."""
    flat = experts.reshape(-1)
    want_counts = torch.bincount(flat, minlength=n_expert)
    want_sums = torch.zeros(n_expert, dtype=torch.int64, device=x.device)
    want_sums.index_add_(0, flat, row_signatures(x).repeat_interleave(experts.shape[1]))
    sums = torch.zeros_like(want_sums)
    if rows.shape[0] == flat.numel():  # the slots, assigned to experts by the router's counts
        slot_expert = torch.repeat_interleave(
            torch.arange(n_expert, device=x.device), want_counts, output_size=rows.shape[0]
        )
        sums.index_add_(0, slot_expert, row_signatures(rows))
    return counts, want_counts, sums, want_sums


register(
    Registration(
        "dispatch",
        DispatchConfig,
        lambda model, optimizer, config, rank: DispatchCheck(model, config, rank=rank),
        recheck=True,
        drain=True,
    )
)
