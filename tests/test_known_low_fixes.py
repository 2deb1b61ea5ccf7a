"""Regression tests of three low-severity defects.

1. The injector's records and ABFT's events number the calls of a shared module alike: ``call``
   is the 0-based index of the module's forward call within the micro-batch, and the backward
   products (dX, dW) of forward call i are call i (the injector counted backward calls in
   backward order, ABFT counted from 1 over all micro-batches of a step).
2. ``train --resume`` with an edited fault file names the first differing field and both values.
3. An empty path option (``--out ""``, which Typer reads as ``.``) is refused before any work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.detect import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector


# ------------------------------------------------------------------ 1. call numbering
class Shared(nn.Module):
    """One Linear called twice per forward; ``between`` runs between the two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.between = None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.between is not None:
            self.between()
        return self.lin(h)


def _spec(site, kind="transient", micro_batch=0):
    schedule = {"kind": "transient", "step": 0, "micro_batch": micro_batch} if kind == "transient" \
        else {"kind": "permanent", "start": 0}
    return FaultSpec.from_dict({"site": site, "target": "lin", "model": "bitflip", "bits": [31],
                                "pattern": {"kind": "element", "index": 3}, "schedule": schedule})


def _run(spec, *, micro=1, second_only=False):
    """(injector records, ABFT events) as {(micro_batch, call)}, after one step of ``micro``
    micro-batches; ``second_only``: the injector is armed only from the module's second call on."""
    torch.manual_seed(0)
    model = Shared()
    xs = torch.randn(micro, 4, 6, requires_grad=True)   # dX of the first call exists
    inj = Injector(model, [spec]).attach()
    det = ABFTDetector(model, ABFTConfig(checksums="both")).attach()   # after the injector
    det.begin_step(0)
    for mb in range(micro):
        inj.set_position(0, mb)
        if second_only:
            inj.armed = False
            model.between = lambda: setattr(inj, "armed", True)
        model(xs[mb]).square().sum().backward()
    events = det.check(0)
    inj.close()
    gemm = {"gemm.forward": "forward"}.get(spec.site, spec.site[5:])
    assert events and all(e.module == "lin" and e.gemm == gemm for e in events), events
    return ({(r["micro_batch"], r["call"]) for r in inj.records},
            {(e.evidence["micro_batch"], e.evidence["call"]) for e in events})


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_input", "gemm.grad_weight"])
def test_injector_and_abft_number_a_shared_modules_calls_alike(site):
    # a transient fault acts once: on the first forward call, or on the first backward call --
    # the gradient of the second forward call
    first = 0 if site == "gemm.forward" else 1
    records, events = _run(_spec(site))
    assert records == events == {(0, first)}
    # every call: numbered by its forward call, whatever order the backward runs them in
    records, events = _run(_spec(site, "permanent"))
    assert records == events == {(0, 0), (0, 1)}


def test_the_second_forward_call_is_call_1_for_both():
    records, events = _run(_spec("gemm.forward"), second_only=True)
    assert records == events == {(0, 1)}


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_weight"])
def test_calls_are_counted_within_each_micro_batch(site):
    """ABFT counted calls from 1 over every micro-batch since the last check (call 4 here)."""
    first = 0 if site == "gemm.forward" else 1
    records, events = _run(_spec(site, micro_batch=1), micro=2)
    assert records == events == {(1, first)}
    records, events = _run(_spec(site, "permanent"), micro=2)
    assert records == events == {(0, 0), (0, 1), (1, 0), (1, 1)}


# ------------------------------------------------------------------ CLI
runner = CliRunner()

FAULT = """\
- site: weight
  target: blocks.0.attn.q_proj
  model: stuck_at_1
  bits: [29]
  pattern: {kind: element, index: 3}
  schedule: {kind: permanent, start: 0}
  seed: 1
"""


def _invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


def _files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_with_an_edited_fault_file_names_the_first_differing_field(tmp_path):
    spec = tmp_path / "fault.yaml"
    spec.write_text(FAULT)
    code, text = _invoke("train", "--steps", 1, "--faults", spec, "--out", tmp_path / "run")
    assert code == 0, text
    before = _files(tmp_path / "run")
    spec.write_text(FAULT.replace("bits: [29]", "bits: [30]"))
    code, text = _invoke("train", "--resume", tmp_path / "run", "--steps", 2, "--faults", spec)
    assert code == 2 and "Traceback" not in text, text
    assert "faults[0].bits[0] is 30 in the file, 29 in the run" in text, text
    assert "drop --faults" in text    # the whole message, on one line
    spec.write_text(FAULT.replace("index: 3", "index: 4") + FAULT.replace("bits: [29]", "bits: [28]"))
    _, text = _invoke("train", "--resume", tmp_path / "run", "--steps", 2, "--faults", spec)
    assert "faults[0].pattern.index is 4 in the file, 3 in the run" in text, text
    spec.write_text(FAULT + FAULT.replace("bits: [29]", "bits: [28]"))
    _, text = _invoke("train", "--resume", tmp_path / "run", "--steps", 2, "--faults", spec)
    assert 'faults[1] is {"site": "weight", ' in text and "…" in text and "(absent) in the run" in text, text
    assert _files(tmp_path / "run") == before


@pytest.mark.parametrize("flag, args", [
    ("--out", ["train", "--steps", 0, "--out", ""]),
    ("--out", ["train", "--steps", 0, "-o", " "]),
    ("--out", ["train", "--steps", 0, "--out=", "--faults", "f.yaml"]),
    ("--faults", ["train", "--steps", 0, "--out", "x", "--faults", ""]),
    ("--resume", ["train", "--steps", 0, "--resume", ""]),
    ("--out", ["inject", "--steps", 1, "--spec", "f.yaml", "--out", ""]),
    ("--out", ["demo", "--steps", 2, "--out", ""]),
    ("--out", ["invariants", "trace", "--steps", 0, "--out", ""]),
    ("directory", ["campaign", "init", "", "--spec", "c.yaml"]),
])
def test_an_empty_path_option_is_refused_before_any_work(tmp_path, monkeypatch, flag, args):
    """Typer reads ``--out ""`` as ``.``: the run went into the working directory."""
    monkeypatch.chdir(tmp_path)
    code, text = _invoke(*args)
    assert code == 2, text
    assert f"Invalid value for '{flag}'" in text and "is not a path" in text and "Traceback" not in text, text
    assert list(tmp_path.iterdir()) == []


# -- configs from any mapping (an OmegaConf/Hydra config, a MappingProxyType), nested too ---------
def test_guard_config_from_read_only_mappings():
    from types import MappingProxyType as RO

    from sdcscope.guard import GuardConfig

    cfg = GuardConfig.from_dict(RO({
        "abft": RO({"c": 6.0, "kinds": ["linear"]}),
        "policy": RO({"rules": RO({"abft:transient": ["veto"]})}),
        "ranks": RO({"ledger": RO({})}),
    }))
    assert cfg.abft.c == 6.0 and cfg.abft.kinds == ("linear",)
    assert cfg.policy.actions_for("abft", "transient") == ["veto"]
    with pytest.raises(ValueError, match="unknown abft key 'cc'"):
        GuardConfig.from_dict(RO({"abft": RO({"cc": 6.0})}))


# -- a GEMM with no work (an MoE expert routed no token) takes no fault ----------------------------
@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_input", "gemm.grad_weight", "activation"])
def test_an_empty_call_takes_no_fault_and_a_transient_waits_for_work(site):
    torch.manual_seed(0)
    expert = nn.Linear(4, 4)
    net = nn.ModuleDict({"expert": expert})
    spec = FaultSpec.from_dict({"site": site, "target": "expert", "model": "bitflip", "bits": [30], "seed": 1,
                                "schedule": {"kind": "transient", "step": 0}})
    inj = Injector(net, [spec]).attach()
    inj.set_position(0)
    x = torch.randn(3, 4, requires_grad=True)
    (expert(x[:0]).sum() + expert(x).square().sum()).backward()   # the first call gets no token
    (rec,) = inj.records
    assert rec["call"] == 1 and rec["count"] == 1
    inj.set_position(1)
    expert(x[:0]).sum().backward()
    assert len(inj.records) == 1
