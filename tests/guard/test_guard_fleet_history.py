"""``GuardConfig.fleet_history``: a guarded run records its ledger in the fleet history when the
guard closes, so that one device convicted by two real runs is a repeat offender there."""

import torch

from helpers import ce, learnable_batch, mlp
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.localize.history import History, statuses
from sdcscope.localize.ledger import device_id

FAULT = {
    "site": "gemm.forward",
    "target": "2",
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 5},
    "schedule": {"kind": "intermittent", "p": 1.0, "start": 1},
}


def guarded_run(run_dir, fleet):
    """A plain loop with a recurring GEMM fault: the ledger convicts the device, the guard stops."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    inj = Injector(model, [FaultSpec.from_dict(FAULT)], opt).attach()
    config = GuardConfig(profile="full", metrics=None, ledger={"strikes": 2}, fleet_history=str(fleet))
    with Guard(model, opt, config, run_dir=run_dir, loss_fn=ce) as guard:
        for step in range(6):
            inj.set_position(step)
            opt.zero_grad()
            batch = learnable_batch(step)
            with guard.step(step, batch):
                loss = ce(model, batch)
                loss.backward()
            guard.optimizer_step(loss)
            if guard.stopped:
                break
    inj.detach()
    assert guard.stopped


def test_two_guarded_runs_convicting_one_device_make_it_a_repeat_offender(tmp_path):
    fleet = tmp_path / "fleet"
    guarded_run(tmp_path / "r1", fleet)
    ((first,), _) = statuses(History(fleet))
    assert f"{first.host}:{first.device}" == device_id(next(mlp().parameters()).device)
    assert len(first.convictions) == 1 and first.strikes == 2 and not first.offender
    guarded_run(tmp_path / "r2", fleet)
    ((second,), _) = statuses(History(fleet))
    assert second.offender and len(second.runs) == 2 and "abft:2:forward:col=1" in second.reason
