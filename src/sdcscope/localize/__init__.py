"""Localize a fault: lock-step comparison of a suspect execution with a reference.

``first_divergence(reference_fn, suspect_fn, model)`` names the first divergent submodule,
direction (forward/backward), GEMM product, element indices and magnitude; ``lockstep(...,
sync=True)`` gives mismatch frequency and severity per submodule with every value re-synchronized
to the reference (Ma et al.'s computation synchronization). ``replica(model)`` makes a hook-free
float64 copy for a recomputation-in-higher-precision reference.

Across data-parallel ranks, :class:`RankLocalizer` replays a suspect rank's step on itself and on
peers that are no suspects where possible (transient, persistent, or the data's doing; with three or
more ranks only a majority of peers convicts, :mod:`sdcscope.localize.verdicts`) and
:class:`RankLedger` keeps every suspicion per device.
"""

from sdcscope.localize.compare import TensorDiff, diff
from sdcscope.localize.lockstep import Divergence, LockstepReport, Mismatch, first_divergence, lockstep, replica
from sdcscope.localize.ranks import (
    LEDGER_FILE,
    SUSPICIONS,
    VERDICTS,
    LedgerConfig,
    LocalizeConfig,
    RankLedger,
    RankLocalizer,
    device_id,
)

__all__ = [
    "Divergence",
    "LockstepReport",
    "Mismatch",
    "TensorDiff",
    "diff",
    "first_divergence",
    "lockstep",
    "replica",
    "LEDGER_FILE",
    "SUSPICIONS",
    "VERDICTS",
    "LedgerConfig",
    "LocalizeConfig",
    "RankLedger",
    "RankLocalizer",
    "device_id",
]
