"""The fleet history: runs' ledgers recorded per host and device, a device convicted in two runs is
a repeat offender, recording is idempotent, bad records are named by file and line, and
concurrent writers keep every record whole."""

import json
import multiprocessing
import threading
from datetime import datetime, timedelta, timezone

import pytest

from sdcscope.detect import Event
from sdcscope.localize.history import (
    History,
    RepeatRule,
    judge,
    make_record,
    record_run,
    statuses,
)
from sdcscope.localize.ledger import Ledger, LedgerConfig

DEV = "node7:cuda:3"
OTHER = "node2:cuda:0"


def run_dir(tmp_path, name, *, carried=None, convict=True, faults=False):
    """A finished run directory whose ledger holds what ``convict`` says (a persistent fault on DEV
    at step 5, and a single suspicion of OTHER), optionally carrying an earlier ledger over."""
    d = tmp_path / name
    d.mkdir()
    specs = [{"site": "weight", "target": "fc", "model": "bitflip", "bits": [30]}] if faults else []
    (d / "config.json").write_text(json.dumps({"seed": 0, "workload": "gpt", "faults": specs}))
    ledger = Ledger(d / "ledger.json", LedgerConfig(strikes=2), entries=carried)
    if convict:
        for when in (5, 6):
            e = Event(5, "abft", "transient", module="blocks.0.mlp.fc", gemm="forward", index=(None, 0, 9))
            ledger.note(DEV, e, when=when)
        ledger.note(OTHER, Event(3, "state_checksum", "corrupt", module="w", evidence={"tensor": "w"}), when=3)
    ledger.save()
    return d


def test_a_device_convicted_in_two_runs_is_a_repeat_offender_and_recording_is_idempotent(tmp_path):
    book = History(tmp_path / "fleet")
    first = run_dir(tmp_path, "r1")
    written, found, run1 = record_run(book, first)
    assert written == found == 4  # DEV: conviction + 2 strikes; OTHER: 1 strike
    (dev, other) = sorted(statuses(book)[0], key=lambda s: s.host != "node7")
    assert (dev.host, dev.device, len(dev.convictions), dev.strikes, dev.offender) == ("node7", "cuda:3", 1, 2, False)
    assert not other.convictions and other.strikes == 1
    assert record_run(book, first)[0] == 0  # the same run again: nothing new

    carried = run_dir(tmp_path, "r2", carried=Ledger.read(first / "ledger.json"), convict=False)
    assert record_run(book, carried)[0] == 0  # a conviction carried into the next job is not a second one
    assert not [s for s in statuses(book)[0] if s.offender]

    second = run_dir(tmp_path, "r3")
    assert record_run(book, second)[0] == 4
    found = {s.host: s for s in statuses(book)[0]}
    assert found["node7"].offender and found["node7"].runs == sorted([run1, record_run(book, second)[2]])
    assert found["node7"].since == json.loads((second / "ledger.json").read_text())["devices"][DEV]["since"]
    assert "convicted in 2 runs within 30 days" in found["node7"].reason
    assert not found["node2"].offender  # struck twice, never convicted
    by_strikes = {s.host: s for s in judge(book.read()[0], RepeatRule(convictions=3, strike_runs=2))}
    assert by_strikes["node2"].offender and "strikes in 2 runs" in by_strikes["node2"].reason
    assert by_strikes["node7"].offender  # struck in both runs too
    assert not any(s.offender for s in judge(book.read()[0], RepeatRule(convictions=3)))
    drill = run_dir(tmp_path, "r4", faults=True)  # a run with injected faults: simulated, not the device's doing
    drill_run = record_run(book, drill)[2]
    assert all(r.evidence["injected"] for r in book.read()[0] if r.run == drill_run)
    assert not {s.host: s for s in judge(book.read()[0], RepeatRule(convictions=3))}["node7"].offender
    assert {s.host: s for s in judge(book.read()[0], RepeatRule(convictions=3, count_injected=True))}["node7"].offender
    lines = (tmp_path / "fleet" / "node7.jsonl").read_text().splitlines()
    assert len(lines) == 9 and {json.loads(x)["host"] for x in lines} == {"node7"}  # one file per host


def _at(days_ago, kind, run, now):
    t = (now - timedelta(days=days_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return make_record("n1", "cuda:0", run, t, kind, {"reason": kind}, basis=[t, run])


def test_the_rule_counts_failed_screens_forgives_after_a_pass_and_forgets_outside_its_window():
    now = datetime(2026, 12, 7, tzinfo=timezone.utc)
    fail_then_conviction = [_at(3, "screen_fail", "s1", now), _at(2, "conviction", "r1", now)]
    (s,) = judge(fail_then_conviction, now=now)
    assert s.offender and s.since == fail_then_conviction[1].time
    assert not judge(fail_then_conviction, RepeatRule(screen_fail_counts=False), now=now)[0].offender
    passed = [*fail_then_conviction, _at(1, "screen_pass", "s2", now), _at(0.5, "conviction", "r2", now)]
    (s,) = judge(passed, now=now)
    assert not s.offender and [r.run for r in s.convictions] == ["r2"] and s.screens == {"pass": 1, "fail": 1}
    assert judge(passed, RepeatRule(cleared_by_pass=False), now=now)[0].offender
    old = [_at(40, "conviction", "r0", now), _at(1, "conviction", "r1", now)]
    assert not judge(old, now=now)[0].offender and judge(old, RepeatRule(window_days=60), now=now)[0].offender
    same_run = [_at(2, "conviction", "r1", now), _at(1, "conviction", "r1", now)]
    assert not judge(same_run, now=now)[0].offender  # two convictions of one run are one
    with pytest.raises(ValueError, match="convictions"):
        RepeatRule(convictions=0)
    with pytest.raises(TypeError, match="window_days"):
        RepeatRule(window_days="14")


def test_bad_records_are_refused_naming_the_file_and_line_and_a_torn_tail_is_cut(tmp_path):
    book = History(tmp_path)
    now = datetime.now(timezone.utc)
    good = [_at(1, "conviction", "r1", now), _at(0, "strike", "r2", now)]
    assert book.append(good) == 2 and book.append(good) == 0
    path = book.file("n1")
    path.write_text(path.read_text() + '{"format": "sdcscope-fleet/1", "kind": "arrest"}\n')
    with pytest.raises(ValueError, match=r"n1\.jsonl:3: record keys"):
        book.read()
    records, problems = book.read(strict=False)
    assert len(records) == 2 and len(problems) == 1 and "n1.jsonl:3" in problems[0]
    path.write_text("".join(x + "\n" for x in path.read_text().splitlines()[:2]) + '{"format": "sdcsco')
    assert len(book.read()[0]) == 2  # a last line still being written is not read
    assert book.append([_at(0, "conviction", "r3", now)]) == 1  # cuts what a killed writer left first
    assert len(book.read()[0]) == 3 and path.read_text().count("\n") == 3


def _append_many(root, worker):
    now = datetime.now(timezone.utc)
    book = History(root)
    for i in range(25):
        book.append([_at(0, "strike", f"w{worker}-{i}", now)])


def _two_threads(root, worker):
    threads = [threading.Thread(target=_append_many, args=(root, f"{worker}.{t}")) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_concurrent_writers_keep_every_record_whole(tmp_path):
    """Two processes of two threads each append to one host's file at once."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_two_threads, args=(tmp_path, w)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    records, problems = History(tmp_path).read(strict=False)
    assert not problems and len({r.run for r in records}) == 100
    assert (tmp_path / "n1.jsonl").read_text().count("\n") == 100  # each record once
