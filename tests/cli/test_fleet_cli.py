"""``sdcscope fleet``: a real failing screen and a run's conviction of the same device, recorded in
the history, make it a repeat offender that ``fleet list`` reports and the three exports name."""

import json
import socket

from helpers import cli_fails, cli_invoke
from sdcscope.detect import Event
from sdcscope.localize.exports import check_k8s_patch, check_nvrx_decision
from sdcscope.localize.ledger import Ledger, device_id


def test_a_failed_screen_and_a_run_conviction_make_an_offender_every_export_names(tmp_path, monkeypatch):
    fleet = tmp_path / "fleet"
    monkeypatch.setenv("SDCSCOPE_FLEET", str(fleet))  # screen appends to the configured history
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    screen = [
        "screen",
        "--device",
        "cpu",
        "--reference",
        tmp_path / "ref.json",
        "--ledger",
        tmp_path / "l.json",
        "--steps",
        "2",
    ]
    assert cli_invoke(*screen, "--record")[0] == 0
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "- {site: weight, target: fc1.weight, model: bitflip, bits: [0], pattern: {kind: element, index: 3},"
        " schedule: {kind: transient, step: 1}}\n"
    )
    code, out = cli_invoke(*screen, "--faults", faults)
    assert code == 4 and f"history: {fleet}" in out

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    Ledger(run / "ledger.json").note(device_id("cpu"), Event(4, "nonfinite", "persistent", module="fc1"), when=4)
    code, out = cli_invoke("fleet", "record", run)
    assert code == 0 and "2 new of 2 record(s)" in out  # the conviction and its strike
    assert "0 new of 2" in cli_invoke("fleet", "record", run)[1]

    code, out = cli_invoke("fleet", "list")  # the screen's fault was injected: no evidence against the device
    host = socket.gethostname()
    assert code == 0 and "1 injected-fault finding(s) not counted" in out and "0 repeat offender(s)" in out
    drill = ["--count-injected"]  # a drill of the hand-off counts it
    code, out = cli_invoke("fleet", "list", *drill)
    assert code == 0 and "REPEAT OFFENDER" in out and "1 device(s), 1 repeat offender(s)" in out
    (row,) = json.loads(cli_invoke("fleet", "list", "--json", *drill)[1])
    assert (row["host"], row["device"], row["convictions"]) == (host, "cpu:0", 2)
    assert row["screens"] == {"pass": 0, "fail": 1}
    assert "0 repeat offender(s)" in cli_invoke("fleet", "list", "--convictions", "3", *drill)[1]

    assert cli_invoke("fleet", "export", "--format", "slurm", *drill) == (0, host)
    assert cli_invoke("fleet", "export", "--format", "slurm") == (0, "")
    code, _ = cli_invoke("fleet", "export", "--format", "nvrx", "--job-id", "77", "--out", tmp_path, *drill)
    (_, _, node, observation) = check_nvrx_decision((tmp_path / "segment_health_check.77.state").read_text())
    assert code == 0 and node["excluded_nodes"][0]["node"] == host and observation["node"] == host
    code, out = cli_invoke("fleet", "export", "--format", "k8s", "--node", host.lower(), *drill)
    (condition,) = check_k8s_patch(json.loads(out))["status"]["conditions"]
    assert code == 0 and condition["status"] == "True" and condition["type"] == "SDCSuspect"

    cli_fails(["fleet", "export", "--format", "lsf"], "--format", "slurm, nvrx, k8s")
    cli_fails(["fleet", "export", "--format", "nvrx"], "--job-id")
    cli_fails(["fleet", "export", "--format", "nvrx", "--job-id", "7", "--ttl", "0"], "--ttl")
    cli_fails(["fleet", "export", "--format", "k8s", "--condition-type", "SDC suspect"], "condition type")
    (fleet / f"{host}.jsonl").open("a").write("not json\n")
    cli_fails(["fleet", "list"], f"{host}.jsonl:4")
    assert "skipped a bad record" in cli_invoke("fleet", "list", "--skip-bad")[1]
