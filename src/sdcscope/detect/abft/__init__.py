"""ABFT: checksum verification of every GEMM of a model, forward and backward, through hooks.

What is checked. Every ``nn.Linear`` (and transformers' ``Conv1D``, weight stored (in, out)):
Y = X·Wᵀ + b, dX = dY·W and dW = dYᵀ·X (this call's increment, before autograd sums it with the
weight's other uses); every MatMul-contract module (:func:`sdcscope.common.modules.is_matmul`):
C = a·b, dA and dB; every ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``: Y, dX and dW as
the GEMMs of im2col, checked without forming it (:mod:`~sdcscope.detect.abft.convcheck`); and the
``F.linear`` calls a module makes on a weight of its own (an MoE's expert weights, a router,
``nn.MultiheadAttention``'s projections: :mod:`~sdcscope.detect.abft.taps`); every FP8 layer's
(:class:`~sdcscope.common.fp8.Fp8Linear`) Y, dX and dW at their ``torch._scaled_mm`` calls, against
the dequantized operands (:mod:`~sdcscope.detect.abft.fp8`). Each product is read
where the values the rest of the model consumes are: ABFT's forward hook runs last in its
module's order (after any injector), dX / dW at the call's own autograd nodes. Not covered: fused
recurrent kernels (``nn.LSTM``...), products outside a module's forward other than ``F.linear``,
``nn.Linear`` subclasses overriding ``forward`` (unless named in ``ABFTConfig.linear_subclasses``)
and parametrized layers (:attr:`ABFTDetector.skipped`), bias gradients, and the backward of a call
a ``create_graph=True`` backward ran through (:attr:`ABFTDetector.skipped_higher_order`).

The threshold. Each check compares the column checksums 1ᵀC (with ``checksums='both'`` also the
row checksums C·1) of the result with those computed from the operands, and divides the residual
by the standard deviation that floating-point rounding gives it under a rounding model of the
GEMM (:mod:`sdcscope.detect.checksum`: operand, accumulation and output rounding in the GEMM's
dtype, bounded through the operands' norms, so the model std is an upper bound). A check fails
when that ratio exceeds ``c`` model stds (optionally tightened by calibration): clean GEMMs stay
far below it, while a fault that moves a result by more than the rounding noise of its line is
caught; the event names the layer, the GEMM, the failing column (with both sides, the element),
the residuals and thresholds.

Tensor parallel. A ``nn.Linear`` split by ``parallelize_module`` (``ColwiseParallel``,
``RowwiseParallel``, with FSDP2 on a 2-D mesh, sequence-parallel layouts) is checked on each rank's
local shards, before the plan's collectives; an event names the element in shard and global
coordinates (:mod:`~sdcscope.detect.abft.tensorparallel`).

Calls. A layer called several times (a shared layer, gradient accumulation) numbers its calls as
the injector does: ``evidence["micro_batch"]`` counts the micro-batches since the last
:meth:`ABFTDetector.check`, ``evidence["call"]`` the layer's forward calls within it (its dX and
dW are that call's too); an activation checkpoint's recompute is no new call (``None``).

Cost. Hooks exist only on the layers sampled for the current step (:mod:`~sdcscope.detect.abft.sampling`),
checks of a step are judged together in one host sync, and statistics of an operand several
GEMMs read are computed once.

Per step::

    abft = ABFTDetector(model, ABFTConfig()).attach()   # after injectors
    for step ...:
        abft.begin_step(step)          # optional: check() arms step + 1 by itself
        loss.backward(); events = abft.check(step)   # one host sync; before optimizer.step()
"""

from sdcscope.detect.abft.config import CHECKSUM_DTYPES, CHECKSUMS, KINDS, ABFTConfig
from sdcscope.detect.abft.detector import ABFTDetector
from sdcscope.detect.abft.sampling import BUDGET_AIM

__all__ = ["BUDGET_AIM", "CHECKSUMS", "CHECKSUM_DTYPES", "KINDS", "ABFTConfig", "ABFTDetector"]
