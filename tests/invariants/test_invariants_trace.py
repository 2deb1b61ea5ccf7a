"""TraceRecorder: what it records from a plain loop and from the engine, and that it cleans up."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import clip_grad_norm_ as imported_clip_grad_norm_  # bound before any recorder
from torch.utils.checkpoint import checkpoint

from helpers import DropoutMLP
from sdcscope.invariants import TraceConfig, TraceRecorder, checksum, load_trace
from sdcscope.invariants.names import compress, from_hex, names_of, pair_up, resolve


def loop(rec, model, opt, steps=3, zero_grad=True, clip=True):
    for step in range(steps):
        rec.step_begin(step)
        if zero_grad:
            opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(5, 8, generator=g)).pow(2).mean()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec.log_metrics(loss=loss.detach())
        rec.step_end()


def setup(seed=0):
    torch.manual_seed(seed)
    model = DropoutMLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_records_calls_effects_and_metrics_of_a_plain_loop(tmp_path):
    model, opt = setup()
    rec = TraceRecorder(model, opt, out=tmp_path).attach()
    loop(rec, model, opt)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 8))
    rec.log_metrics(val_loss=1.5)
    rec.detach()
    trace = load_trace(tmp_path)
    assert trace.header["params"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert trace.header["mode_modules"] == {"Dropout.training": ["drop"]}
    train, ev = trace.phase("train"), trace.phase("eval")
    assert [r["step"] for r in train] == [0, 1, 2] and len(ev) == 1 and ev[0]["step"] == 3
    r = train[1]
    assert [c[0] for c in r["calls"]] == ["zero_grad", "forward", "backward", "clip_grad_norm_", "optimizer.step"]
    fields = dict(r["calls"])
    assert fields["forward"]["training"] is True and fields["forward"]["Dropout.training"] is True
    assert fields["forward"]["out.dtype"] == "float32" and isinstance(fields["forward"]["input"], int)
    assert fields["clip_grad_norm_"]["params"] == "0xf" and fields["clip_grad_norm_"]["max_norm"] == 1.0
    assert isinstance(fields["backward"]["loss"], float) and fields["backward"]["loss"] == r["metrics"]["loss"]
    assert r["effects"] == {"grad": "0xf", "update": "0xf", "cleared": "0xf", "outside": "0x0"}
    assert len(r["checksums"]) == 4
    assert ev[0]["metrics"] == {"val_loss": 1.5}
    assert dict(ev[0]["calls"])["forward"]["Dropout.training"] is False


def test_detach_restores_torch_and_the_users_objects():
    model, opt = setup()
    clip, backward = torch.nn.utils.clip_grad_norm_, torch.autograd.backward
    scale = torch.nn.utils.clip_grad._clip_grads_with_norm_
    rec = TraceRecorder(model, opt).attach()
    assert torch.nn.utils.clip_grad_norm_ is not clip and "zero_grad" in vars(opt)
    assert torch.autograd.backward is not backward and torch.nn.utils.clip_grad._clip_grads_with_norm_ is not scale
    rec.detach()
    assert torch.nn.utils.clip_grad_norm_ is clip and torch.nn.utils.clip_grad.clip_grad_norm_ is clip
    assert torch.autograd.backward is backward and torch.nn.utils.clip_grad._clip_grads_with_norm_ is scale
    assert "zero_grad" not in vars(opt) and "zero_grad" not in vars(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_backward_and_clipping_are_recorded_once_however_they_are_called():
    model, opt = setup()
    rec = TraceRecorder(model, opt).attach()
    rec.step_begin(0)
    x = torch.randn(4, 8)
    model(x).pow(2).mean().backward()
    torch.autograd.backward(model(x).pow(2).mean())
    torch.autograd.backward([model(x).sum(), model(x).sum()])  # two roots: no one loss
    # reentrant checkpointing runs a backward inside this one: part of it, not recorded again
    checkpoint(model.fc2, torch.relu(model.fc1(x)), use_reentrant=True).pow(2).mean().backward()
    imported_clip_grad_norm_(model.parameters(), 1.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=1.0)
    (r,) = rec.step_end()
    rec.detach()
    assert [c[0] for c in r["calls"]] == [
        "forward",
        "backward",
        "forward",
        "backward",
        "forward",
        "forward",
        "backward",
        "backward",
        "clip_grad_norm_",
        "clip_grad_norm_",
    ]
    backward = [f for api, f in r["calls"] if api == "backward"]
    assert ["loss" in f for f in backward] == [True, True, False, True]
    imported, public = [f for api, f in r["calls"] if api == "clip_grad_norm_"]
    assert "norm_type" not in imported and (imported["max_norm"], imported["params"]) == (1.0, "0xf")
    assert (public["max_norm"], public["norm_type"]) == (0.5, 1.0) and public["out"] > 0


def test_parameters_written_outside_optimizer_step_show_in_the_effects():
    model, opt = setup()
    rec = TraceRecorder(model, opt).attach()
    records = []
    for step in range(3):
        rec.step_begin(step)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            if step == 1:
                model.fc1.bias.add_(1.0)  # before the update
            opt.step()
            if step == 2:
                model.fc2.weight.mul_(0.5)  # after it
        records += rec.step_end()
    rec.detach()
    names = rec.param_names
    assert [names_of(from_hex(r["effects"]["outside"]), names) for r in records] == [[], ["fc1.bias"], ["fc2.weight"]]


def test_a_scheduler_step_records_whether_it_drives_the_optimizer():
    model, opt = setup()
    other = torch.optim.SGD(model.parameters(), lr=0.1)  # e.g. the optimizer before a rebuild
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1) for o in (opt, other)]
    rec = TraceRecorder(model, opt, schedulers=schedulers).attach()
    rec.step_begin(0)
    for o, s in zip((opt, other), schedulers):
        o.step()
        s.step()
    (r,) = rec.step_end()
    rec.detach()
    assert [f["drives_optimizer"] for api, f in r["calls"] if api == "lr_scheduler.step"] == [True, False]


def test_stale_grads_frozen_and_unregistered_parameters_show_in_the_effects():
    model, _ = setup()
    model.fc1.bias.requires_grad_(False)
    opt = torch.optim.AdamW([model.fc1.weight, model.fc2.bias], lr=1e-2)  # fc2.weight left out
    rec = TraceRecorder(model, opt).attach()
    records = []
    for step in range(3):
        rec.step_begin(step)
        model(torch.randn(4, 8)).sum().backward()  # no zero_grad at all
        opt.step()
        records += rec.step_end()
    rec.detach()
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    r = records[-1]["effects"]
    assert names_of(from_hex(r["grad"]), names) == ["fc1.weight", "fc2.weight", "fc2.bias"]
    assert names_of(from_hex(r["update"]), names) == ["fc1.weight", "fc2.bias"]
    assert names_of(from_hex(r["cleared"]), names) == ["fc1.bias"]  # only the grad that is None
    assert records[0]["effects"]["cleared"] == "0xf"  # nothing to compare with at the first step


def test_zeroed_grads_count_as_cleared():
    model, opt = setup()
    rec = TraceRecorder(model, opt).attach()
    records = []
    for step in range(2):
        rec.step_begin(step)
        opt.zero_grad(set_to_none=False)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        records += rec.step_end()
    rec.detach()
    assert records[1]["effects"]["cleared"] == "0xf"
    assert records[1]["effects"]["grad"] == "0xf"  # accumulated into the zeroed tensors
    assert dict(records[1]["calls"])["zero_grad"]["set_to_none"] is False


def test_engine_adapter_records_steps_and_evaluation(tmp_path):
    from sdcscope.engine import TrainConfig, Trainer
    from sdcscope.workloads import WorkloadConfig, make_workload

    trainer = Trainer(make_workload(WorkloadConfig(workload="cnn", batch_size=16)), TrainConfig(seed=0))
    rec = TraceRecorder(trainer.model, trainer.optimizer, out=tmp_path).attach()
    trainer.add_callback(rec)
    for _ in range(2):
        trainer.train_step()
    trainer.evaluate()
    rec.detach()
    trace = load_trace(tmp_path)
    assert [r["phase"] for r in trace.records] == ["train", "train", "eval"]
    assert set(trace.records[0]["metrics"]) >= {"loss", "grad_norm", "lr"}
    assert "val_acc" in trace.records[2]["metrics"]


def test_selective_config_and_usage_errors(tmp_path):
    model, opt = setup()
    rec = TraceRecorder(model, opt, config=TraceConfig(checksums=("fc2.*",), input_fingerprint=False))
    assert rec.watched_names == ["fc2.weight", "fc2.bias"]
    rec.attach()
    with pytest.raises(ValueError, match="already attached"):
        rec.attach()
    rec.step_begin(0)
    with pytest.raises(ValueError, match="step_end"):
        rec.step_begin(1)
    model(torch.randn(2, 8))
    (r,) = rec.step_end()
    assert "input" not in dict(r["calls"])["forward"] and len(r["checksums"]) == 2
    with pytest.raises(ValueError, match="without step_begin"):
        rec.step_end()
    rec.detach()
    with pytest.raises(ValueError, match="matches no tensor"):
        TraceRecorder(model, opt, config=TraceConfig(checksums=("fc3.*",)))
    (tmp_path / "trace.jsonl").write_text(json.dumps({"kind": "header"}) + "\n")
    with pytest.raises(ValueError, match="already exists"):
        TraceRecorder(model, opt, out=tmp_path).attach()
    with pytest.raises(TypeError):
        TraceRecorder(model, "adam")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 63), st.integers(0, 31), st.sampled_from([torch.float32, torch.bfloat16, torch.int32]))
def test_checksum_sees_every_bit_of_every_element(index, bit, dtype):
    t = (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    bits = (
        t.clone()
        .view(-1)
        .view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int32: torch.int32}[dtype])
    )
    bit %= bits.element_size() * 8
    flipped = bits.clone()
    flipped[index] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int64).to(bits.dtype)
    assert checksum(flipped.view(dtype).view(8, 8)) != checksum(t)
    assert checksum(t.clone()) == checksum(t)


def test_checksum_is_position_sensitive():
    t = torch.arange(16.0)
    assert checksum(t) != checksum(t.flip(0))


@settings(max_examples=80, deadline=None)
@given(st.sets(st.sampled_from(["a.x.w", "a.x.b", "a.y.w", "b.w", "b.b", "c"]), min_size=1))
def test_compress_selects_exactly_what_it_was_given(chosen):
    names = ["a.x.w", "a.x.b", "a.y.w", "b.w", "b.b", "c"]
    assert set(resolve(compress(chosen, names), names, "t")) == chosen


def test_pair_up_matches_by_name_and_names_close_matches():
    names = ["r.0.w", "r.0.b", "r.1.w", "r.1.b"]
    assert pair_up("r.0.*", "r.1.*", names, "inv") == [("r.0.w", "r.1.w"), ("r.0.b", "r.1.b")]
    with pytest.raises(ValueError, match="close matches: r.0.w"):
        pair_up("r.0.v", "r.1.v", names, "inv")
    with pytest.raises(ValueError, match="no counterpart"):
        pair_up("r.*", "q.*", names, "inv")
