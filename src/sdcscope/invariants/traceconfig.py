"""What a trace records and where: the trace file's name and format, and :class:`TraceConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

TRACE_FILE = "trace.jsonl"
TRACE_FORMAT = "sdcscope-trace/1"
MODE_SENSITIVE = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
"""Modules that compute differently in train and eval mode; their ``training`` flag is recorded."""

MAX_SHIFT = 3
"""The largest target shift looked for (see ``TraceConfig.target_shift``)."""
CONFIRM_EVERY = 4
"""With ``TraceConfig.confirm_updates``, updates are confirmed on every this-many-th step (the
others count a moved version counter): a parameter that stops changing is reported within that
many steps, at a quarter of the cost of copying and comparing every parameter each step."""
CAUSAL_EVERY = 10
"""Default steps between two causality probes (``TraceConfig.causal_probe``): a probe is one
forward of a few sequences without gradients, a small share of training at this spacing, and two
short reference runs still give inference the support it needs (``InferConfig.min_support``).
A checker probes as often as its ``Causal`` invariant says (``every``)."""


@dataclass(kw_only=True)
class TraceConfig:
    """What the recorder collects beyond the cheap always-on facts."""

    checksums: bool | tuple[str, ...] = True
    """Full-tensor checksums after each step: ``True`` every parameter and buffer (what
    inferring ``Consistent`` needs), a tuple of name patterns only those, ``False`` none."""
    input_fingerprint: bool = True
    """Checksum the model's first input at each forward (for "no batch repeats", and to tell a
    replay of the step from extra calls)."""
    target_shift: bool = True
    """For a forward on token ids, the shift k (0..``MAX_SHIFT``) at which the targets of the
    cross-entropy computed next equal the input (``target[..., :-k] == input[..., k:]``; 1 for
    next-token prediction, -1 for none): targets equal to the inputs (0) or shifted too far (2)
    train a model that learns nothing useful, at a normal-looking loss."""
    confirm_updates: bool = True
    """Count a parameter as updated by ``optimizer.step`` only if its values changed (a copy of
    the parameters before the step, compared after it: three fused passes, no per-parameter
    Python), on steps ``step % CONFIRM_EVERY == 0``; elsewhere and with ``False`` a moved version
    counter is enough (no data read)."""
    causal_probe: int = CAUSAL_EVERY
    """For a training forward on token ids (``[B, T]`` integers) that returns per-position
    outputs (``[B, T, ...]``): on the first such step and then every this-many steps, re-run the
    model on one sequence of the batch and on copies with the tokens from a cut t on replaced,
    and record at that forward how much its outputs before t changed relative to those from t
    on: ``causal_leak`` (0 for an autoregressive model), with ``causal_cut`` (t), ``causal_pos``
    (the output position that changed most) and ``causal_len`` (T); see ``probe``.  0: never.
    Costs one forward of a few sequences, without gradients, per probe."""
    grad_norms: bool = True
    """Record each parameter's gradient norm when ``optimizer.step`` returns: the gradients the
    update used, after every micro-batch, clipping and a GradScaler's unscaling (and after a
    closure ran).  One fused ``torch._foreach_norm`` pass over the gradients per step, fetched
    with the record's other values: far cheaper than the backward that made them."""
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.checksums, bool):
            if isinstance(self.checksums, str) or not all(isinstance(p, str) for p in self.checksums):
                raise TypeError(f"checksums must be a bool or a tuple of name patterns, not {self.checksums!r}")
            self.checksums = tuple(self.checksums)
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank={self.rank!r} must be an integer >= 0")
        every = self.causal_probe
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(
                f"causal_probe={self.causal_probe!r} must be an integer >= 0 (probe every this many steps; 0: never)"
            )
