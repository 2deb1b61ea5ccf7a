"""Level (a) with a target group: a first divergence inside any module of the group is the
injected unit's (the trial's target is the group's names joined by a comma)."""

from sdcscope.study import init_campaign, run_campaign, write_report
from sdcscope.study.levels import in_target
from sdcscope.study.spec import load_campaign
from sdcscope.study.store import ResultsDB

SPEC = """
name: group-levels
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [2]
horizon: 1
faults:
  sites: [gemm.forward, gemm.grad_input]
  targets: [[blocks.0.mlp.fc, blocks.1.attn.v_proj]]
  models: [bitflip]
  bits: [30]
baseline: {seeds: [7, 8]}
analysis: full
"""


def test_in_target_matches_group_members_and_their_submodules_only():
    group = "blocks.0.mlp.fc,blocks.1.attn.v_proj"
    assert in_target("blocks.1.attn.v_proj", group) and in_target("blocks.0.mlp.fc", group)
    assert in_target("blocks.0.mlp", "blocks.0.mlp") and in_target("blocks.0.mlp.fc", "blocks.0.mlp")
    assert not in_target("blocks.0.mlp.fc2", group)  # a name prefix is no submodule
    assert not in_target(group, "blocks.0.mlp.fc") and not in_target(None, group)


def test_report_counts_a_divergence_in_any_module_of_the_group(tmp_path):
    (tmp_path / "spec.yaml").write_text(SPEC)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        rows = db.trials()
    first = {r["site"]: r["first_divergence"]["module"] for r in rows}
    # the forward fault shows first in the group's first module, the backward one in its last:
    # neither equals the comma-joined target, both lie inside it
    assert first == {"gemm.forward": "blocks.0.mlp.fc", "gemm.grad_input": "blocks.1.attn.v_proj"}
    assert all(r["activated"] and r["target"] == "blocks.0.mlp.fc,blocks.1.attn.v_proj" for r in rows)
    write_report(tmp_path / "c")
    md = (tmp_path / "c" / "report.md").read_text()
    assert "first divergence = injected module and direction in 2/2 activated trials" in md
