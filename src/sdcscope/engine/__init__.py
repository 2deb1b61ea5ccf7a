"""A small deterministic training loop with callbacks, snapshots and verified checkpoints."""

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
]
