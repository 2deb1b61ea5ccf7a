"""A campaign on Slurm through submitit: ``run_campaign(DIR, slurm=...)``, ``campaign run --slurm``.

The runner submits one job array of ``workers`` tasks for the whole run; each task is a worker
that lives through every phase (golden, baselines, twins, trials), like a local pool's worker, and
runs jobs through the same :class:`~sdcscope.study.worker.Worker`, so the rows are the ones a
local run writes. One queue wait, not one per phase. The runner puts each job of a phase in
``DIR/slurm/queue/KEY.pkl``; a task takes any queued job, writes its result to
``DIR/slurm/results/KEY.pkl`` (atomically) as soon as it is done, and the runner commits it to
``results.sqlite`` as it appears. A job runs to completion once: while it runs, its task holds an
exclusive ``flock`` on ``DIR/slurm/claims/KEY.lock`` (the OS drops it when the process dies,
``kill -9`` included), and a task passes over a job whose result exists or whose claim is held.
A killed task's job goes back to the other tasks; a preempted or timed-out task is requeued by
submitit (the task is checkpointable) and takes jobs again. When every task has ended with jobs
left, the run stops; the next ``campaign run`` submits only those, and reads results a killed
runner never committed instead of running them again. ``KEY`` is a hash of the campaign spec and
the job. Tasks end when the runner says so, or once it has shown no sign of life for
``runner_timeout_s``. The campaign directory must be on storage every node sees, with a working
``flock`` (NFS v4; Lustre mounted with ``-o flock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pickle
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sdcscope.common.io import load_yaml, read_text, write_bytes_atomic
from sdcscope.common.validate import brief, build_config, check_choice, check_float, check_mapping

__all__ = ["SLURM_DIR", "DEFAULT_TASKS", "SlurmConfig", "SlurmBackend", "ArrayTask", "TasksEndedError", "job_key"]

log = logging.getLogger("sdcscope.study.slurm")

SLURM_DIR = "slurm"
"""Under the campaign directory: ``logs/`` (submitit's), ``queue/``, ``results/``, ``claims/``, ``runs/``."""
DEFAULT_TASKS = 16
"""Array tasks when ``workers`` is not given (never more than the run has jobs)."""
CLUSTERS = ("slurm", "local")
DEFAULT_PARAMETERS = {"timeout_min": 60, "cpus_per_task": 1}
"""Under the user's ``parameters``: a worker runs torch on one thread."""


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """How the tasks are submitted (a YAML file of these fields: ``campaign run --slurm-config``).

    ``cluster``: ``slurm``, or ``local`` (submitit's local executor: the tasks are processes on
    this machine, which tests and a dry run use). ``folder``: submitit's folder (job pickles and
    logs; ``%j`` in it is the job id), by default ``DIR/slurm/logs``. ``parameters``: submitit
    executor parameters, the ``AutoExecutor`` names (``timeout_min``, ``mem_gb``,
    ``cpus_per_task``, ``slurm_partition``, ``slurm_array_parallelism``, ``slurm_setup``,
    ``slurm_additional_parameters``, ...), over ``timeout_min: 60, cpus_per_task: 1``.
    ``poll_s``: how often the runner looks for results and a task for queued jobs.
    ``runner_timeout_s``: how long an idle task waits for a runner that shows no sign of life
    (killed) before it ends.
    """

    cluster: str = "slurm"
    folder: str | None = None
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    poll_s: float = 2.0
    runner_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_choice("slurm cluster", self.cluster, CLUSTERS)
        if self.folder is not None and (not isinstance(self.folder, str) or not self.folder):
            raise TypeError(f"slurm folder={brief(self.folder)} must be a non-empty path string or null")
        check_mapping("slurm parameters", self.parameters)
        for name in self.parameters:
            if not isinstance(name, str):
                raise TypeError(f"slurm parameter name {brief(name)} must be a string")
        check_float("slurm poll_s", self.poll_s, low=0.0, low_open=True)
        check_float("slurm runner_timeout_s", self.runner_timeout_s, low=self.poll_s, low_open=True)

    @classmethod
    def coerce(cls, value: SlurmConfig | Mapping | str | os.PathLike) -> SlurmConfig:
        """A config from itself, a mapping of its fields, or a YAML/JSON file of them."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, os.PathLike)):
            where = os.fspath(value)
            data = load_yaml(read_text(where), where)
            try:
                return build_config(cls, {} if data is None else data, "slurm config")
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {exc}") from None
        return build_config(cls, value, "slurm config")


class TasksEndedError(RuntimeError):
    """Every array task ended with jobs of the phase left (killed, failed): run the campaign again."""


def import_submitit():
    """The ``submitit`` module; a ValueError naming the extra to install when it is missing."""
    try:
        import submitit
    except ImportError:
        raise ValueError("running a campaign on Slurm needs submitit: pip install 'sdcscope[slurm]'") from None
    return submitit


def job_key(spec_hash: str, job: Mapping[str, Any]) -> str:
    """The name of ``job``'s queue entry, result and claim: a hash of the campaign spec and the job."""
    text = json.dumps([spec_hash, job], sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class _Files:
    """The paths under ``DIR/slurm``."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory) / SLURM_DIR
        self.queue, self.results, self.claims, self.runs = (
            self.root / n for n in ("queue", "results", "claims", "runs")
        )

    def result(self, key: str) -> Path:
        return self.results / f"{key}.pkl"

    def claim(self, key: str) -> Path:
        return self.claims / f"{key}.lock"

    def job(self, key: str) -> Path:
        return self.queue / f"{key}.pkl"


@contextlib.contextmanager
def _claim(path: Path) -> Iterator[bool]:
    """Whether this process holds ``path``'s exclusive lock (taken without waiting); the file names
    the holder (host, pid) and is removed when the holder is done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        try:
            yield True
        finally:
            path.unlink(missing_ok=True)  # a task that opened it meanwhile finds the result once it locks
    finally:
        os.close(fd)


class ArrayTask:
    """One array task: a campaign worker that runs queued jobs until its run ends (see the module).

    Checkpointable: submitit calls ``checkpoint`` on preemption or timeout and requeues the task
    with what it returns, this task, which takes queued jobs again.
    """

    def __init__(self, directory: str, spec: dict[str, Any], run: str, poll_s: float, runner_timeout_s: float) -> None:
        self.directory, self.spec, self.run = directory, spec, run
        self.poll_s, self.runner_timeout_s = poll_s, runner_timeout_s

    def __call__(self) -> int:
        """Run queued jobs until the runner stops this run (or is gone); returns how many ran."""
        from sdcscope.study.worker import Worker

        files, worker, ran = _Files(self.directory), None, 0
        alive, stop = files.runs / f"{self.run}.alive", files.runs / f"{self.run}.stop"
        beat, seen = None, time.monotonic()
        while not stop.exists():
            with _take(files) as taken:
                if taken is not None:
                    key, job = taken
                    worker = worker or Worker(self.directory, self.spec)
                    write_bytes_atomic(files.result(key), pickle.dumps(worker.run(job)))
                    files.job(key).unlink(missing_ok=True)
                    ran += 1
                    continue
            mtime = alive.stat().st_mtime_ns if alive.exists() else None  # nothing queued: wait
            if mtime != beat:
                beat, seen = mtime, time.monotonic()
            elif time.monotonic() - seen > self.runner_timeout_s:
                log.warning("the runner of run %s has shown no sign of life: this task ends", self.run)
                break
            time.sleep(self.poll_s)
        return ran

    def checkpoint(self, *args: Any, **kwargs: Any):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


@contextlib.contextmanager
def _take(files: _Files) -> Iterator[tuple[str, dict] | None]:
    """A queued job without a result, claimed by this process while the block runs; None when
    every queued job is done or held by another task."""
    try:
        names = sorted(os.listdir(files.queue))
    except FileNotFoundError:
        names = []
    for name in names:
        key = name.removesuffix(".pkl")
        if not name.endswith(".pkl") or files.result(key).exists():
            continue
        with _claim(files.claim(key)) as mine:
            if not mine or files.result(key).exists():  # another task runs it, or finished it meanwhile
                continue
            try:
                job = pickle.loads(files.job(key).read_bytes())
            except FileNotFoundError:  # finished and dequeued meanwhile
                continue
            yield key, job
            return
    yield None


class SlurmBackend:
    """The runner's side: one job array for the run, each phase's jobs queued and their results
    read as they appear."""

    def __init__(self, directory: Path, spec, workers: int | None, config: SlurmConfig, jobs: int) -> None:
        """``jobs``: how many the run will queue at most (no more tasks than that are started)."""
        submitit = import_submitit()
        self.dir = Path(directory).resolve()
        self.files, self.spec, self.config = _Files(self.dir), spec, config
        self.size = max(1, min(workers or DEFAULT_TASKS, jobs))
        folder = config.folder or str(self.files.root / "logs")
        self.executor = submitit.AutoExecutor(folder=folder, cluster=config.cluster)
        try:
            self.executor.update_parameters(**{**DEFAULT_PARAMETERS, **config.parameters})
        except NameError as exc:  # submitit's unknown-parameter report, which lists the known ones
            raise ValueError(f"slurm parameters: {exc}") from None
        except AssertionError as exc:  # submitit's type check of the shared parameters
            raise TypeError(f"slurm parameters: {exc}") from None
        self.run, self.tasks = uuid.uuid4().hex[:12], []
        for d in (self.files.queue, self.files.results, self.files.claims, self.files.runs):
            d.mkdir(parents=True, exist_ok=True)
        for stale in self.files.queue.iterdir():  # an earlier run's queue: this run queues what it needs
            stale.unlink(missing_ok=True)

    def map(self, jobs: list[dict]) -> Iterator[dict]:
        pending = {job_key(self.spec.hash, job): job for job in jobs}
        yield from self._collect(pending)  # results a killed runner never committed
        if not pending:
            return
        for key, job in pending.items():
            write_bytes_atomic(self.files.job(key), pickle.dumps(job))
        if not self.tasks:
            self._submit()
        alive = self.files.runs / f"{self.run}.alive"
        while True:
            alive.touch()  # the tasks' sign that the runner lives
            ended = all(t.done() for t in self.tasks)  # before reading: a task's last result is read
            yield from self._collect(pending)
            if not pending:
                return
            if ended:
                raise TasksEndedError(self._missing(len(pending), len(jobs)))
            time.sleep(self.config.poll_s)

    def _submit(self) -> None:
        c = self.config
        task = ArrayTask(str(self.dir), self.spec.to_dict(), self.run, c.poll_s, c.runner_timeout_s)
        self.tasks = self.executor.submit_array([task] * self.size)
        log.info("submitted %d array tasks (job %s, run %s)", self.size, self.tasks[0].job_id, self.run)

    def _collect(self, pending: dict[str, dict]) -> Iterator[dict]:
        for key in list(pending):
            path = self.files.result(key)
            if path.exists():
                del pending[key]
                yield pickle.loads(path.read_bytes())

    def _missing(self, left: int, total: int) -> str:
        failed = []
        for t in self.tasks:
            exc = t.exception()
            if exc is not None:
                lines = str(exc).strip().splitlines()
                failed.append(f"task {t.job_id}: {lines[-1] if lines else type(exc).__name__}")
        why = "; ".join(failed[:3]) or "no task reported an error"
        return (
            f"every array task ended with {left} of {total} jobs of the phase left ({why}; logs: "
            f"{self.executor.folder}); finished jobs are kept: run the campaign again to resume"
        )

    def close(self) -> None:
        """End the run: its tasks stop taking jobs; any still running are cancelled."""
        with contextlib.suppress(OSError):
            (self.files.runs / f"{self.run}.stop").touch()
        deadline = time.monotonic() + 3 * self.config.poll_s + 30  # an idle task sees it within poll_s, then exits
        while time.monotonic() < deadline and not all(t.done() for t in self.tasks):
            time.sleep(self.config.poll_s / 4)
        for t in self.tasks:
            with contextlib.suppress(Exception):
                if not t.done():
                    t.cancel(check=False)
        self.tasks = []
