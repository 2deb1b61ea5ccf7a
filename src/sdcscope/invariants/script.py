"""Trace a user's own training script, unchanged (what TraceCheck's ``collect`` does).

    python -m sdcscope.invariants.script --out runs/ref1 -- my_train.py ARGS
    (or: sdcscope invariants trace --out runs/ref1 -- python my_train.py ARGS)

``run_script`` runs the script in this process (``runpy``, as ``__main__``, with its own
``sys.argv``) with a :class:`ScriptTracer` installed, which needs nothing from the script:

- the **optimizer** is the first one constructed (``torch.optim.Optimizer.__init__`` is wrapped
  while the tracer is installed); the **model** is the module that holds the most of its
  parameters (the smallest such module, the outermost among equals: a wrapper whose forward is
  the one called), found among the live modules when the optimizer is built.  The recorder
  attaches there, before the first step;
- **learning-rate schedulers** and **GradScalers** built while it is installed are wrapped as
  if given to the recorder (``schedulers=``, ``scaler=``);
- **steps** are found by :class:`ScriptRecorder`: a step begins at the first training-mode
  forward of the model, ``zero_grad`` or backward after the previous ``optimizer.step`` (so
  gradient accumulation, a closure, clearing the gradients at the end of the step stay in one
  step), and a forward in eval mode after it closes the step (its forwards form an evaluation
  record; one between the ``zero_grad`` that opened a step and its backward, as when the
  gradients are cleared at the end of each iteration, sets the step aside meanwhile).  A
  trailing step that ran neither a backward nor an update is dropped.

The script logs no metrics through the recorder, so metric relations (``MetricBound``,
``MetricTrend``) learn nothing from such traces; everything judged on the calls (the loss a
backward starts from, the gradient norm, the learning rate, the effects) is there.  One
optimizer is traced: a second one (a GAN's) is left alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.common.script import InitWatch, followed_model, run_main
from sdcscope.invariants import probe
from sdcscope.invariants.recorder import TraceRecorder
from sdcscope.invariants.traceconfig import TraceConfig

log = logging.getLogger("sdcscope.invariants.script")


class ScriptRecorder(TraceRecorder):
    """A :class:`TraceRecorder` that finds the step boundaries itself (see the module doc)."""

    _stepped = False  # optimizer.step has returned in the open step
    _active = False  # the open step ran a backward or an update

    def add_scheduler(self, scheduler: Any) -> None:
        """Record a scheduler built after attaching, as if given as ``schedulers=``."""
        self.schedulers.append(scheduler)
        self._wrap(scheduler, "step", "lr_scheduler.step", self._drives(scheduler))

    def set_scaler(self, scaler: Any) -> None:
        """Record a GradScaler built after attaching, as if given as ``scaler=``."""
        if self.scaler is not None:
            return
        self.scaler = scaler
        self._wrap(scaler, "scale", "scaler.scale", self._scale_fields)
        for name in ("unscale_", "step", "update"):
            self._wrap(scaler, name, f"scaler.{name}")

    _held: dict[str, Any] | None = None  # the open step's record, set aside during an evaluation

    def _boundary(self, train: bool) -> None:
        self._resume()
        if self._in_step and self._stepped:
            self.step_end()
        if train and not self._in_step:
            self.step_begin()
            self._stepped = self._active = False

    def _evaluation(self) -> None:
        """An eval-mode forward: it closes a step that has updated; between the ``zero_grad`` that
        opened a step and its first backward (the gradients cleared at the end of the previous
        iteration), the step is set aside while the evaluation's record takes the calls."""
        if self._in_step and self._stepped:
            self.step_end()
        elif self._in_step and not self._active:
            self._held, self._rec, self._in_step = self._rec, None, False

    def _resume(self) -> None:
        if self._held is not None:
            self._close_between()  # the evaluation's record
            self._rec, self._in_step, self._held = self._held, True, None

    def _call(self, api: str, fields: dict[str, Any]) -> None:
        if api == "zero_grad" and not probe.running():
            self._boundary(train=True)
        super()._call(api, fields)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if not probe.running():
            if module.training:
                self._boundary(train=True)
            else:
                self._evaluation()
        super()._pre_forward(module, args)

    def on_backward_begin(self, root: torch.Tensor | None) -> None:
        self._boundary(train=True)
        self._active = True
        super().on_backward_begin(root)

    def _post_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        super()._post_step(opt, args, kwargs)
        self._stepped = self._active = True

    def detach(self) -> list[dict[str, Any]]:
        self._resume()
        if self._in_step and not self._active:
            self.abandon_step()
        return super().detach()


class ScriptTracer:
    """While installed, attaches a :class:`ScriptRecorder` to the first optimizer built."""

    def __init__(self, out: str | Path, config: TraceConfig | None = None) -> None:
        self.out, self.config = Path(out), config
        self.recorder: ScriptRecorder | None = None
        self._scaler: Any = None
        self._watch = InitWatch()

    def install(self) -> ScriptTracer:
        from torch.optim.lr_scheduler import LRScheduler

        self._watch.watch(torch.optim.Optimizer, self._on_optimizer)
        self._watch.watch(LRScheduler, self._on_scheduler)
        self._watch.watch(torch.amp.GradScaler, self._on_scaler)
        return self

    def uninstall(self) -> None:
        """Put the constructors back and detach the recorder (closing its last step)."""
        self._watch.uninstall()
        if self.recorder is not None:
            self.recorder.detach()

    def _on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        model = followed_model(optimizer, self.recorder is not None, "traced")
        if model is None:
            return
        self.recorder = ScriptRecorder(model, optimizer, out=self.out, scaler=self._scaler, config=self.config)
        self.recorder.attach()
        log.info("tracing %s with %s into %s", type(model).__name__, type(optimizer).__name__, self.out)

    def _on_scheduler(self, scheduler: Any) -> None:
        if self.recorder is not None:
            self.recorder.add_scheduler(scheduler)

    def _on_scaler(self, scaler: Any) -> None:
        if self.recorder is None:
            self._scaler = scaler
        else:
            self.recorder.set_scaler(scaler)


def run_script(argv: list[str], out: str | Path, config: TraceConfig | None = None) -> tuple[int, bool]:
    """Run ``argv`` (``script.py ARGS`` or ``-m module ARGS``) as ``__main__`` with a tracer
    installed; return its exit code and whether it built an optimizer to trace.  An exception
    of the script propagates, after the trace is closed."""
    tracer = ScriptTracer(out, config).install()
    try:
        code = run_main(argv)
    finally:
        tracer.uninstall()
    return code, tracer.recorder is not None


NO_OPTIMIZER = 3
"""Exit code of ``main`` when the script built no optimizer (nothing was traced)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdcscope.invariants.script", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="new run directory (gets trace.jsonl)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py ARGS, or -- -m module ARGS")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    logging.basicConfig(level=logging.WARNING, format="sdcscope: %(message)s")
    code, traced = run_script(command, args.out)
    if not traced:
        log.error("the script built no optimizer over a module's parameters: nothing was traced")
        return code or NO_OPTIMIZER
    return code


if __name__ == "__main__":
    sys.exit(main())
