"""One run with faults and a guard is assembled in one place (``sdcscope.jobs.FaultyRun``): the
fault specs are validated once, before any output, and the guarded twin only resolves them."""

from __future__ import annotations

import sdcscope.inject.validate as validate_module
from sdcscope.engine import TrainConfig
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.study.experiment import Experiment
from sdcscope.workloads import WorkloadConfig


def test_an_experiment_with_a_guard_validates_its_specs_once(tmp_path, monkeypatch):
    calls = []
    original = validate_module.validate_spec

    def counted(*args, **kwargs):
        calls.append(args[1])
        import traceback

        traceback.print_stack(limit=6)
        return original(*args, **kwargs)

    monkeypatch.setattr(validate_module, "validate_spec", counted)
    specs = [
        FaultSpec.from_dict(
            {
                "site": "gemm.forward",
                "target": "blocks.0.attn.q_proj",
                "model": "bitflip",
                "bits": [30],
                "schedule": {"kind": "transient", "step": 2},
            }
        ),
        FaultSpec.from_dict(
            {
                "site": "weight",
                "target": "blocks.0.mlp.*",
                "model": "bitflip",
                "bits": [20],
                "schedule": {"kind": "transient", "step": 1},
            }
        ),
    ]
    wcfg = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, eval_batches=1)
    experiment = Experiment(tmp_path / "e", wcfg, TrainConfig(seed=0), specs, guard=GuardConfig(), steps=3)
    assert calls == specs  # the faulty run's check; the guarded twin resolved the same specs only
    assert experiment.guarded.injector.targets.keys() == experiment.faulty.injector.targets.keys()
    comparison = experiment.run(3)
    assert calls == specs and comparison["fired"] is True
