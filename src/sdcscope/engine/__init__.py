"""A small deterministic training loop with callbacks, snapshots and verified checkpoints; its
distributed form under ``torch.distributed``: one trainer (:mod:`~sdcscope.engine.distributed`) and
one run (:mod:`~sdcscope.engine.distrun`) composed with a topology (:mod:`~sdcscope.engine.topology`:
DDP, FSDP2, tensor parallel, FSDP×TP, HSDP), with the cross-rank plumbing in
:mod:`~sdcscope.engine.dist` and the gradient-bucket hook in :mod:`~sdcscope.engine.buckets`."""

from sdcscope.engine.run import CHECKPOINT_DIR, Run
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

__all__ = [
    "Run",
    "CHECKPOINT_DIR",
    "Trainer",
    "TrainConfig",
    "StepContext",
    "CALLBACK_POINTS",
    "TrainState",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "param_sha256",
    "JsonlWriter",
    "read_jsonl",
    "write_json",
    "check_new_run_dir",
    "DistTrainer",
    "DistRun",
    "Topology",
    "DistConfig",
    "DistributedError",
    "BucketHook",
    "BucketView",
    "bucket_hook",
    "gather_rows",
    "init_distributed",
    "spawn",
]

_DISTRIBUTED = {  # name: module
    "DistTrainer": "distributed",
    "DistRun": "distrun",
    "Topology": "topology",
    "BucketHook": "buckets",
    "BucketView": "buckets",
    "bucket_hook": "buckets",
    **dict.fromkeys(("DistConfig", "DistributedError", "gather_rows", "init_distributed", "spawn"), "dist"),
}


def __getattr__(name: str):
    """The distributed names load on first use: single-process users skip ``torch.distributed``."""
    if name in _DISTRIBUTED:
        import importlib

        return getattr(importlib.import_module(f"sdcscope.engine.{_DISTRIBUTED[name]}"), name)
    raise AttributeError(f"module 'sdcscope.engine' has no attribute {name!r}")
