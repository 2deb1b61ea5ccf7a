"""The guard's metrics and counts reach the trainers' own loggers: HF ``report_to`` (MLflow, file
store) and a Lightning logger (CSV), with the fault put in by the injector callbacks."""

import csv

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import output_flip


def test_hf_report_to_gets_guard_counts_and_metrics(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from sdcscope.integrations.hf import guard_trainer
    from sdcscope.integrations.hf_inject import inject_trainer

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    x = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, logging_steps=1, report_to=["mlflow"], use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=LlamaForCausalLM(config), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in x]
    )
    inject_trainer(trainer, [output_flip("model.layers.0.mlp.up_proj", 1, 1)])
    sdc = guard_trainer(trainer, {"profile": "full"})  # every GEMM checked every step
    trainer.train()
    assert [(e["step"], e["action"]) for e in sdc.events] == [(1, "recompute")]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["sdcscope/detections"] for h in logged] == [0, 1, 1] and logged[-1]["sdcscope/replays"] == 1
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hf").experiment_id])
    # in step order: the Trainer's MLflow callback may log asynchronously, so the store's order is the writes'
    history = lambda key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
    assert history("sdcscope/detections") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert history("sdcscope/actions/recompute")[-1] == (3, 1.0)
    assert [s for s, _ in history("sdcscope/grad_norm")] == [1, 2, 3]


def test_lightning_logger_gets_guard_counts_and_metrics(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from sdcscope.integrations.lightning import SDCGuardCallback
    from sdcscope.integrations.lightning_inject import SDCInjectorCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    torch.manual_seed(0)
    sdc = SDCGuardCallback({"profile": "full"}, run_dir=tmp_path / "sdc")  # every GEMM checked every step
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=CSVLogger(tmp_path, name="csv", version=0),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SDCInjectorCallback(output_flip("net.2", 2), run_dir=tmp_path / "sdc"), sdc],
    )  # fmt: skip
    trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=8))
    assert [(e["step"], e["action"]) for e in sdc.events] == [(2, "recompute")]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("sdcscope/detections")]
    assert [(int(r["step"]), float(r["sdcscope/detections"])) for r in rows] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert float(rows[-1]["sdcscope/replays"]) == 1 and float(rows[-1]["sdcscope/actions/recompute"]) == 1
    assert all(float(r["sdcscope/grad_norm"]) > 0 for r in rows)
