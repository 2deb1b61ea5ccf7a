"""The guard where people and trackers look: one WARNING line per detection, Prometheus over
loopback (one metric per quantity, counters of detections, actions, replays, rollbacks), and the
real Weights & Biases (offline) and MLflow (file store) libraries."""

import glob
import json
import logging
import struct
import urllib.request

import pytest

from helpers import ce, guarded_step, loop_batch, make_loop
from sdcscope.guard import Guard, GuardConfig
from sdcscope.observe import MetricsConfig, PrometheusSink, split_metric
from sdcscope.observe.trackers import MlflowSink, WandbSink

EVENT = {  # an events.jsonl record: a transient fault the replay proved and recomputed
    "step": 3,
    "detector": "abft",
    "verdict": "transient",
    "module": "2",
    "gemm": "forward",
    "rank": None,
    "action": "recompute",
    "evidence": {"replay": {"verdict": "transient"}},
}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def guarded():
    """A plain loop with a bit flip in a GEMM output at step 3, guarded, served for Prometheus on a
    free loopback port: (events, sdcscope log records, the text a scrape returned)."""
    pytest.importorskip("prometheus_client")
    lines, logger = Lines(), logging.getLogger("sdcscope")
    logger.addHandler(lines)
    try:
        model, opt, inj = make_loop(fault=True)
        guard = Guard(
            model, opt, GuardConfig(profile="full", metrics=MetricsConfig(prometheus_port=0)), loss_fn=ce
        ).attach()
        for step in range(5):
            inj.set_position(step)
            guarded_step(guard, model, step, loop_batch(step))
        (sink,) = [s for s in guard.metrics.sinks if isinstance(s, PrometheusSink)]
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        guard.close()
        with pytest.raises(OSError):  # closed with the guard
            urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=2)
    finally:
        logger.removeHandler(lines)
    return guard.events, lines.records, text


def test_each_detection_is_one_warning_line(guarded):
    events, records, _ = guarded
    assert events, "the fault was not detected"
    warnings = [r for r in records if r.levelno == logging.WARNING and r.name.startswith("sdcscope.guard")]
    assert len(warnings) == len(events)
    for record, event in zip(warnings, events):
        line = record.getMessage()
        assert "\n" not in line
        for key, value in (
            ("step", event["step"]),
            ("rank", event["rank"] if event["rank"] is not None else "-"),
            ("detector", event["detector"]),
            ("verdict", event["verdict"]),
            ("layer", event["module"] or "-"),
            ("gemm", event["gemm"] or "-"),
            ("action", event["action"]),
        ):
            assert f"{key}={value}" in line.split(), (key, line)


def test_prometheus_scrape_counts_the_guards_events(guarded):
    from prometheus_client.parser import text_string_to_metric_families

    events, _, text = guarded
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    detections = {k: v for k, v in samples.items() if k[0] == "sdcscope_detections_total"}
    assert sum(detections.values()) == len(events)
    for e in events:
        assert (("detector", e["detector"]), ("rank", "0"), ("verdict", e["verdict"])) in {k[1] for k in detections}
    steps_with = lambda action: len({e["step"] for e in events if action in e["action"].split(",")})
    for action in {a for e in events for a in e["action"].split(",")}:
        assert samples[("sdcscope_actions_total", (("action", action), ("rank", "0")))] == steps_with(action)
    replayed = len({e["step"] for e in events if e["evidence"].get("replay")})
    assert replayed >= 1 and samples[("sdcscope_replays_total", (("rank", "0"),))] == replayed
    assert samples[("sdcscope_rollbacks_total", (("rank", "0"),))] == steps_with("rollback")
    assert samples[("sdcscope_step", (("rank", "0"),))] == 4
    assert ("sdcscope_grad_norm", (("rank", "0"),)) in samples  # the whole model: no layer label
    assert ("sdcscope_layer_grad_norm", (("layer", "2"), ("rank", "0"))) in samples


def test_prometheus_names_follow_its_conventions():
    """Whole-model and per-layer values are separate metrics (``sum()`` over layers counted the whole
    model twice), each with a HELP text saying what it is (it was ``sdcscope metric <name>``), units
    in the name, ``_total`` counters, and the rank as a label."""
    from prometheus_client.parser import text_string_to_metric_families

    prom = pytest.importorskip("prometheus_client")
    sink = PrometheusSink(registry=prom.CollectorRegistry(), labels={"run": "a"})
    row = {
        "loss": 2.0,
        "lr": 0.001,
        "grad_norm": 5.0,
        "grad_norm/blocks.0.fc": 3.0,
        "grad_norm/blocks.1.fc": 4.0,
        "attn/entropy": 1.5,
        "attn/entropy/blocks.0.attn": 1.25,
        "attn/entropy_min": 1.25,
        "stable_rank/blocks.0.fc.weight": 3.0,
        "cos/update_grad": -0.5,
    }
    sink.write(7, row)
    sink.event(EVENT)
    text = prom.generate_latest(sink.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        assert not family.documentation.startswith("sdcscope "), (family.name, family.documentation)
        for sample in family.samples:
            assert sample.labels["rank"] == "0" and sample.labels["run"] == "a", sample
    get = lambda name, **labels: sink.registry.get_sample_value(name, {"rank": "0", "run": "a", **labels})
    layers = [s.value for s in families["sdcscope_layer_grad_norm"].samples]
    assert sorted(layers) == [3.0, 4.0]  # the whole model's 5.0 is not among them
    assert get("sdcscope_grad_norm") == 5.0 and "whole model" in families["sdcscope_grad_norm"].documentation
    assert get("sdcscope_attn_entropy_nats") == 1.5  # the unit in the name
    assert get("sdcscope_layer_attn_entropy_nats", layer="blocks.0.attn") == 1.25
    assert get("sdcscope_attn_entropy_min_nats") == 1.25
    assert get("sdcscope_layer_stable_rank", layer="blocks.0.fc.weight") == 3.0
    assert get("sdcscope_update_grad_cosine") == -0.5 and get("sdcscope_learning_rate") == 0.001
    assert get("sdcscope_step") == 7 and get("sdcscope_loss") == 2.0
    assert families["sdcscope_detections"].type == "counter"  # exposed as sdcscope_detections_total
    assert get("sdcscope_detections_total", detector="abft", verdict="transient") == 1
    assert get("sdcscope_actions_total", action="recompute") == 1 and get("sdcscope_replays_total") == 1
    assert not any(name.endswith("_by_layer") or name == "sdcscope_attn" for name in families), families
    assert split_metric("grad_norm/blocks.0.fc") == ("grad_norm", "blocks.0.fc")
    assert split_metric("adam/g2_over_v") == ("adam/g2_over_v", None)


def wandb_history(run_dir):
    """The history rows of an offline W&B run, read from its ``.wandb`` file (W&B's LevelDB-style
    log: 7-byte header, 32 KiB blocks of records [crc32, length, type] + a protobuf ``Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, chunks, rows = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        chunks, pos = chunks + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last piece
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_gets_rows_and_event_counts(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = WandbSink(project="sdcscope-test", mode="offline", dir=str(tmp_path))
    sink.write(2, {"loss": 1.5, "grad_norm/blocks.0.fc": 0.25})
    sink.event(EVENT)
    sink.write(3, {"loss": 1.25})
    sink.close()
    wandb.teardown()  # the W&B service writes the run file; stopping it flushes the file
    rows = {r["_step"]: r for r in wandb_history(tmp_path)}
    assert rows[2]["loss"] == 1.5 and rows[2]["grad_norm/blocks.0.fc"] == 0.25
    assert rows[3]["loss"] == 1.25 and rows[3]["sdcscope/detections"] == 1
    assert rows[3]["sdcscope/actions/recompute"] == 1 and rows[3]["sdcscope/replays"] == 1
    assert rows[3]["sdcscope/rollbacks"] == 0 and rows[3]["sdcscope/detector/abft"] == 1


def test_mlflow_file_store_gets_rows_and_event_counts(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store in maintenance
    sink = MlflowSink(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="sdc", run_name="t")
    sink.write(0, {"loss": 2.0, "grad_norm": 1.0, "grad_norm/blocks.0.fc": 0.5})
    sink.event({**EVENT, "action": "rollback"})
    sink.write(1, {"loss": 1.5, "grad_norm": 0.75})
    run_id, client = sink.run_id, sink.client
    sink.close()
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
    assert history("loss") == [(0, 2.0), (1, 1.5)]
    assert history("grad_norm/all") == [(0, 1.0), (1, 0.75)] and history("grad_norm/blocks.0.fc") == [(0, 0.5)]
    assert history("sdcscope/detections") == [(1, 1.0)] and history("sdcscope/rollbacks") == [(1, 1.0)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_tracker_settings_are_checked_in_the_config():
    with pytest.raises(ValueError, match=r"prometheus_port=70000 .*0\.\.65535"):
        MetricsConfig(prometheus_port=70000)
    with pytest.raises(TypeError, match="prometheus_port"):
        MetricsConfig(prometheus_port="9100")
    with pytest.raises(TypeError, match="wandb="):
        MetricsConfig(wandb="offline")
    with pytest.raises(ValueError, match=r"mlflow settings \['uri'\] unknown; allowed: tracking_uri"):
        GuardConfig.from_dict({"metrics": {"mlflow": {"uri": "x"}}})
