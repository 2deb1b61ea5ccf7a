"""Studies of injected runs: golden/faulty comparison, campaigns, outcomes, PVF, reports."""

from sdcscope.study.compare import compare_runs, param_distance, write_comparison

__all__ = ["compare_runs", "param_distance", "write_comparison"]
