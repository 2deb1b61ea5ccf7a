"""Sampling honesty and campaign extension: a stratified sample smaller than its strata warns and
names the strata it covers (drawn at random, not the first ones in plan order); a finished
campaign whose sampling is edited keeps every row and runs only the new trials."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from helpers import CAMPAIGN_SPEC, cli_invoke
from sdcscope.study import ResultsDB, init_campaign, load_campaign, run_campaign
from sdcscope.study.runner import plan_campaign

SPACE = """
name: strata
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [2]
horizon: 2
faults: {sites: [gemm.forward], targets: ["blocks.*.mlp.*"], bits: ["0-7"]}
sampling: {kind: stratified, n: 3, by: [target, bit], seed: 1}
"""


def test_a_sample_smaller_than_its_strata_warns_and_names_the_strata_it_covers(caplog):
    with caplog.at_level(logging.WARNING, logger="sdcscope.study.plan"):
        plan = plan_campaign(load_campaign(SPACE))
    strata = {(t.target, t.bit) for t in plan}
    assert len(plan) == 3 and len(strata) == 3
    (record,) = [r for r in caplog.records if "strata" in r.getMessage()]
    message = record.getMessage()
    assert "n=3 is below the 32 strata" in message and "only 3 strata are covered" in message
    assert all(f"{target}/{bit}" in message for target, bit in strata)
    other = {(t.target, t.bit) for t in plan_campaign(load_campaign(SPACE.replace("seed: 1", "seed: 2")))}
    assert other != strata  # drawn at random (seeded): not always the first strata in plan order


@pytest.mark.parametrize(("kind", "sizes"), [("random", (4, 8)), ("stratified", (3, 13))], ids=["random", "stratified"])
def test_a_larger_n_draws_a_superset(kind, sizes):
    """Extending ``n`` adds trials and drops none: n=8 holds the n=4 sample (it drew 7 new ones)."""
    extra = ", by: [target]" if kind == "stratified" else ""  # 4 strata (the MLP Linears) of 8 bits
    samples = []
    for n in sizes:
        text = SPACE.replace("sampling: {kind: stratified, n: 3, by: [target, bit], seed: 1}", "")
        plan = plan_campaign(load_campaign(text + f"sampling: {{kind: {kind}, n: {n}{extra}, seed: 1}}\n"))
        samples.append({t.key for t in plan})
        assert len(samples[-1]) == n
    for smaller, larger in zip(samples, samples[1:]):
        assert smaller < larger, (len(smaller - larger), "trials of the smaller sample are not in the larger")
    if kind == "stratified":  # n=13 over 4 strata of 8: 3 each, and one more in one of them
        counts = Counter(key.split("|")[2] for key in samples[1])
        assert sorted(counts.values()) == [3, 3, 3, 4], counts


@pytest.mark.slow
def test_a_finished_campaign_is_extended_keeping_every_row(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(CAMPAIGN_SPEC + "sampling: {kind: random, n: 1, seed: 0}\n")
    directory = tmp_path / "c"
    init_campaign(directory, spec_file)
    assert run_campaign(directory, workers=0)["done"] == 1
    spec = load_campaign(directory / "campaign.yaml")
    with ResultsDB(directory / "results.sqlite", spec) as db:
        (first,) = db.trials()
    (directory / "campaign.yaml").write_text(CAMPAIGN_SPEC)  # exhaustive now: both bits
    # `campaign status` reads the edit first (it binds the database to it): the counters follow the
    # new plan there and after the run (it said 1/1, then 2/1 for ever)
    assert "1/2 trials done" in " ".join(cli_invoke("campaign", "status", directory)[1].split())
    assert "1/2 trials done" in " ".join(cli_invoke("campaign", "status", directory)[1].split())  # and again
    summary = run_campaign(directory, workers=0)
    assert (summary["done"], summary["ran"]) == (2, 1)
    extended = load_campaign(directory / "campaign.yaml")
    with ResultsDB(directory / "results.sqlite", extended) as db:
        rows = {r["key"]: r for r in db.trials()}
        assert rows[first["key"]] == first  # kept as it was, bit for bit
        assert len({r["trial_id"] for r in rows.values()}) == 2 and {r["bit"] for r in rows.values()} == {30, 31}
        assert db.meta()["plan_size"] == "2" and db.meta()["spec_hash"] == extended.hash
    assert "2/2 trials done" in " ".join(cli_invoke("campaign", "status", directory)[1].split())
    (directory / "campaign.yaml").write_text(CAMPAIGN_SPEC.replace("horizon: 2", "horizon: 3"))
    with pytest.raises(ValueError, match="another campaign spec"):  # another fault space: still refused
        run_campaign(directory, workers=0)
