"""Memory faults at any moment of a step are caught and repaired; the state checksum cannot cancel
and names the element. Each test reproduces a hole of the plain-sum, record-after-every-step
checksum and shows it closed."""

import pytest
import torch
from torch import nn

from sdcscope.detect.state import StateChecksum
from sdcscope.engine import TrainConfig, Trainer, param_sha256
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload

STEP = 5
STEPS = 7
CONFIG = dict(snapshots={"every": 4}, metrics=None)


@pytest.fixture(scope="module")
def gpt():
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000))


@pytest.fixture(scope="module")
def golden(gpt):
    return param_sha256(train(gpt, guard=False)[0].model)


def train(workload, spec=None, guard=True, accum=2, **config):
    trainer = Trainer(workload, TrainConfig(seed=3, grad_accum=accum))
    if spec is not None:
        trainer.add_callback(
            Injector(trainer.model, [FaultSpec.from_dict(spec)], trainer.optimizer).attach().callback()
        )
    g = Guard(trainer.model, trainer.optimizer, GuardConfig(**{**CONFIG, **config})) if guard else None
    if g is not None:
        trainer.add_callback(g.callback(trainer))
    while trainer.step < STEPS:
        trainer.train_step()
    return trainer, g


def weight_flip(micro_batch, bit=30, kind="transient"):
    return {
        "site": "weight",
        "target": "blocks.0.mlp.fc.weight",
        "model": "bitflip",
        "bits": [bit],
        "pattern": {"kind": "element", "index": 77},
        "schedule": {"kind": kind, "step": STEP, "micro_batch": micro_batch},
    }


def test_a_weight_flip_between_micro_batches_is_repaired_to_the_golden_run(gpt, golden):
    """The flip lands after the step began (micro-batch 1 of 2): the checksum verified right before
    the update catches it, the step rolls back, and the corruption never becomes the reference
    (before, it was re-recorded after the veto and every later step was vetoed). A flip between
    steps: test_guard_engine."""
    trainer, g = train(gpt, weight_flip(1))
    (e,) = [x for x in g.events if x["detector"] == "state_checksum"]
    assert (e["step"], e["action"], e["module"]) == (STEP, "rollback", "blocks.0.mlp.fc.weight")
    assert e["evidence"]["elements"] == [77] and e["evidence"]["bits"] == [30]
    assert e["index"] == list(divmod(77, trainer.model.blocks[0].mlp.fc.weight.shape[1]))
    assert g.discarded_steps == 1 and g.state_verified and not g.stopped
    assert param_sha256(trainer.model) == golden


def test_a_row_fault_is_named_element_by_element_and_repaired(gpt, golden):
    """A mantissa bit flipped in a whole weight row (0→1 in some values, 1→0 in others): the block
    checksums see it, the snapshot holding the verified state names every element, the rollback
    repairs it."""
    spec = {**weight_flip(0, bit=12), "pattern": {"kind": "row", "index": 3}}
    trainer, g = train(gpt, spec, snapshots={"every": 1})
    (e,) = [x for x in g.events if x["detector"] == "state_checksum"]
    width = trainer.model.blocks[0].mlp.fc.weight.shape[1]
    assert e["action"] == "rollback" and e["evidence"]["bits"] == [12]
    assert e["evidence"]["corrupted_elements"] == width and e["evidence"]["elements"][0] == 3 * width
    assert param_sha256(trainer.model) == golden


def row_fault(w: torch.Tensor, row: int, bit: int) -> None:
    """Flip ``bit`` in every value of a row: 0→1 in half of them, 1→0 in the other half."""
    words = w.data[row].view(torch.int32)
    words[: len(words) // 2] &= ~(1 << bit)  # make the bit 0 in the first half, 1 in the second
    words[len(words) // 2 :] |= 1 << bit
    words ^= 1 << bit


def test_a_same_bit_row_fault_that_cancels_in_a_plain_sum_is_detected():
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    row_fault(model.weight, 9, 12)  # the state as it was recorded: bit 12 of row 9 half 0, half 1
    check = StateChecksum(model, opt)
    check.record()
    plain = model.weight.detach().view(torch.int32).sum(dtype=torch.int64)
    model.weight.data[9].view(torch.int32).__ixor__(1 << 12)  # the fault: 64 values, 32 up and 32 down
    assert model.weight.detach().view(torch.int32).sum(dtype=torch.int64) == plain  # the old checksum's hole
    (e,) = check.verify(1)
    assert e.module == "weight" and e.evidence["block"][0] <= 9 * 64 < 10 * 64 <= e.evidence["block"][1]


@pytest.mark.parametrize(
    "dtype,bit", [(torch.float32, 31), (torch.float32, 0), (torch.bfloat16, 14), (torch.float64, 62)]
)
def test_a_single_flip_is_named_to_the_element_bit_and_values(dtype, bit):
    torch.manual_seed(1)
    model = nn.Linear(33, 7).to(dtype)
    check = StateChecksum(model)
    check.record()
    w = model.weight.data.view(-1)
    before = w[100].item()
    ints = w.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[w.element_size()])
    ints[100] ^= (1 << bit) if bit < 8 * w.element_size() - 1 else -(1 << bit)
    (e,) = check.verify(1)
    assert e.evidence["elements"] == [100] and e.evidence["bits"] == [bit] and e.index == (100 // 33, 100 % 33)
    assert e.evidence["value_before"] == before and e.evidence["value_now"] == w[100].item()
    ints[100] ^= (1 << bit) if bit < 8 * w.element_size() - 1 else -(1 << bit)
    assert check.verify(2) == []
