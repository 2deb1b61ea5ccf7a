"""From a campaign spec to its trials: expand the fault space, sample it, number the trials.

Target patterns are expanded against the live model into single modules (or parameters), so
every trial corrupts one layer and PVF can be read per layer; a target group (a list entry of
``faults.targets``) stays one target, the names it matches joined by ``,``. The plan is a pure
function of the spec: trial ``k`` is the same trial on every run, every machine, every worker
count.

Fault seeds give a *paired* design: all bits, fault models and schedules of one (injection step,
site, target, pattern location, repeat) share a seed, so a ``"random"`` location is the same
element for each of them and a sweep over bits compares like with like. A pattern's location
leaves out its channel swizzling (``swizzle``, ``swizzle_seed``), so a swizzled MAC cell and a
plain one are the same physical cell -- in one campaign or in two with the same fault space.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import dataclass
from itertools import product
from typing import Any

from torch import nn

from sdcscope.faults import BIT_MODELS, FaultSpec
from sdcscope.inject import resolve_targets
from sdcscope.inject.probe import evaluated, probe_model
from sdcscope.inject.validate import validate_spec
from sdcscope.study.spec import CampaignSpec
from sdcscope.workloads import make_workload, mix_seed

log = logging.getLogger("sdcscope.study.plan")

__all__ = ["Trial", "build_plan", "pending_trials", "pattern_label", "schedule_label", "location_json", "TARGET_SEP"]

TARGET_SEP = ","
"""Joins the module names of a target group into one trial target."""
SWIZZLE_KEYS = ("swizzle", "swizzle_seed")


def location_json(pattern: dict) -> str:
    """JSON of where a pattern's fault sits, without how the hardware swizzles channels to it."""
    return json.dumps({k: v for k, v in pattern.items() if k not in SWIZZLE_KEYS}, sort_keys=True)


def pattern_label(pattern: dict) -> str:
    """``element``, ``mac_cell(input_channel=0,output_channel=random)``, …"""
    args = ",".join(f"{k}={v}" for k, v in pattern.items() if k != "kind")
    return f"{pattern['kind']}({args})" if args else pattern["kind"]


def schedule_label(schedule: dict) -> str:
    return pattern_label(schedule)


@dataclass(frozen=True)
class Trial:
    """One point of the fault space, with its number in the plan and its fault seed."""

    trial_id: int
    inject_step: int
    site: str
    target: str
    model: str
    bit: int | None
    pattern: str
    """JSON of the pattern mapping (hashable)."""
    schedule: str
    """JSON of the schedule template."""
    repeat: int
    fault_seed: int
    profile: str = ""
    """The node profile whose fault space holds this trial ("" for a spec of one fault space)."""

    @property
    def swizzle(self) -> bool:
        """Whether the pattern re-maps its channels every step (a ``mac_cell`` with ``swizzle: per_step``)."""
        return json.loads(self.pattern).get("swizzle", "none") != "none"

    @property
    def key(self) -> str:
        """What the trial is, as stored (a profile is named only where there is one, so a spec of
        one fault space keeps the keys it always had)."""
        return "|".join(
            f"{k}={getattr(self, k)}"
            for k in ("inject_step", "site", "target", "model", "bit", "pattern", "schedule", "repeat")
        ) + (f"|profile={self.profile}" if self.profile else "")

    def dimension(self, name: str) -> Any:
        """The value of a fault-space dimension (labels for pattern and schedule)."""
        if name == "pattern":
            return pattern_label(json.loads(self.pattern))
        if name == "schedule":
            return schedule_label(json.loads(self.schedule))
        return getattr(self, name)

    def fault_spec(self, format: str | None = None) -> FaultSpec:
        """The FaultSpec of this trial, its schedule anchored at the injection step."""
        template = json.loads(self.schedule)
        kind, s = template["kind"], self.inject_step
        if kind == "transient":
            schedule = {
                "kind": kind,
                "step": s,
                **({"micro_batch": template["micro_batch"]} if template.get("micro_batch") is not None else {}),
            }
        elif kind == "permanent":
            schedule = {"kind": kind, "start": s}
        else:
            duration = template.get("duration")
            schedule = {"kind": kind, "p": template["p"], "start": s, **({"stop": s + duration} if duration else {})}
        return FaultSpec(
            site=self.site,
            target=self.target.split(TARGET_SEP),
            model=self.model,
            bits=None if self.bit is None else [self.bit],
            format=format,
            pattern=json.loads(self.pattern),
            schedule=schedule,
            rank=0,
            seed=self.fault_seed,
        )

    def to_row(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "key": self.key,
            "inject_step": self.inject_step,
            "site": self.site,
            "target": self.target,
            "model": self.model,
            "bit": self.bit,
            "pattern": self.dimension("pattern"),
            "schedule": self.dimension("schedule"),
            "swizzle": int(self.swizzle),
            "repeat": self.repeat,
            "fault_seed": self.fault_seed,
            "profile": self.profile or None,
        }


def _expand(model: nn.Module, space, site: str) -> list[str]:
    names: list[str] = []
    for entry in space.targets:
        found: list[str] = []
        for pattern in entry if isinstance(entry, tuple) else (entry,):
            probe = FaultSpec(site=site, target=pattern, model="zero", schedule={"kind": "transient", "step": 0})
            try:
                found += [t.key for t in resolve_targets(model, probe)]
            except ValueError as exc:
                raise ValueError(f"faults.targets {pattern!r} for site {site!r}: {exc}") from None
        found = list(dict.fromkeys(found))
        bad = [n for n in found if TARGET_SEP in n]
        if bad:
            raise ValueError(
                f"faults.targets {entry!r}: module name {bad[0]!r} contains {TARGET_SEP!r}, "
                "which joins the names of a target group"
            )
        names += [TARGET_SEP.join(found)] if isinstance(entry, tuple) else found
    return list(dict.fromkeys(names))


def _where(profile: str) -> str:
    """The prefix an error of a node profile's space carries (none for a spec of one space)."""
    return f"faults.profiles.{profile}: " if profile else ""


def _points(spec: CampaignSpec, model: nn.Module, optimizer) -> list[dict]:
    points = []
    for profile, space in spec.faults.spaces:
        for site in space.sites:
            try:
                targets = _expand(model, space, site)
            except ValueError as exc:
                raise ValueError(f"{_where(profile)}{exc}") from None
            where = product(spec.inject_steps, targets, space.patterns, range(space.repeats))
            for s, target, pattern, repeat in where:
                seed = mix_seed(space.seed, s, site, target, location_json(pattern), repeat)
                for model_name in space.models:
                    bits = space.bits if model_name in BIT_MODELS else (None,)
                    for bit, schedule in product(bits, space.schedules):
                        points.append(
                            dict(
                                inject_step=s,
                                site=site,
                                target=target,
                                model=model_name,
                                bit=bit,
                                pattern=json.dumps(pattern, sort_keys=True),
                                schedule=json.dumps(schedule, sort_keys=True),
                                repeat=repeat,
                                fault_seed=seed,
                                profile=profile,
                            )
                        )
    # One FaultSpec per distinct (site, target, model, pattern, schedule) checks against the model, and
    # against the tensors of one forward pass (and of the evaluation, which a permanent fault on a
    # module output acts in too): a trial's trainer runs from inject_step to + horizon.
    seen: dict[tuple, dict] = {}
    for p in points:
        seen.setdefault(
            (p["profile"], p["site"], p["target"], p["model"], p["pattern"], p["schedule"], p["inject_step"]), p
        )
    workload = make_workload(spec.workload_config())
    batch = workload.batch(spec.seed, spec.inject_steps[0], 0)
    specs = [(p, Trial(trial_id=-1, **p).fault_spec(spec.faults.space(p["profile"]).format)) for p in seen.values()]
    probe = probe_model(
        model,
        lambda m: workload.loss(m, batch),
        evaluate=workload.evaluate if evaluated([s for _, s in specs]) else None,
    )
    for p, spec_ in specs:
        try:
            validate_spec(
                model, spec_, optimizer, steps=p["inject_step"] + spec.horizon, grad_accum=spec.grad_accum, probe=probe
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"{_where(p['profile'])}fault space point {spec_.site} on {p['target']} ({spec_.schedule.kind}): {exc}"
            ) from None
    return points


def _shuffled(items: list, *key: object) -> list:
    """``items`` in a random order fixed by ``key`` (a seeded permutation)."""
    order = list(items)
    random.Random(mix_seed("sampling", *key)).shuffle(order)
    return order


def _sample(spec: CampaignSpec, points: list[dict]) -> list[int]:
    """The indices of the sampled points. Prefix-stable: each draw is the first ``n`` of a seeded
    permutation (of the points; of the strata, and of each stratum's points), so a larger ``n``
    with the same seed draws a superset -- an extended campaign only adds trials."""
    sampling = spec.sampling
    if sampling.kind == "exhaustive":
        return list(range(len(points)))
    if sampling.kind == "random":
        if sampling.n > len(points):
            raise ValueError(
                f"sampling n={sampling.n} exceeds the {len(points)} points of the fault space; "
                "lower n or use kind: exhaustive"
            )
        return sorted(_shuffled(range(len(points)), sampling.seed)[: sampling.n])
    strata: dict[tuple, list[int]] = {}
    for i, p in enumerate(points):
        key = tuple(Trial(trial_id=i, **p).dimension(d) for d in sampling.by)
        strata.setdefault(key, []).append(i)
    # n = share per stratum + one more for the first `extra` strata of a seeded order of them: a
    # stratum's count never falls as n grows, and it takes the first points of its own permutation
    share, extra = divmod(sampling.n, len(strata))
    order = _shuffled(list(strata), sampling.seed, "strata")
    chosen: list[int] = []
    for k, key in enumerate(order):
        want = share + (1 if k < extra else 0)
        chosen += _shuffled(strata[key], sampling.seed, *key)[:want]
    if share == 0:
        covered = order[:extra]
        shown = "; ".join("/".join(map(str, key)) for key in covered[:8]) + ("; …" if len(covered) > 8 else "")
        log.warning(
            "sampling n=%d is below the %d strata of by=%s: only %d strata are covered (%s), the others get no "
            "trial; raise n to at least %d (the campaign can be extended later) or stratify by fewer dimensions",
            sampling.n,
            len(strata),
            list(sampling.by),
            len(covered),
            shown,
            len(strata),
        )
    return sorted(chosen)


def pending_trials(plan: list[Trial], stored: dict[int, str]) -> list[Trial]:
    """The trials of ``plan`` not stored yet (``stored``: ``{trial_id: key}`` of the stored rows).
    A trial is known by its key; where an extended campaign's plan gives a new trial an id a
    stored row already holds, it gets the next free id instead, so every row stays as it is."""
    done = set(stored.values())
    todo = [t for t in plan if t.key not in done]
    taken = set(stored)
    if not any(t.trial_id in taken for t in todo):
        return todo
    next_id = max([*taken, *(t.trial_id for t in plan)]) + 1
    renumbered = []
    for t in todo:
        if t.trial_id in taken:
            t, next_id = dataclasses.replace(t, trial_id=next_id), next_id + 1
        taken.add(t.trial_id)
        renumbered.append(t)
    return renumbered


def build_plan(spec: CampaignSpec, model: nn.Module, optimizer=None) -> list[Trial]:
    """The campaign's trials in plan order, numbered 0..N-1 (never empty: raises instead)."""
    points = _points(spec, model, optimizer)
    if not points:
        raise ValueError("the fault space is empty")
    chosen = _sample(spec, points)
    if not chosen:
        raise ValueError("sampling selected no trial")
    trials = [Trial(trial_id=k, **points[i]) for k, i in enumerate(chosen)]
    keys = [t.key for t in trials]
    if len(set(keys)) != len(keys):  # a trial is stored under its key: two could never both finish
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the fault space holds the same trial twice: {twice}")
    return trials
