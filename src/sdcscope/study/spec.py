"""The campaign spec (``campaign.yaml``): workload, golden run, fault space, sampling, baseline.

Example (every key but ``workload``, ``inject_steps``, ``horizon`` and ``faults`` has a default)::

    name: gpt-bits
    workload: {name: gpt, preset: tiny, eval_batches: 2}   # + any WorkloadConfig field
                                   # (a relative corpus: path is taken from this file's folder)
    seed: 0                        # training seed of the golden run (init and data order)
    inject_steps: [30]             # golden snapshots are saved here; each trial starts from one
    horizon: 50                    # steps trained after the injection step
    golden_steps: 80               # golden-run length (default and minimum: max(inject_steps) + horizon)
    faults:                        # the fault space: the cross product of these lists
      sites: [gemm.forward, gemm.grad_input, gemm.grad_weight]
      targets: ["blocks.*.attn.*_proj", "blocks.*.mlp.*", head]   # expanded to single modules
      models: [bitflip]
      bits: ["0-31"]               # ints and "a-b" ranges
      patterns: [{kind: element}]  # FaultSpec patterns (mac_cell: array, swizzle: per_step, ...)
      schedules: [{kind: transient}]   # transient | permanent | intermittent {p, duration}
      repeats: 1                   # independent draws (fault seeds) per point
      seed: 0
    sampling: {kind: random, n: 40, seed: 0}   # exhaustive | random | stratified (+ by: [bit], or by: bit)
    baseline: {seeds: [101, 102, 103], alpha: 0.01, twins: 4, twin_margin: 2.0}
    guard: false                   # true: the guard, profile balanced; or a guard config mapping:
                                   # {profile: minimal | balanced | full, abft: {c: 9}, ...}
    analysis: basic                # full: also lock-step (level a) and gradient NSR (level b)

``faults`` may instead name node profiles, a fault space each (the union is sampled, every trial
tagged with its profile; ``sampling.by: [profile]`` stratifies by them)::

    faults:
      profiles:
        attn-lane: {sites: [gemm.forward], targets: ["blocks.*.attn.*_proj"], models: [bitflip], bits: [22],
                    patterns: [{kind: mac_cell, array: [8, 8]}], schedules: [{kind: intermittent, p: 0.2}],
                    repeats: 5}
        ffn-exponent: {…}

A ``targets`` entry that is itself a list is *one* target: every module its patterns match, hit
by the same fault in one trial (a unit that runs all those GEMMs, e.g. one NVDLA MAC array serving
every layer: ``targets: [[conv1, conv2, fc1, fc2, fc3]]``). A plain entry is expanded into single
modules, one trial each.

Schedules are templates: the runner puts the injection step in (transient ``step``, permanent and
intermittent ``start``; intermittent ``duration`` gives ``stop = start + duration``). Everything is
validated here; mistakes raise ``ValueError``/``TypeError`` naming the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sdcscope.common.io import load_yaml, read_text
from sdcscope.common.validate import did_you_mean
from sdcscope.engine.trainer import SEED_MAX
from sdcscope.study.guarded import guard_section
from sdcscope.study.space import (
    SCHEDULE_TEMPLATES,
    FaultProfiles,
    FaultSpace,
    _choices,
    _int,
    _keys,
    _list,
    fault_section,
)

__all__ = [
    "CampaignSpec",
    "FaultSpace",
    "FaultProfiles",
    "Sampling",
    "Baseline",
    "load_campaign",
    "SAMPLING_KINDS",
    "DIMENSIONS",
    "ANALYSES",
    "SCHEDULE_TEMPLATES",
]

SAMPLING_KINDS = ("exhaustive", "random", "stratified")
DIMENSIONS = ("profile", "inject_step", "site", "target", "model", "bit", "pattern", "schedule", "swizzle")
"""The dimensions of the fault space (``sampling.by`` picks strata among them)."""
ANALYSES = ("basic", "full")
BASELINE_SEED_MAX = 2**63 - 1
"""results.sqlite keeps a baseline's seed as a signed 64-bit integer."""
TWINS_MIN, TWINS_MAX = 3, 64
"""Perturbation twins per injection step: each is tested against the others (>= 2 of them)."""
WORKLOAD_KEYS = (
    "name",
    "preset",
    "batch_size",
    "lr",
    "weight_decay",
    "warmup",
    "grad_clip",
    "corpus",
    "max_corpus_bytes",
    "eval_batches",
    "qk_norm",
    "z_loss",
    "precision",
    "label_noise",
)


@dataclass(frozen=True)
class Sampling:
    """Which points of the fault space become trials.

    ``exhaustive``: all. ``random``: ``n`` points uniformly without replacement. ``stratified``:
    ``n`` points spread evenly over the strata formed by the dimensions ``by`` (the remainder goes
    to strata drawn at random), uniformly without replacement inside each stratum; a stratum
    smaller than its share gives all its points. An ``n`` below the number of strata covers only
    ``n`` of them: the plan warns and names them.

    A campaign may be *extended*: its ``sampling`` edited (a larger ``n``, another seed,
    ``exhaustive``) while the fault space, workload and everything else stay the same
    (:attr:`CampaignSpec.space_hash`). Every stored row is kept; the trials of the new sample not
    run yet are added.
    """

    kind: str = "exhaustive"
    n: int | None = None
    by: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SAMPLING_KINDS:
            raise ValueError(
                f"unknown sampling kind {self.kind!r}{did_you_mean(str(self.kind), SAMPLING_KINDS)}; "
                f"allowed: {list(SAMPLING_KINDS)}"
            )
        if self.kind == "exhaustive":
            if self.n is not None or self.by:
                raise ValueError("sampling kind 'exhaustive' takes neither n nor by")
        else:
            if self.n is None:
                raise ValueError(f"sampling kind {self.kind!r} needs n (the number of trials, >= 1)")
            _int("sampling n", self.n, 1)
        by = () if self.by is None else self.by
        if isinstance(by, str):
            by = [by]  # `by: bit` is `by: [bit]`
        elif not isinstance(by, (list, tuple)):
            raise TypeError(
                f"sampling.by must be a dimension name or a list of them among {list(DIMENSIONS)}, got {by!r}"
            )
        for item in by:
            if not isinstance(item, str):
                raise TypeError(
                    f"sampling.by entries must be dimension names (strings) among {list(DIMENSIONS)}, got {item!r}"
                )
        by = tuple(_choices("sampling.by", list(by), DIMENSIONS)) if by else ()
        if self.kind == "stratified" and not by:
            raise ValueError(f"sampling kind 'stratified' needs by: a list among {list(DIMENSIONS)}")
        if self.kind == "random" and by:
            raise ValueError("sampling kind 'random' takes no by (use kind: stratified)")
        object.__setattr__(self, "by", by)
        _int("sampling seed", self.seed)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "n": self.n, "by": list(self.by), "seed": self.seed}


@dataclass(frozen=True)
class Baseline:
    """Healthy runs continued from each injection snapshot with other data-order ``seeds``; their
    spread sets the outcome thresholds (one-sided level ``alpha``, see :mod:`.stats`).

    ``twins`` perturbation twins per injection step set the chaos floor of ``sdc:drift``: golden's
    snapshot with a rounding-level change (one ulp of a random half of the weights), trained with
    golden's data order; a trial is beyond the floor when its final distance to golden exceeds
    ``twin_margin`` times the twins' bound (see :mod:`.twins`). At least 3 twins, so that each twin
    can be tested against the others (the false-drift rate)."""

    seeds: tuple[int, ...] = (1001, 1002, 1003)
    alpha: float = 0.01
    twins: int = 4
    twin_margin: float = 2.0

    def __post_init__(self) -> None:
        seeds = [_int("baseline seed", s, 0, BASELINE_SEED_MAX) for s in _list("baseline.seeds", self.seeds)]
        if len(set(seeds)) < 2:
            raise ValueError(
                f"baseline.seeds needs at least 2 distinct seeds to measure the seed-to-seed spread, got {seeds!r}"
            )
        object.__setattr__(self, "seeds", tuple(dict.fromkeys(seeds)))
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < 0.5:
            raise ValueError(f"baseline.alpha must be a number in (0, 0.5), got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        _int("baseline.twins", self.twins, TWINS_MIN, TWINS_MAX)
        margin = self.twin_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 1 <= margin < float("inf"):
            raise ValueError(
                f"baseline.twin_margin must be a finite number >= 1 (a factor on the twins' bound), got {margin!r}"
            )
        object.__setattr__(self, "twin_margin", float(margin))

    def to_dict(self) -> dict[str, Any]:
        return {"seeds": list(self.seeds), "alpha": self.alpha, "twins": self.twins, "twin_margin": self.twin_margin}


@dataclass(frozen=True)
class CampaignSpec:
    workload: dict
    inject_steps: tuple[int, ...]
    horizon: int
    faults: FaultSpace | FaultProfiles
    name: str = "campaign"
    seed: int = 0
    grad_accum: int = 1
    golden_steps: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    baseline: Baseline = field(default_factory=Baseline)
    guard: bool | Mapping[str, Any] = False
    """``false`` (the default): no guard. ``true``: every trial and healthy baseline runs under the
    Guard with its defaults, profile ``balanced``. A mapping: the guard config those runs get, as a
    ``--guard-config`` file writes it -- ``{profile: full}``, ``{profile: minimal, abft: {c: 9}}``
    -- its ``profile`` ``balanced`` unless given (``minimal`` | ``balanced`` | ``full``), the
    sections it gives kept as given (:class:`~sdcscope.guard.GuardConfig`). Stored as
    ``false`` or the mapping with its profile spelled out (the results database and the report
    name the profile measured); ``true`` and ``{profile: balanced}`` are one spec, one hash."""
    analysis: str = "basic"

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        wl = _keys("workload", self.workload, WORKLOAD_KEYS)
        if "name" not in wl:
            raise ValueError("workload.name is required: gpt, moe or cnn")
        set_("workload", wl)
        try:
            self.workload_config()  # validates names, presets and values
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"workload: {exc}") from None
        steps = [_int("inject_steps entry", s) for s in _list("inject_steps", self.inject_steps)]
        if len(set(steps)) != len(steps):
            raise ValueError(f"inject_steps must be distinct, got {steps!r}")
        set_("inject_steps", tuple(sorted(steps)))
        _int("horizon", self.horizon, 1)
        _int("seed", self.seed, 0, SEED_MAX)
        _int("grad_accum", self.grad_accum, 1)
        need = self.inject_steps[-1] + self.horizon
        if self.golden_steps is None:
            set_("golden_steps", need)
        elif _int("golden_steps", self.golden_steps, 1) < need:
            raise ValueError(f"golden_steps={self.golden_steps} must be >= max(inject_steps) + horizon = {need}")
        if self.seed in self.baseline.seeds:
            raise ValueError(f"baseline.seeds {list(self.baseline.seeds)} must differ from the golden seed {self.seed}")
        set_("guard", guard_section(self.guard))
        if self.analysis not in ANALYSES:
            raise ValueError(
                f"unknown analysis {self.analysis!r}{did_you_mean(str(self.analysis), ANALYSES)}; "
                f"allowed: {list(ANALYSES)}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty string, got {self.name!r}")

    def workload_config(self):
        from sdcscope.workloads import WorkloadConfig

        opts = {k: v for k, v in self.workload.items() if k != "name"}
        return WorkloadConfig(workload=self.workload["name"], **opts)

    def train_config(self, seed: int | None = None):
        from sdcscope.engine import TrainConfig

        return TrainConfig(seed=self.seed if seed is None else seed, grad_accum=self.grad_accum)

    @property
    def guard_profile(self) -> str | None:
        """The guard profile the trials are measured under; None without a guard."""
        return self.guard["profile"] if self.guard else None

    def guard_config(self):
        """A fresh :class:`~sdcscope.guard.GuardConfig` of ``guard`` (one per guarded run: a
        guard may change its config), or None without a guard."""
        if not self.guard:
            return None
        from sdcscope.guard import GuardConfig

        return GuardConfig.from_dict(self.guard)

    @classmethod
    def from_dict(cls, data: Any) -> CampaignSpec:
        data = _keys("campaign", data, tuple(f.name for f in fields(cls)))
        for key in ("workload", "inject_steps", "horizon", "faults"):
            if key not in data:
                raise ValueError(f"campaign key {key!r} is required")
        data["faults"] = fault_section(data["faults"])
        data["sampling"] = Sampling(**_keys("sampling", data.get("sampling", {}), ("kind", "n", "by", "seed")))
        data["baseline"] = Baseline(
            **_keys("baseline", data.get("baseline", {}), ("seeds", "alpha", "twins", "twin_margin"))
        )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "workload": dict(self.workload),
            "seed": self.seed,
            "grad_accum": self.grad_accum,
            "inject_steps": list(self.inject_steps),
            "horizon": self.horizon,
            "golden_steps": self.golden_steps,
            "faults": self.faults.to_dict(),
            "sampling": self.sampling.to_dict(),
            "baseline": self.baseline.to_dict(),
            "guard": json.loads(json.dumps(self.guard)),
            "analysis": self.analysis,
        }

    @property
    def hash(self) -> str:
        """sha256 of the normalized spec (comments, key order and defaults spelled out or not
        make no difference); the results database is bound to it."""
        text = json.dumps(_hash_form(self.to_dict()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def space_hash(self) -> str:
        """:attr:`hash` without ``sampling``: two specs with the same space hash draw trials from
        the same fault space with the same meaning, so one campaign may be extended by the other
        (see :class:`Sampling`)."""
        return space_hash(self.to_dict())


_TWIN_DEFAULTS = {"twins": Baseline.twins, "twin_margin": Baseline.twin_margin}


def _hash_form(spec: Mapping) -> Mapping:
    """``spec`` as hashed: a guard of every default (``{profile: balanced}``) as ``true``, as specs
    wrote it before guard profiles, and the perturbation twins' knobs left out at their defaults,
    as specs wrote them before twins, so their results databases stay bound to them (they gain
    the twins on the next ``campaign run``)."""
    if spec.get("guard") == {"profile": "balanced"}:
        spec = {**spec, "guard": True}
    base = spec.get("baseline")
    if isinstance(base, Mapping):
        spec = {**spec, "baseline": {k: v for k, v in base.items() if _TWIN_DEFAULTS.get(k, object()) != v}}
    return spec


def read_campaign_data(source: str | os.PathLike[str]) -> tuple[str, Mapping]:
    """``(where, data)``: the raw mapping of a campaign spec file path (or YAML text), before
    validation; ``where`` names the file (``"<text>"`` for text)."""
    path = os.fspath(source)
    if "\n" not in path and os.path.isdir(path):
        raise FileNotFoundError(f"campaign spec {path!r} is a directory, not a spec file")
    if "\n" not in path and os.path.isfile(path):
        where, text = path, read_text(path)
    elif "\n" not in path and path.endswith((".yaml", ".yml", ".json")):
        raise FileNotFoundError(f"campaign spec {path!r} does not exist")
    else:
        where, text = "<text>", path
    data = load_yaml(text, where)
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must hold a mapping (a campaign spec), got {data!r}")
    return where, data


def _resolve_corpus(data: Mapping, where: str) -> Mapping:
    """``data`` with a relative ``workload.corpus`` made absolute against the folder of the spec
    file ``where`` (not the current directory, which changes between ``init`` and ``run``); the
    corpus must exist."""
    wl = data.get("workload")
    corpus = wl.get("corpus") if isinstance(wl, Mapping) else None
    if not isinstance(corpus, str) or not corpus:
        return data  # absent, or a bad value the workload's validation names
    path = os.path.expanduser(corpus)
    if not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.abspath(where)), path)
    path = os.path.realpath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"workload.corpus {corpus!r} does not exist (looked for {path!r}; a relative "
            "path is taken from the spec file's folder); give a text file or a folder"
        )
    return {**data, "workload": {**wl, "corpus": path}}


def load_campaign(source: str | os.PathLike[str]) -> CampaignSpec:
    """A campaign spec from a YAML file path (or YAML text); errors name the file. From a file,
    a relative ``workload.corpus`` is taken from the file's folder (and stored absolute)."""
    where, data = read_campaign_data(source)
    try:
        if where != "<text>":
            data = _resolve_corpus(data, where)
        return CampaignSpec.from_dict(data)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


def space_hash(spec: Mapping) -> str:
    """:attr:`CampaignSpec.space_hash` of a normalized spec mapping (``to_dict()``, as stored)."""
    text = json.dumps(
        {k: v for k, v in _hash_form(spec).items() if k != "sampling"}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()
