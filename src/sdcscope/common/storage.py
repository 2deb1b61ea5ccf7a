"""Failed writes as one error naming the path and what was being written.

A full disk, a read-only mount or a missing permission reaches sdcscope in many disguises: an
``OSError`` with its errno, a torch ``RuntimeError`` whose cause is that ``OSError`` (or, when torch
opened the file itself, only ``unexpected pos``), a ``sqlite3.OperationalError`` ("database or
disk is full"). :func:`storage_cause` recognises them; :func:`writing` turns them into one
:class:`StorageError`, which the CLI reports as one line with :data:`ExitCode.STORAGE`. It is an
``OSError`` that pickles whole, so it crosses process pools too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

__all__ = ["STORAGE_ERRNOS", "StorageError", "storage_cause", "writing", "new_outputs"]

STORAGE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EROFS", "EACCES", "EPERM", "EDQUOT", "EFBIG") if hasattr(errno, name)
)
"""The errnos of a write the storage refused (not a bug, not a bad path the user typed)."""

_SQLITE = {  # sqlite3.OperationalError messages: what they mean as an errno
    "database or disk is full": errno.ENOSPC,
    "attempt to write a readonly database": errno.EROFS,
    "unable to open database file": errno.EACCES,
    "disk i/o error": errno.EIO,
}
_TORCH = ("unexpected pos", "file write failed", "failed writing")  # torch's own file writer: no errno kept


class StorageError(OSError):
    """A write refused by the storage: ``what`` (e.g. "the checkpoint") to ``path``, and why."""

    def __init__(self, code: int, what: str, path: str | Path, reason: str | None = None) -> None:
        reason = reason or os.strerror(code)
        super().__init__(code, reason)
        self.what, self.path, self.reason = what, str(path), reason
        self.filename = str(path)

    def __str__(self) -> str:
        return f"cannot write {self.what} to {self.path!r}: {self.reason} (nothing half-written was kept)"

    def __reduce__(self):
        return (type(self), (self.errno, self.what, self.path, self.reason))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)  # "from None" ends it


def storage_cause(exc: BaseException) -> OSError | None:
    """The storage failure behind ``exc`` (itself, or in its cause/context chain) as an OSError
    with its errno, or None when ``exc`` is something else."""
    for e in _chain(exc):
        if isinstance(e, StorageError):
            return e
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS | {errno.EIO}:
            return e
        if isinstance(e, sqlite3.OperationalError):
            code = next((c for text, c in _SQLITE.items() if text in str(e).lower()), None)
            if code is not None:
                return OSError(code, os.strerror(code))
        if type(e) is RuntimeError and any(t in str(e) for t in _TORCH):
            return OSError(errno.ENOSPC, "the write stopped short (disk full?)")
    return None


@contextlib.contextmanager
def writing(what: str, path: str | Path) -> Iterator[None]:
    """Raise a storage failure inside the block as :class:`StorageError` naming ``what`` and
    ``path`` (the file meant, not a temporary one); anything else passes unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        cause = storage_cause(exc)
        if cause is None:
            raise
        raise StorageError(cause.errno, what, path, cause.strerror) from None


@contextlib.contextmanager
def new_outputs(*folders: str | Path, keep: bool = False) -> Iterator[None]:
    """Output folders that leave no debris: if the block fails (any exception, ``KeyboardInterrupt``
    and an exit with a non-zero code among them), each of ``folders`` that did not exist before it is
    removed with what the block wrote there, as are the parents the block created for it; one that
    existed empty is emptied again. ``keep``: leave everything (e.g. a run meant to be resumed)."""
    before = []
    for folder in map(Path, folders):
        absent = [p for p in (folder, *folder.parents) if not p.exists()]  # nearest first
        empty = folder.is_dir() and not any(folder.iterdir())
        before.append((folder, absent, empty))
    try:
        yield
    except BaseException as exc:
        if not keep and getattr(exc, "exit_code", getattr(exc, "code", 1)) != 0:
            for folder, absent, empty in before:
                _clean(folder, absent, empty)
        raise


def _clean(folder: Path, absent: list[Path], empty: bool) -> None:
    with contextlib.suppress(OSError):
        if absent and absent[0] == folder:
            shutil.rmtree(folder, ignore_errors=True)
            for parent in absent[1:]:
                parent.rmdir()  # only while empty: never another writer's folder
        elif empty and folder.is_dir():
            for child in folder.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
