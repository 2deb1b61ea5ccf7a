"""Jobs: one run with faults and a guard (:mod:`~sdcscope.jobs.assemble`), and the torchrun job of
a data-parallel run (:mod:`~sdcscope.jobs.torchrun`) with its launcher (:mod:`~sdcscope.jobs.launcher`)."""

__all__ = [
    "CheckpointFault",
    "FaultyRun",
    "check_faults",
    "guard_trainer",
    "Job",
    "make_job",
    "save_job",
    "load_job",
    "check_job",
    "run_job",
    "launch",
]

_MODULES = {**dict.fromkeys(__all__[:4], "assemble"), **dict.fromkeys(__all__[4:10], "torchrun"), "launch": "launcher"}


def __getattr__(name: str):
    """Names load on first use: ``python -m sdcscope.jobs.torchrun`` (every torchrun rank) must find
    its module not yet imported, and the CLI imports torch inside commands only."""
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(f"sdcscope.jobs.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'sdcscope.jobs' has no attribute {name!r}")
