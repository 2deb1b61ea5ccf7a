"""The Guard in a real Lightning ``Trainer`` (a small MLP, on CPU): a clean fit is untouched, a
transient GEMM fault is caught that step, named and recomputed through the step's closure (or
vetoed with the Adam state untouched), and bad configs or unsupported settings fail before any
step."""

import sys

import pytest

L = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from helpers import event_summary, output_flip, params, random_flip, same, same_state  # noqa: E402
from sdcscope.common.io import read_jsonl  # noqa: E402
from sdcscope.detect import ABFTDetector  # noqa: E402
from sdcscope.faults import FaultSpec  # noqa: E402
from sdcscope.guard import GuardConfig  # noqa: E402
from sdcscope.inject import Injector  # noqa: E402
from sdcscope.integrations.lightning import SDCGuardCallback  # noqa: E402

STEPS, FAULT_STEP, CLIP = 6, 3, 0.05
TARGET = "net.2"


class Classifier(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Validated(Classifier):
    def validation_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])


def data():
    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g))
    return torch.utils.data.DataLoader(dataset, batch_size=8)


class Record(L.Callback):
    """Tells the injector where training is; keeps each step's loss as Lightning returned it."""

    def __init__(self, injector: Injector) -> None:
        self.injector, self.losses, self.validated = injector, [], 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.injector.set_position(trainer.global_step, batch_idx % trainer.accumulate_grad_batches)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.validated += 1


def flip(micro_batch: int = 0, kind: str = "transient") -> FaultSpec:
    """Exponent bit 30 of one element of the hidden layer's output."""
    return output_flip(TARGET, FAULT_STEP, micro_batch, kind)


def fit(tmp_path, config=None, *, guard=True, spec=None, callbacks=(), manual=False, **trainer_args):
    validate = bool(trainer_args.get("val_check_interval"))
    torch.manual_seed(0)
    module = (Validated if validate else Classifier)(manual)
    record = Record(Injector(module, [spec] if spec else []).attach())
    full = GuardConfig(profile="full")  # every GEMM checked every step
    sdc = SDCGuardCallback(full if config is None else config, run_dir=tmp_path / "sdc") if guard else None
    trainer_args = {"max_steps": STEPS, "gradient_clip_val": CLIP, **trainer_args}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[record, *callbacks, *([sdc] if sdc else [])],
        **trainer_args,
    )
    trainer.fit(module, data(), data() if validate else None)
    return module, sdc, record


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    module, _, record = fit(tmp_path_factory.mktemp("clean"), guard=False)
    return params(module), record.losses


class OwnMethods(L.Callback):
    """The module's and optimizer's own attributes as training starts, before the guard's."""

    def on_train_start(self, trainer, pl_module):
        self.before = (dict(vars(pl_module)).get("optimizer_step"), vars(trainer.optimizers[0]).get("step"))
        self.optimizer = trainer.optimizers[0]


def test_clean_fit_is_untouched_and_the_trainer_restored(tmp_path, clean):
    own = OwnMethods()
    module, sdc, record = fit(tmp_path, callbacks=[own], val_check_interval=2, limit_val_batches=2)  # validation
    # passes in between change nothing
    assert sdc.events == [] and (tmp_path / "sdc" / "events.jsonl").read_text() == ""
    assert same(params(module), clean[0]) and record.losses == clean[1]  # bitwise: the guard only reads
    assert record.validated > 2  # the sanity check's and those between steps
    rows = read_jsonl(tmp_path / "sdc" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert min(r["grad_norm"] for r in rows) > CLIP  # the guard saw the gradients before Lightning clipped them
    assert (vars(module).get("optimizer_step"), vars(own.optimizer).get("step")) == own.before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def test_transient_fault_is_caught_named_and_recomputed(tmp_path, clean):
    module, sdc, record = fit(tmp_path, spec=flip())
    assert [(r["step"], r["module"]) for r in record.injector.records] == [(FAULT_STEP, TARGET)]
    assert event_summary(sdc.events) == [(FAULT_STEP, "abft", "transient", "recompute", TARGET)]
    (event,) = read_jsonl(tmp_path / "sdc" / "events.jsonl")
    assert event["gemm"] == "forward" and event["evidence"]["replay"]["verdict"] == "transient"
    # the closure's clean re-execution replaced the step: parameters and the losses Lightning
    # returned are the clean fit's, bit for bit
    assert same(params(module), clean[0]) and record.losses == clean[1]
    unguarded, _, _ = fit(tmp_path / "unguarded", guard=False, spec=flip())
    assert not same(params(unguarded), clean[0])  # the fault does change an unguarded fit


class Watch(L.Callback):
    """Parameters and Adam state (exp_avg, exp_avg_sq, step) when step ``s`` begins
    (``seen["begin", s]``) and after it (``seen["end", s]``)."""

    def __init__(self, *steps: int) -> None:
        self.steps, self.seen = steps, {}

    def _take(self, when, trainer, module):
        state = trainer.optimizers[0].state
        self.seen[when] = (
            [p.detach().clone() for p in module.parameters()],
            [{k: v.clone() for k, v in state[p].items()} for p in module.parameters()],
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps:
            self._take(("begin", trainer.global_step), trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step - 1 in self.steps:  # global_step counts the step just done
            self._take(("end", trainer.global_step - 1), trainer, pl_module)


def test_veto_leaves_parameters_and_adam_state_untouched(tmp_path):
    watch = Watch(FAULT_STEP, FAULT_STEP + 1)
    config = GuardConfig(profile="full", policy={"rules": {"abft:transient": ["veto"]}})
    _, sdc, record = fit(tmp_path, config, spec=flip(), callbacks=[watch])
    assert event_summary(sdc.events) == [(FAULT_STEP, "abft", "transient", "veto", TARGET)]
    assert same_state(watch.seen["begin", FAULT_STEP], watch.seen["end", FAULT_STEP])
    assert not same(watch.seen["end", FAULT_STEP][0], watch.seen["end", FAULT_STEP + 1][0])  # then it trains on
    assert len(record.losses) == STEPS and sdc.guard.discarded_steps == 1


def test_weight_corruption_is_rolled_back(tmp_path):
    """A flipped weight between steps: the state checksums catch it before the forward pass and
    the module and optimizer go back to the latest snapshot (taken when step 2 began)."""
    watch = Watch(2, FAULT_STEP)
    spec = random_flip("weight", f"{TARGET}.weight", FAULT_STEP)
    module, sdc, record = fit(tmp_path, {"snapshots": {"every": 2}}, spec=spec, callbacks=[watch])
    assert event_summary(sdc.events) == [(FAULT_STEP, "state_checksum", "corrupt", "rollback", f"{TARGET}.weight")]
    assert same_state(watch.seen["begin", 2], watch.seen["end", FAULT_STEP])
    assert len(record.losses) == STEPS and module.net[2].weight.abs().max() < 10


def test_accumulation_needs_replay_off_and_then_vetoes_unverified(tmp_path):
    with pytest.raises(ValueError, match="accumulate_grad_batches=2 with replay"):
        fit(tmp_path, accumulate_grad_batches=2)
    _, sdc, record = fit(
        tmp_path, {"profile": "full", "replay": False}, spec=flip(micro_batch=1), accumulate_grad_batches=2
    )
    assert [(r["step"], r["micro_batch"]) for r in record.injector.records] == [(FAULT_STEP, 1)]
    assert event_summary(sdc.events) == [(FAULT_STEP, "abft", "unverified", "veto", TARGET)]


def test_guard_failure_is_an_event_not_a_crash(tmp_path, monkeypatch, clean):
    def broken(self, step=None):
        raise ZeroDivisionError("checksum unit on fire")

    monkeypatch.setattr(ABFTDetector, "check", broken)
    module, sdc, _ = fit(tmp_path)
    assert same(params(module), clean[0])
    assert {(e["detector"], e["verdict"]) for e in sdc.events} == {("guard", "internal_error")}
    with pytest.raises(ZeroDivisionError):  # unless told to
        fit(tmp_path / "strict", GuardConfig(profile="full", strict=True))


def test_a_stalled_guard_stops_training(tmp_path):
    _, sdc, record = fit(tmp_path, {"profile": "full", "stall_after": 2}, spec=flip(kind="permanent"))
    assert len(record.losses) == 2 and sdc.guard.discarded_steps == 2
    assert [e["verdict"] for e in sdc.events if e["detector"] == "guard"] == ["stalled"]


@pytest.mark.parametrize(
    "config, error, match",
    [
        ({"abtf": {}}, ValueError, r"unknown guard config key 'abtf' \(did you mean 'abft'\?\)"),
        ({"abft": {"c": -1}}, ValueError, "c=-1 must be a finite number > 0"),
        ("missing.yaml", FileNotFoundError, "guard config 'missing.yaml' does not exist"),
        ([], TypeError, "must be a GuardConfig, a YAML/JSON file path, a mapping or None, got list"),
    ],
)
def test_bad_config_fails_when_the_callback_is_built(config, error, match):
    with pytest.raises(error, match=match):
        SDCGuardCallback(config)


def test_unsupported_settings_fail_before_any_step(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"manual optimization \(automatic_optimization=False\)"):
        fit(tmp_path, manual=True, gradient_clip_val=None)


def test_pytorch_lightning_trainer_works_too(tmp_path, clean):
    PL = pytest.importorskip("pytorch_lightning")

    class PLClassifier(PL.LightningModule):  # the same module, of the other package
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

        training_step, configure_optimizers = Classifier.training_step, Classifier.configure_optimizers

    torch.manual_seed(0)
    module = PLClassifier()
    sdc = SDCGuardCallback(run_dir=tmp_path)
    trainer = PL.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[sdc],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data())
    assert sdc.events == [] and len(read_jsonl(tmp_path / "metrics.jsonl")) == STEPS
    assert same(params(module), clean[0])


def test_import_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "sdcscope.integrations.lightning")
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # as if neither were installed
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(ImportError, match=r"pip install 'sdcscope\[lightning\]'"):
        import sdcscope.integrations.lightning  # noqa: F401
