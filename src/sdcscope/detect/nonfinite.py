"""Non-finite loss or gradients, decided before the optimizer step with one host sync.

The per-gradient max-abs (``torch._foreach_norm(grads, inf)``, one fused pass that cannot
overflow the way a sum of squares can) and the loss are stacked and reduced on device into one
``all finite`` flag; :meth:`NonFiniteDetector.check` reads it with a single ``.item()``. Only when
it is false does a second read name the offending parameters (the optimizer is gated on a
finiteness flag, as Megatron checks loss and grads before the DP reduce). In the guard
(``check(view)``, :mod:`sdcscope.detect.protocol`) even that sync is saved on a clean step: the
world's loss and global gradient norm, read once for every detector, are finite iff the loss and
every gradient are (or a norm overflowed), and only then does the detector look closer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sdcscope.common.tensors import dense_values
from sdcscope.common.validate import check_bool, check_positive
from sdcscope.detect.events import Event
from sdcscope.detect.protocol import CheckView, Registration, register


@dataclass(kw_only=True)
class NonFiniteConfig:
    check_loss: bool = True
    check_grads: bool = True
    max_listed: int = 8
    """How many offending parameter names an event lists."""

    def __post_init__(self) -> None:
        for name in ("check_loss", "check_grads"):
            check_bool(name, getattr(self, name))
        check_positive("max_listed", self.max_listed)


class NonFiniteDetector:
    """``check(step, loss)`` after backward (and before ``optimizer.step()``) -> events; the guard
    calls ``check(view)``."""

    name = "nonfinite"

    def __init__(self, model: nn.Module, config: NonFiniteConfig | None = None, *, rank: int | None = None) -> None:
        self.config = config or NonFiniteConfig()
        self.rank = rank
        self._named = list(model.named_parameters())  # those with a gradient, frozen at first or not

    def _maxabs(self) -> tuple[list[str], torch.Tensor | None]:
        named = [(n, p.grad) for n, p in self._named if p.grad is not None]
        if not named:
            return [], None
        dev = named[0][1].device
        norms = torch._foreach_norm(dense_values([g for _, g in named]), math.inf)
        return [n for n, _ in named], torch.stack([t.to(dev, torch.float32) for t in norms])

    def flag(self, loss: torch.Tensor | float | None = None) -> torch.Tensor | None:
        """Device bool tensor, True when loss and gradients are all finite (no host sync);
        usable with ``torch._assert_async`` or to gate a step without syncing."""
        parts = []
        if self.config.check_grads:
            _, maxabs = self._maxabs()
            if maxabs is not None:
                parts.append(torch.isfinite(maxabs).all())
        if self.config.check_loss and isinstance(loss, torch.Tensor):
            t = torch.isfinite(loss.detach()).all()
            parts.append(t.to(parts[0].device) if parts else t)
        if not parts:
            return None
        return torch.stack(parts).all()

    def check(self, step: int | CheckView, loss: torch.Tensor | float | None = None) -> list[Event]:
        """Events for a non-finite loss and for the parameters with non-finite gradients; one host
        sync on a clean step. ``check(view)``: the guard's protocol (:meth:`check_view`)."""
        if isinstance(step, CheckView):
            return self.check_view(step)
        cfg = self.config
        names, maxabs = self._maxabs() if cfg.check_grads else ([], None)
        loss_t = None
        if cfg.check_loss and loss is not None:
            loss_t = (
                loss.detach().float().reshape(-1)[:1] if isinstance(loss, torch.Tensor) else torch.tensor([float(loss)])
            )
        parts = [t for t in (loss_t, maxabs) if t is not None]
        if not parts:
            return []
        dev = parts[0].device
        flat = torch.cat([t.to(dev) for t in parts])
        if bool(torch.isfinite(flat).all()):  # the one sync on a clean step
            return []
        events = []
        values = flat.tolist()
        if loss_t is not None:
            lv = values.pop(0)
            if not math.isfinite(lv):
                events.append(
                    Event(step, self.name, "nonfinite", rank=self.rank, evidence={"what": "loss", "value": lv})
                )
        # nearest the output first (registration order reversed): gradients flow from the output
        # back, so a value that went non-finite in the backward pass leaves the layers after it
        # finite, and the last non-finite one in forward order is where it entered (when the loss
        # itself is non-finite every gradient is, and no layer can be named from them)
        bad = [(n, v) for n, v in zip(names, values) if not math.isfinite(v)][::-1]
        if bad:
            first = bad[0][0]
            events.append(
                Event(
                    step,
                    self.name,
                    "nonfinite",
                    module=first.rpartition(".")[0] or first,
                    rank=self.rank,
                    evidence={
                        "what": "grad",
                        "count": len(bad),
                        "of": len(names),
                        "params": [n for n, _ in bad[: cfg.max_listed]],
                        "values": [v for _, v in bad[: cfg.max_listed]],
                    },
                )
            )
        return events

    def check_view(self, view: CheckView) -> list[Event]:
        """The guard's check: a closer look only when the view's world values are non-finite (or
        on a replay's re-check, which has none); finite gradients whose norm overflowed its dtype
        are reported too when this rank can name them (:attr:`CheckView.own_overflow`)."""
        if view.replay:
            return self.check(view.step, view.loss)
        bad_loss = view.loss_value is not None and not math.isfinite(view.loss_value)
        bad_grad = view.grad_norm is not None and not math.isfinite(view.grad_norm)
        if not (bad_loss or bad_grad):
            return []
        found = self.check(view.step, view.loss)
        if bad_grad and view.own_overflow and not any(e.evidence.get("what") == "grad" for e in found):
            found.append(self._overflow(view))
        return found

    def _overflow(self, view: CheckView) -> Event:
        """Every gradient element is finite, but a gradient's norm overflowed (its square is not
        finite): the event names those parameters, nearest the output first."""
        sq = view.grad_sq
        over = [] if sq is None else [n for n, v in zip(view.grad_names, sq.tolist()) if not math.isfinite(v)]
        return Event(
            view.step,
            self.name,
            "nonfinite",
            module=over[-1].rpartition(".")[0] or None if over else None,
            rank=self.rank,
            evidence={
                **({"params": over[-self.config.max_listed :][::-1]} if over else {}),
                "what": "grad_norm",
                "value": view.grad_norm,
                "note": "finite gradients whose norm overflows",
            },
        )


register(
    Registration(
        "nonfinite",
        NonFiniteConfig,
        lambda model, optimizer, config, rank: NonFiniteDetector(model, config, rank=rank),
        world_values=True,
        recheck=True,
    )
)
