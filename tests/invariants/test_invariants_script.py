"""Tracing a user's own script, unchanged: ``sdcscope invariants trace -- python my_train.py ARGS``
(a subprocess) and ``run_script`` (in-process), with the steps found from the calls."""

from __future__ import annotations

import textwrap

import pytest
import torch

from helpers import cli_invoke
from sdcscope.common.script import find_model
from sdcscope.invariants import InferConfig, check_trace, infer_invariants, load_trace
from sdcscope.invariants.script import run_script

SCRIPT = textwrap.dedent(
    """
    import argparse, math, sys
    import torch
    from torch import nn

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--exit", type=int, default=0)
    args = ap.parse_args()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.1))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.body(x))

    def factor(s):
        if s < args.warm:
            return (s + 1) / args.warm
        return 0.5 * (1 + math.cos(math.pi * (s + 1 - args.warm) / (args.steps + 1 - args.warm)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        for micro in range(args.accum):
            x = torch.randn(16, 6, generator=g)
            loss = nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)) / args.accum
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()  # cleared at the end of the step
        if step % 4 == 3:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 6, generator=g))
            model.train()
    sys.exit(args.exit)
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "user" / "my_train.py"  # outside the package, in a folder of its own
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_cli_traces_a_script_outside_the_package(script, tmp_path):
    out = tmp_path / "run"
    code, output = cli_invoke("invariants", "trace", "--out", out, "--", "python", script, "--steps", "6")
    assert code == 0, output
    trace = load_trace(out)
    assert trace.header["model"] == "Net" and trace.header["optimizer"] == "SGD"
    assert trace.header["params"] == ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
    train = trace.phase("train")
    assert [r["step"] for r in train] == list(range(6)) and len(trace.phase("eval")) == 1
    # The gradients are cleared at the end of each iteration: that zero_grad opens the next step.
    loop = ["forward", "backward", "optimizer.step", "lr_scheduler.step"]
    assert [[c[0] for c in r["calls"]] for r in train] == [loop] + [["zero_grad", *loop]] * 5
    assert dict(train[0]["calls"])["forward"]["Dropout.training"] is True
    assert dict(trace.phase("eval")[0]["calls"])["forward"]["Dropout.training"] is False


def test_exit_code_of_the_script_is_returned_and_the_trace_kept(script, tmp_path):
    assert run_script([str(script), "--exit", "5"], tmp_path / "r") == (5, True)
    assert len(load_trace(tmp_path / "r").phase("train")) == 8


def test_in_process_steps_span_the_accumulated_micro_batches(script, tmp_path):
    code, traced = run_script([str(script), "--steps", "5", "--accum", "3"], tmp_path / "r")
    assert (code, traced) == (0, True)
    train = load_trace(tmp_path / "r").phase("train")
    assert len(train) == 5
    assert all([c[0] for c in r["calls"]].count("backward") == 3 for r in train)
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"  # tracer uninstalled
    assert torch.optim.Optimizer.__init__.__qualname__ == "Optimizer.__init__"


def test_invariants_inferred_from_traced_scripts_flag_a_never_ending_warm_up(script, tmp_path):
    refs = []
    for i, lr in enumerate(("0.05", "0.02")):
        run_script([str(script), "--lr", lr], tmp_path / f"ref{i}")
        refs.append(tmp_path / f"ref{i}")
    invs = infer_invariants(refs, InferConfig(relations=("LRSchedule", "APISequence", "EventContain")))
    run_script([str(script), "--lr", "0.1", "--warm", "4"], tmp_path / "ok")
    assert check_trace(tmp_path / "ok", invs) == []
    run_script([str(script), "--warm", "100"], tmp_path / "bad")
    found = check_trace(tmp_path / "bad", invs)
    assert [(e["verdict"], e["evidence"]["rule"]) for e in found] == [("schedule.train.lr", "warmup")]


def test_script_without_an_optimizer_traces_nothing(tmp_path):
    path = tmp_path / "eval_only.py"
    path.write_text("import torch\nprint(torch.nn.Linear(2, 2)(torch.ones(2)).shape)\n")
    assert run_script([str(path)], tmp_path / "r") == (0, False)
    assert not (tmp_path / "r").exists()


def test_model_is_the_smallest_module_holding_the_optimizers_parameters():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    outer = torch.nn.ModuleDict({"model": inner, "ema": torch.nn.Linear(2, 2)})  # noqa: F841 (alive)
    wrapper = torch.nn.ModuleList([inner])  # same parameters: the outermost of equals
    assert find_model(torch.optim.SGD(inner.parameters(), lr=0.1)) is wrapper
    assert find_model(torch.optim.SGD(inner[0].parameters(), lr=0.1)) is inner[0]
