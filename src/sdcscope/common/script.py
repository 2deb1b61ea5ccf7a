"""Run a user's training script unchanged, with a tool watching it (the bootstrap of
``sdcscope invariants trace -- python …`` and of ``sdcscope guard|inject -- python …``).

Three parts, shared by every tool that attaches to a script it cannot edit:

- :func:`run_main` runs ``script.py ARGS`` (or ``-m module ARGS``) in this process as
  ``__main__`` (``runpy``), with its own ``sys.argv``, and turns its ``SystemExit`` into an exit code;
- :class:`InitWatch` wraps constructors (``torch.optim.Optimizer.__init__``, ...) while installed,
  so a tool sees each object the script builds, right after it is built;
- :func:`find_model` names the module an optimizer trains: the live module holding the most of
  its parameters (the smallest such module, the outermost among equals: a wrapper whose forward
  is the one called), found among the live objects (``gc``) when it is called;
  :func:`followed_model` applies it to the first optimizer a script builds, the one followed.
"""

from __future__ import annotations

import gc
import logging
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

log = logging.getLogger(__name__)


def find_model(optimizer: Any) -> nn.Module | None:
    """The live module holding the most of ``optimizer``'s parameters (see the module doc)."""
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    best, key = None, None
    for obj in gc.get_objects():
        if not issubclass(type(obj), nn.Module):  # type(): no __class__ property runs
            continue
        ids = [id(p) for p in obj.parameters()]
        covered = len(wanted.intersection(ids))
        if not covered:
            continue
        k = (covered, -len(ids))
        if key is None or k > key or k == key and any(m is best for m in obj.modules()):
            best, key = obj, k
    return best


def followed_model(optimizer: Any, taken: bool, what: str) -> nn.Module | None:
    """The model a script's optimizer trains (:func:`find_model`) when it is the first optimizer
    the script builds (one model and optimizer per process is followed); None, logged, for a
    second one (``taken``) or one that holds no module's parameters. ``what``: ``attached``,
    ``traced``."""
    name = type(optimizer).__name__
    if taken:
        log.info("a second optimizer (%s) is not %s", name, what)
        return None
    model = find_model(optimizer)
    if model is None:
        log.warning("optimizer %s holds no module's parameters: not %s", name, what)
    return model


def outermost(module: nn.Module) -> nn.Module:
    """Called from within ``module``'s forward (a forward pre-hook): the wrapper whose forward is
    calling it that holds exactly its parameters (a ``DistributedDataParallel`` built around the
    model after its optimizer), climbing while there is one; else ``module``. Read from the
    call stack, without a scan of every live object."""
    own = {id(p) for p in module.parameters()}
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if (
            issubclass(type(obj), nn.Module)
            and obj is not module
            and any(child is module for child in obj.children())
            and {id(p) for p in obj.parameters()} == own
        ):
            module = obj
        frame = frame.f_back
    return module


class InitWatch:
    """Constructors wrapped while installed: ``after(obj)`` runs right after ``cls.__init__(obj,
    …)``; :meth:`uninstall` puts every constructor back."""

    def __init__(self) -> None:
        self._saved: list[tuple[type, Any]] = []

    def watch(self, cls: type, after: Callable[[Any], None]) -> None:
        init = cls.__init__

        def wrapped(obj, *args, **kwargs):
            init(obj, *args, **kwargs)
            after(obj)

        self._saved.append((cls, init))
        cls.__init__ = wrapped

    def uninstall(self) -> None:
        for cls, init in reversed(self._saved):
            cls.__init__ = init
        self._saved = []


def check_argv(argv: list[str]) -> None:
    """A usage error before anything runs: no script, or one that does not exist."""
    if not argv or argv[0] == "-m" and len(argv) < 2:
        raise ValueError("give the script to run: script.py ARGS or -m module ARGS")
    if argv[0] != "-m" and not Path(argv[0]).is_file():
        raise ValueError(f"script {argv[0]!r} does not exist")


def run_main(argv: list[str]) -> int:
    """Run ``argv`` (``script.py ARGS`` or ``-m module ARGS``) as ``__main__`` in this process and
    return its exit code (an exception of the script propagates; ``sys.argv`` and ``sys.path``
    are put back either way)."""
    check_argv(argv)
    saved_argv, saved_path = sys.argv, list(sys.path)
    code: Any = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if code is None:
        return 0
    if not isinstance(code, int):
        log.error("%s", code)
        return 1
    return code
