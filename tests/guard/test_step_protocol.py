"""The guard's step protocol exists once: every driver runs the one StepSession, nobody else reaches
into the Guard's privates, and a finding's event is written after its action, saying what was done."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.guard import Guard, GuardConfig, StepSession

SRC = Path(__file__).resolve().parents[2] / "src" / "sdcscope"


def test_no_code_outside_the_guard_touches_a_guard_private():
    """An attribute ``_name`` read off anything called guard (``guard._x``, ``self.guard._x``,
    ``g._x`` where ``g = ...guard``) outside ``sdcscope/guard`` is a second copy of the protocol."""
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "guard" and path.parent.parent == SRC:
            continue
        tree = ast.parse(path.read_text())
        aliases = {"guard", "_guard"}
        for node in ast.walk(tree):  # g = self.guard / g = guard
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = node.value
                name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", None)
                if name in aliases:
                    aliases.add(node.targets[0].id)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name in aliases:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
    assert not found, "Guard privates used outside sdcscope.guard:\n" + "\n".join(found)


def _model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return model, (x, y)


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_the_plain_loop_drives_the_one_session(monkeypatch):
    calls = []
    for name in ("begin", "check", "before_update", "update", "end"):
        original = getattr(StepSession, name)

        def spy(self, *a, _name=name, _original=original, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(StepSession, name, spy)
    model, batch = _model_and_batch()
    guard = Guard(model, torch.optim.SGD(model.parameters(), 0.1), GuardConfig(), loss_fn=_loss).attach()
    with guard.step(0, batch):
        loss = _loss(model, batch)
        loss.backward()
    assert guard.optimizer_step(loss)
    assert calls == ["begin", "check", "before_update", "update", "end"]


def test_a_rollback_event_is_written_after_the_rollback_and_names_its_target():
    model, batch = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    seen = []
    guard = Guard(model, opt, GuardConfig(), loss_fn=_loss, on_event=lambda r: seen.append((r, guard.rolled_back_to)))
    guard.attach()
    for step in range(2):
        with guard.step(step, batch):
            loss = _loss(model, batch)
            loss.backward()
        guard.optimizer_step(loss)
        opt.zero_grad()
    with torch.no_grad():  # memory corruption between steps: the state checksum finds it
        model[0].weight.view(-1).view(torch.int32)[3] ^= 1 << 30
    with guard.step(2, batch):
        loss = _loss(model, batch)
        loss.backward()
    assert not guard.optimizer_step(loss)
    ((record, rolled_back_to),) = seen
    assert record["detector"] == "state_checksum" and record["action"] == "rollback"
    assert rolled_back_to is not None  # the rollback had happened when the event was written
    assert record["evidence"]["rolled_back_to"] == rolled_back_to
