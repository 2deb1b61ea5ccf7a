"""Inference keeps what holds in every clean reference; checking flags bugs with evidence."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.utils import clip_grad_norm_ as imported_clip_grad_norm_  # bound before any recorder

from helpers import DropoutMLP
from sdcscope.engine import read_jsonl
from sdcscope.invariants import (
    InferConfig,
    Invariant,
    InvariantChecker,
    Trace,
    TraceRecorder,
    check_trace,
    infer_invariants,
    load_invariants,
    load_trace,
    parse_invariants,
    save_invariants,
)

EVENT_KEYS = {"step", "detector", "verdict", "module", "rank", "evidence", "action"}


STYLES = {  # correct loops that differ from the references: how they clear, backward and clip
    "zero_grad_last": "optimizer.zero_grad() at the end of the step, after the scheduler",
    "grads_none_by_hand": "p.grad = None for every parameter instead of zero_grad()",
    "keep_tensors": "optimizer.zero_grad(set_to_none=False)",
    "model_zero_grad": "model.zero_grad() instead of optimizer.zero_grad()",
    "autograd_backward": "torch.autograd.backward(loss) instead of loss.backward()",
    "imported_clip": "a clip_grad_norm_ imported before the recorder attached",
    "no_clip": "gradient clipping turned off (the references clip)",
}


def mlp_run(attach, seed, bug=None, steps=12, lr=1e-2, style=None):
    """A plain loop with a scheduler, clipping and evaluation every 4 steps; ``bug`` breaks it,
    ``style`` (see STYLES) changes it without breaking it."""
    torch.manual_seed(seed)
    model = DropoutMLP()
    if bug == "frozen":
        model.fc1.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if bug == "stale_scheduler":  # the optimizer rebuilt after the scheduler was made
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tool = attach(model, opt, schedulers=[sched])
    clip = imported_clip_grad_norm_ if style == "imported_clip" else torch.nn.utils.clip_grad_norm_
    previous = None
    for step in range(steps):
        tool.step_begin(step)
        if style == "keep_tensors":
            opt.zero_grad(set_to_none=False)
        elif style == "model_zero_grad":
            model.zero_grad()
        elif style == "grads_none_by_hand":
            for p in model.parameters():
                p.grad = None
        elif bug not in ("no_zero_grad", "zero_grad_before_step") and style != "zero_grad_last":
            opt.zero_grad()
        x = previous if bug == "repeated_input" and step == 6 else torch.randn(6, 8)
        previous = x
        loss = model(x).pow(2).mean()
        if style == "autograd_backward":
            torch.autograd.backward(loss)
        else:
            (loss * 100 if bug == "scaled_loss" else loss).backward()
        if bug == "guarded" and step == 5:  # a guard's replay: the same step executed again
            opt.zero_grad()
            model(x).pow(2).mean().backward()
        if bug == "guarded" and step == 6:  # a guard's veto: no update, the step is discarded
            tool.abandon_step()
            continue
        if style != "no_clip" and (bug != "clip_late" or step >= 2) and (bug != "clip_dropped" or step < 6):
            clip(model.parameters(), 1.0)
        if bug == "zero_grad_before_step":
            opt.zero_grad()
        opt.step()
        if bug == "decay_by_hand":  # weight decay applied by hand as well as by AdamW
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 - 1e-2 * lr)
        sched.step()
        if style == "zero_grad_last":
            opt.zero_grad()
        tool.step_end()
        if step % 4 == 3:
            if bug != "no_eval_mode":
                model.eval()
            with torch.no_grad():
                tool.log_metrics(val=model(torch.randn(6, 8)).pow(2).mean())
            model.train()
    tool.detach()
    return tool


def recorder(out):
    return lambda model, opt, **kw: TraceRecorder(model, opt, out=out, **kw).attach()


def checker(invariants, **options):
    return lambda model, opt, **kw: InvariantChecker(model, opt, invariants, **kw, **options).attach()


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    for seed, lr in ((1, 1e-2), (2, 5e-3)):
        mlp_run(recorder(root / f"r{seed}"), seed, lr=lr)
    return [root / "r1", root / "r2"]


@pytest.fixture(scope="module")
def invariants(refs):
    return infer_invariants(refs)


def by_id(invariants):
    return {i.id: i for i in invariants}


def test_inference_covers_every_relation_with_preconditions(invariants):
    inv = by_id(invariants)
    assert inv["sequence.train"].params["apis"] == [
        "zero_grad",
        "backward",
        "clip_grad_norm_",
        "optimizer.step",
        "lr_scheduler.step",
    ]
    assert inv["contain.optimizer.step.update"].params["tensors"] == ["*"]
    assert inv["contain.optimizer.step.update"].precondition.when == ("optimizer.step",)
    assert inv["arg.train.clip_grad_norm_.params"].params["value"] == ["*"]
    assert inv["arg.train.forward.Dropout.training"].params["value"] is True
    assert inv["arg.eval.forward.Dropout.training"].params["value"] is False
    assert inv["arg.train.forward.input"].params["mode"] == "distinct"
    assert inv["arg.train.backward.loss"].params["mode"] == "range"
    assert inv["output.train.forward.out.dtype"].params["value"] == "float32"
    assert inv["metric.eval.val"].precondition.phase == "eval"
    # learning rates differ between the references, so no constant is inferred for them
    assert inv["arg.train.optimizer.step.lr"].params["mode"] == "range"
    assert inv["arg.train.optimizer.step.lr"].params["bounds"][0] == 0.0  # schedules may decay to 0
    assert not any(i.relation == "Consistent" for i in invariants)


def test_clean_run_of_another_seed_passes_online_and_offline(invariants, tmp_path):
    tool = mlp_run(checker(invariants), seed=7, lr=7e-3)
    assert tool.violations == []
    mlp_run(recorder(tmp_path), seed=7, lr=7e-3)
    assert check_trace(tmp_path, invariants) == []


@pytest.mark.parametrize(
    "bug, verdict, step, module",
    [
        ("no_zero_grad", "sequence.train", 1, "zero_grad"),  # step 0 looks like clearing by hand
        ("zero_grad_before_step", "sequence.train", 0, "zero_grad"),
        ("decay_by_hand", "exclusive.optimizer.step.write", 0, "fc1.weight"),
        ("stale_scheduler", "arg.train.lr_scheduler.step.drives_optimizer", 0, "lr_scheduler.step"),
        ("frozen", "contain.optimizer.step.update", 0, "fc1.weight"),
        ("scaled_loss", "arg.train.backward.loss", 0, "backward"),
        ("clip_late", "sequence.train", 2, "clip_grad_norm_"),  # clipping on or off is the run's choice:
        ("clip_dropped", "sequence.train", 6, "clip_grad_norm_"),  # on some steps only is a bug
        ("no_eval_mode", "arg.eval.forward.Dropout.training", 4, "drop"),
    ],
)
def test_bugs_are_reported_with_invariant_module_and_evidence(invariants, tmp_path, bug, verdict, step, module):
    tool = mlp_run(checker(invariants, run_dir=tmp_path), seed=7, bug=bug, lr=7e-3)
    hits = [e for e in tool.violations if e["verdict"] == verdict]
    assert hits and hits[0]["step"] == step and hits[0]["module"] == module
    assert set(hits[0]) == EVENT_KEYS and hits[0]["detector"] == "invariant"
    assert hits[0]["evidence"]["description"] == by_id(invariants)[verdict].description
    assert read_jsonl(tmp_path / "events.jsonl") == tool.violations


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_loop_that_clears_backs_up_or_clips_its_own_way_is_no_violation(invariants, style):
    assert mlp_run(checker(invariants), seed=7, lr=7e-3, style=style).violations == []


def test_how_zero_grad_is_called_is_not_learned(invariants):
    inv = by_id(invariants)
    assert not [i for i in inv if i.startswith("arg.train.zero_grad.")]
    assert inv["exclusive.optimizer.step.write"].params["tensors"] == ["*"]
    assert inv["arg.train.lr_scheduler.step.drives_optimizer"].params["value"] is True


def test_a_guards_replay_and_discarded_step_are_no_violation_a_repeated_input_is(invariants):
    assert mlp_run(checker(invariants), seed=7, bug="guarded", lr=7e-3).violations == []
    hits = mlp_run(checker(invariants), seed=7, bug="repeated_input", lr=7e-3).violations
    assert [(e["verdict"], e["step"], e["evidence"]["first_seen_step"]) for e in hits] == [
        ("arg.train.forward.input", 6, 5)
    ]


def test_missing_zero_grad_breaks_gradient_clearing_from_step_1(invariants):
    tool = mlp_run(checker(invariants, every_step=True), seed=7, bug="no_zero_grad", lr=7e-3)
    cleared = [e for e in tool.violations if e["verdict"] == "contain.step.cleared"]
    assert [e["step"] for e in cleared] == list(range(1, 12))
    assert cleared[0]["evidence"]["missing"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_offline_check_equals_online_check(invariants, tmp_path):
    online = mlp_run(checker(invariants, every_step=True), seed=8, bug="no_zero_grad", lr=7e-3).violations
    mlp_run(recorder(tmp_path), seed=8, bug="no_zero_grad", lr=7e-3)
    assert check_trace(tmp_path, invariants) == online


def test_warm_up_precondition_is_learned(tmp_path):
    runs = []
    for seed in (1, 2):
        mlp_run(recorder(tmp_path / str(seed)), seed, bug="clip_late")
        runs.append(tmp_path / str(seed))
    seq = by_id(infer_invariants(runs))["sequence.train"]
    assert seq.precondition.min_step == 2 and "clip_grad_norm_" in seq.params["apis"]
    assert mlp_run(checker([seq]), seed=3, bug="clip_late").violations == []


def amp_run(attach, seed, overflow_at=None, steps=10):
    torch.manual_seed(seed)
    model = DropoutMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    tool = attach(model, opt, scaler=scaler)
    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        scaler.scale(model(torch.randn(6, 8)).pow(2).mean()).backward()
        if step == overflow_at:
            model.fc1.weight.grad[0, 0] = float("inf")  # what an fp16 overflow looks like
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        tool.step_end()
    tool.detach()
    return tool


def test_a_step_the_grad_scaler_skips_is_not_a_violation(tmp_path):
    runs = []
    for seed in (1, 2):
        amp_run(recorder(tmp_path / str(seed)), seed)
        runs.append(tmp_path / str(seed))
    invariants = infer_invariants(runs)
    assert by_id(invariants)["sequence.train"].params["apis"][-3:] == ["scaler.step", "optimizer.step", "scaler.update"]
    assert amp_run(checker(invariants), seed=3, overflow_at=4).violations == []
    amp_run(recorder(tmp_path / "overflow"), seed=3, overflow_at=4)
    step4 = [c[0] for c in load_trace(tmp_path / "overflow").records[4]["calls"]]
    assert "scaler.step" in step4 and "optimizer.step" not in step4  # the scaler did skip it


class Pair(nn.Module):
    """Two replicas plus a constant buffer pair and a tied weight: only replicas are Consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.replicas = nn.ModuleList([DropoutMLP(), None])
        self.replicas[1] = copy.deepcopy(self.replicas[0])
        self.register_buffer("k1", torch.ones(3))
        self.register_buffer("k2", torch.ones(3))
        self.tied = self.replicas[0].fc2  # the same module under a second name

    def forward(self, xs):
        return [r(x) for r, x in zip(self.replicas, xs)]


def pair_run(attach, seed, flip_at=None, steps=8):
    torch.manual_seed(seed)
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tool = attach(model, opt)
    pairs = list(zip(model.replicas[0].parameters(), model.replicas[1].parameters()))
    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        sum(o.pow(2).mean() for o in model([torch.randn(4, 8), torch.randn(4, 8)])).backward()
        with torch.no_grad():
            for a, b in pairs:
                mean = (a.grad + b.grad) / 2
                a.grad.copy_(mean)
                b.grad.copy_(mean)
        opt.step()
        if step == flip_at:  # one bit of one element of replica 1: an SDC
            w = model.replicas[1].fc1.weight.data.view(-1).view(torch.int32)
            w[37] ^= 1
        tool.step_end()
    tool.detach()
    return tool


def test_consistent_pairs_replicas_by_name_and_catches_one_flipped_bit(tmp_path):
    runs = []
    for seed in (1, 2):
        pair_run(recorder(tmp_path / str(seed)), seed)
        runs.append(tmp_path / str(seed))
    consistent = [i for i in infer_invariants(runs) if i.relation == "Consistent"]
    assert [(i.params["a"], i.params["b"]) for i in consistent] == [("replicas.0.*", "replicas.1.*")]
    assert pair_run(checker(consistent), seed=5).violations == []
    (event,) = pair_run(checker(consistent), seed=5, flip_at=3).violations
    assert event["step"] == 3 and event["module"] == "replicas.1.fc1.weight"
    assert event["evidence"]["differing"] == [["replicas.0.fc1.weight", "replicas.1.fc1.weight"]]


def lm_windows(g, vocab, shift=1, n=8, length=16):
    """Token windows of a sequence that mostly follows t -> 3t+1 (mod vocab): inputs, and the
    targets ``shift`` tokens ahead (1: next-token prediction)."""
    seq = torch.randint(0, vocab, (n, 1), generator=g)
    for _ in range(length + 2):
        noise = torch.rand(n, 1, generator=g) < 0.1
        nxt = torch.where(noise, torch.randint(0, vocab, (n, 1), generator=g), (seq[:, -1:] * 3 + 1) % vocab)
        seq = torch.cat([seq, nxt], 1)
    return seq[:, :length], seq[:, shift : length + shift]


def lm_run(attach, seed, bug=None, steps=12, lr=2e-2, vocab=16):
    """A bigram language model, evaluated every 3 steps on fixed held-out windows; ``bug``
    breaks it: targets equal to the inputs, targets two tokens ahead, gradient ascent."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, 16), nn.Linear(16, vocab))
    opt = torch.optim.Adam(model.parameters(), lr=lr, maximize=bug == "ascent")
    tool = attach(model, opt)
    g, val = torch.Generator().manual_seed(seed), lm_windows(torch.Generator().manual_seed(99), vocab)

    def loss(x, y):
        return F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))

    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        x, y = lm_windows(g, vocab, shift=2 if bug == "shift_2" else 1)
        loss(x, x if bug == "targets_equal_inputs" else y).backward()
        opt.step()
        tool.step_end()
        if step % 3 == 2:
            model.eval()
            with torch.no_grad():
                tool.log_metrics(val_loss=loss(*val))
            model.train()
    tool.detach()
    return tool


@pytest.fixture(scope="module")
def lm_invariants(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    for seed, lr in ((1, 2e-2), (2, 1e-2)):
        lm_run(recorder(root / str(seed)), seed, lr=lr)
    return by_id(infer_invariants([root / "1", root / "2"]))


def test_targets_shifted_wrongly_and_gradient_ascent_are_reported(lm_invariants):
    assert lm_invariants["arg.train.forward.target_shift"].params["value"] == 1
    assert lm_invariants["trend.eval.val_loss"].params["direction"] == "down"
    invariants = list(lm_invariants.values())
    assert lm_run(checker(invariants), seed=7, lr=1.5e-2).violations == []
    for bug, shift in (("targets_equal_inputs", 0), ("shift_2", 2)):
        (e, *_) = lm_run(checker(invariants), seed=7, bug=bug, lr=1.5e-2).violations
        assert (e["verdict"], e["step"], e["evidence"]["observed"]) == ("arg.train.forward.target_shift", 0, shift)
    hits = [
        e
        for e in lm_run(checker(invariants), seed=7, bug="ascent", lr=1.5e-2).violations
        if e["verdict"] == "trend.eval.val_loss"
    ]
    assert hits[0]["step"] == 6 and hits[0]["evidence"]["value"] > hits[0]["evidence"]["first_value"]


def test_metric_counters_are_not_bounded_and_nonfinite_values_violate():
    header = {"kind": "header", "params": [], "watched": [], "shapes": [], "dtypes": []}

    def trace(losses):
        return Trace(
            header,
            [
                {
                    "step": s,
                    "phase": "train",
                    "calls": [["optimizer.step", {}]],
                    "metrics": {"tokens": 100.0 * s, "loss": v},
                }
                for s, v in enumerate(losses)
            ],
            "synthetic",
        )

    (bound,) = infer_invariants(
        [trace([3.0, 2.0, 2.5, 2.2]), trace([3.1, 2.4, 2.0])], InferConfig(relations=("MetricBound",))
    )
    assert bound.id == "metric.train.loss" and bound.params["bounds"] == pytest.approx([0.2, 31.0])
    assert bound.precondition.when == ("optimizer.step",)
    bad = trace([2.0, float("nan"), 500.0, float("inf")])
    bad.records[3]["calls"] = []  # a step the scaler skipped: its non-finite values are handled
    assert [e["step"] for e in check_trace(bad, [bound])] == [1, 2]


def test_yaml_round_trip(invariants, tmp_path):
    path = save_invariants(invariants, tmp_path / "inv.yaml", ["refs/a"])
    assert path.read_text().startswith("# sdcscope invariants")
    loaded = load_invariants(path)
    assert [i.to_dict() for i in loaded] == [i.to_dict() for i in invariants]


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"relation": "Consistant", "params": {"a": "x", "b": "y"}},
            "unknown relation 'Consistant'; allowed: .*Consistent.*did you mean 'Consistent'",
        ),
        ({"relation": "Consistent", "params": {"a": "x"}}, "missing param 'b'"),
        ({"relation": "MetricBound", "params": {"metric": "loss", "bounds": [1, 2]}, "when": 1}, "unknown key"),
        (
            {"relation": "APIArg", "params": {"api": "forward", "arg": "training", "mode": "distinct"}},
            "'distinct' applies to",
        ),
        (
            {"relation": "APISequence", "params": {"apis": ["zero_grad", "optimizer_step"]}},
            "did you mean 'optimizer.step'",
        ),
        (
            {"relation": "EventContain", "params": {"parent": "backward", "child": "update", "tensors": ["*"]}},
            "happens within 'optimizer.step'",
        ),
        (
            {
                "relation": "MetricBound",
                "params": {"metric": "loss", "bounds": [1, 2]},
                "precondition": {"phase": "test"},
            },
            "unknown precondition phase 'test'",
        ),
    ],
)
def test_invalid_entries_fail_with_a_clear_error(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_invariants([entry])


def test_names_that_match_nothing_fail_when_bound_to_a_model():
    model = DropoutMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = [
        Invariant(
            id="upd",
            relation="EventContain",
            params={"parent": "optimizer.step", "child": "update", "tensors": ["fc3.*"]},
        )
    ]
    with pytest.raises(
        ValueError,
        match=r"invariant 'upd': tensor pattern 'fc3.\*' matches no tensor"
        r".*close matches: .*fc1\.\*",
    ):
        InvariantChecker(model, opt, bad)
    bn = [
        Invariant(
            id="bn",
            relation="APIArg",
            params={"api": "forward", "arg": "BatchNorm1d.training", "mode": "constant", "value": True},
        )
    ]
    with pytest.raises(ValueError, match="has no BatchNorm1d module"):
        InvariantChecker(model, opt, bn)
    dup = parse_invariants(yaml.safe_load("[{id: a, relation: MetricBound, params: {metric: l, bounds: [0, 1]}}]"))
    with pytest.raises(ValueError, match="duplicate"):
        InvariantChecker(model, opt, dup + dup)
