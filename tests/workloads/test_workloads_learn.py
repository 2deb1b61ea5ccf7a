"""The reference workloads really learn on their real data."""

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.workloads import WorkloadConfig, make_workload


def test_tiny_gpt_300_steps_lowers_val_loss():
    t = Trainer(make_workload(WorkloadConfig(workload="gpt", preset="tiny")), TrainConfig(seed=0))
    start = t.evaluate()["val_loss"]
    for _ in range(300):
        t.train_step()
    end = t.evaluate()["val_loss"]
    # ln(256) ≈ 5.55 at init; a byte model that learned Python's syntax is far below.
    assert start > 5.0
    assert end < start - 2.5, (start, end)


def test_cnn_reaches_90_percent_on_digits():
    t = Trainer(make_workload(WorkloadConfig(workload="cnn", preset="tiny")), TrainConfig(seed=0))
    for _ in range(400):
        t.train_step()
    assert t.evaluate()["val_acc"] >= 0.90
