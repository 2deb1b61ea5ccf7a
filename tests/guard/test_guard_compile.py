"""The guard on a ``torch.compile``d model: its hooks run eagerly, every check still runs."""

import warnings

import torch

from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload


def test_guard_checks_a_compiled_model_without_tracing_its_hooks():
    w = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))
    torch.manual_seed(0)
    model = w.build_model()
    opt = w.build_optimizer(model)
    compiled = torch.compile(model, backend="eager")
    guard = Guard(model, opt, GuardConfig(abft={"kinds": ["linear"]}))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = w.batch(0, step)
            with guard.step(step, (x, y)):
                loss = w.loss(compiled, (x, y))
                loss.backward()
            assert guard.optimizer_step(loss)
    assert guard.events == []
    traced = [str(c.message) for c in caught if "lru_cache" in str(c.message)]
    assert traced == []  # dynamo warns so when it traces into the hooks
    # Y, dX, dW of every Linear each step (the tied head's dW too: its own node), nothing skipped
    assert guard.abft.checks_run == 3 * 3 * linears
