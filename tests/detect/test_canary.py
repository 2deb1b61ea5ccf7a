"""The kernel canary: a correct fused linear + cross-entropy is clean and checked every step; a
wrong kernel is caught in the first step its bad shape occurs, the op named, forward and dX; a
kernel that drops a row is caught by its shape; a transient error in a registered module goes
through the guard's replay and is recomputed; rows are drawn per step, the same on a replay."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import batch_of, ce, guarded_step, params, same
from sdcscope.detect import CanaryConfig, CanaryDetector, canary_function, canary_module
from sdcscope.detect.canary import bound
from sdcscope.detect.canary import op as canary_op
from sdcscope.detect.canary.record import sample_rows
from sdcscope.detect.protocol import CheckView
from sdcscope.guard import Guard, GuardConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "canary_fused_ce.py"


def _example():
    spec = importlib.util.spec_from_file_location("canary_fused_ce", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    """These runs are many tiny ops: one thread (two wait on each other on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def registered():
    """Ops a test registers, removed when it ends."""
    ops = []
    yield ops
    for o in ops:
        o.remove()


def test_a_correct_fused_linear_ce_is_clean_and_checked_every_step(tmp_path):
    script = _example()
    result = script.main(["--steps", "6", "--batch-size", "2", "--out", str(tmp_path / "run")])
    assert result["events"] == []
    assert result["calls"] == {"lm_head_ce": 6}  # recorded every step (the short step's shape too)
    assert result["checks"] == 12  # forward rows and dX rows, each step: an op that errs would be seen
    assert (tmp_path / "run" / "events.jsonl").read_text() == ""


def test_a_wrong_kernel_is_caught_in_the_first_step_of_its_shape_with_the_op_named():
    script = _example()
    result = script.main(["--steps", "5", "--batch-size", "2", "--wrong"])
    events = result["events"]
    assert [(e["step"], e["detector"], e["module"], e["evidence"]["pass"]) for e in events] == [
        (script.SHORT_STEP, "canary", "lm_head_ce", "forward"),  # the skipped row's loss
        (script.SHORT_STEP, "canary", "lm_head_ce", "backward"),  # and its dX
    ]
    last = script.CHUNK  # the short batch's rows: CHUNK + 1, the last one skipped by the kernel
    for e in events:
        assert (e["verdict"], e["action"], e["evidence"]["finding"]) == ("reproducible", "veto", "mismatch")
        assert e["evidence"]["row"] == last and e["index"][0] == last and last in e["evidence"]["rows"]
        assert e["evidence"]["rel_error"] == 1.0  # the row is all zeros: off by all of itself
    assert events[1]["evidence"]["input"] == 0  # dX of x (row argument 0)


class RowDrop(torch.autograd.Function):
    """A row-wise custom kernel, y = x·w (per row), that drops its last row when given 7 rows."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = x @ w
        return y[:-1] if x.shape[0] == 7 else y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = F.pad(dy, (0, 0, 0, x.shape[0] - dy.shape[0]))
        return dy @ w.T, x.T @ dy


def test_a_kernel_that_drops_a_row_for_one_shape_is_caught_by_its_shape(registered):
    fn = canary_function("row_drop", RowDrop.apply, lambda x, w: x @ w, backward=True)
    registered.append(fn.canary)
    det = CanaryDetector(CanaryConfig()).attach()
    w = torch.randn(4, 3, requires_grad=True)
    found = {}
    try:
        for step, rows in enumerate((8, 5, 7, 8)):
            det.begin_step(step)
            fn(torch.randn(rows, 4, requires_grad=True), w).sum().backward()
            found[step] = det.check(CheckView(step))
    finally:
        det.detach()
    assert found[0] == found[1] == found[3] == [] and det.checks_run == 6  # forward and dX of 3 steps
    (e,) = found[2]  # the first (only) step with 7 rows
    assert (e.step, e.detector, e.verdict, e.module) == (2, "canary", "shape", "row_drop")
    assert (e.evidence["output_rows"], e.evidence["input"], e.evidence["input_rows"]) == ([6], 0, [7])


class FlakyMLP(nn.Module):
    """A 'fused' MLP whose kernel errs once: its output 1 % off on call ``bad`` (a transient fault)."""

    def __init__(self, bad: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 4)
        self.bad, self.calls = bad, 0

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        self.calls += 1
        return y * 1.01 if self.calls - 1 == self.bad else y


def _mlp_reference(m: FlakyMLP):
    """fc1, ReLU, fc2 in the dtype of its argument (fp32; fp64 when the canary confirms a row)."""

    def ref(x):
        w1, b1, w2, b2 = (p.to(x.dtype) for p in (m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias))
        return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)

    return ref


def _run(model: FlakyMLP, guarded: bool, steps: int = 5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GuardConfig(profile="minimal", loss_spike=None, grad_spike=None, detectors={"canary": {}})
    guard = Guard(model, opt, config, loss_fn=ce).attach() if guarded else None
    for step in range(steps):
        batch = batch_of(step)
        if guard is not None:
            guarded_step(guard, model, step, batch)
            continue
        opt.zero_grad()
        ce(model, batch).backward()
        opt.step()
    if guard is not None:
        guard.close()
    return params(model), guard


def test_a_transient_error_in_a_registered_module_is_replayed_and_recomputed(registered):
    clean, _ = _run(FlakyMLP(bad=None), guarded=False)
    model = FlakyMLP(bad=2)  # the third call: step 2's forward; the replay's call is clean
    registered.append(canary_module("flaky_mlp", model, _mlp_reference(model), backward=True))
    got, guard = _run(model, guarded=True)
    (e,) = guard.events
    assert (e["step"], e["detector"], e["module"], e["verdict"], e["action"]) == (
        2,
        "canary",
        "flaky_mlp",
        "transient",
        "recompute",
    )
    assert e["evidence"]["pass"] == "forward" and 0.009 < e["evidence"]["rel_error"] < 0.011
    assert e["evidence"]["replay"]["replay_detections"] == 0  # the replay re-checked the same rows: clean
    assert same(clean, got)  # the clean re-execution was kept: the run is the clean one
    assert guard.detectors["canary"].calls == {"flaky_mlp": 6}  # 5 steps and the replay


def test_rows_are_drawn_per_step_and_again_on_a_replay(registered):
    model = nn.Linear(3, 5)
    registered.append(
        canary_module("lin", model, lambda x: F.linear(x, model.weight.to(x.dtype), model.bias.to(x.dtype)))
    )
    det = CanaryDetector(CanaryConfig(rows=2, last_row=False, every=2)).attach()
    drawn = []
    try:
        for step in (4, 4, 5, 6):  # step 4 and its replay, a step off the cadence, the next one
            det.begin_step(step)
            model(torch.randn(2, 50, 3))
            drawn.append([c.rows for c in det._pending])
            assert det.check(CheckView(step)) == []
    finally:
        det.detach()
    assert drawn[0] == drawn[1] == [sample_rows(0, 4, "lin", 0, 100, 2, False)] and len(drawn[0][0]) == 2
    assert drawn[2] == [] and drawn[3] != drawn[0]  # every=2: step 5 records nothing
    assert det.calls == {"lin": 3}


def test_the_canary_is_configured_and_registered_with_clear_errors(registered):
    with pytest.raises(ValueError, match=r"canary rows=0 must be a positive integer"):
        CanaryConfig(rows=0)
    with pytest.raises(
        ValueError, match=r"unknown detectors canary key 'row' \(did you mean 'rows'\?\); allowed: rows"
    ):
        GuardConfig.from_dict({"detectors": {"canary": {"row": 2}}})
    fn = canary_function("mine.op", torch.mul, torch.mul, row_args=(0, 1))
    registered.append(fn.canary)
    assert canary_op("mine.op") is fn.canary
    with pytest.raises(ValueError, match=r"a canary op 'mine.op' is registered already"):
        canary_function("mine.op", torch.mul, torch.mul)
    with pytest.raises(
        ValueError, match=r"unknown canary op 'mine.ob' \(did you mean 'mine.op'\?\); registered: mine.op"
    ):
        canary_op("mine.ob")
    with pytest.raises(ValueError, match=r"canary ops: 'lm_\*' matches no registered canary op; registered: mine.op"):
        CanaryDetector(CanaryConfig(ops=["lm_*"]))
    with pytest.raises(TypeError, match=r"row_args=\(-1,\) must be argument positions"):
        canary_function("other", torch.mul, torch.mul, row_args=(-1,))
    config = GuardConfig(detectors={"canary": {"rows": 3, "ops": ["mine.*"]}})
    assert config.detectors["canary"] == CanaryConfig(rows=3, ops=["mine.*"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_bound_allows_the_output_dtypes_rounding_and_flags_more(dtype):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 64, generator=g, dtype=torch.float64).float()
    got = ref.to(dtype)  # a correct op: its result rounded to its dtype
    assert float(bound(got, ref, dtype, 0.0, 0.0).max()) <= 0.5
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    scale = ref[1, 5].abs() + ref[1].abs().mean()
    bad = got.float().clone()
    bad[1, 5] += 3 * u * scale  # off by 1.5x the allowance 2u(|ref| + row mean)
    ratio = bound(bad, ref, dtype, 0.0, 0.0)
    assert (ratio > 1).nonzero().tolist() == [[1, 5]]
    assert float(bound(bad, ref, dtype, 2 * u, 0.0).max()) <= 1  # rtol widens it


@pytest.mark.parametrize("wrong", [False, True])
def test_the_fp64_stage_clears_a_correct_kernels_cancellation_and_not_a_wrong_one(registered, wrong):
    """Very confident rows: dX = (p - onehot)·W·g is a small difference of large terms, off by up to
    its whole size in a correct fp32 kernel; the fp64 reference tells that from a skipped row."""
    script = _example()
    fn = script.register("confident_ce", wrong=wrong)
    registered.append(fn.canary)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2 * script.CHUNK + 1, 128, generator=g) * 6).requires_grad_()
    w = torch.randn(256, 128, generator=g) * 0.1
    det = CanaryDetector(CanaryConfig(rows=x.shape[0])).attach()  # every row
    try:
        det.begin_step(0)
        fn(x, w, (x.detach() @ w.T).argmax(1)).mean().backward()
        events = det.check(CheckView(0))
    finally:
        det.detach()
    if not wrong:
        assert events == [] and det.cleared == 1  # dX flagged by the fp32 bound, cleared in fp64
        return
    assert [(e.evidence["pass"], e.evidence["row"], e.evidence["reference"]) for e in events] == [
        ("forward", x.shape[0] - 1, "fp64"),
        ("backward", x.shape[0] - 1, "fp64"),
    ]
