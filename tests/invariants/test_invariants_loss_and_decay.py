"""Silent bugs written after the invariants were designed, on a small classifier loop: the loss at
the first step (micro-batch losses added up, not averaged), the training loss trend (labels that
do not belong to their inputs), which parameters get weight decay (LayerNorms put in the decay
group); and correct loops written differently (a closure, one backward over the summed losses,
another accumulation, a resumed run, another GradScaler scale) that must raise nothing."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.invariants import InvariantChecker, TraceRecorder, infer_invariants

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "silent_bugs" / "scenarios.py"
ACCUM = 2
TEACHER = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def groups(model: nn.Module, bug: str | None) -> list[dict]:
    """Matrices decay; biases and the LayerNorm do not (nanoGPT's rule)."""
    named = list(model.named_parameters())
    if bug == "decay_on_norms":  # a filter meant to exclude biases and norms excludes biases only
        decay = [p for n, p in named if not n.endswith("bias")]
    elif bug == "one_group":  # every parameter in one group: the norms and biases decay too
        return [{"params": [p for _, p in named], "weight_decay": 0.1}]
    else:
        decay = [p for _, p in named if p.dim() >= 2]
    ids = {id(p) for p in decay}
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": [p for _, p in named if id(p) not in ids], "weight_decay": 0.0},
    ]


def run(
    attach, seed, bug=None, *, steps=16, lr=2e-2, accum=ACCUM, style="plain", start=0, scale=None, load=None, save=None
):
    """A classifier trained on a fixed teacher's labels, ``accum`` micro-batches per step;
    ``style``: ``plain``, ``closure`` (optimizer.step(closure)) or ``one_backward`` (one
    backward over the summed micro-batch losses); ``scale``: a GradScaler's initial scale;
    ``load``: a checkpoint (``{"model": ..., "optimizer": ...}``, either may be left out) loaded
    before training, as a resumed run in a new process does; ``save``: a dict that gets the
    run's checkpoint when it ends."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(groups(model, bug), lr=lr)
    if load:
        if "model" in load:
            model.load_state_dict(load["model"])
        if "optimizer" in load:
            opt.load_state_dict(load["optimizer"])
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
    tool = attach(model, opt, scaler=scaler)
    g = torch.Generator().manual_seed(seed)
    for step in range(start, start + steps):
        tool.step_begin(step)

        def compute():
            opt.zero_grad()
            total, loss = 0.0, None
            for _ in range(accum):
                x = torch.randn(32, 8, generator=g)
                y = (x @ TEACHER).argmax(-1)
                if bug == "labels_misaligned":  # labels shuffled apart from their inputs
                    y = y[torch.randperm(len(y), generator=g)]
                loss = F.cross_entropy(model(x), y)
                if bug != "not_averaged":
                    loss = loss / accum
                total = total + loss
                if style == "plain" and bug != "last_micro_only":
                    (loss if scaler is None else scaler.scale(loss)).backward()
            if style in ("closure", "one_backward"):
                total.backward()
            elif bug == "last_micro_only":  # backward moved out of the loop: one micro-batch counts
                loss.backward()
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return total

        if style == "closure":
            opt.step(compute)
        elif scaler is not None:
            compute()
            scaler.step(opt)
            scaler.update()
        else:
            compute()
            opt.step()
        tool.step_end()
    tool.detach()
    if save is not None:
        save.update(model=copy.deepcopy(model.state_dict()), optimizer=copy.deepcopy(opt.state_dict()))
    return tool


def _record(root):
    return lambda m, o, **kw: TraceRecorder(m, o, out=root, **kw).attach()


@pytest.fixture(scope="module")
def invariants(tmp_path_factory):
    root = tmp_path_factory.mktemp("unseen")
    for seed, lr in ((1, 2e-2), (2, 1e-2)):
        run(_record(root / str(seed)), seed, lr=lr)
    return infer_invariants([root / "1", root / "2"])


def check(invariants, bug=None, seed=7, **options):
    tool = run(lambda m, o, **kw: InvariantChecker(m, o, invariants, **kw).attach(), seed, bug, lr=1.5e-2, **options)
    return tool.violations


def test_initial_loss_trend_and_decay_relations_are_learned(invariants):
    by_id = {i.id: i for i in invariants}
    initial = by_id["loss.train.initial"]
    assert initial.params["step"] == 0 and initial.support == 2
    lo, hi = initial.params["bounds"]
    assert lo < 1.39 < hi and hi / lo < 1.5**2 * 1.2  # ln 4 at init, within a factor 1.5
    trend = by_id["trend.train.loss"].params
    assert (trend["start"], trend["window"], trend["from_step"]) == (0, 4, 0)
    assert 0.8 < trend["max_ratio"] < 0.95  # half the slowest reference's improvement
    assert by_id["arg.train.optimizer.step.decayed"].params["value"] == ["fc1.weight", "fc2.weight"]
    assert by_id["count.train.backward.per.forward"].description.startswith("backward runs at most 1")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"accum": 1},
        {"accum": 3},
        {"style": "closure"},
        {"style": "one_backward"},
    ],
    ids=["twin", "accum_1", "accum_3", "closure", "one_backward"],
)
@pytest.mark.parametrize("seed", [7, 8, 9])
def test_correct_loops_written_differently_raise_nothing(invariants, options, seed):
    assert check(invariants, seed=seed, **options) == []


@pytest.mark.parametrize(
    "bug, verdict, step",
    [
        ("not_averaged", "loss.train.initial", 0),
        ("last_micro_only", "loss.train.initial", 0),
        ("labels_misaligned", "trend.train.loss", 7),
        ("decay_on_norms", "arg.train.optimizer.step.decayed", 0),
        ("one_group", "arg.train.optimizer.step.decayed", 0),
    ],
)
@pytest.mark.parametrize("seed", [7, 8, 9])
def test_loss_label_and_decay_bugs_are_reported(invariants, bug, verdict, step, seed):
    hits = check(invariants, bug, seed=seed)
    assert [e["verdict"] for e in hits] == [verdict], hits
    assert hits[0]["step"] == step


def test_evidence_names_the_loss_and_the_parameters(invariants):
    (initial,) = check(invariants, "not_averaged")
    assert initial["module"] == "loss"
    assert initial["evidence"]["step_loss"] > initial["evidence"]["bounds"][1]
    (norms,) = check(invariants, "decay_on_norms")
    assert norms["module"] == "norm.weight" and norms["evidence"]["extra"] == ["norm.weight"]
    (alike,) = check(invariants, "one_group")
    assert alike["evidence"]["observed"] == "every parameter treated alike"
    (trend,) = check(invariants, "labels_misaligned")
    assert trend["evidence"]["ratio"] >= trend["evidence"]["max_ratio"]


def test_a_resumed_run_is_not_judged_on_its_first_loss_but_on_its_trend(invariants):
    # Started at step 5 (from a checkpoint, say): its first loss is no initial loss; its trend is
    # judged against where the references' training started, which a loss added up over the
    # micro-batches (2x) of an untrained model never gets below.
    hits = check(invariants, "not_averaged", start=5)
    assert [(e["verdict"], e["evidence"]["resumed"]) for e in hits if e["module"] == "loss"] == [
        ("trend.train.loss", True)
    ]


def test_closure_calls_are_recorded_before_the_step_they_run_in():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = TraceRecorder(model, opt).attach()
    rec.step_begin(0)

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    (r,) = rec.step_end()
    rec.detach()
    assert [c[0] for c in r["calls"]] == ["zero_grad", "forward", "backward", "optimizer.step"]
    assert "decayed" not in r["calls"][-1][1]  # every parameter decays alike: nothing to record


def test_the_initial_loss_is_the_unscaled_one_under_a_grad_scaler(tmp_path):
    for seed, lr in ((1, 2e-2), (2, 1e-2)):
        run(_record(tmp_path / str(seed)), seed, lr=lr, steps=8, scale=2.0**12)
    invs = infer_invariants([tmp_path / "1", tmp_path / "2"])
    assert "loss.train.initial" in {i.id for i in invs}
    hits = check(invs, steps=8, scale=2.0**8)  # another initial scale is no violation
    assert not [e for e in hits if e["verdict"] in ("loss.train.initial", "trend.train.loss")]


def test_the_benchmark_holds_these_bugs_and_their_correct_variants():
    spec = importlib.util.spec_from_file_location("silent_bugs_scenarios_unseen", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    names = {b.name for b in module.BUGS}
    assert {
        "accum_loss_not_averaged",
        "labels_misaligned",
        "decay_on_norms",
        "residual_detached",
        "no_causal_mask",
        "softmax_before_loss",
    } <= names and len(names) == len(module.BUGS) == 30
    assert {"closure_step", "accum_one_backward", "ce_module_inference_mode"} <= {v.name for v in module.VARIANTS}


@pytest.fixture(scope="module")
def checkpoint():
    """A clean run of 16 steps trained to its plateau, as a checkpoint a new process resumes."""
    state: dict = {}
    run(lambda m, o, **kw: TraceRecorder(m, o, **kw).attach(), 7, lr=1.5e-2, save=state)
    return state


@pytest.mark.parametrize("start", [0, 16], ids=["steps_from_0", "steps_continued"])
def test_a_correct_resume_in_a_new_process_is_no_violation(invariants, checkpoint, start):
    # The new process may count its steps from 0 again: the optimizer's state marks the resume.
    hits = check(invariants, seed=8, start=start, load=checkpoint)
    assert hits == [], hits


@pytest.mark.parametrize(
    "bug, load",
    [("labels_misaligned", ("model", "optimizer")), (None, ("optimizer",))],
    ids=["labels_misaligned_after_resume", "weights_not_restored"],
)
def test_a_resumed_run_back_where_training_starts_is_still_reported(invariants, checkpoint, bug, load):
    # Judged against where the references' training started, once the run made the progress
    # the slowest reference needed since the resume.
    hits = check(invariants, bug, seed=8, load={k: checkpoint[k] for k in load})
    trend = [e for e in hits if e["verdict"] == "trend.train.loss"]
    assert trend and trend[0]["evidence"]["resumed"], hits
    assert trend[0]["evidence"]["recent_mean"] >= trend[0]["evidence"]["first_mean"] * trend[0]["evidence"]["max_ratio"]
