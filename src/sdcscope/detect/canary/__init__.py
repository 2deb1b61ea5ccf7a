r"""Kernel canary: sampled output rows of a registered op recomputed with a reference you trust.

A fused kernel (linear + cross-entropy that never forms the logits, flash attention, a custom
autograd function, any module) computes what no checksum of a Linear sees. Register it with its
reference -- the same math in fp32 (or fp64) -- through :func:`canary_function` (a wrapper to call
instead) or :func:`canary_module` (hooks), and switch the canary on in the guard
(``detectors: {canary: {}}``; :class:`CanaryConfig`). On every step (``every``) each call draws
``rows`` output rows (2 by default, plus the last row) from a generator seeded by (seed, step, op
name, call number) -- a replay draws the same -- keeps those rows of the output and of the row
arguments, and after backward the reference recomputes them; ops registered with ``backward``
also have the sampled rows of their input gradients (dX of the row arguments, from dY's rows)
compared with the reference's autograd (or your backward reference). The findings, one
:class:`~sdcscope.detect.events.Event` per failing comparison (``detector: canary``, ``module``: the
op's registered name, ``index``: row and element, ``evidence``: pass, row, worst relative error),
go through the guard's one decision loop: a replay re-checks the re-executed step (silent: a
transient fault, recomputed), a repeat is ``reproducible`` (vetoed: a wrong kernel).

The bound. Element e of a sampled row r passes when

    |got − ref| ≤ (2·u_out + rtol)·(|ref_e| + mean_r|ref|) + atol

with u_out the unit roundoff of the op's output dtype (2⁻²⁴ fp32, 2⁻¹¹ fp16, 2⁻⁸ bf16): the op's
rounding of its result and of one intermediate to that dtype (its inputs are the reference's, so
their rounding is shared). ``rtol`` (1e-4 by default, per op or in the config) covers a different
summation order or algorithm inside the op -- raise it for ops with several reduced-precision
stages or TF32 (about 2·u per rounded stage); the row's mean magnitude covers cancellation within a
row; ``atol`` (per op, 0 by default, forward only: it is in the output's units) an output that is
a small difference of large terms (a cross-entropy loss of a confident row). Gradients are judged
alike in the gradient's dtype. A result this bound flags is judged again against the reference
run in fp64 (the second stage, only on a flag): it passes if |got − ref₆₄| stays within the bound
plus ``fp32_factor`` (32) times the fp32 reference's own error |ref₃₂ − ref₆₄| (the largest over
the call's sampled rows) -- an op about as accurate as an fp32 evaluation of the reference is
correct, also where no relative bound fits (a confident row's cross-entropy dX, a small difference
of large terms, off by up to its whole size in a correct fp32 kernel). So write the reference for
the dtype it is given (cast parameters it closes over to its argument's dtype); one that cannot
run in fp64 keeps the first stage's verdict. Also a finding (``verdict: shape``): a row argument
whose leading dims differ from the output's (a kernel that dropped a row), in any call.

Cost: per recorded call a few small indexing ops (the sampled rows copied), the reference on those
rows and one sync per step for all calls; no full tensor is copied (the non-row arguments are kept
by reference until the check, so they must not be modified in place before it).
``benchmarks/bench_canary.py`` prices it on the ``small`` GPT. A fault confined to k of R rows of
a call is seen with probability about 1 − (1 − k/R)^rows per call. Not checked: calls outside a
step (between ``check`` and the next ``begin_step``: evaluation), an op whose output is no tensor.
Under ``torch.compile`` the recording runs outside the graph (``torch.compiler.disable``: a graph
break around each recorded call).
"""

from sdcscope.detect.canary.detector import CanaryConfig, CanaryDetector
from sdcscope.detect.canary.judge import bound
from sdcscope.detect.canary.ops import CanaryOp, canary_function, canary_module, op, ops

__all__ = [
    "CanaryConfig",
    "CanaryDetector",
    "CanaryOp",
    "bound",
    "canary_function",
    "canary_module",
    "op",
    "ops",
]
