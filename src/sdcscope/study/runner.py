"""Plan, run and resume a campaign directory (``campaign.yaml``, ``results.sqlite``, ``golden/``).

Phases: one golden run that saves snapshots at the injection steps; healthy baselines (each
snapshot continued with other data-order seeds); thresholds from their spread; perturbation twins
(each snapshot with a rounding-level change, golden's data order) and their envelope, the chaos
floor of ``sdc:drift`` (:mod:`.twins`); then the trials.
Every phase skips what ``results.sqlite`` already holds, so running a killed campaign again
resumes it; results are a pure function of (spec, trial id), whatever the worker count. One
run at a time per directory: a run holds an exclusive ``flock`` on ``run.lock`` (released when
its process ends, ``kill -9`` included); a second one fails at once with :class:`CampaignBusyError`.

Backends: in-process (``workers=0``), local worker processes (default: one per CPU core), Ray
(``ray_address``) or a Slurm job array through submitit (``slurm``, :mod:`.slurm`); for the last two
the campaign directory must be on storage every node sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import multiprocessing
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch
import yaml

from sdcscope.study.outcomes import TWIN_BOUND
from sdcscope.study.plan import Trial, build_plan, pending_trials
from sdcscope.study.slurm import SlurmBackend, SlurmConfig, import_submitit
from sdcscope.study.spec import CampaignSpec, load_campaign, read_campaign_data
from sdcscope.study.stats import RULE, THRESHOLD_MEASURES, prediction_bound
from sdcscope.study.store import DB_FILE, ResultsDB
from sdcscope.study.timing import RunTiming
from sdcscope.study.twins import envelope_bound, spread_flags, twin_flags
from sdcscope.study.worker import GOLDEN_DIR, Worker

__all__ = ["SPEC_FILE", "LOCK_FILE", "CampaignBusyError", "init_campaign", "plan_campaign", "run_campaign", "Progress"]

log = logging.getLogger("sdcscope.study.runner")

SPEC_FILE = "campaign.yaml"
LOCK_FILE = "run.lock"
"""Held (``flock``) by the one ``run_campaign`` working on a directory; it dies with its process."""
Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``; phases: golden, baseline, twins, trials."""


def plan_campaign(spec: CampaignSpec) -> list[Trial]:
    """The trials of ``spec`` (validates the fault space against the workload's model)."""
    from sdcscope.workloads import make_workload

    workload = make_workload(spec.workload_config())
    with torch.random.fork_rng():
        model = workload.build_model()
        optimizer = workload.build_optimizer(model)
    return build_plan(spec, model, optimizer)


def count_plan(spec: CampaignSpec, db: ResultsDB) -> int:
    """The trials a campaign counts: its stored rows and the trials of ``spec``'s plan not stored
    yet (what ``plan_size`` becomes on the next run); recorded where the database can be written."""
    keys = db.trial_keys()
    size = len(keys) + len(pending_trials(plan_campaign(spec), keys))
    if not db.readonly:
        with contextlib.suppress(OSError):  # a full disk: the count is still right, only not kept
            db.set_plan_size(size)
    return size


def init_campaign(directory: str | Path, spec_path: str | Path) -> tuple[CampaignSpec, list[Trial]]:
    """Validate ``spec_path`` and its fault space, then create ``directory`` with a copy of the
    spec and an empty results database. Nothing is written when validation fails."""
    directory, spec_path = Path(directory), Path(spec_path)
    if spec_path.is_dir():
        raise FileNotFoundError(
            f"--spec {str(spec_path)!r} is a directory, not a spec file; give a campaign spec (YAML) file"
        )
    if not spec_path.is_file():
        raise FileNotFoundError(f"--spec {str(spec_path)!r} does not exist")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"{str(directory)!r} already exists and is not an empty folder; give a new campaign directory")
    spec = load_campaign(spec_path)  # a relative workload.corpus is resolved against the spec's folder
    try:
        plan = plan_campaign(spec)
    except (TypeError, ValueError) as exc:  # the fault space against the model: say which file
        raise type(exc)(f"{str(spec_path)!r}: {exc}") from None
    data = read_campaign_data(spec_path)[1]
    directory.mkdir(parents=True, exist_ok=True)
    if spec.workload.get("corpus") == data["workload"].get("corpus"):
        shutil.copyfile(spec_path, directory / SPEC_FILE)  # verbatim, comments included
    else:  # the stored spec names the corpus absolute: the campaign trains on the same data from anywhere
        data["workload"] = {**data["workload"], "corpus": spec.workload["corpus"]}
        text = (
            f"# copied from {spec_path.resolve()} by `sdcscope campaign init`, with workload.corpus "
            "made absolute\n" + yaml.safe_dump(data, sort_keys=False)
        )
        (directory / SPEC_FILE).write_text(text, encoding="utf-8")
    ResultsDB(directory / DB_FILE, spec, len(plan)).close()
    return spec, plan


# ----------------------------------------------------------------------------------- backends

_WORKER: Worker | None = None


def _exit_with_parent(parent: int) -> None:
    """A worker whose runner (pid ``parent``) was killed (``kill -9``) stops instead of finishing
    orphaned jobs; it also stops at once when the runner was gone before it started."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _init_worker(directory: str, spec: dict, parent: int) -> None:
    """``parent`` is the runner's pid, taken in the runner: the child's own ``os.getppid()`` after
    its slow spawn start-up may already be 1 (runner dead), and watching pid 1 never ends."""
    global _WORKER
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _WORKER = Worker(directory, spec)


def _run_job(job: dict) -> dict:
    return _WORKER.run(job)


class _InProcess:
    def __init__(self, directory: Path, spec: CampaignSpec) -> None:
        self.threads, self.size = torch.get_num_threads(), 1
        self.worker = Worker(directory, spec.to_dict())

    def map(self, jobs: list[dict]) -> Iterator[dict]:
        with torch.random.fork_rng():
            for job in jobs:
                yield self.worker.run(job)

    def close(self) -> None:
        torch.set_num_threads(self.threads)


class _Pool:
    def __init__(self, directory: Path, spec: CampaignSpec, workers: int) -> None:
        self.size = workers
        self.pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(str(directory), spec.to_dict(), os.getpid()),
        )  # the runner's pid

    def map(self, jobs: list[dict]) -> Iterator[dict]:
        pending = {self.pool.submit(_run_job, job) for job in jobs}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                try:
                    result = future.result()
                except BrokenProcessPool:
                    raise RuntimeError(
                        "a campaign worker process died (killed, or out of memory; a script "
                        "that starts a campaign needs an `if __name__ == '__main__':` guard); "
                        "finished trials are kept: run the campaign again to resume"
                    ) from None
                yield result

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _Ray:
    """One ``Worker`` actor (1 CPU) per worker on a Ray cluster; ``address`` as for ``ray.init``
    (``local`` starts a private cluster on this machine, ``auto`` joins a running one; a Ray
    already initialized in this process is used as it is). The actors are removed on close, and
    a cluster this backend started is shut down."""

    def __init__(self, directory: Path, spec: CampaignSpec, workers: int | None, address: str) -> None:
        ray = _import_ray(address)
        from ray.util import ActorPool

        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=address)
            except ConnectionError as exc:
                raise ValueError(
                    f"--ray-address {address!r}: no Ray cluster to connect to ({exc}); "
                    "'local' starts one on this machine"
                ) from None
        n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        actor = ray.remote(num_cpus=1)(Worker)
        self.actors = [actor.remote(str(directory.resolve()), spec.to_dict()) for _ in range(n)]
        self.size = n
        self.pool = ActorPool(self.actors)

    def map(self, jobs: list[dict]) -> Iterator[dict]:
        return self.pool.map_unordered(lambda a, job: a.run.remote(job), jobs)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        if self.started:
            self.ray.shutdown()


def _import_ray(address: str):
    """The ``ray`` module; a ValueError naming the extra to install when it is missing."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"--ray-address {address!r} needs Ray: pip install 'sdcscope[ray]'") from None
    return ray


def _backend(
    directory: Path,
    spec: CampaignSpec,
    workers: int | None,
    ray_address: str | None,
    slurm: SlurmConfig | None,
    todo: list[Trial],
):
    if slurm is not None:  # no more tasks than the run has jobs: golden, baselines, twins, trials
        b = spec.baseline
        return SlurmBackend(
            directory, spec, workers, slurm, 1 + len(spec.inject_steps) * (len(b.seeds) + b.twins) + len(todo)
        )
    if ray_address:
        return _Ray(directory, spec, workers, ray_address)
    n = (os.cpu_count() or 1) if workers is None else workers
    return _InProcess(directory, spec) if n == 0 else _Pool(directory, spec, n)


# ------------------------------------------------------------------------------------ phases


def _golden_ready(directory: Path, spec: CampaignSpec) -> bool:
    g = directory / GOLDEN_DIR
    return all(
        (g / f"step-{s}" / "manifest.json").is_file() and (g / f"trajectory-{s}.pt").is_file()
        for s in spec.inject_steps
    )


def _each(backend, jobs: list[dict], phase: str, progress: Progress | None, timing: RunTiming) -> Iterable[dict]:
    t0 = time.perf_counter()
    if progress:
        progress(phase, 0, len(jobs))
    for k, result in enumerate(backend.map(jobs) if jobs else (), 1):
        timing.job(result)
        yield result
        if progress:
            progress(phase, k, len(jobs))
    if jobs:
        timing.phase(phase, time.perf_counter() - t0)


def _thresholds(spec: CampaignSpec, baselines: list[dict]) -> list[dict]:
    rows = []
    for s in spec.inject_steps:
        mine = [b for b in baselines if b["inject_step"] == s]
        for measure in THRESHOLD_MEASURES:
            try:
                bound = prediction_bound([abs(b[measure]) for b in mine], spec.baseline.alpha)
            except ValueError as exc:
                raise ValueError(f"healthy baselines at step {s}, {measure}: {exc}") from None
            rows.append({"inject_step": s, "measure": measure, "rule": RULE, **bound})
    return rows


def _write_envelope(spec: CampaignSpec, db: ResultsDB) -> None:
    """The twins' envelope at the end of the horizon (threshold ``dist_twin``) per injection step,
    the drift labels of the twins (leave-one-out) and of the healthy re-seeded runs, and every
    stored trial decided again (a campaign finished before the twins gets its labels here, from
    its stored measures)."""
    alpha, margin = spec.baseline.alpha, spec.baseline.twin_margin
    all_twins, all_bases, thresholds = db.twins(), db.baselines(), db.thresholds()
    rows, twin_labels, base_labels = [], {}, {}
    beyond = lambda d, bound: None if d is None else int(d > bound)  # noqa: E731
    for s in spec.inject_steps:
        twins = [t for t in all_twins if t["inject_step"] == s]
        row = envelope_bound([t["dist_golden"] for t in twins], alpha, margin)
        if row is None:  # no spread among the twins' distances: the fixed bound, said so
            row = {"bound": TWIN_BOUND, "n": len(twins), "alpha": alpha, "rule": "fixed TWIN_BOUND (no spread)"}
            log.warning(
                "perturbation twins at step %d have no spread; sdc:drift uses the fixed bound %g", s, TWIN_BOUND
            )
        rows.append({"inject_step": s, "measure": "dist_twin", **row})
        spread = thresholds[s]["dist_golden"]
        for t, f in zip(twins, twin_flags(twins, alpha, margin)):
            twin_labels[(s, t["twin"])] = {"drift_twin": f, "drift_spread": beyond(t["dist_golden"], spread)}
        bases = [b for b in all_bases if b["inject_step"] == s]
        for b, f in zip(bases, spread_flags([b["dist_golden"] for b in bases], alpha)):
            base_labels[(s, b["seed"])] = {"drift_twin": beyond(b["dist_golden"], row["bound"]), "drift_spread": f}
    db.write_envelope(spec, rows, twin_labels, base_labels)


def run_campaign(
    directory: str | Path,
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    slurm: SlurmConfig | Mapping | str | os.PathLike | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run (or resume) the campaign in ``directory``; returns counts of the trials' outcomes.

    ``slurm`` (a :class:`~sdcscope.study.slurm.SlurmConfig`, a mapping of its fields or a YAML file
    of them) runs the workers as one Slurm job array of ``workers`` tasks (default
    :data:`~sdcscope.study.slurm.DEFAULT_TASKS`) through submitit."""
    directory = Path(directory)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"workers={workers!r} must be an int >= 0 (0: run in this process)")
    if ray_address is not None and (not isinstance(ray_address, str) or not ray_address):
        raise ValueError(
            f"ray_address={ray_address!r} must be a non-empty str: 'local' (a private cluster on "
            "this machine), 'auto' (a running cluster) or 'ray://host:port'"
        )
    if slurm is not None:
        if ray_address is not None:
            raise ValueError(f"ray_address={ray_address!r} and slurm: give one backend, not both")
        if workers == 0:
            raise ValueError("workers=0 runs in this process; with slurm give the array tasks per phase (>= 1)")
        slurm = SlurmConfig.coerce(slurm)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} holds no {SPEC_FILE} (create it, or use `sdcscope campaign init DIR --spec FILE`)"
        )
    if ray_address is not None:
        _import_ray(ray_address)  # before results.sqlite is created
    if slurm is not None:
        import_submitit()
    with _run_lock(directory):
        return _run_locked(directory, spec_path, workers, ray_address, slurm, progress)


class CampaignBusyError(RuntimeError):
    """Another ``run_campaign`` holds the campaign directory's lock."""


def _lock(path: Path) -> tuple[int, bool]:
    """An fd holding an exclusive, non-blocking ``flock`` on ``path``, and whether this call
    created the file."""
    while True:
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise CampaignBusyError(
                f"another `campaign run` is active on {str(path.parent)!r} (pid {holder}); "
                "wait for it to finish or stop it, then run again to resume"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd, created
        os.close(fd)  # a failed run removed the file after this one opened it: lock the new one


@contextlib.contextmanager
def _run_lock(directory: Path) -> Iterator[None]:
    """An exclusive, non-blocking ``flock`` on ``directory/run.lock`` while a run works on the
    directory; the OS drops it when the process ends, however it ends, so none goes stale. A run
    that fails (a bad spec, no Ray, ...) removes the lock file it created."""
    path = directory / LOCK_FILE
    fd, created = _lock(path)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        except BaseException:
            if created:  # still locked: a runner that opened it meanwhile finds it gone and starts over
                path.unlink(missing_ok=True)
            raise
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def _run_locked(
    directory: Path,
    spec_path: Path,
    workers: int | None,
    ray_address: str | None,
    slurm: SlurmConfig | None,
    progress: Progress | None,
) -> dict[str, Any]:
    timing = RunTiming()
    spec = load_campaign(spec_path)
    plan = plan_campaign(spec)
    with ResultsDB(directory / DB_FILE, spec, len(plan)) as db:
        todo = pending_trials(plan, db.trial_keys())  # by key: an extended campaign keeps its rows
        db.set_plan_size(len(db.trial_keys()) + len(todo))  # also after a `campaign status` bound the edit
        th = db.thresholds()
        ready = bool(th) and all("dist_twin" in v for v in th.values())  # baselines, twins, envelope
        backend = None if ready and not todo else _backend(directory, spec, workers, ray_address, slurm, todo)
        try:
            if backend is not None:
                timing.size = backend.size
                timing.phase("startup", time.perf_counter() - timing.t0)
                _run_phases(directory, spec, db, backend, todo, progress, timing)
        finally:
            if backend is not None:
                backend.close()
        rows = db.trials()
    times = timing.summary()
    if times["trials"]["efficiency"] is not None:
        log.info(
            "%d trials on %d workers at %.2f of their compute floor (%.2f in CPU time; golden step %.2f ms "
            "x steps run)",
            times["trials"]["trials"],
            times["size"],
            times["trials"]["efficiency"],
            times["trials"]["cpu_efficiency"] or 0.0,
            1e3 * times["golden"]["step_s"],
        )
    return {
        "trials": len(plan),
        "done": len(rows),
        "ran": len(todo),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "timing": times,
    }


def _run_phases(
    directory: Path,
    spec: CampaignSpec,
    db: ResultsDB,
    backend,
    todo: list[Trial],
    progress: Progress | None,
    timing: RunTiming,
) -> None:
    have_refs = bool(db.references())
    if not have_refs or not _golden_ready(directory, spec):
        for result in _each(backend, [{"kind": "golden"}], "golden", progress, timing):
            if not have_refs:
                db.write_golden(result["losses"], result["references"])
    refs, losses = db.references(), db.golden_losses()
    h = spec.horizon

    def base_job(kind: str, s: int) -> dict:
        return {"kind": kind, "inject_step": s, "reference": refs[s], "golden_losses": losses[s : s + h]}

    done = {(b["inject_step"], b["seed"]) for b in db.baselines()}
    jobs = [
        {**base_job("baseline", s), "seed": k}
        for s in spec.inject_steps
        for k in spec.baseline.seeds
        if (s, k) not in done or not (directory / GOLDEN_DIR / f"baseline-{s}-{k}.pt").is_file()
    ]
    for result in _each(backend, jobs, "baseline", progress, timing):
        if (result["inject_step"], result["seed"]) not in done:
            db.write_baseline(result)
    if not db.thresholds():
        db.write_thresholds(_thresholds(spec, db.baselines()))
    have = {(t["inject_step"], t["twin"]) for t in db.twins()}
    jobs = [
        {**base_job("twin", s), "twin": k}
        for s in spec.inject_steps
        for k in range(spec.baseline.twins)
        if (s, k) not in have
    ]
    for result in _each(backend, jobs, "twins", progress, timing):
        db.write_twin(result)
    if jobs or any("dist_twin" not in th for th in db.thresholds().values()):
        _write_envelope(spec, db)
    thresholds = db.thresholds()
    jobs = [
        {**base_job("trial", t.inject_step), "trial": dataclasses.asdict(t), "thresholds": thresholds[t.inject_step]}
        for t in todo
    ]
    for result in _each(backend, jobs, "trials", progress, timing):
        db.write_trial({**result, "spec_hash": spec.hash})
