"""Fleet exports: the fleet history's repeat offenders in the formats fleet tools read.

* **Slurm** -- :func:`slurm_exclude`: the hosts as a plain comma-separated host list for
  ``sbatch --exclude=`` / ``srun --exclude=`` (no bracket compression: Slurm reads both forms, and
  ``scontrol show hostlist`` compresses one when wanted).
* **NVRx** -- :func:`nvrx_decision`: the JSON-lines artefact of NVIDIA resiliency-ext's Scheduler
  Exclusion Service (``services/scheduler_exclusions/decision_file.py`` in
  NVIDIA/nvidia-resiliency-ext, consumed by its segment health check): line 1 the compact JSON array
  of excluded Slurm array-task ids, line 2 the ``array_task`` decision, line 3 the ``node``
  decision, then one ``observation`` per node; named ``segment_health_check.<job_id>.state``.
* **Kubernetes** -- :func:`k8s_patches`: per node a strategic-merge patch of ``status.conditions``
  (merge key ``type``) setting a condition such as ``SDCSuspect`` to ``True`` (a repeat
  offender) or ``False``, for ``kubectl patch node N --subresource=status --type=strategic -p``.

Each export is checked against its documented shape (:func:`check_slurm_hostlist`,
:func:`check_nvrx_decision`, :func:`check_k8s_patch`) before it is returned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from sdcscope.common.validate import brief, check_float
from sdcscope.localize.history import DeviceStatus, parse_time

NVRX_SCHEMA_VERSION = 1
NVRX_TTL_SECONDS = 1800.0
"""NVRx's ``DEFAULT_CACHE_TTL_SECONDS``: how long a published exclusion stays valid."""
NVRX_STATE = "sdc_repeat_offender"
"""The ``state`` of an observation (NVRx writes the Slurm node state it saw; this is ours)."""
CONDITION = "SDCSuspect"
TRUE_REASON, FALSE_REASON = "SDCRepeatOffender", "NoSDCRepeatOffence"
MESSAGE_LIMIT = 1024

_SLURM_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_NVRX_FIRST = re.compile(r'\[(?:"[0-9]+"(?:,"[0-9]+")*)?\]')
"""The segment health check's own test of line 1 (a compact array of digit strings)."""
_NVRX_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_K8S_NODE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_K8S_TYPE = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_K8S_REASON = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_CONDITION_KEYS = {"type", "status", "reason", "message", "lastTransitionTime", "lastHeartbeatTime"}


def _stamp(t: datetime) -> str:
    return t.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_name(host: str, *, short: bool = False) -> str:
    """``host`` as a scheduler names it: ``short`` cuts the domain (``node7.cluster`` → ``node7``)."""
    return host.split(".", 1)[0] if short else host


def by_node(statuses: Sequence[DeviceStatus], *, short: bool = False) -> dict[str, list[DeviceStatus]]:
    """Devices per node (sorted); a node is excluded when any of its devices is an offender."""
    nodes: dict[str, list[DeviceStatus]] = {}
    for s in statuses:
        nodes.setdefault(node_name(s.host, short=short), []).append(s)
    return dict(sorted(nodes.items()))


def _why(devices: Sequence[DeviceStatus]) -> str:
    return "; ".join(f"{d.device}: {d.reason}" for d in devices if d.offender)


# -- Slurm -------------------------------------------------------------------------------------


def check_slurm_hostlist(text: str) -> str:
    """``text`` when it is a plain Slurm host list (``a,b,c``, no spaces, no brackets; empty: none)."""
    if text and not all(_SLURM_HOST.fullmatch(h) for h in text.split(",")):
        raise ValueError(f"not a plain Slurm host list (name,name,...): {brief(text)}")
    return text


def slurm_exclude(statuses: Sequence[DeviceStatus], *, short: bool = False) -> str:
    """The nodes holding a repeat offender, for ``--exclude=`` (empty: none)."""
    nodes = [n for n, devices in by_node(statuses, short=short).items() if any(d.offender for d in devices)]
    return check_slurm_hostlist(",".join(nodes))


# -- NVRx --------------------------------------------------------------------------------------


def nvrx_file_name(job_id: str) -> str:
    """The artefact's file name in the exclusion directory, as NVRx's consumer looks for it."""
    _check_job_id(job_id)
    return f"segment_health_check.{job_id}.state"


def _check_job_id(job_id: object) -> None:
    if not isinstance(job_id, str) or not job_id.strip() or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"Slurm job id {brief(job_id)} must be a non-empty name (e.g. $SLURM_JOB_ID)")


def nvrx_decision(
    statuses: Sequence[DeviceStatus],
    *,
    job_id: str,
    ttl_seconds: float = NVRX_TTL_SECONDS,
    now: datetime | None = None,
    tasks: Mapping[str, Sequence[tuple[str, int]]] | None = None,
    short: bool = False,
) -> str:
    """The NVRx scheduler-exclusion artefact (JSON lines) excluding the nodes of repeat offenders
    for ``ttl_seconds`` from ``now``. ``tasks``: per node, the Slurm array tasks ``(task_id,
    restart_count)`` running there (what ``squeue --array`` shows), which NVRx's segment health
    check reads from line 1; without it only the node decision names them."""
    _check_job_id(job_id)
    check_float("ttl_seconds", ttl_seconds, low=0, low_open=True)
    now = now or datetime.now(timezone.utc)
    generated, valid = _stamp(now), _stamp(now + timedelta(seconds=ttl_seconds))
    tasks = tasks or {}
    excluded = {n: devices for n, devices in by_node(statuses, short=short).items() if any(d.offender for d in devices)}
    task_rows = sorted(
        {(str(t), int(c)) for n in excluded for t, c in tasks.get(n, ())}, key=lambda x: (int(x[0]), x[1])
    )
    common = {"type": "decision", "schema_version": NVRX_SCHEMA_VERSION, "job_id": job_id, "generated_at": generated}
    records: list[Any] = [
        list(dict.fromkeys(t for t, _ in task_rows)),
        {
            **common,
            "scope": "array_task",
            "excluded_array_tasks": [{"task_id": t, "restart_count": c, "valid_until": valid} for t, c in task_rows],
        },
        {**common, "scope": "node", "excluded_nodes": [{"node": n, "valid_until": valid} for n in excluded]},
    ]
    for n, devices in excluded.items():
        records.append(
            {
                "type": "observation",
                "node": n,
                "state": NVRX_STATE,
                "reason": _why(devices),
                "observed_at": generated,
                "valid_until": valid,
                "array_tasks": [{"task_id": str(t), "restart_count": int(c)} for t, c in sorted(tasks.get(n, ()))],
            }
        )
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    check_nvrx_decision(text)
    return text


def check_nvrx_decision(text: str) -> list[Any]:
    """The records of an NVRx scheduler-exclusion artefact, checked against its shape (ValueError
    naming the line otherwise): line 1 a compact array of digit strings, newline-terminated; a
    ``decision`` of scope ``array_task`` and one of scope ``node`` with the same ``job_id`` and
    ``generated_at``; then ``observation`` records; every time UTC ISO 8601 with ``Z``."""
    if not text.endswith("\n"):
        raise ValueError("NVRx artefact: the last record is not newline-terminated")
    lines = text[:-1].split("\n")
    if not _NVRX_FIRST.fullmatch(lines[0]):
        raise ValueError(f"NVRx artefact line 1 must be a compact array of task ids, got {brief(lines[0])}")
    if len(lines) < 3:
        raise ValueError("NVRx artefact: needs the task list and the array_task and node decisions")
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"NVRx artefact line {number} is not JSON ({exc})") from None
    scopes = {
        "array_task": ("excluded_array_tasks", {"task_id", "restart_count", "valid_until"}),
        "node": ("excluded_nodes", {"node", "valid_until"}),
    }
    for number, (record, scope) in enumerate(zip(records[1:3], scopes), 2):
        key, fields = scopes[scope]
        want = {"type", "schema_version", "job_id", "generated_at", "scope", key}
        if (
            not isinstance(record, dict)
            or set(record) != want
            or record["type"] != "decision"
            or record["scope"] != scope
        ):
            raise ValueError(f"NVRx artefact line {number} must be the {scope} decision with keys {sorted(want)}")
        if record["schema_version"] != NVRX_SCHEMA_VERSION or record["job_id"] != records[1]["job_id"]:
            raise ValueError(f"NVRx artefact line {number}: schema_version or job_id differs")
        _times(number, record, ["generated_at"])
        for row in record[key]:
            if not isinstance(row, dict) or set(row) != fields:
                raise ValueError(f"NVRx artefact line {number}: {key} rows have keys {sorted(fields)}")
            _times(number, row, ["valid_until"])
    if [t["task_id"] for t in records[1]["excluded_array_tasks"]] and not records[0]:
        raise ValueError("NVRx artefact: line 1 omits the excluded array tasks")
    obs_keys = {"type", "node", "state", "reason", "observed_at", "valid_until", "array_tasks"}
    for number, record in enumerate(records[3:], 4):
        if not isinstance(record, dict) or set(record) != obs_keys or record["type"] != "observation":
            raise ValueError(f"NVRx artefact line {number} must be an observation with keys {sorted(obs_keys)}")
        _times(number, record, ["observed_at", "valid_until"])
    return records


def _times(number: int, record: Mapping[str, Any], keys: Sequence[str]) -> None:
    for k in keys:
        if not isinstance(record.get(k), str) or not _NVRX_TIME.fullmatch(record[k]):
            raise ValueError(f"NVRx artefact line {number}: {k} {brief(record.get(k))} is not a UTC ISO time")


# -- Kubernetes --------------------------------------------------------------------------------


def k8s_patches(
    statuses: Sequence[DeviceStatus], *, condition: str = CONDITION, now: datetime | None = None, short: bool = False
) -> dict[str, dict[str, Any]]:
    """Per node of the history (named in lower case, as the kubelet names it), the status patch
    that sets ``condition``: ``True`` on a node holding a repeat offender (since the record that
    made it one), ``False`` elsewhere -- a patch for every node, so a node cleared by a passing
    screen loses the condition."""
    now = now or datetime.now(timezone.utc)
    patches = {}
    for node, devices in by_node(statuses, short=short).items():
        bad = [d for d in devices if d.offender]
        if bad:
            since = _stamp(min(parse_time(d.since) for d in bad if d.since))
            cond = {"status": "True", "reason": TRUE_REASON, "message": _why(bad), "lastTransitionTime": since}
        else:
            convicted = sum(len(d.convictions) for d in devices)
            message = f"no repeat offender among {len(devices)} device(s); {convicted} counted conviction(s)"
            cond = {"status": "False", "reason": FALSE_REASON, "message": message, "lastTransitionTime": _stamp(now)}
        if len(cond["message"]) > MESSAGE_LIMIT:
            cond["message"] = cond["message"][: MESSAGE_LIMIT - 3] + "..."
        patch = {"status": {"conditions": [{"type": condition, **cond, "lastHeartbeatTime": _stamp(now)}]}}
        patches[node.lower()] = check_k8s_patch(patch)
    for node in patches:
        if len(node) > 253 or not _K8S_NODE.fullmatch(node):
            raise ValueError(f"host {brief(node)} is not a Kubernetes node name (RFC 1123 subdomain)")
    return patches


def check_condition_type(name: object) -> str:
    """``name`` when it is a valid Kubernetes condition type (``SDCSuspect``, ``example.com/Bad``)."""
    if not isinstance(name, str) or len(name) > 316 or not _K8S_TYPE.fullmatch(name):
        raise ValueError(f"condition type {brief(name)} is not a valid Kubernetes condition type (e.g. SDCSuspect)")
    return name


def check_k8s_patch(patch: object) -> dict[str, Any]:
    """``patch`` when it is a node-status strategic-merge patch of ``status.conditions`` (each
    condition: ``type``, ``status`` True/False/Unknown, ``reason`` CamelCase, ``message``, RFC 3339
    ``lastTransitionTime`` / ``lastHeartbeatTime``); ValueError naming what is wrong."""
    if not isinstance(patch, dict) or set(patch) != {"status"} or not isinstance(patch["status"], dict):
        raise ValueError(f"a node status patch is {{'status': {{'conditions': [...]}}}}, got {brief(patch)}")
    if set(patch["status"]) != {"conditions"} or not isinstance(patch["status"]["conditions"], list):
        raise ValueError("a node status patch sets status.conditions (a list) and nothing else")
    for c in patch["status"]["conditions"]:
        if not isinstance(c, dict) or not {"type", "status"} <= set(c) <= _CONDITION_KEYS:
            raise ValueError(f"a node condition has type, status and some of {sorted(_CONDITION_KEYS)}: {brief(c)}")
        check_condition_type(c["type"])
        if c["status"] not in ("True", "False", "Unknown"):
            raise ValueError(f"condition status {brief(c['status'])}; allowed: True, False, Unknown")
        if "reason" in c and (
            not isinstance(c["reason"], str) or len(c["reason"]) > 1024 or not _K8S_REASON.fullmatch(c["reason"])
        ):
            raise ValueError(f"condition reason {brief(c['reason'])} must be CamelCase ([A-Za-z][A-Za-z0-9_,:]*)")
        if "message" in c and not isinstance(c["message"], str):
            raise ValueError(f"condition message {brief(c['message'])} must be a string")
        for k in ("lastTransitionTime", "lastHeartbeatTime"):
            if k in c and (not isinstance(c[k], str) or not _RFC3339.fullmatch(c[k])):
                raise ValueError(f"condition {k} {brief(c[k])} is not an RFC 3339 UTC time (…T…Z)")
    return patch
