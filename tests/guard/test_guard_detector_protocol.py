"""A detector of one's own: its class plus one ``register`` call, nothing else edited. Its events
reach ``events.jsonl``, take the replay's verdict and the policy's action like a built-in's; a
detector registered but not configured, or unregistered, leaves the guard as it was."""

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import batch_of, ce, mlp, params, same
from sdcscope.detect import Event
from sdcscope.detect.protocol import CheckView, Registration, register, registered, unregister
from sdcscope.guard import Guard, GuardConfig

BAD_STEP, STEPS = 3, 6


# -- the user's detector: its config, its class, one registration ---------------------------------
@dataclass(kw_only=True)
class CeilingConfig:
    limit: float = 10.0

    def __post_init__(self) -> None:
        if not self.limit > 0:
            raise ValueError(f"limit={self.limit!r} must be > 0")


class LossCeiling:
    """A loss above ``limit`` is a finding (the world's loss: the mean over the ranks when sharded)."""

    def __init__(self, config: CeilingConfig, rank: int | None = None) -> None:
        self.config, self.rank = config, rank
        self.views: list[CheckView] = []

    def check(self, view: CheckView) -> list[Event]:
        self.views.append(view)
        if view.loss_value is None or view.loss_value <= self.config.limit:
            return []
        evidence = {"loss": view.loss_value, "limit": self.config.limit}
        return [Event(view.step, "loss_ceiling", "above", rank=self.rank, evidence=evidence)]


@pytest.fixture
def ceiling():
    yield register(
        Registration(
            "loss_ceiling",
            CeilingConfig,
            lambda model, optimizer, config, rank: LossCeiling(config, rank),
            world_values=True,
        )
    )
    unregister("loss_ceiling")


# -- the loop: one step's loss is corrupted once (×100), its replay (loss_fn) is clean -------------
def run(config: GuardConfig | None, corrupt: bool = True, run_dir: str | None = None):
    """``STEPS`` steps of a plain loop (``config`` None: unguarded); ``(params, events, guard)``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = None
    if config is not None:
        guard = Guard(model, opt, config, run_dir=run_dir or tempfile.mkdtemp(), loss_fn=ce).attach()
    for step in range(STEPS):
        batch = batch_of(step)
        opt.zero_grad()
        if guard is None:
            ce(model, batch).backward()
            opt.step()
            continue
        with guard.step(step, batch):
            loss = ce(model, batch) * (100.0 if corrupt and step == BAD_STEP else 1.0)
            loss.backward()
        guard.optimizer_step(loss)
    if guard is not None:
        guard.close()
    return params(model), (guard.events if guard else []), guard


def minimal(**kw) -> GuardConfig:
    """No other detector that could see the corrupted step (no ABFT, no spike detectors)."""
    return GuardConfig(profile="minimal", loss_spike=None, grad_spike=None, **kw)


def test_a_registered_detector_is_driven_like_a_built_in(ceiling):
    clean, _, _ = run(None)
    run_dir = tempfile.mkdtemp()
    got, events, guard = run(minimal(detectors={"loss_ceiling": {"limit": 20.0}}), run_dir=run_dir)
    assert list(guard.detectors) == ["dispatch", "nonfinite", "loss_ceiling"]  # dispatch: MoE layers (none here)
    assert [(e["step"], e["detector"], e["verdict"], e["action"]) for e in events] == [
        (BAD_STEP, "loss_ceiling", "transient", "recompute")  # the replay's verdict, the policy's *:transient
    ]
    (e,) = events
    assert e["evidence"]["finding"] == "above" and e["evidence"]["limit"] == 20.0
    assert e["evidence"]["replay"]["verdict"] == "transient"
    assert (
        e["evidence"]["ledger"]["device"] == guard.ranks.strikes.device
    )  # a suspicion in the device ledger, like any finding
    written = [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]
    assert written == events
    assert same(clean, got)  # the recompute kept the clean re-execution: the run is the clean one


def test_the_view_holds_the_world_values(ceiling):
    _, _, guard = run(minimal(detectors={"loss_ceiling": {}}), corrupt=False)
    views = guard.detectors["loss_ceiling"].views
    assert [v.step for v in views] == list(range(STEPS)) and not any(v.replay for v in views)
    model = mlp()  # the first step again, by hand
    loss = ce(model, batch_of(0))
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    first = views[0]
    assert first.loss_value == loss.item() and math.isclose(first.grad_norm, norm.item(), rel_tol=1e-6)
    assert first.grad_names == tuple(n for n, _ in model.named_parameters()) and first.grad_sq.dtype == torch.float64
    assert first.model is guard.model and not first.own_overflow


def test_not_configured_or_unregistered_leaves_the_guard_as_before(ceiling):
    registered_only = run(minimal())
    assert list(registered_only[2].detectors) == ["dispatch", "nonfinite"]
    unregister("loss_ceiling")
    try:
        without = run(minimal())
        with pytest.raises(ValueError, match=r"unknown detector 'loss_ceiling'; registered: canary$"):
            minimal(detectors={"loss_ceiling": {}})
    finally:
        register(ceiling)
    assert registered_only[1] == without[1] == []  # nothing else sees the corrupted step
    assert same(registered_only[0], without[0])


def test_its_section_is_validated_and_round_trips(ceiling):
    config = GuardConfig.from_dict({"profile": "minimal", "detectors": {"loss_ceiling": {"limit": 3.0}}})
    assert config.detectors == {"loss_ceiling": CeilingConfig(limit=3.0)}
    assert GuardConfig.from_dict(config.to_dict()) == config
    assert GuardConfig(detectors={"loss_ceiling": None}).detectors == {"loss_ceiling": None}  # off
    with pytest.raises(ValueError, match=r"unknown detector 'loss_ceilin' \(did you mean 'loss_ceiling'\?\); "):
        GuardConfig(detectors={"loss_ceilin": {}})
    with pytest.raises(ValueError, match=r"'abft' is a section of its own: set guard abft itself"):
        GuardConfig(detectors={"abft": {}})
    with pytest.raises(ValueError, match=r"limt.*limit"):
        GuardConfig(detectors={"loss_ceiling": {"limt": 1.0}})
    with pytest.raises(ValueError, match=r"limit=-1"):
        GuardConfig(detectors={"loss_ceiling": {"limit": -1}})
    with pytest.raises(TypeError, match=r"mapping, CeilingConfig or null, got 5"):
        GuardConfig(detectors={"loss_ceiling": 5})
    with pytest.raises(TypeError, match=r"guard detectors must be a mapping"):
        GuardConfig(detectors=["loss_ceiling"])


def test_a_build_without_check_is_refused():
    register(Registration("no_check", CeilingConfig, lambda model, optimizer, config, rank: object()))
    try:
        with pytest.raises(TypeError, match=r"detector 'no_check': build returned .* no check\(view\)"):
            Guard(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), GuardConfig(detectors={"no_check": {}}))
    finally:
        unregister("no_check")
    assert "no_check" not in [r.name for r in registered()]


def test_the_policy_takes_rules_for_a_registered_detector(ceiling):
    """A rule naming the registered detector decides its findings (a veto instead of the default
    ``*:transient`` recompute); before registration the same rule is refused by name."""
    unregister("loss_ceiling")
    with pytest.raises(ValueError, match="unknown detector 'loss_ceiling'"):
        GuardConfig(policy={"rules": {"loss_ceiling:transient": ["veto"]}})
    register(ceiling)
    config = GuardConfig(
        profile="minimal",
        detectors={"loss_ceiling": {"limit": 20.0}},
        policy={"rules": {"loss_ceiling:transient": ["veto"]}},
    )
    _, events, _ = run(config)
    found = [e for e in events if e["detector"] == "loss_ceiling"]
    assert [(e["step"], e["verdict"], e["action"]) for e in found] == [(BAD_STEP, "transient", "veto")]
