"""Spatial patterns through live hooks, schedules over steps, determinism, clean detach."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sdcscope.engine import TrainConfig, Trainer, param_sha256
from sdcscope.faults import FaultSpec, fires, swizzle_permutation
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload


@pytest.fixture(scope="module")
def gpt():
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))


@pytest.fixture(scope="module")
def cnn():
    return make_workload(WorkloadConfig(workload="cnn", preset="tiny", batch_size=8))


def spec(**kw):
    base = {"model": "bitflip", "bits": [22], "schedule": {"kind": "transient", "step": 0}}
    base.update(kw)
    return FaultSpec.from_dict(base)


def output_diff(workload, module, s, seed=0):
    """Flat indices where the module's first forward output differs with the fault."""
    outs = []
    for faulty in (False, True):
        trainer = Trainer(workload, TrainConfig(seed=seed))
        inj = Injector(trainer.model, [s], trainer.optimizer).attach() if faulty else None
        mod = dict(trainer.model.named_modules())[module]
        kept = []
        mod.register_forward_hook(lambda m, a, o: kept.append(o.detach().clone()) if not kept else None)
        if inj:
            inj.set_position(0, 0)
        trainer.workload.loss(trainer.model, trainer.workload.batch(seed, 0))
        outs.append(kept[0])
    golden, faulty = outs
    return golden, faulty, set((golden.reshape(-1) != faulty.reshape(-1)).nonzero().flatten().tolist())


def test_pe_pattern_on_linear_output(gpt):
    s = spec(site="gemm.forward", target="blocks.0.mlp.fc", pattern={"kind": "pe", "array": [4, 8], "pe": [1, 5]})
    golden, _, diff = output_diff(gpt, "blocks.0.mlp.fc", s)
    rows, cols = golden.numel() // golden.shape[-1], golden.shape[-1]
    expected = {i * cols + j for i in range(1, rows, 4) for j in range(5, cols, 8)}
    assert diff == expected and len(expected) == (rows // 4) * (cols // 8)


def test_mac_cell_on_conv_weight(cnn):
    s = spec(
        site="weight", target="conv2.weight", pattern={"kind": "mac_cell", "input_channel": 2, "output_channel": 5}
    )
    trainer = Trainer(cnn, TrainConfig())
    before = trainer.model.conv2.weight.detach().clone()
    with Injector(trainer.model, [s], trainer.optimizer) as inj:
        inj.set_position(0)
    after = trainer.model.conv2.weight.detach()
    diff = set((before.reshape(-1) != after.reshape(-1)).nonzero().flatten().tolist())
    c_in, k = 8, 9  # conv2: [16, 8, 3, 3]
    assert diff == {5 * c_in * k + 2 * k + e for e in range(k)}


def test_mac_cell_gemm_forward_corrupts_only_products_of_the_cell(cnn):
    s = spec(
        site="gemm.forward",
        target="conv2",
        model="stuck_at_0",
        bits=[29],
        pattern={"kind": "mac_cell", "input_channel": 3, "output_channel": 6},
    )
    golden, faulty, diff = output_diff(cnn, "conv2", s)
    channels = {(i // (golden.shape[2] * golden.shape[3])) % golden.shape[1] for i in diff}
    assert channels == {6}
    # the error is exactly the conv of input channel 3 with the weight error of cell (6, 3)
    trainer = Trainer(cnn, TrainConfig())
    kept = []
    trainer.model.conv2.register_forward_hook(lambda m, a, o: kept.append(a[0].detach()))
    trainer.workload.loss(trainer.model, trainer.workload.batch(0, 0))
    w = trainer.model.conv2.weight.detach()
    from sdcscope.faults import stuck_at

    dw = stuck_at(w[6, 3], (29,), 0) - w[6, 3]
    err = torch.nn.functional.conv2d(kept[0][:, 3:4], dw[None, None], padding=1)[:, 0]
    torch.testing.assert_close(faulty[:, 6] - golden[:, 6], err, rtol=1e-4, atol=1e-6)


def _weight_diff(trainer, name, before):
    after = dict(trainer.model.named_parameters())[name].detach().reshape(-1)
    return set((before.reshape(-1) != after).nonzero().flatten().tolist())


def test_mac_cell_array_on_conv_weight(cnn):
    # conv2 weight [16, 8, 3, 3]; array 3 input rows x 5 output columns, cell (a=2, b=4):
    # input channels {2, 5}, output channels {4, 9, 14}, every kernel element
    s = spec(
        site="weight",
        target="conv2.weight",
        pattern={"kind": "mac_cell", "array": [3, 5], "input_channel": 2, "output_channel": 4},
    )
    trainer = Trainer(cnn, TrainConfig())
    before = trainer.model.conv2.weight.detach().clone()
    with Injector(trainer.model, [s], trainer.optimizer) as inj:
        inj.set_position(0)
    c_in, k = 8, 9
    assert _weight_diff(trainer, "conv2.weight", before) == {
        o * c_in * k + i * k + e for o in (4, 9, 14) for i in (2, 5) for e in range(k)
    }
    assert inj.records[0]["count"] == 3 * 2 * 9


def test_mac_cell_array_random_cell_is_one_cell_for_every_layer(cnn):
    """One physical cell of the array serves every GEMM the unit runs: the same (a, b) in each layer."""
    for seed in range(4):
        s = spec(
            site="weight",
            target=["conv2.weight", "fc1.weight", "fc2.weight"],
            seed=seed,
            pattern={"kind": "mac_cell", "array": [4, 8]},
        )
        trainer = Trainer(cnn, TrainConfig())
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        with Injector(trainer.model, [s], trainer.optimizer) as inj:
            inj.set_position(0)
        cells = set()
        for name in ("conv2.weight", "fc1.weight", "fc2.weight"):
            shape = before[name].shape
            diff = _weight_diff(trainer, name, before[name])
            inner = shape[1] * (shape[2] * shape[3] if len(shape) == 4 else 1)
            pairs = {(e % inner // (inner // shape[1]), e // inner) for e in diff}  # (input, output) channel
            cell = {(i % 4, o % 8) for i, o in pairs}
            assert len(cell) == 1
            a, b = cell.pop()
            assert pairs == {(i, o) for i in range(a, shape[1], 4) for o in range(b, shape[0], 8)}
            cells.add((a, b))
        assert len(cells) == 1, cells


def test_swizzled_mac_cell_moves_with_the_step_in_training_and_evaluation(cnn):
    # conv2 [16, 8, 3, 3] on an array of 4 input rows x 8 output columns; cell (1, 3): lanes
    # {1, 5} (input) and {3, 11} (output); logical channel c sits on lane perm_t[c] at step t
    s = spec(
        site="gemm.forward",
        target="conv2",
        model="stuck_at_0",
        bits=[28],
        pattern={
            "kind": "mac_cell",
            "array": [4, 8],
            "input_channel": 1,
            "output_channel": 3,
            "swizzle": "per_step",
            "swizzle_seed": 9,
        },
        schedule={"kind": "permanent", "start": 0},
    )
    trainer = Trainer(cnn, TrainConfig(seed=3))
    inj = Injector(trainer.model, [s], trainer.optimizer).attach()
    trainer.add_callback(inj.callback())
    for _ in range(3):
        trainer.train_step()
    trainer.evaluate()  # evaluation at step 3 uses the mapping of step 3
    inj.close()
    assert [r["step"] for r in inj.records] == [0, 1, 2, 3]
    sets = []
    for rec in inj.records:
        t = rec["step"]
        ins = [c for c, lane in enumerate(swizzle_permutation(8, 9, t, "input").tolist()) if lane in (1, 5)]
        outs = [c for c, lane in enumerate(swizzle_permutation(16, 9, t, "output").tolist()) if lane in (3, 11)]
        want = sorted(o * 72 + i * 9 + e for o in outs for i in ins for e in range(9))
        assert rec["count"] == 36 and rec["index"] == want
        sets.append(tuple(want))
    assert len(set(sets)) == 4


def _fired_steps(workload, s, steps=12):
    trainer = Trainer(workload, TrainConfig(seed=1))
    inj = Injector(trainer.model, [s], trainer.optimizer).attach()
    trainer.add_callback(inj.callback())
    for _ in range(steps):
        trainer.train_step()
    return [r["step"] for r in inj.records], param_sha256(trainer.model)


@pytest.mark.parametrize(
    "schedule,expected",
    [
        ({"kind": "transient", "step": 3}, [3]),
        ({"kind": "permanent", "start": 4}, list(range(4, 12))),
    ],
)
def test_schedules_fire_at_exact_steps(cnn, schedule, expected):
    s = spec(site="gemm.grad_input", target="fc2", schedule=schedule)
    assert _fired_steps(cnn, s)[0] == expected


def test_intermittent_fires_inside_window_deterministically(cnn):
    s = spec(
        site="param_grad",
        target="fc1.weight",
        seed=9,
        schedule={"kind": "intermittent", "p": 0.5, "start": 2, "stop": 10},
    )
    steps_a, sha_a = _fired_steps(cnn, s)
    steps_b, sha_b = _fired_steps(cnn, s)
    assert steps_a == steps_b and sha_a == sha_b
    assert steps_a == [k for k in range(12) if fires(s, k, 0, "fc1.weight", 0)]
    assert all(2 <= k < 10 for k in steps_a) and 0 < len(steps_a) < 8


def test_micro_batch_transient_fires_once(gpt):
    s = spec(site="activation", target="blocks.0.attn", schedule={"kind": "transient", "step": 1, "micro_batch": 1})
    trainer = Trainer(gpt, TrainConfig(grad_accum=2))
    inj = Injector(trainer.model, [s], trainer.optimizer).attach()
    trainer.add_callback(inj.callback())
    for _ in range(3):
        trainer.train_step()
    assert [(r["step"], r["micro_batch"]) for r in inj.records] == [(1, 1)]


def test_same_specs_same_seed_bitwise_identical_faulty_runs(gpt):
    s = spec(
        site="gemm.grad_weight",
        target="blocks.*.attn.o_proj",
        bits=[27],
        schedule={"kind": "intermittent", "p": 0.3, "start": 0},
    )

    def faulty_run():
        trainer = Trainer(gpt, TrainConfig(seed=1))
        inj = Injector(trainer.model, [s], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
        for _ in range(6):
            trainer.train_step()
        return inj.records, param_sha256(trainer.model)

    clean = Trainer(gpt, TrainConfig(seed=1))
    for _ in range(6):
        clean.train_step()
    records, digest = faulty_run()
    assert len({r["step"] for r in records}) > 1  # the intermittent fault fired, more than once
    assert all(r["before"] != r["after"] for r in records)  # and changed the values it hit
    assert digest != param_sha256(clean.model)  # and the run
    assert faulty_run() == (records, digest)  # bitwise the same the second time


def test_context_exit_leaves_model_as_without_injector(gpt):
    later = spec(site="gemm.forward", target="blocks.*", schedule={"kind": "permanent", "start": 100})
    live = spec(site="gemm.grad_input", target="blocks.*", schedule={"kind": "permanent", "start": 100})
    golden = Trainer(gpt, TrainConfig(seed=2))
    trainer = Trainer(gpt, TrainConfig(seed=2))
    # (step 100 is set but never run: at exit the injector says its two specs never fired there)
    with (
        pytest.warns(UserWarning, match="never fired, though its schedule covered step 100"),
        Injector(trainer.model, [later, live], trainer.optimizer) as inj,
    ):
        trainer.add_callback(inj.callback())
        trainer.train_step()  # armed but not firing: no hooks at all, identical to golden
        assert not any(m._forward_hooks or m._backward_hooks for m in trainer.model.modules())
        inj.set_position(100)
        assert any(m._forward_hooks for m in trainer.model.modules())
        inj.set_position(trainer.step)
    golden.train_step()
    assert not any(m._forward_hooks or m._backward_hooks for m in trainer.model.modules())
    trainer.callbacks.clear()
    trainer.train_step()
    golden.train_step()
    assert param_sha256(trainer.model) == param_sha256(golden.model)


def test_activation_checkpointing_sees_the_same_fault_once_logged(gpt):
    """Forward re-run in backward (checkpointing) gets the same fault; the result equals
    the run without checkpointing and the fault is recorded once."""
    s = spec(site="gemm.forward", target="blocks.0.mlp.fc", bits=[26], schedule={"kind": "transient", "step": 0})

    def run(use_checkpoint):
        trainer = Trainer(gpt, TrainConfig(seed=5))
        block = trainer.model.blocks[0]
        if use_checkpoint:
            forward = block.forward
            block.forward = lambda x: checkpoint(forward, x, use_reentrant=False)
        with Injector(trainer.model, [s], trainer.optimizer) as inj:
            inj.set_position(0)
            loss = trainer.workload.loss(trainer.model, trainer.workload.batch(5, 0))
            loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None])
        return loss.item(), grads, len(inj.records)

    loss_a, grads_a, n_a = run(False)
    loss_b, grads_b, n_b = run(True)
    assert n_a == n_b == 1
    assert loss_a == loss_b and torch.equal(grads_a, grads_b)


def test_permanent_weight_stuck_at_survives_updates(gpt):
    s = spec(
        site="weight",
        target="blocks.0.mlp.proj.weight",
        model="stuck_at_1",
        bits=[30],
        pattern={"kind": "element", "index": 77},
        schedule={"kind": "permanent", "start": 1},
    )
    trainer = Trainer(gpt, TrainConfig())
    inj = Injector(trainer.model, [s], trainer.optimizer).attach()
    trainer.add_callback(inj.callback())
    w = trainer.model.blocks[0].mlp.proj.weight
    for _ in range(4):
        trainer.train_step()
        if trainer.step > 1:  # after every update the bit is stuck again
            assert w.detach().reshape(-1)[77].view(torch.int32) & (1 << 30)


BASE = dict(target="0", model="stuck_at_1", bits=[30], schedule={"kind": "transient", "step": 0})


def _fired(site: str, pattern: dict) -> list[int]:
    """Flat indices a fault hit in Linear(6, 8) of a tiny MLP (one step, x needs a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    spec = FaultSpec(site=site, pattern={"kind": "mac_cell", **pattern}, **BASE)
    with Injector(model, [spec]) as inj:
        inj.set_position(0, 0)
        model(torch.randn(4, 6, requires_grad=True)).sum().backward()
    (record,) = inj.records
    return record["index"]


def test_the_channel_a_single_axis_site_has_is_honoured():
    # activation [4, 8]: output channel 2 of every row; dX [4, 6]: input channel 4 of every row
    assert _fired("activation", {"output_channel": 2}) == [2, 10, 18, 26]
    assert _fired("gemm.grad_input", {"input_channel": 4}) == [4, 10, 16, 22]
