"""The guard on a ``torch.compile``d model: its hooks stay out of the graph (graph count printed and
bounded), and eager runs of the module are still checked in full."""

import warnings

import torch
from torch._dynamo.utils import counters

from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload


def test_guard_keeps_a_compiled_model_in_at_most_three_graphs_and_says_what_it_does_not_check():
    torch._dynamo.reset()
    counters.clear()
    w = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))
    torch.manual_seed(0)
    model = w.build_model()
    opt = w.build_optimizer(model)
    compiled = torch.compile(model, backend="eager")
    guard = Guard(model, opt, GuardConfig(profile="full", abft={"kinds": ["linear"]}))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = w.batch(0, step)
            with guard.step(step, (x, y)):
                loss = w.loss(compiled, (x, y))
                loss.backward()
            assert guard.optimizer_step(loss)
        graphs = counters["stats"]["unique_graphs"]
        print(f"compiled tiny GPT under the guard: {graphs} graph(s)")
        assert 1 <= graphs <= 3
        assert guard.events == [] and guard.abft.compiled and guard.abft.checks_run == 0
        assert sum("torch.compile graph" in str(c.message) for c in caught) == 1
        assert not [c for c in caught if "lru_cache" in str(c.message)]  # dynamo warns so when it traces into hooks
        x, y = w.batch(0, 4)  # an eager step of the module (what a replay runs): every Linear checked
        with guard.step(4, (x, y)):
            loss = w.loss(model, (x, y))
            loss.backward()
        assert guard.optimizer_step(loss)
    assert guard.events == [] and guard.abft.checks_run == 3 * linears
