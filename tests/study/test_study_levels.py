"""The three-level analysis (analysis: full), early-masked trials and paired fault seeds."""

import pytest

from helpers import campaign_db, ran_campaign
from sdcscope.study import write_report

SPEC = """
name: levels
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 3
faults:
  sites: [gemm.forward, gemm.grad_input, gemm.grad_weight]
  targets: [blocks.0.mlp.fc]
  models: [stuck_at_0, stuck_at_1]
  bits: [31]
baseline: {seeds: [7, 8]}
analysis: full
"""
DIRECTION = {"gemm.forward": "forward", "gemm.grad_input": "backward", "gemm.grad_weight": "backward"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    campaign = ran_campaign(tmp_path_factory.mktemp("levels"), SPEC)
    with campaign_db(campaign) as db:
        return campaign, db.trials()


def test_sign_stuck_at_pairs_one_noop_one_flip(rows):
    _, trials = rows
    for site in DIRECTION:
        pair = [r for r in trials if r["site"] == site]
        assert len(pair) == 2 and pair[0]["fault_seed"] == pair[1]["fault_seed"]  # same element
        noop = [r for r in pair if not r["activated"]]
        flip = [r for r in pair if r["activated"]]
        assert len(noop) == 1 and len(flip) == 1, site
        assert noop[0]["outcome"] == "masked" and noop[0]["steps"] == 1  # stopped early: golden from here
        assert noop[0]["first_divergence"] is None and noop[0]["nsr_max"] == 0.0
        assert flip[0]["outcome"] != "masked" or flip[0]["dist_golden"] == 0.0


def test_levels_a_and_b_localize_and_measure(rows):
    _, trials = rows
    for r in (r for r in trials if r["activated"]):
        d = r["first_divergence"]
        assert (d["module"], d["direction"]) == ("blocks.0.mlp.fc", DIRECTION[r["site"]]), r["site"]
        assert r["lockstep"]["blocks.0.mlp.fc"][DIRECTION[r["site"]]]["frequency"] > 0
        assert len(r["nsr"]) == 3 and r["nsr"][0] > 0 and r["nsr_max"] == max(r["nsr"])
        assert all(x == 0 for x in r["nsr"][1:])  # a transient fault: later steps are healthy again
        assert len(r["drift"]) == 3 and r["dist_healthy"] > 0


def test_report_has_level_sections(rows):
    directory, _ = rows
    _, md = write_report(directory)
    text = md.read_text()
    assert "Level (a)" in text and "Level (b)" in text
    assert "first divergence = injected module and direction in 3/3 activated trials" in text
