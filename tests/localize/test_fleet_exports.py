"""The fleet exports in the formats fleet tools read: a Slurm --exclude host list, NVRx's
scheduler-exclusion JSONL artefact, Kubernetes node-condition status patches -- each checked
against its documented shape, and a broken one refused."""

import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from sdcscope.localize.exports import (
    check_k8s_patch,
    check_nvrx_decision,
    k8s_patches,
    nvrx_decision,
    nvrx_file_name,
    slurm_exclude,
)
from sdcscope.localize.history import RepeatRule, judge, make_record

NOW = datetime(2026, 12, 7, 16, 0, tzinfo=timezone.utc)


def _rec(host, device, kind, run, hours_ago):
    t = (NOW - timedelta(hours=hours_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return make_record(host, device, run, t, kind, {"reason": f"persistent fault ({run})"}, basis=[t, run])


@pytest.fixture
def statuses():
    records = [
        _rec("node7.cluster", "cuda:3", "conviction", "r1", 48),
        _rec("node7.cluster", "cuda:3", "conviction", "r2", 2),  # repeat offender since 2 h ago
        _rec("node7.cluster", "cuda:1", "strike", "r2", 2),
        _rec("node3.cluster", "cuda:0", "screen_fail", "s1", 5),
        _rec("node3.cluster", "cuda:0", "conviction", "r3", 1),  # a failed screen + a conviction
        _rec("node1.cluster", "cuda:0", "conviction", "r1", 3),  # convicted once: not excluded
    ]
    return judge(records, RepeatRule(), now=NOW)


def test_slurm_exclude_lists_the_nodes_holding_repeat_offenders(statuses):
    assert slurm_exclude(statuses) == "node3.cluster,node7.cluster"
    assert slurm_exclude(statuses, short=True) == "node3,node7"
    assert slurm_exclude([s for s in statuses if not s.offender]) == ""


def test_nvrx_artefact_has_the_scheduler_exclusion_service_shape(statuses):
    text = nvrx_decision(statuses, job_id="4242", now=NOW, short=True, tasks={"node7": [("3", 1)], "node1": [("5", 0)]})
    lines = text.splitlines()
    assert text.endswith("\n") and lines[0] == '["3"]'  # what NVRx's segment health check reads
    assert re.fullmatch(r'\[(?:"[0-9]+"(?:,"[0-9]+")*)?\]', lines[0])
    task, node, *observations = [json.loads(x) for x in lines[1:]]
    valid = "2026-12-07T16:30:00Z"  # NVRx's default TTL, 1,800 s
    assert task == {
        "type": "decision",
        "schema_version": 1,
        "job_id": "4242",
        "generated_at": "2026-12-07T16:00:00Z",
        "scope": "array_task",
        "excluded_array_tasks": [{"task_id": "3", "restart_count": 1, "valid_until": valid}],
    }
    assert node["scope"] == "node" and node["excluded_nodes"] == [
        {"node": "node3", "valid_until": valid},
        {"node": "node7", "valid_until": valid},
    ]
    assert [o["node"] for o in observations] == ["node3", "node7"]
    assert set(observations[1]) == {"type", "node", "state", "reason", "observed_at", "valid_until", "array_tasks"}
    assert "cuda:3: convicted in 2 runs" in observations[1]["reason"] and "cuda:1" not in observations[1]["reason"]
    assert all(" " not in x for x in lines[:3])  # compact, as NVRx writes it
    assert nvrx_file_name("4242") == "segment_health_check.4242.state"
    with pytest.raises(ValueError, match="line 1 must be a compact array"):
        check_nvrx_decision(text.replace('["3"]', '[ "3" ]', 1))
    with pytest.raises(ValueError, match="line 3 must be the node decision"):
        check_nvrx_decision("\n".join(lines[:2] + [lines[3]]) + "\n")
    with pytest.raises(ValueError, match="valid_until"):
        check_nvrx_decision(text.replace(valid, "2026-12-07 16:30:00", 1))
    with pytest.raises(ValueError, match="job id"):
        nvrx_decision(statuses, job_id="../x")


def test_k8s_patches_set_the_condition_true_on_offenders_and_false_elsewhere(statuses):
    patches = k8s_patches(statuses, now=NOW, short=True)
    assert sorted(patches) == ["node1", "node3", "node7"]
    (bad,) = patches["node7"]["status"]["conditions"]
    assert bad["type"] == "SDCSuspect" and bad["status"] == "True" and bad["reason"] == "SDCRepeatOffender"
    assert bad["lastTransitionTime"] == "2026-12-07T14:00:00Z"  # the second conviction made it one
    assert bad["lastHeartbeatTime"] == "2026-12-07T16:00:00Z" and "convicted in 2 runs" in bad["message"]
    (fine,) = patches["node1"]["status"]["conditions"]
    assert fine["status"] == "False" and fine["reason"] == "NoSDCRepeatOffence"
    for broken, needle in [
        ({"status": {"conditions": [{**bad, "status": "yes"}]}}, "condition status"),
        ({"status": {"conditions": [{**bad, "reason": "repeat offender"}]}}, "CamelCase"),
        ({"status": {"conditions": [{**bad, "lastTransitionTime": "yesterday"}]}}, "RFC 3339"),
        ({"status": {"conditions": [{**bad, "color": "red"}]}}, "node condition has"),
        ({"metadata": {}, "status": {"conditions": []}}, "node status patch"),
    ]:
        with pytest.raises(ValueError, match=needle):
            check_k8s_patch(broken)
    with pytest.raises(ValueError, match="Kubernetes node name"):
        k8s_patches(judge([_rec("node_1", "cuda:0", "conviction", "r1", 1)], now=NOW), now=NOW)
