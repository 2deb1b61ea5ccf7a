"""The guard and the fault injector attached to a user's training script, unchanged.

    python -m sdcscope.integrations.script --out runs/g [--guard-config F] -- train.py ARGS
    python -m sdcscope.integrations.script --out runs/f --spec F [--guard] -- train.py ARGS
    (or: sdcscope guard --out runs/g -- python train.py ARGS; sdcscope inject --spec F --out runs/f
    -- python train.py ARGS; either with -- torchrun OPTS train.py ARGS)

The script runs as ``__main__`` (:func:`~sdcscope.common.script.run_main`, the bootstrap of
``sdcscope invariants trace``) with a :class:`ScriptAttach` installed, which needs nothing from it:

- **optimizer and model**: the first ``torch.optim.Optimizer`` the script builds (its constructor
  is watched); its model is :func:`~sdcscope.common.script.find_model`'s: the live module holding
  the most of its parameters. A forward pre-hook goes on that module at once; at its first
  training forward a wrapper built around it since (``DistributedDataParallel``) is looked for
  (:func:`~sdcscope.common.script.outermost`) and the guard and the injector are built on it.
  A second optimizer (a GAN's) is left alone;
- **steps**: a step begins at the first training-mode forward (``module.training`` with
  gradients enabled) of the model after the previous ``optimizer.step()``; each further one is the
  next micro-batch (gradient accumulation); a forward in eval mode or under ``no_grad`` is an
  evaluation (the injector's permanent faults only). The step's loss is the sum of the scalars
  ``backward`` was called on (``torch.autograd.backward``, seen through
  :mod:`sdcscope.invariants.apis`);
- **the guard's protocol**: ``begin`` at the step's first forward; the checks and the decision
  (:meth:`StepSession.decide <sdcscope.guard.session.StepSession.decide>`, through
  :class:`~sdcscope.integrations.GuardSession`) in a global optimizer step pre-hook
  (``register_optimizer_step_pre_hook``), the update's metrics and the end in the post-hook.

Limits, stated plainly: the step is not re-callable from outside the script (its data and loss
function are the script's), so there is **no replay**: a finding's verdict is ``unverified`` and
the default policy vetoes the step (a rollback restores the guard's snapshot). A vetoed step's
gradients are cleared before ``optimizer.step()`` runs, so torch's optimizers (which skip a
parameter without a gradient) change nothing; an LR scheduler the script steps still advances.
The script's own gradient clipping runs before the checks (they see clipped gradients). With a
``GradScaler`` the loss is not judged (backward starts from the scaled loss), and the steps it
skips never reach the hooks: each joins the next step. The injector learns no accumulation count:
a ``param_grad`` fault acts after the step's first micro-batch. When the guard stops
training (a stall, a persistent fault), the script is ended with exit code 4.

Run directory: ``OUT`` gets config.json, events.jsonl, metrics.jsonl, injections.jsonl and
summary.json. Under DDP (torchrun) the files are those of the explicit API: rank 0 writes the
world's events, rank r its ``metrics.rank{r}.jsonl``, ``injections.rank{r}.jsonl`` (merged into
``injections.jsonl`` by the ``sdcscope`` command when the launcher ends) and ``summary.rank{r}.json``.
Processes of a launcher that train independently (no DDP) each write ``OUT/rank{r}/``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from sdcscope.common.exitcodes import ExitCode
from sdcscope.common.io import write_json
from sdcscope.common.script import InitWatch, check_argv, followed_model, outermost, run_main
from sdcscope.common.world import world_of
from sdcscope.engine.state import param_sha256
from sdcscope.faults import FaultSpec, load_specs
from sdcscope.guard import GuardConfig
from sdcscope.guard.guard import check_optimizer
from sdcscope.inject import Injector
from sdcscope.integrations import GuardSession, open_guard
from sdcscope.integrations.injection import injections_file
from sdcscope.invariants import apis

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


class AttachError(ValueError):
    """A fault spec or guard setting that does not fit the script's model, found when it is built."""


class ScriptAttach:
    """While installed, attaches a guard (``guard``) and/or an injector (``specs``) to the first
    optimizer the script builds and its model; see the module doc. ``out``: the run directory."""

    def __init__(self, out: str | Path, guard: GuardConfig | None = None, specs: list[FaultSpec] = ()) -> None:
        if guard is not None and not isinstance(guard, GuardConfig):
            raise TypeError(f"guard must be a GuardConfig or None, got {type(guard).__name__}")
        self.out, self.guard_config, self.specs = Path(out), guard, list(specs)
        for i, spec in enumerate(self.specs):
            if not isinstance(spec, FaultSpec):
                raise TypeError(f"fault spec #{i} must be a FaultSpec (sdcscope.faults.load_specs), got {spec!r}")
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: torch.nn.Module | None = None
        self.session: GuardSession | None = None
        self.injector: Injector | None = None
        self.run_dir: Path | None = None
        self.step = 0  # optimizer steps taken (the number of the open step)
        self.loss: float | None = None  # the last step's
        self._open, self._micro, self._built, self._unseen = False, 0, False, False
        self._scaled = False  # the script built a GradScaler
        self._losses: list[torch.Tensor] = []
        self._lrs: list[Any] | None = None
        self._watch = InitWatch()
        self._handles: list[Any] = []  # the model's forward pre-hook
        self._global: list[Any] = []  # the global optimizer step hooks
        self._lead, self._suffix = True, ""
        self._started = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def install(self) -> ScriptAttach:
        """Watch the optimizers the script builds; :meth:`hook` the steps."""
        self._watch.watch(torch.optim.Optimizer, self._on_optimizer)
        self._watch.watch(torch.amp.GradScaler, self._on_scaler)
        return self.hook()

    def hook(self) -> ScriptAttach:
        """The global hooks on: optimizer step pre/post hooks, the backward wrapper (the losses)."""
        if not self._global:
            self._global = [
                register_optimizer_step_pre_hook(self._pre_step),
                register_optimizer_step_post_hook(self._post_step),
            ]
            apis.install(self)
        return self

    def unhook(self) -> None:
        """The global hooks off (the model's forward hook stays: it acts on that model alone)."""
        for h in self._global:
            h.remove()
        if self._global:
            apis.uninstall(self)
        self._global = []

    def uninstall(self, code: int | None = None) -> None:
        """Remove every hook, close the guard and the injector, write summary.json."""
        self._watch.uninstall()
        self.unhook()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.injector is not None:
            self.injector.close()
        if self.session is not None:
            self.session.guard.close()
        if self._built:
            self._write_summary(code)

    # -- what the script builds --------------------------------------------------------------
    def _on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        model = followed_model(optimizer, self.optimizer is not None, "attached")
        if model is None:
            return
        if self.guard_config is not None:
            try:
                check_optimizer(optimizer)
            except ValueError as exc:
                log.error("%s: nothing attached", exc)
                return
        self.optimizer, self.model = optimizer, model
        self._handles.append(model.register_forward_pre_hook(self._pre_forward))
        log.info("attached to %s with %s", type(model).__name__, type(optimizer).__name__)

    def _on_scaler(self, scaler: Any) -> None:
        log.info("a GradScaler: the losses backward starts from are scaled, the guard does not judge them")
        self._scaled = True

    def _build(self) -> None:
        """At the first training forward: the guard and the injector on the model as it is now."""
        self._built = True
        model = outermost(self.model)  # a DDP wrapper built since the optimizer
        world = world_of(model)
        inner = world.ddp.module if world.ddp is not None else model
        env_rank, env_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        rank, size = (world.rank, world.size) if world.distributed else (env_rank, env_size)
        self.run_dir = self.out if world.distributed or size == 1 else self.out / f"rank{rank}"
        self._lead = rank == 0 or not world.distributed
        self._suffix = f".rank{rank}" if world.distributed and rank else ""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.specs:
                log_file = injections_file(self.run_dir, rank, size if world.distributed else 1)
                log_file.touch()
                self.injector = Injector(
                    inner, self.specs, self.optimizer, rank=rank, world_size=size, log=log_file
                ).attach()
            if self.guard_config is not None:
                self.session = GuardSession(open_guard(model, self.optimizer, self.guard_config, self.run_dir))
        except (ValueError, TypeError) as exc:
            raise AttachError(str(exc)) from exc
        if self._lead:
            config = {
                "script": sys.argv,
                "rank": None if world.distributed else rank,
                "world_size": size,
                "model": type(inner).__name__,
                "optimizer": type(self.optimizer).__name__,
                "guard": None if self.guard_config is None else self.guard_config.to_dict(),
                "faults": [s.to_dict() for s in self.specs],
            }
            write_json(self.run_dir / CONFIG_FILE, config)

    def _write_summary(self, code: int | None) -> None:
        guard = None if self.session is None else self.session.guard
        summary = {
            "outcome": "stalled" if guard is not None and guard.stopped else "completed" if code == 0 else "failed",
            "exit_code": code,
            "final_train_loss": self.loss,
            "param_sha256": param_sha256(self.model),
            "steps": self.step,
            "discarded_steps": 0 if guard is None else guard.discarded_steps,
            "events": 0 if guard is None else len(guard.events),
            "injections": 0 if self.injector is None else len(self.injector.records),
            "wall_seconds": round(time.monotonic() - self._started, 3),
        }
        write_json(self.run_dir / f"summary{self._suffix}.json", summary)

    # -- the step, from hooks ----------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if not (module.training and torch.is_grad_enabled()):
            if self.injector is not None:
                self.injector.set_position(self.step, 0, evaluating=True)
            return
        if self._open:  # gradient accumulation: the step's next micro-batch
            self._micro += 1
            if self.injector is not None:
                self.injector.set_position(self.step, self._micro)
            return
        if not self._built:
            self._build()
        self._open, self._micro, self._losses = True, 0, []
        if self.injector is not None:
            self.injector.set_position(self.step, 0)
        if self.session is not None:
            self.session.begin(self.step)

    def on_backward_begin(self, root: torch.Tensor | None) -> None:
        if self._open and not self._scaled and root is not None and root.numel() == 1:
            self._losses.append(root.detach().reshape(()))

    def on_backward_end(self) -> None:
        pass

    def on_clip(self, params: list, max_norm: float, norm_type: float | None, total: torch.Tensor) -> None:
        pass

    def on_targets(self, target: Any) -> None:
        pass

    def _step_loss(self) -> torch.Tensor | None:
        if not self._losses:
            return None
        return self._losses[0] if len(self._losses) == 1 else torch.stack(self._losses).sum()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if optimizer is not self.optimizer:
            return
        if not self._open and not self._unseen:  # the script trains a module other than the one found
            self._unseen = True
            log.warning(
                "%s.step() ran with no training forward of %s before it: such steps are not guarded",
                type(optimizer).__name__,
                type(self.model).__name__,
            )
        if not self._open or self.session is None:
            return
        s = self.session
        s.check(self._step_loss(), rerun=None)
        if not s.discard:  # a discarded step's gradients are cleared: the optimizer changes nothing
            self._lrs = s.guard.safe(s.session.begin_update, "update")

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if optimizer is not self.optimizer or not self._open:
            return
        self._open = False
        self.step += 1
        loss = self._step_loss()
        self.loss = None if loss is None else float(loss)
        s = self.session
        if s is None or not s.open:
            return
        s.open = False
        if not s.discard:
            row = {}
            try:
                row = s.guard.safe(lambda: s.session.update_metrics(s.loss), "metrics", default={})
            finally:
                if self._lrs is not None:
                    s.session.restore_lrs(self._lrs)
                self._lrs = None
            s.session.end(applied=True, row=row, logged=None if s.loss is None else {"loss": s.loss})
        if s.guard.stopped:
            log.error("the guard stopped training: %s", s.guard.stop_reason)
            raise SystemExit(int(ExitCode.GUARD_STOPPED))


def run_attached(
    argv: list[str], out: str | Path, guard: GuardConfig | None, specs: list[FaultSpec]
) -> tuple[int, bool]:
    """Run ``argv`` (``script.py ARGS`` or ``-m module ARGS``) as ``__main__`` with a
    :class:`ScriptAttach` installed; ``(its exit code, whether it attached to an optimizer)``. An
    exception of the script propagates, after the guard and the injector are closed."""
    attach = ScriptAttach(out, guard, specs).install()
    code: int | None = None
    try:
        code = run_main(argv)
    finally:
        attach.uninstall(code)
    return code, attach._built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdcscope.integrations.script", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="the run directory")
    ap.add_argument("--guard", action="store_true", help="attach the guard (default settings)")
    ap.add_argument("--guard-config", type=Path, help="attach the guard with these settings (YAML/JSON)")
    ap.add_argument("--spec", type=Path, help="inject these fault specs (YAML/JSON list)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py ARGS, or -- -m module ARGS")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    logging.basicConfig(level=logging.WARNING, format="sdcscope: %(message)s")
    try:  # the user's errors are refused before the script runs
        guard = GuardConfig.load(args.guard_config) if args.guard_config else GuardConfig() if args.guard else None
        specs = load_specs(args.spec) if args.spec else []
        if guard is None and not specs:
            raise ValueError("nothing to attach: give --guard, --guard-config or --spec")
        check_argv(command)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return int(ExitCode.USER_ERROR)
    try:
        code, attached = run_attached(command, args.out, guard, specs)
    except AttachError as exc:  # a spec or setting that does not fit the model the script built
        log.error("%s", exc)
        return int(ExitCode.USER_ERROR)
    if not attached:
        log.error("the script built no optimizer over a module's parameters: nothing was attached")
    return code


if __name__ == "__main__":
    sys.exit(main())
