"""The device ledger (sites, strikes, window, the documented file) and ``sdcscope screen``: a device
whose golden steps differ from the reference of its stack is flagged, clean ones pass."""

import json

import pytest

from helpers import cli_invoke
from sdcscope.detect import Event
from sdcscope.faults import FaultSpec
from sdcscope.localize.ledger import FORMAT, Ledger, LedgerConfig, site_of
from sdcscope.localize.screen import ScreenConfig, screen

DEV = "host:cuda:3"


def abft(step, col, verdict="transient"):
    return Event(step, "abft", verdict, module="blocks.0.mlp.fc", gemm="forward", index=(None, 0, col))


def test_repeats_at_one_site_within_the_window_become_persistent(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json", LedgerConfig(strikes=3, window=100, max_suspicions=10))
    notes = [ledger.note(DEV, abft(s, 7), when=s) for s in (1, 2)]
    assert [n.strikes for n in notes] == [1, 2] and not any(n.persistent for n in notes)
    assert not ledger.note(DEV, abft(3, 8), when=3).persistent  # another column: another site
    assert not ledger.note(DEV, abft(500, 7), when=500).persistent  # the first two left the window
    assert ledger.note(DEV, abft(501, 7), when=501).strikes == 2
    last = ledger.note(DEV, abft(502, 7), when=502)
    assert last.persistent and last.became_faulty and last.site == "abft:blocks.0.mlp.fc:forward:col=7"
    assert not ledger.note(DEV, Event(503, "spike", "reproducible"), when=503).suspicion  # the data's doing
    data = json.loads((tmp_path / "ledger.json").read_text())
    entry = data["devices"][DEV]
    assert data["format"] == FORMAT and entry["faulty"] and "persistent fault at abft:" in entry["reason"]
    assert entry["sites"]["abft:blocks.0.mlp.fc:forward:col=7"]["persistent"]
    assert Ledger(tmp_path / "x.json", entries=Ledger.read(tmp_path / "ledger.json")).faulty(DEV)  # carried over


def test_a_rolled_back_step_met_again_counts_again_and_sites_name_elements():
    ledger = Ledger(None, LedgerConfig(strikes=2))
    e = Event(4, "state_checksum", "corrupt", module="w", evidence={"tensor": "w:exp_avg", "elements": [12]})
    assert site_of(e) == "state:w:exp_avg[12]"
    assert ledger.note(DEV, e, when=4).strikes == 1
    assert ledger.note(DEV, e, when=4).strikes == 1  # the same moment counts once
    assert ledger.note(DEV, e, when=9).persistent  # step 4 again after a rollback: a new moment


@pytest.fixture(scope="module")
def small():
    return ScreenConfig(steps=3, batch=8, width=32)


def test_screen_flags_a_device_whose_golden_step_differs_and_passes_clean_ones(tmp_path, small):
    ref, book = tmp_path / "ref.json", tmp_path / "ledger.json"
    (recorded,) = screen(["cpu"], ref, book, small, record=True)
    assert recorded.verdict == "recorded" and ref.is_file()
    (clean,) = screen(["cpu"], ref, book, small)
    assert clean.verdict == "pass" and clean.first_difference is None
    fault = {
        "site": "gemm.forward",
        "target": "fc2",
        "model": "bitflip",
        "bits": [3],  # a low mantissa bit: a tiny error that only a bitwise comparison sees
        "pattern": {"kind": "element", "index": 5},
        "schedule": {"kind": "transient", "step": 1},
    }
    (bad,) = screen(["cpu"], ref, book, small, faults=[FaultSpec.from_dict(fault)])
    assert bad.verdict == "fail" and bad.first_difference["step"] == 1 and "grads" in bad.first_difference["differs"]
    entry = Ledger.read(book)[bad.device]
    assert entry["faulty"] and "golden step 1 differs" in entry["reason"]
    assert [s["screen"] for s in entry["screens"]] == ["recorded", "pass", "fail"]
    (other,) = screen(["cpu"], ref, None, ScreenConfig(steps=3, batch=8, width=32, dtype="bfloat16"))
    assert other.verdict == "no_reference"


def test_screen_command_exits_4_for_a_failing_device(tmp_path):
    ref = tmp_path / "ref.json"
    args = ["screen", "--device", "cpu", "--reference", str(ref), "--ledger", str(tmp_path / "l.json"), "--steps", "2"]
    code, out = cli_invoke(*args, "--record")
    assert code == 0 and "recorded" in out
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "- {site: weight, target: fc1.weight, model: bitflip, bits: [0], pattern: {kind: element, index: 3},"
        " schedule: {kind: transient, step: 1}}\n"
    )
    code, out = cli_invoke(*args, "--faults", str(faults))
    assert code == 4 and "fail" in out
    assert json.loads((tmp_path / "l.json").read_text())["devices"]
