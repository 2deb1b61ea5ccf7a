"""A small deterministic training loop with callbacks, snapshots and verified checkpoints; its
data-parallel form under ``torch.distributed`` (:mod:`sdcscope.engine.ddp`)."""

from sdcscope.engine.rundir import JsonlWriter, check_new_run_dir, read_jsonl, write_json
from sdcscope.engine.state import (
    CheckpointError,
    TrainState,
    load_checkpoint,
    param_sha256,
    save_checkpoint,
    verify_checkpoint,
)
from sdcscope.engine.trainer import CALLBACK_POINTS, StepContext, TrainConfig, Trainer
from sdcscope.engine.run import CHECKPOINT_DIR, Run

__all__ = [
    "Run", "CHECKPOINT_DIR", "Trainer", "TrainConfig", "StepContext", "CALLBACK_POINTS", "TrainState", "CheckpointError",
    "save_checkpoint", "load_checkpoint", "verify_checkpoint", "param_sha256",
    "JsonlWriter", "read_jsonl", "write_json", "check_new_run_dir",
    "DDPTrainer", "DDPRun", "DistConfig", "DistributedError", "BucketHook", "BucketView", "bucket_hook",
    "gather_rows", "init_distributed", "launch", "spawn",
]

_DISTRIBUTED = frozenset(__all__[__all__.index("DDPTrainer"):])


def __getattr__(name: str):
    """The data-parallel names load on first use: ``python -m sdcscope.engine.ddp`` (every
    torchrun rank) must find the module not yet imported, and single-process users skip
    ``torch.distributed``."""
    if name in _DISTRIBUTED:
        from sdcscope.engine import ddp

        return getattr(ddp, name)
    raise AttributeError(f"module 'sdcscope.engine' has no attribute {name!r}")
