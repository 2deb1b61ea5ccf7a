"""The Guard inside other libraries' training loops.

* :mod:`sdcscope.integrations.hf` -- ``transformers.Trainer``: ``guard_trainer(trainer, config)``
  (``pip install 'sdcscope[transformers]'``);
* :mod:`sdcscope.integrations.lightning` -- ``lightning.pytorch.Trainer(callbacks=[SDCGuardCallback(config)])``
  (``pip install 'sdcscope[lightning]'``);
* :mod:`sdcscope.integrations.titan` -- torchtitan's ``Trainer``: ``guard_titan(trainer, config)``.

A user's own script, unchanged: :mod:`sdcscope.integrations.script` (``sdcscope guard|inject --
python train.py``) attaches the guard and the injector through global optimizer step hooks.

Importing this package imports none of these libraries. It holds what the adapters share:
:func:`load_config` (the config argument they take), :func:`open_guard` (the guard and its
files in the run directory), :class:`GuardSession` (the guard's per-step protocol cut at the
points such a trainer lets an adapter in) and :class:`Patches` (the trainer methods an adapter
wraps for one run, put back after it). Under DDP both adapters build the Guard with ``ddp=`` (the
trainer's ``DistributedDataParallel`` wrapper) and replay a suspect rank's step through
:mod:`sdcscope.integrations.ddp`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sdcscope.common.world import world_of
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.actions import Applied
from sdcscope.guard.world import fit_config

__all__ = ["GuardSession", "Patches", "load_config", "open_guard"]


def load_config(config: GuardConfig | str | os.PathLike | Mapping | None) -> GuardConfig:
    """A :class:`GuardConfig` from what an adapter was given: one as it is, a YAML/JSON file
    (:meth:`GuardConfig.load`), a mapping of sections (:meth:`GuardConfig.from_dict`) or None
    (every default). Validated here, when the adapter is built: a bad config fails before training."""
    if config is None:
        return GuardConfig()
    if isinstance(config, GuardConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return GuardConfig.load(config)
    if isinstance(config, Mapping):
        return GuardConfig.from_dict(config)
    raise TypeError(
        f"guard config must be a GuardConfig, a YAML/JSON file path, a mapping or None, "
        f"got {type(config).__name__} {config!r}"
    )


def open_guard(
    model,
    optimizer,
    config: GuardConfig,
    run_dir: str | os.PathLike,
    on_event: Callable[[dict], None] | None = None,
    *,
    ddp=None,
) -> Guard:
    """An attached Guard writing ``run_dir/events.jsonl`` and, unless the config names another
    file, ``run_dir/metrics.jsonl`` (the user's config object is left as it is). ``ddp``: the
    trainer's ``DistributedDataParallel`` wrapper of ``model`` (a data-parallel run: rank 0
    writes the world's events, rank r > 0 its metrics to ``metrics.rank{r}.jsonl``); a sharded
    model (DTensor parameters: FSDP2, tensor parallel) is guarded in the sharded world."""
    run_dir = Path(run_dir)
    world = world_of(model, ddp)
    config = fit_config(config, world.kind)  # a default section the world cannot run is off before it is set
    m = config.metrics
    if m is not None and m.path is None and m.sink == "jsonl":
        rank = world.rank
        path = run_dir / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
        config = dataclasses.replace(config, metrics=dataclasses.replace(m, path=str(path)))
    return Guard(model, optimizer, config, run_dir=run_dir, on_event=on_event, ddp=ddp).attach()


class GuardSession:
    """The guard's step protocol (:class:`~sdcscope.guard.StepSession`) at the points a library's
    trainer lets an adapter in.

    A library's trainer runs forward/backward, then clips the gradients, then steps the optimizer,
    and offers a way in between each. The guard takes its part at each point:

    * :meth:`begin` -- before the step's first forward pass;
    * :meth:`decide` -- after its last backward, before the library touches the gradients: the
      detectors see them as computed, a recompute replaces them before the library clips them
      (as ``before_step`` does in a plain loop), and a discarded step leaves none to clip;
    * :meth:`update` -- called by the adapter in place of the optimizer's own step: applies it
      under the LR backoff, then records metrics and the checksums of the new state; or, for a
      vetoed or rolled-back step, does nothing at all (parameters and optimizer state untouched).

    The guard's own failures become events (or raise under ``strict``), as in a plain loop.
    """

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.session = guard.session
        self.open = False  # begun, its update not yet reached
        self.discard = False  # this step's update must not be applied
        self.loss: Any = None

    def begin(self, step: int) -> None:
        self.open, self.discard, self.loss = True, False, None
        self.guard.safe(lambda: self.session.begin(step), "begin")

    def check(self, loss: Any, rerun: Callable[[], Any] | None, rank_replay: Callable[[int], Any] | None = None) -> Any:
        """Check the finished backward, replay with ``rerun()`` (zero the gradients, run the
        step's forward and backward again, return its loss) if anything fired, and act on the
        policy's answer; returns the step's loss (a recompute's, if the replay was kept). Under
        DDP every rank decides together (a collective: every rank calls it every step) and
        ``rank_replay(r)`` (:class:`~sdcscope.integrations.ddp.RankReplay`) replaces ``rerun``."""
        s = self.session
        if not self.open:
            return loss
        applied, self.loss = self.guard.safe(
            lambda: s.check(loss, rerun, rank_replay=rank_replay), "check", default=(Applied(), loss)
        )
        self.discard = applied.discarded
        if self.discard:
            s.clear_grads()  # nothing left for the library to clip or apply
            s.end(applied=False)
        else:
            s.before_update()
        return self.loss

    def update(self, apply: Callable[[], Any]) -> Any:
        """``apply()`` (the optimizer's real step) unless this step is discarded."""
        if not self.open:  # a step the guard did not see begin: not its to judge
            return apply()
        self.open = False
        if self.discard:
            return None
        out, row = self.session.update(apply, self.loss)  # after the library's clipping
        self.session.end(applied=True, row=row, logged=None if self.loss is None else {"loss": self.loss})
        return out

    def clear_grads(self) -> None:
        """Zero every gradient before the adapter re-runs the step's forward and backward."""
        self.session.clear_grads()


class Patches:
    """Instance attributes set over an object's own (a bound method wrapped for one run), each
    put back exactly as it was -- the class's method again, or the user's own instance override.
    A wrapper carries its original's attributes (``functools.update_wrapper``): a torch LR
    scheduler marks the optimizer's ``step`` it wrapped and warns when the mark is gone;
    Lightning's ``is_overridden`` follows ``__wrapped__``."""

    _MISSING = object()

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """``obj.name = make(original)``, where ``original`` is what ``obj.name`` was."""
        self._done.append((obj, name, vars(obj).get(name, self._MISSING)))
        original = getattr(obj, name)
        setattr(obj, name, functools.update_wrapper(make(original), original))

    def undo(self) -> None:
        for obj, name, before in reversed(self._done):
            if before is self._MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)
        self._done.clear()
