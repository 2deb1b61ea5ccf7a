"""Localize a fault: lock-step comparison of a suspect execution with a reference.

``first_divergence(reference_fn, suspect_fn, model)`` names the first divergent submodule,
direction (forward/backward), GEMM product, element indices and magnitude; ``lockstep(...,
sync=True)`` gives mismatch frequency and severity per submodule with every value re-synchronized
to the reference (Ma et al.'s computation synchronization). ``replica(model)`` makes a hook-free
float64 copy for a recomputation-in-higher-precision reference.
"""

from sdcscope.localize.compare import TensorDiff, diff
from sdcscope.localize.lockstep import Divergence, LockstepReport, Mismatch, first_divergence, lockstep, replica

__all__ = ["Divergence", "LockstepReport", "Mismatch", "TensorDiff", "diff", "first_divergence", "lockstep",
           "replica"]
