"""The campaign worker: golden run, healthy baselines, perturbation twins and trials, one job at a time.

A worker builds the workload and a trainer once, then restores a golden snapshot for each job
(never re-training from step 0). Every job result is a pure function of (campaign spec, job):
workers run torch with one thread, so results do not depend on the worker count or on which
worker runs a job. Files it writes (snapshots, trajectories, baseline end states) go to
``DIR/golden/`` atomically; rows go back to the runner, which commits them (each result also
carries its wall and CPU time and the worker's name, and the golden job its mean step time: the
run's timing, :mod:`.timing`). Each trial also leaves what the scoreboard reads
(``sdcscope.study.scoreboard``): ``DIR/trials/trial-ID/injections.jsonl``
(the fired faults' records, each with the corrupted tensor's ``shape`` as far as known) and, in a
guarded campaign, its ``events.jsonl`` (the guard's events); a healthy baseline of a guarded
campaign leaves ``DIR/trials/baseline-STEP-SEED/events.jsonl``.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import torch

from sdcscope.engine import Trainer, load_checkpoint, param_sha256, save_checkpoint
from sdcscope.faults import FaultSpecError
from sdcscope.inject import Injector
from sdcscope.study.drift import Predictor, disagreement
from sdcscope.study.guarded import first_detection, guard_events, make_guard
from sdcscope.study.levels import gradient_level, submodule_level
from sdcscope.study.outcomes import classify, drift_flags
from sdcscope.study.plan import Trial
from sdcscope.study.scoreboard import TRIALS_DIR, baseline_name, known_shape, trial_name, write_rows
from sdcscope.study.spec import CampaignSpec
from sdcscope.study.twins import perturb_twin
from sdcscope.workloads import make_workload

__all__ = ["Worker", "GOLDEN_DIR", "drift_offsets", "flat_params", "rel_distance"]

GOLDEN_DIR = "golden"


def drift_offsets(horizon: int, points: int = 8) -> list[int]:
    """Steps after the injection at which parameter drift is measured (ends at ``horizon``)."""
    return sorted({max(1, round(horizon * k / points)) for k in range(1, points + 1)})


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def rel_distance(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """‖a − b‖ / ‖b‖ in float64; ``None`` when not finite."""
    num = float((a.double() - b.double()).norm())
    den = float(b.double().norm())
    value = num / den if den > 0 else math.inf
    return value if math.isfinite(value) else None


def _save(obj: Any, path: Path) -> None:
    from sdcscope.engine.state import save_torch  # atomic; a refused write raises StorageError

    save_torch(obj, path, "the golden run's trajectory")


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _unchanged(records: list[dict]) -> bool:
    """Every fired fault left every value bit for bit as it was (all of its elements listed)."""
    return all(
        r["count"] == len(r["before"])
        and all(_bits(float(b)) == _bits(float(a)) for b, a in zip(r["before"], r["after"]))
        for r in records
    )


def _steady(times: list[float]) -> float:
    """The mean step time, the first (warm-up: it allocates) left out: the trials' compute floor."""
    rest = times[1:] or times
    return sum(rest) / len(rest)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class Worker:
    """Runs campaign jobs (``{"kind": "golden" | "baseline" | "twin" | "trial", ...}``) in one process."""

    def __init__(self, directory: str | Path, spec: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        self.dir = Path(directory) / GOLDEN_DIR
        self.spec = CampaignSpec.from_dict(spec)
        self.workload = make_workload(self.spec.workload_config())
        self.trainer = Trainer(self.workload, self.spec.train_config())
        self._cache: dict[str, Any] = {}
        self._predictor: Predictor | None = None
        self.id = f"{socket.gethostname()}:{os.getpid()}"
        """Names this worker in the results it returns (``worker``), for the run's timing."""

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        t0, c0 = time.perf_counter(), time.process_time()
        kinds = {"golden": self.golden, "baseline": self.baseline, "twin": self.twin, "trial": self.trial}
        result = kinds[job["kind"]](job)
        result["wall_s"] = round(time.perf_counter() - t0, 4)
        result["cpu_s"] = round(time.process_time() - c0, 4)
        result["worker"] = self.id
        return result

    # -- files -------------------------------------------------------------------------------
    def _load(self, name: str, loader) -> Any:
        if name not in self._cache:
            self._cache[name] = loader(self.dir / name)
        return self._cache[name]

    def _restore(self, step: int, seed: int | None = None) -> None:
        t = self.trainer
        t.callbacks = []
        t.config = self.spec.train_config(seed)
        t.restore(self._load(f"step-{step}", load_checkpoint))

    def _trajectory(self, step: int) -> dict[str, Any]:
        return self._load(f"trajectory-{step}.pt", lambda p: torch.load(p, weights_only=True))

    def _disagree(self, step: int, k: int, model: torch.nn.Module) -> float | None:
        """Prediction disagreement of ``model`` with golden at the ``k``-th drift step after
        ``step`` (golden's predictions come from its stored trajectory, once per worker)."""
        if self._predictor is None:
            self._predictor = Predictor(self.workload)
        golden = self._load(f"predictions-{step}-{k}", lambda _: self._predictor(self._trajectory(step)["params"][k]))
        return disagreement(self._predictor(model), golden)

    # -- golden ------------------------------------------------------------------------------
    def golden(self, job: dict[str, Any]) -> dict[str, Any]:
        spec = self.spec
        self.dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(self.workload, spec.train_config())
        offsets = drift_offsets(spec.horizon)
        points = {s + o for s in spec.inject_steps for o in offsets}
        ends = {s + spec.horizon: s for s in spec.inject_steps}
        flats: dict[int, torch.Tensor] = {}
        losses, refs, times, cpu = [], [], [], []
        for step in range(spec.golden_steps + 1):
            if step in spec.inject_steps:
                save_checkpoint(trainer.snapshot(), self.dir / f"step-{step}")
            if step in points:
                flats[step] = flat_params(trainer.model)
            if step in ends:
                ev = trainer.evaluate()
                refs.append(
                    {
                        "inject_step": ends[step],
                        "end_step": step,
                        "val_loss": ev["val_loss"],
                        "val_acc": ev.get("val_acc"),
                        "param_sha256": param_sha256(trainer.model),
                        "drift_steps": [ends[step] + o for o in offsets],
                    }
                )
            if step == spec.golden_steps:
                break
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.train_step()["loss"]
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if not math.isfinite(loss):
                raise ValueError(
                    f"the golden run itself diverged at step {step} (loss {loss}); "
                    "lower the learning rate or the golden-run length"
                )
            losses.append(loss)
        for s in spec.inject_steps:
            _save(
                {"steps": [s + o for o in offsets], "params": torch.stack([flats[s + o] for o in offsets])},
                self.dir / f"trajectory-{s}.pt",
            )
        return {
            "kind": "golden",
            "losses": losses,
            "references": refs,
            "step_s": _steady(times),
            "step_cpu_s": _steady(cpu),
        }

    # -- a horizon of training ---------------------------------------------------------------
    def _train(self, job: dict[str, Any], stop=None) -> dict[str, Any]:
        """Train to the end of the horizon (a guard's rollback may replay steps: at most 4x the
        horizon in optimizer steps); loss curve, drift to golden, crash; ``stop()`` may end early."""
        t, s, h = self.trainer, job["inject_step"], self.spec.horizon
        traj = self._trajectory(s)
        at, drift, disagree = set(traj["steps"]), {}, {}
        out = {"losses": [], "crash": False, "error": None, "early": False}
        by_step: dict[int, float] = {}  # a step trained again after a rollback replaces its first try
        rows = 0
        try:
            while t.step < s + h and rows < 4 * h:
                row = t.train_step()
                rows += 1
                loss = by_step[row["step"]] = row["loss"]
                if not math.isfinite(loss) and not row.get("skipped"):  # a step the guard discarded is no crash
                    out["crash"] = True
                    break
                if t.step in at:
                    k = traj["steps"].index(t.step)
                    d = drift[t.step] = rel_distance(flat_params(t.model), traj["params"][k])
                    disagree[t.step] = 0.0 if d == 0 else None if d is None else self._disagree(s, k, t.model)
                if stop is not None and stop():
                    out["early"] = True
                    break
        except FaultSpecError:  # the fault does not fit its tensor: a configuration error, not a crash
            raise
        except Exception as exc:  # a corrupted value can make an operation raise: the run crashed
            out.update(crash=True, error=f"{type(exc).__name__}: {exc}")
        out["losses"] = [by_step[k] for k in sorted(by_step)]
        out["steps_run"] = rows  # optimizer steps run, a guard's replays included (the run's timing)
        out["drift"] = [drift[k] for k in traj["steps"] if k in drift]
        out["disagree"] = [disagree[k] for k in traj["steps"] if k in disagree]
        return out

    def _measures(self, job: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
        golden, losses = job["golden_losses"], run["losses"]
        pairs = [(f, g) for f, g in zip(losses, golden) if math.isfinite(f)]
        diffs = [f - g for f, g in pairs]
        first = next((i for i, (f, g) in enumerate(zip(losses, golden)) if _bits(f) != _bits(g)), None)
        return {
            "steps": len(losses),
            "losses": losses,
            "drift": run["drift"],
            "disagree": run["disagree"],
            "final_loss": losses[-1] if losses else None,
            "first_diff_step": None if first is None else job["inject_step"] + first,
            "loss_excess": max(diffs) if diffs else None,
            "loss_diff_max": max(map(abs, diffs)) if diffs else None,
            "loss_diff_mean": sum(map(abs, diffs)) / len(diffs) if diffs else None,
        }

    # -- healthy baseline and perturbation twin ---------------------------------------------
    def baseline(self, job: dict[str, Any]) -> dict[str, Any]:
        """A healthy run re-seeded (another data order) from the injection snapshot."""
        s, seed = job["inject_step"], job["seed"]
        self._restore(s, seed)
        events = self.dir.parent / TRIALS_DIR / baseline_name(s, seed) / "events.jsonl"  # a clean trial's verdicts
        row = self._healthy(job, f"the healthy baseline run from step {s} with seed {seed}", events)
        _save(flat_params(self.trainer.model), self.dir / f"baseline-{s}-{seed}.pt")
        return {**row, "kind": "baseline", "seed": seed}

    def twin(self, job: dict[str, Any]) -> dict[str, Any]:
        """Perturbation twin ``job["twin"]``: the injection snapshot with one ulp of a random half of
        the weights (:func:`~sdcscope.study.twins.perturb_twin`), trained on with golden's seed."""
        s, k = job["inject_step"], job["twin"]
        self._restore(s)
        changed = perturb_twin(self.trainer.model, s, k)
        row = self._healthy(job, f"perturbation twin {k} from step {s}")
        return {**row, "kind": "twin", "twin": k, "changed": changed}

    def _healthy(self, job: dict[str, Any], what: str, events: Path | None = None) -> dict[str, Any]:
        """Train a restored healthy run over the horizon (under the guard when the campaign has
        one, its events written to ``events`` for the scoreboard) and measure it against golden;
        a diverged healthy run stops the campaign."""
        s, ref = job["inject_step"], job["reference"]
        guard = make_guard(self.trainer, self.spec.guard_config()) if self.spec.guard else None
        run = self._train(job)
        if run["crash"]:
            raise ValueError(f"{what} diverged ({run['error'] or 'non-finite loss'}); lower the learning rate")
        ev = self.trainer.evaluate()
        if guard is not None and events is not None:
            write_rows(events, guard_events(guard, s))
        m = self._measures(job, run)
        return {
            "inject_step": s,
            "val_loss": ev["val_loss"],
            "val_acc": ev.get("val_acc"),
            "val_delta": ev["val_loss"] - ref["val_loss"],
            "loss_excess": m["loss_excess"],
            "dist_golden": run["drift"][-1],
            "guard_events": None if guard is None else len(guard_events(guard, s)),
            "losses": run["losses"],
            "drift": run["drift"],
            "disagree": run["disagree"],
        }

    # -- trial -------------------------------------------------------------------------------
    def _arm(self, spec):
        """``arm(step)``: a fresh attached injector holding the fault (a swizzled pattern follows
        the injector's step by itself)."""
        t = self.trainer
        return lambda step: Injector(t.model, [spec], t.optimizer, warn_unfired=False).attach()

    def trial(self, job: dict[str, Any]) -> dict[str, Any]:
        trial = Trial(**job["trial"])
        try:
            return self._trial(trial, job)
        except FaultSpecError as exc:
            raise FaultSpecError(
                f"trial {trial.trial_id} ({trial.site} on {trial.target}, pattern "
                f"{trial.dimension('pattern')}): {exc}; fix the fault space (a configuration "
                "error is never recorded as a crash)"
            ) from None

    def _trial(self, trial: Trial, job: dict[str, Any]) -> dict[str, Any]:
        s, t, ref = trial.inject_step, self.trainer, job["reference"]
        spec = trial.fault_spec(self.spec.faults.space(trial.profile).format)
        row: dict[str, Any] = {"kind": "trial", **trial.to_row()}
        if self.spec.analysis == "full":
            self._restore(s)
            arm = self._arm(spec)
            row.update(submodule_level(t, arm))
            self._restore(s)
            ratios = gradient_level(t, arm, self.spec.horizon)
            row.update(nsr=ratios, nsr_max=max(ratios), nsr_mean=sum(ratios) / len(ratios))
        self._restore(s)
        fault = Injector(t.model, [spec], t.optimizer, warn_unfired=False).attach()
        callback = fault.callback()
        t.add_callback(callback)
        guard = make_guard(t, self.spec.guard_config()) if self.spec.guard else None
        sched = spec.schedule
        over = (
            (lambda: t.step > sched.step)
            if sched.kind == "transient"
            else ((lambda: t.step >= sched.stop) if sched.kind != "permanent" and sched.stop is not None else None)
        )
        early_ok = over is not None and guard is None and spec.pattern.kind != "mac_cell"
        stop = (lambda: over() and _unchanged(fault.records)) if early_ok else None
        run = self._train(job, stop)
        permanent = sched.kind == "permanent"
        ev_fault = t.evaluate() if permanent and not run["crash"] else {}
        fault.close()
        records = fault.records
        t.callbacks = [c for c in t.callbacks if c is not callback]
        row.update(self._measures(job, run), steps_run=run["steps_run"])
        traj = self._trajectory(s)
        if run["early"]:  # nothing changed and nothing can fire any more: the golden trajectory
            row.update(
                losses=job["golden_losses"],
                final_loss=job["golden_losses"][-1],
                loss_excess=0.0,
                loss_diff_max=0.0,
                loss_diff_mean=0.0,
                drift=[0.0] * len(traj["steps"]),
                disagree=[0.0] * len(traj["steps"]),
            )
            ev, sha, final = (
                {"val_loss": ref["val_loss"], "val_acc": ref["val_acc"]},
                ref["param_sha256"],
                traj["params"][-1],
            )
        else:
            ev = t.evaluate() if not run["crash"] else {}
            sha, final = param_sha256(t.model), flat_params(t.model)
        crash = run["crash"] or not bool(torch.isfinite(final).all()) or not _finite(ev.get("val_loss"))
        activated = bool(records) and (not _unchanged(records))
        val_loss = ev.get("val_loss")
        dist_golden = row["drift"][-1] if len(row["drift"]) == len(traj["steps"]) else None
        disagree_final = row["disagree"][-1] if len(row["disagree"]) == len(traj["steps"]) else None
        healthy = [
            rel_distance(final, self._load(f"baseline-{s}-{k}.pt", lambda p: torch.load(p, weights_only=True)))
            for k in self.spec.baseline.seeds
        ]
        events = guard_events(guard, s) if guard is not None else []
        where = self.dir.parent / TRIALS_DIR / trial_name(trial.trial_id)
        write_rows(
            where / "injections.jsonl", [{**r, "shape": known_shape(t.model, r["site"], r["module"])} for r in records]
        )
        if guard is not None:
            write_rows(where / "events.jsonl", events)
        first, hit = first_detection(events, records)
        row.update(
            fired=int(bool(records)),
            activated=int(activated),
            injections=len(records),
            crash=int(crash),
            masked=int(bool(records) and not crash and (sha == ref["param_sha256"] or not activated)),
            error=run["error"],
            val_loss=val_loss if _finite(val_loss) else None,
            val_acc=ev.get("val_acc"),
            val_loss_fault=ev_fault.get("val_loss"),
            val_acc_fault=ev_fault.get("val_acc"),
            val_delta=val_loss - ref["val_loss"] if _finite(val_loss) else None,
            dist_golden=None if crash else dist_golden,
            disagree_final=None if crash else disagree_final,
            dist_healthy=None if crash or None in healthy else sum(healthy) / len(healthy),
            detected=None if guard is None else int(hit is not None),
            detect_step=None if hit is None else hit["step"],
            detector=None if hit is None else hit.get("detector"),
            latency=None if hit is None else hit["step"] - first,
            guard_events=None if guard is None else len(events),
        )
        measures = {**row, "crash": crash, "masked": row["masked"], "detected": row["detected"]}
        row.update(classify(measures, job["thresholds"], guard is not None), **drift_flags(measures, job["thresholds"]))
        return row
