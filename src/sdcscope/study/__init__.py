"""Studies of injected runs: golden/faulty comparison, campaigns, outcomes, PVF, reports.

spec, plan = init_campaign("runs/bits", "examples/campaigns/gpt_bits.yaml")
run_campaign("runs/bits", workers=2)        # resumable; same results for any worker count
write_report("runs/bits")                   # report.html + report.md
"""

from sdcscope.study.compare import compare_runs, param_distance, write_comparison
from sdcscope.study.outcomes import EFFECTS, OUTCOMES, SDC_KINDS, classify
from sdcscope.study.plan import Trial, build_plan
from sdcscope.study.runner import SPEC_FILE, init_campaign, plan_campaign, run_campaign
from sdcscope.study.spec import Baseline, CampaignSpec, FaultSpace, Sampling, load_campaign
from sdcscope.study.stats import prediction_bound, pvf_table, wilson_interval
from sdcscope.study.store import DB_FILE, ResultsDB

__all__ = [
    "Baseline",
    "CampaignSpec",
    "DB_FILE",
    "EFFECTS",
    "FaultSpace",
    "OUTCOMES",
    "ResultsDB",
    "SDC_KINDS",
    "SPEC_FILE",
    "Sampling",
    "Trial",
    "build_plan",
    "build_report",
    "classify",
    "compare_runs",
    "init_campaign",
    "load_campaign",
    "param_distance",
    "plan_campaign",
    "prediction_bound",
    "pvf_table",
    "run_campaign",
    "wilson_interval",
    "write_comparison",
    "write_report",
]


def __getattr__(name: str):
    """The report (matplotlib, jinja2) is imported on first use, not by campaign workers."""
    if name in ("build_report", "write_report"):
        from sdcscope.study import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
