"""GradShare: each parameter's share of the step's gradient norm, learned from clean references.

Broken gradient flow leaves the forward, the loss and the update looking normal: a residual
stream detached in every block, a ``.detach()`` half-way up the model, a leftover hook that
scales one layer's gradient.  A small residual network shows the relation catching each, while
clean runs with another seed, learning rate and gradient accumulation raise nothing; synthetic
traces pin down the inference (bounds, the noise floor) and the check (persistence, a missing
gradient, bad entries)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.invariants import (
    InferConfig,
    Invariant,
    InvariantChecker,
    Precondition,
    Trace,
    TraceRecorder,
    check_trace,
    infer_invariants,
    load_invariants,
    parse_invariants,
    save_invariants,
)
from sdcscope.invariants.names import from_hex, names_of
from sdcscope.invariants.relations.gradshare import MIN_SHARE, PERSIST, PROGRESS

TEACHER = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
VERDICT = "gradshare.train"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


class ResNet(nn.Module):
    """Pre-norm residual blocks between an input projection and a classifier head."""

    def __init__(self, bug: str | None = None, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)
        self.bug = bug

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            # The bug: the residual stream detached (a leftover of a memory experiment); the
            # forward computes the same values, the layers below get gradient only via branches.
            x = (x.detach() if self.bug == "residual_detached" else x) + block(x)
            if self.bug == "detached_midway" and i == 1:  # the lower half cut off the graph
                x = x.detach()
        return self.head(self.norm(x))


def run(attach, seed, bug=None, *, lr=1e-2, steps=12, accum=1):
    torch.manual_seed(seed)
    model = ResNet(bug)
    if bug == "grad_scaled_down":  # a leftover gradient hook (a reversal layer's scale, say)
        model.blocks[1].fc1.weight.register_hook(lambda g: g * 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tool = attach(model, opt)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        for _ in range(accum):
            x = torch.randn(32, 16, generator=g)
            (F.cross_entropy(model(x), (x @ TEACHER).argmax(-1)) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tool.step_end()
    tool.detach()
    return tool


@pytest.fixture(scope="module")
def invariants(tmp_path_factory):
    root = tmp_path_factory.mktemp("gradshare")
    for seed, lr in ((1, 1e-2), (2, 5e-3)):
        run(lambda m, o, seed=seed: TraceRecorder(m, o, out=root / str(seed)).attach(), seed, lr=lr)
    return infer_invariants([root / "1", root / "2"])


def check(invariants, bug=None, seed=7, lr=7e-3, **options):
    return run(lambda m, o: InvariantChecker(m, o, invariants).attach(), seed, bug, lr=lr, **options).violations


def gradshare(invariants) -> Invariant:
    (inv,) = [i for i in invariants if i.relation == "GradShare"]
    return inv


def test_every_parameter_gets_bounds_from_the_references(invariants):
    inv = gradshare(invariants)
    names = [n for n, _ in ResNet().named_parameters()]
    assert inv.id == VERDICT and list(inv.params["shares"]) == names
    assert inv.params["persist"] == PERSIST and inv.support == 24  # 2 references x 12 steps
    assert inv.precondition.when == ("optimizer.step",)
    for lo, hi in inv.params["shares"].values():
        assert 0 < lo < hi <= 1


@pytest.mark.parametrize(
    "options",
    [
        {"seed": 7, "lr": 7e-3},
        {"seed": 8, "lr": 2e-2, "accum": 3},
        {"seed": 9, "lr": 3e-3},
    ],
    ids=["seed7", "seed8_lr2e-2_accum3", "seed9_lr3e-3"],
)
def test_clean_runs_of_other_seeds_and_learning_rates_raise_nothing(invariants, options):
    assert check(invariants, **options) == []


def below(*prefixes: str) -> set[str]:
    return {n for n, _ in ResNet().named_parameters() if n.startswith(prefixes)}


@pytest.mark.parametrize(
    "bug, must, may",
    [
        # The input projection is reached only through the 4 branches; the blocks above it less so.
        ("residual_detached", {"inp.weight"}, below("inp.", "blocks.0.", "blocks.1.", "blocks.2.")),
        ("detached_midway", below("inp.", "blocks.0.", "blocks.1."), below("inp.", "blocks.0.", "blocks.1.")),
        ("grad_scaled_down", {"blocks.1.fc1.weight"}, {"blocks.1.fc1.weight"}),
    ],
)
def test_broken_gradient_flow_is_reported_on_the_parameters_it_starves(invariants, bug, must, may):
    hits = [e for e in check(invariants, bug) if e["verdict"] == VERDICT]
    assert must <= {e["module"] for e in hits} <= may, [(e["step"], e["module"]) for e in hits]
    for e in hits:
        ev = e["evidence"]
        assert ev["share"] < ev["bounds"][0] and ev["steps_out"] == PERSIST
        assert e["step"] == ev["since_step"] + PERSIST - 1
        assert "too little gradient reaches it" in ev["meaning"]


def test_only_a_grad_share_invariant_makes_the_checker_record_gradient_norms(invariants):
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not InvariantChecker(
        model, opt, [i for i in invariants if i.relation != "GradShare"]
    ).recorder.config.grad_norms
    assert InvariantChecker(model, opt, [gradshare(invariants)]).recorder.config.grad_norms


def test_the_recorder_takes_each_gradient_norm_when_the_step_returns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3), nn.Linear(3, 2))
    model[3].requires_grad_(False)  # no gradient: left out of the mask
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = TraceRecorder(model, opt).attach()
    rec.step_begin(0)
    model(torch.randint(0, 10, (5, 3))).pow(2).mean().backward()
    expected = [
        p.grad.coalesce().values().norm().item() if p.grad.is_sparse else p.grad.norm().item()
        for p in model.parameters()
        if p.grad is not None
    ]
    opt.step()
    opt.zero_grad()  # after the step: the norms are the update's gradients'
    (r,) = rec.step_end()
    rec.detach()
    names = [n for n, _ in model.named_parameters()]
    assert names_of(from_hex(r["grad_norms"]["params"]), names) == ["0.weight", "2.weight", "2.bias"]
    assert r["grad_norms"]["norms"] == pytest.approx(expected, rel=1e-6)


# -- inference and checking on synthetic traces ----------------------------------------------
PARAMS = ["a", "b", "c", "noise"]


def record(step, norms, *, phase="train"):
    """A training step whose optimizer.step left these gradient norms (None: no gradient)."""
    have = [i for i, x in enumerate(norms) if x is not None]
    return {
        "step": step,
        "phase": phase,
        "calls": [["optimizer.step", {}]],
        "metrics": {},
        "grad_norms": {"params": hex(sum(1 << i for i in have)), "norms": [norms[i] for i in have]},
    }


def trace(rows, source="t"):
    return Trace(
        header={"kind": "header", "params": PARAMS}, records=[record(s, n) for s, n in enumerate(rows)], source=source
    )


def reference(scale):
    """Gradients whose overall size changes 100x over the run: the shares do not."""
    return trace([[3.0 * k, 4.0 * k, 0.01 * k, 1e-9 * k] for k in (scale, scale / 10, scale / 100)])


def test_bounds_are_the_references_range_of_shares_widened_by_the_margin():
    (inv,) = infer_invariants([reference(1.0), reference(5.0)], InferConfig(relations=("GradShare",)))
    total = math.sqrt(9 + 16 + 0.0001)
    shares = inv.params["shares"]
    assert set(shares) == {"a", "b", "c"}  # 'noise' stays below MIN_SHARE: rounding, no flow
    assert shares["a"] == pytest.approx([3 / total / 10, 1.0])  # hi x 100 capped at 1
    assert shares["c"] == pytest.approx([0.01 / total / 10, 0.01 / total * 10 * PROGRESS])  # more room above
    assert inv.support == 6
    assert 1e-9 / total < MIN_SHARE < 0.01 / total


def test_nothing_is_learned_without_gradient_norms_or_support():
    cfg = InferConfig(relations=("GradShare",))
    bare = Trace(
        header={"params": PARAMS}, records=[{"step": 0, "phase": "train", "calls": [], "metrics": {}}], source="old"
    )
    assert infer_invariants([bare], cfg) == []
    step = [1.0, 2.0, 0.1, 0.0]
    assert infer_invariants([trace([step])], cfg) == []  # 1 step < min_support (3)
    assert infer_invariants([trace([step] * 3)], cfg) != []
    # A parameter that lacks a gradient in some reference step has a share of 0 there: no bound.
    (inv,) = infer_invariants([trace([step, [1.0, 2.0, None, 0.0], step])], cfg)
    assert set(inv.params["shares"]) == {"a", "b"}


def shares_invariant(persist=PERSIST):
    """As inferred: judged on training steps whose update was applied."""
    return Invariant(
        id=VERDICT,
        relation="GradShare",
        params={"shares": {"a": [0.1, 1.0], "c": [0.01, 0.2]}, "persist": persist},
        precondition=Precondition(phase="train", when=("optimizer.step",)),
    )


def test_a_share_out_of_bounds_is_reported_once_it_persists():
    ok, low = [3.0, 4.0, 0.5, 0.0], [3.0, 4.0, 1e-3, 0.0]  # c's share: 0.1, then 2e-4
    rows = [ok, low, low, ok, low, low, low, low, ok, [0.0, 0.0, 0.0, 0.0], low]
    events = check_trace(trace(rows), [shares_invariant()])
    assert [(e["step"], e["module"], e["evidence"]["since_step"], e["evidence"]["steps_out"]) for e in events] == [
        (6, "c", 4, 3),
        (7, "c", 4, 4),
    ]  # a streak of 2 is no violation
    assert events[0]["evidence"]["bounds"] == [0.01, 0.2]
    assert check_trace(trace(rows), [shares_invariant(persist=1)])[0]["step"] == 1
    # A record without gradients (a zero total, as at step 9) neither ends a streak nor extends it.
    tail = check_trace(trace([ok, low, low, [0.0, 0.0, 0.0, 0.0], low]), [shares_invariant()])
    assert [(e["step"], e["evidence"]["steps_out"]) for e in tail] == [(4, 3)]


def test_a_parameter_left_without_a_gradient_has_a_share_of_0_and_too_much_is_reported_too():
    rows = [[3.0, 4.0, None, 0.0]] * PERSIST + [[3.0, 4.0, 0.5, 0.0]] + [[0.1, 4.0, 3.9, 0.0]] * PERSIST
    events = check_trace(trace(rows), [shares_invariant()])
    total = math.sqrt(0.01 + 16 + 3.9**2)
    assert [(e["step"], e["module"], e["evidence"]["share"]) for e in events] == [
        (2, "c", 0.0),
        (6, "a", pytest.approx(0.1 / total)),
        (6, "c", pytest.approx(3.9 / total)),
    ]
    assert "too much gradient reaches it" in events[-1]["evidence"]["meaning"]


def test_evaluation_records_and_steps_without_an_update_are_not_judged():
    low = [3.0, 4.0, 1e-3, 0.0]
    rows = [record(s, low, phase="eval") for s in range(PERSIST)]
    rows += [{**record(s, low), "calls": []} for s in range(PERSIST)]  # the scaler skipped the step
    assert check_trace(Trace({"params": PARAMS}, rows, "t"), [shares_invariant()]) == []


def test_yaml_round_trip(tmp_path):
    path = save_invariants([shares_invariant()], tmp_path / "inv.yaml")
    assert [i.to_dict() for i in load_invariants(path)] == [shares_invariant().to_dict()]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"shares": {}}, "at least one parameter"),
        ({"shares": {"a": [0.5, 0.1]}}, "0 <= low <= high"),
        ({"shares": {"a": [-0.1, 0.1]}}, "0 <= low <= high"),
        ({"shares": {"a": [0.1]}}, "two numbers"),
        ({"shares": {"a": [0.1, 0.2]}, "persist": 0}, "persist=0 must be >= 1"),
        ({"shares": {"a": [0.1, 0.2]}, "margin": 10}, "unknown param"),
    ],
)
def test_invalid_entries_fail_with_a_clear_error(params, message):
    with pytest.raises(ValueError, match=message):
        parse_invariants([{"relation": "GradShare", "params": params}])


def test_a_parameter_the_model_does_not_have_fails_when_bound():
    bad = Invariant(id=VERDICT, relation="GradShare", params={"shares": {"blocks.0.fc3.weight": [0.1, 1.0]}})
    model = ResNet()
    with pytest.raises(ValueError, match=r"parameter 'blocks.0.fc3.weight' does not exist.*close matches"):
        InvariantChecker(model, torch.optim.SGD(model.parameters(), lr=0.1), [bad])
