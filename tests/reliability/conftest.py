"""The failure-injection suite's plumbing: storage that fails on demand, and the probe count.

A full disk is a small tmpfs filled to the last byte, a read-only folder a read-only bind mount,
where the tests run as root and may mount (a container with CAP_SYS_ADMIN, this sandbox); a
non-root user gets a read-only folder from ``chmod`` (which root ignores). Where neither works,
the failure is injected at the real write boundary of this process instead (``open``,
``os.open``, ``os.mkdir``, sqlite's writes), with the errno the kernel would give. Every probe runs
the command in this process (Typer's runner), so each mode reaches the same code.

The last line of a run that collected these tests says how many probes were tried and passed.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest

FORCE_ENV = "SDCSCOPE_TEST_STORAGE"
"""``patched`` forces the in-process fault-injecting writer (to test the fallback itself)."""

_PROBES: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if "tests/reliability/" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call" or report.failed or report.skipped:
        if report.nodeid not in _PROBES or report.failed:
            _PROBES[report.nodeid] = "passed" if report.passed else "failed"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    result = yield
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and _PROBES:
        passed = sum(v == "passed" for v in _PROBES.values())
        reporter.write_line(f"sdcscope failure probes tried / passed: {len(_PROBES)} / {passed}")
    return result


_MOUNTABLE: list[bool] = []


def _can_mount(probe: Path) -> bool:
    if os.environ.get(FORCE_ENV) == "patched" or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    if _MOUNTABLE:
        return _MOUNTABLE[0]
    _MOUNTABLE.append(_try_mount(probe))
    return _MOUNTABLE[0]


def _try_mount(probe: Path) -> bool:
    probe.mkdir(exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True)
    if ok.returncode != 0:
        return False
    subprocess.run(["umount", str(probe)], capture_output=True)
    return True


def _umount(folder: Path) -> None:
    if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(folder)], check=True)  # a file still open: detach it


def _write_mode(mode: str) -> bool:
    return any(c in mode for c in "wax+")


class Storage:
    """Make a folder a full disk or read-only for the length of a ``with`` block."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mode = "mount" if _can_mount(tmp / ".mount-probe") else "chmod" if os.geteuid() != 0 else "patched"
        if os.environ.get(FORCE_ENV) == "patched":
            self.mode = "patched"

    # -- full ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def full(self, folder: Path, slack: int = 0):
        """``folder`` (its content kept) on a disk with ``slack`` bytes free (rounded to pages)."""
        if self.mode == "mount":
            with self._tmpfs(folder, slack):
                yield
        else:
            with self._patched(folder, errno.ENOSPC):
                yield

    @contextlib.contextmanager
    def _tmpfs(self, folder: Path, slack: int):
        folder.mkdir(parents=True, exist_ok=True)
        aside = self.tmp / f".aside-{uuid.uuid4().hex}"
        shutil.copytree(folder, aside)
        used = sum(p.stat().st_size + 8192 for p in aside.rglob("*") if p.is_file()) + 64 * 1024
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used + slack}", "tmpfs", str(folder)], check=True)
        try:
            shutil.copytree(aside, folder, dirs_exist_ok=True)
            self._fill(folder / ".filler", slack)
            yield
        finally:
            with contextlib.suppress(OSError):
                (folder / ".filler").unlink()
            saved = self.tmp / f".after-{uuid.uuid4().hex}"
            shutil.copytree(folder, saved)  # the content as the command left it, for the asserts
            _umount(folder)
            shutil.rmtree(folder)
            shutil.copytree(saved, folder)
            shutil.rmtree(saved)
            shutil.rmtree(aside)

    @staticmethod
    def _fill(path: Path, slack: int) -> None:
        """Leave ``slack`` bytes free (0: none at all) on the file system of ``path``."""
        with open(path, "wb", buffering=0) as fh:
            with contextlib.suppress(OSError):
                while (free := shutil.disk_usage(path.parent).free - slack) > 0:
                    fh.write(b"\0" * min(free, 1 << 16))
                while slack == 0:  # to the last byte
                    fh.write(b"\0" * 512)

    # -- read-only ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def readonly(self, folder: Path):
        """``folder`` and everything below it read-only."""
        if self.mode == "mount":
            subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
            try:
                subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
                yield
            finally:
                _umount(folder)
        elif self.mode == "chmod":
            modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
            for p in modes:
                p.chmod(0o555 if p.is_dir() else 0o444)
            try:
                yield
            finally:
                for p, mode in modes.items():
                    p.chmod(mode)
        else:
            with self._patched(folder, errno.EROFS):
                yield

    # -- the fault-injecting writer -------------------------------------------------------------
    @contextlib.contextmanager
    def _patched(self, folder: Path, code: int):
        root = str(folder.resolve())
        inside = lambda p: str(Path(os.fsdecode(p)).resolve()).startswith(root)  # noqa: E731
        refuse = lambda p: OSError(code, os.strerror(code), os.fsdecode(p))  # noqa: E731
        patch = pytest.MonkeyPatch()
        real_open, real_os_open, real_mkdir, real_connect = builtins.open, os.open, os.mkdir, sqlite3.connect
        real_replace, real_unlink = os.replace, os.unlink

        def fake_open(file, mode="r", *args, **kw):
            if isinstance(file, (str, bytes, os.PathLike)) and _write_mode(mode) and inside(file):
                raise refuse(file)
            return real_open(file, mode, *args, **kw)

        def fake_os_open(path, flags, *args, **kw):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
                raise refuse(path)
            return real_os_open(path, flags, *args, **kw)

        def fake_mkdir(path, *args, **kw):
            if inside(path):
                raise refuse(path)
            return real_mkdir(path, *args, **kw)

        def fake_replace(src, dst, *args, **kw):
            if inside(dst):
                raise refuse(dst)
            return real_replace(src, dst, *args, **kw)

        def fake_unlink(path, *args, **kw):
            if code == errno.EROFS and inside(path):
                raise refuse(path)
            return real_unlink(path, *args, **kw)

        def fake_connect(database, *args, **kw):
            conn = real_connect(database, *args, **kw)
            return (
                _RefusingConnection(conn, code) if inside(str(database).removeprefix("file:").split("?")[0]) else conn
            )

        for target, name, fake in (
            (builtins, "open", fake_open),
            (io, "open", fake_open),
            (os, "open", fake_os_open),
            (os, "mkdir", fake_mkdir),
            (os, "replace", fake_replace),
            (os, "unlink", fake_unlink),
            (sqlite3, "connect", fake_connect),
        ):
            patch.setattr(target, name, fake)
        try:
            yield
        finally:
            patch.undo()


_SQLITE_WRITES = ("INSERT", "UPDATE", "DELETE", "CREATE", "ALTER", "BEGIN", "PRAGMA JOURNAL_MODE")


class _RefusingConnection:
    """A sqlite3 connection whose writes fail as SQLite reports a full disk or a read-only file."""

    def __init__(self, conn: sqlite3.Connection, code: int) -> None:
        self._conn, self._code = conn, code

    def _refuse(self, sql: str) -> None:
        if sql.lstrip().upper().startswith(_SQLITE_WRITES):
            raise sqlite3.OperationalError(
                "database or disk is full" if self._code == errno.ENOSPC else "attempt to write a readonly database"
            )

    def execute(self, sql, *args):
        self._refuse(sql)
        return self._conn.execute(sql, *args)

    def executemany(self, sql, *args):
        self._refuse(sql)
        return self._conn.executemany(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._conn, name, value)


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(tmp_path)
