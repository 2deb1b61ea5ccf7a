"""Injector callbacks in real trainers: a forward-GEMM bit flip at a chosen optimizer step and
micro-batch (gradient accumulation 2), recorded bit-exact in ``injections.jsonl`` -- the recorded
before/after are the element of the clean output and of the output the next layer received."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import output_flip
from sdcscope.common.io import read_jsonl

STEP, MICRO, ACCUM, STEPS = 1, 1, 2, 3


class Capture:
    """Every forward call of a Linear while training: (input, output as the model used it, weight, bias)."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []
        self.handle = None

    def hook(self, module, args, out):
        if module.training:
            self.calls.append(
                (
                    args[0].detach().clone(),
                    out.detach().clone(),
                    module.weight.detach().clone(),
                    None if module.bias is None else module.bias.detach().clone(),
                )
            )

    def rehook(self, module):
        """Registered again before each micro-batch: after the injector's hook, so it sees what it returned."""
        if self.handle is not None:
            self.handle.remove()
        self.handle = module.register_forward_hook(self.hook)


def bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).float().view(torch.int32)


def check_record(log, capture, target):
    (rec,) = read_jsonl(log)
    assert (rec["step"], rec["micro_batch"], rec["site"], rec["module"]) == (STEP, MICRO, "gemm.forward", target)
    x, out, w, b = capture.calls[STEP * ACCUM + MICRO]  # one call per micro-batch, no other forward
    clean = F.linear(x, w, b)
    flat_out, flat_clean = out.reshape(-1), clean.reshape(-1)
    index = torch.tensor(rec["index"])
    assert torch.equal(bits(rec["after"]), flat_out[index].view(torch.int32))
    assert torch.equal(bits(rec["before"]), flat_clean[index].view(torch.int32))
    assert torch.equal(bits(rec["before"]) ^ bits(rec["after"]), torch.full_like(index, 1 << 30, dtype=torch.int32))
    others = torch.ones_like(flat_out, dtype=torch.bool)
    others[index] = False
    assert torch.equal(flat_out[others], flat_clean[others])  # nothing else was touched
    for i, (x, out, w, b) in enumerate(capture.calls):  # no other micro-batch of any step
        assert i == STEP * ACCUM + MICRO or torch.equal(out, F.linear(x, w, b)), i


def test_hf_trainer_injects_at_step_and_micro_batch(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from sdcscope.integrations.hf_inject import SDCInjectorCallback, inject_trainer

    target = "model.layers.0.mlp.up_proj"
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model = LlamaForCausalLM(LlamaConfig(**config, num_attention_heads=2, num_key_value_heads=2))
    x = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in x]
    capture, module = Capture(), model.get_submodule(target)

    class Rehook(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            capture.rehook(module)

        on_substep_end = on_step_begin

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    inj = inject_trainer(trainer, [output_flip(target, STEP, MICRO)])
    trainer.add_callback(Rehook())  # after the injector's callback
    trainer.train()
    log = tmp_path / "sdcscope" / "injections.jsonl"
    assert inj.records == read_jsonl(log)
    check_record(log, capture, target)
    with pytest.raises(ValueError, match="one inject_trainer"):
        inject_trainer(trainer, [output_flip(target, STEP, MICRO)])
    with pytest.raises(ValueError, match=r"fault spec #0"):
        inject_trainer(trainer, [output_flip("model.nope", STEP)])
    with pytest.raises(ValueError, match="at least one"):
        SDCInjectorCallback([])


def test_lightning_injects_at_step_and_micro_batch(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from sdcscope.integrations.lightning_inject import SDCInjectorCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    capture = Capture()

    class Rehook(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            capture.rehook(pl_module.net[2])

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    torch.manual_seed(0)
    module, inj = Classifier(), SDCInjectorCallback(output_flip("net.2", STEP, MICRO), run_dir=tmp_path / "sdc")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUM, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[inj, Rehook()],
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    log = tmp_path / "sdc" / "injections.jsonl"
    assert inj.records == read_jsonl(log)
    check_record(log, capture, "net.2")
