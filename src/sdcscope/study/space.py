"""A campaign's fault space (``faults:`` of ``campaign.yaml``, :class:`FaultSpace`): sites, targets,
fault models, bits, patterns and schedule templates, whose cross product the trials sample, or
named node profiles, one such space each (:class:`FaultProfiles`); and the small validators every
campaign spec section uses.

Everything is validated here; mistakes raise ``ValueError``/``TypeError`` naming the value and
what is allowed.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sdcscope.common.validate import did_you_mean
from sdcscope.faults import BIT_MODELS, MODELS, SITES, SWIZZLE_MODES, TOKEN_MODELS, Pattern, check_bits, get_format
from sdcscope.faults.vocab import check_site_pattern

__all__ = [
    "FaultSpace",
    "FaultProfiles",
    "fault_section",
    "SCHEDULE_TEMPLATES",
    "UNSUPPORTED_SITES",
    "CAMPAIGN_SITES",
    "parse_bits",
]

SCHEDULE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "transient": ("micro_batch",),
    "permanent": (),
    "intermittent": ("p", "duration"),
}
UNSUPPORTED_SITES = {
    "checkpoint": "a trial never writes a checkpoint to corrupt; inject checkpoint faults with `sdcscope inject`",
    "comm": "a trial trains in one process, without a gradient all-reduce; inject comm faults with "
    "`sdcscope train --nproc N --faults FILE`",
    "comm.all_gather": "a trial trains in one process, without FSDP2's all-gathers; inject them with "
    "`sdcscope train --nproc N --parallel fsdp --faults FILE` (benchmarks/bench_collective_checks.py, tests/sharded)",
    "comm.reduce_scatter": "a trial trains in one process, without FSDP2's reduce-scatters; inject them with "
    "`sdcscope train --nproc N --parallel fsdp --faults FILE`",
    "comm.all_to_all": "a trial trains in one process, whose MoE layers hold every expert and run no all-to-all; "
    "inject it with `sdcscope train --workload moe --nproc N --parallel ep --faults FILE` "
    "(benchmarks/bench_sharded_matrix.py, tests/sharded)",
    "comm.p2p": "a trial trains in one process, without a pipeline's send/recv; inject them with "
    "`sdcscope train --nproc N --parallel pp --faults FILE` (benchmarks/bench_sharded_matrix.py, tests/sharded)",
}
"""Fault sites a campaign cannot inject, and why."""
CAMPAIGN_SITES = tuple(s for s in SITES if s not in UNSUPPORTED_SITES)


def _keys(what: str, data: Any, allowed: tuple[str, ...]) -> dict:
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a mapping, got {data!r}")
    for key in data:
        if key not in allowed:
            raise ValueError(f"unknown {what} key {key!r}{did_you_mean(key, allowed)}; allowed: {list(allowed)}")
    return dict(data)


def _int(what: str, value: Any, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        rule = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{what} must be {rule}, got {value!r}")
    return value


def _list(what: str, value: Any) -> list:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"{what} must not be empty: the fault space would be empty")
    return list(items)


def _choices(what: str, value: Any, allowed) -> tuple[str, ...]:
    out = []
    for v in _list(what, value):
        if v not in allowed:
            raise ValueError(
                f"unknown {what[:-1] if what.endswith('s') else what} {v!r}"
                f"{did_you_mean(str(v), allowed)}; allowed: {list(allowed)}"
            )
        out.append(v)
    return tuple(dict.fromkeys(out))


def _unique(mappings) -> tuple[dict, ...]:
    """The normalised mappings without repeats, in order."""
    return tuple({json.dumps(m, sort_keys=True): m for m in mappings}.values())


def parse_bits(value: Any) -> tuple[int, ...]:
    """Bit positions from ints and ``"a-b"`` ranges (inclusive), sorted and distinct."""
    bits: list[int] = []
    for item in _list("faults.bits", value):
        if isinstance(item, str) and "-" in item.strip("-"):
            lo, _, hi = item.partition("-")
            try:
                lo_i, hi_i = int(lo), int(hi)
            except ValueError:
                raise ValueError(f"faults.bits range {item!r} must look like '0-31'") from None
            if lo_i > hi_i:
                raise ValueError(f"faults.bits range {item!r} is empty (start > end)")
            bits.extend(range(lo_i, hi_i + 1))
        else:
            bits.append(_int("faults.bits entry", item))
    return tuple(sorted(set(bits)))


def _schedule_template(data: Any) -> dict:
    data = _keys("faults.schedules entry", data, ("kind", *sorted({k for v in SCHEDULE_TEMPLATES.values() for k in v})))
    kind = data.get("kind")
    if kind not in SCHEDULE_TEMPLATES:
        raise ValueError(
            f"unknown schedule kind {kind!r}{did_you_mean(str(kind), SCHEDULE_TEMPLATES)}; "
            f"allowed: {list(SCHEDULE_TEMPLATES)} (the step comes from inject_steps)"
        )
    for key in data:
        if key != "kind" and key not in SCHEDULE_TEMPLATES[kind]:
            raise ValueError(
                f"schedule kind {kind!r} does not take {key!r}; it takes: {list(SCHEDULE_TEMPLATES[kind])}"
            )
    if kind == "intermittent":
        p = data.get("p")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"intermittent schedule needs p in [0, 1], got {p!r}")
        data["p"] = float(p)
        if data.get("duration") is not None:
            _int("intermittent duration", data["duration"], 1)
    if kind == "transient" and data.get("micro_batch") is not None:
        _int("transient micro_batch", data["micro_batch"])
    return data


@dataclass(frozen=True)
class FaultSpace:
    """Sites × targets × models × bits × patterns × schedules × repeats."""

    sites: tuple[str, ...]
    targets: tuple[str | tuple[str, ...], ...]
    models: tuple[str, ...] = ("bitflip",)
    bits: tuple[int, ...] | None = None
    format: str | None = None
    patterns: tuple[dict, ...] = ({"kind": "element"},)
    schedules: tuple[dict, ...] = ({"kind": "transient"},)
    repeats: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("sites", _choices("faults.sites", self.sites, SITES))
        for site in self.sites:
            if site in UNSUPPORTED_SITES:
                raise ValueError(
                    f"faults.sites: site {site!r} is not supported in a campaign: "
                    f"{UNSUPPORTED_SITES[site]}; allowed: {list(CAMPAIGN_SITES)}"
                )
        targets = []
        for t in _list("faults.targets", self.targets):
            group = isinstance(t, (list, tuple))
            if not (t and all(isinstance(x, str) and x for x in (t if group else [t]))):
                raise TypeError(
                    f"faults.targets entries must be non-empty strings or non-empty lists of "
                    f"them (one target hit as a whole), got {t!r}"
                )
            targets.append(tuple(dict.fromkeys(t)) if group else t)
        set_("targets", tuple(targets))
        set_("models", _choices("faults.models", self.models, MODELS + TOKEN_MODELS))
        token = [m for m in self.models if m in TOKEN_MODELS]
        if token and set(self.sites) != {"dispatch"}:
            raise ValueError(
                f"faults.models {token} drop or duplicate a token of an MoE dispatch: they need faults.sites "
                f"[dispatch], got {list(self.sites)} (give the other sites a campaign of their own)"
            )
        if self.format is not None:
            get_format(self.format)
        if any(m in BIT_MODELS for m in self.models):
            if self.bits is None:
                raise ValueError(f"faults.bits is required for models {[m for m in self.models if m in BIT_MODELS]}")
            bits = parse_bits(self.bits)
            try:  # without a format, the targets' own: fp32 is the widest a workload holds
                check_bits(bits, self.format or "fp32")
            except ValueError as exc:
                raise ValueError(f"faults.bits: {exc}") from None
            set_("bits", bits)
        elif self.bits is not None:
            raise ValueError(
                f"faults.bits given, but models {list(self.models)} take no bits; bits are for {list(BIT_MODELS)}"
            )
        patterns = []
        for p in _list("faults.patterns", self.patterns):
            try:
                patterns.append(Pattern.from_dict(p).to_dict())
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"faults.patterns entry {p!r}: {exc}") from None
        set_("patterns", _unique(patterns))  # two spellings of one pattern are one fault-space point
        if token and any(p["kind"] != "row" for p in self.patterns):
            raise ValueError(
                f"faults.models {token} hit one whole token slot: faults.patterns [{{kind: row}}], "
                f"got {list(self.patterns)}"
            )
        for site in self.sites:  # every site meets every pattern: refuse a field one of them would ignore
            for p in self.patterns:
                try:
                    check_site_pattern(site, Pattern.from_dict(p))
                except ValueError as exc:
                    raise ValueError(f"faults.patterns entry {p!r} with faults.sites {site!r}: {exc}") from None
        set_("schedules", _unique(_schedule_template(s) for s in _list("faults.schedules", self.schedules)))
        _int("faults.repeats", self.repeats, 1)
        _int("faults.seed", self.seed)
        random = (
            "random_value" in self.models
            or any(s["kind"] == "intermittent" for s in self.schedules)
            or any(Pattern.from_dict(p).draws_on(site) for p in self.patterns for site in self.sites)
        )
        if self.repeats > 1 and not random:
            raise ValueError(
                f"faults.repeats={self.repeats}: every point of this fault space is one fixed fault "
                "(explicit indices, no random_value model, no intermittent schedule), so its repeats "
                "would be identical runs counted as independent trials; use repeats: 1, or 'random' "
                "indices"
            )

    @property
    def spaces(self) -> tuple[tuple[str, FaultSpace], ...]:
        """``(profile, space)`` pairs: this one space, with no profile name."""
        return (("", self),)

    def space(self, profile: str) -> FaultSpace:
        """This space (a spec of one fault space has the one profile ``""``)."""
        return self

    @classmethod
    def from_dict(cls, data: Any) -> FaultSpace:
        if isinstance(data, Mapping) and "swizzle" in data:
            raise ValueError(
                f"faults.swizzle {data['swizzle']!r} is a pattern option now: write "
                "patterns: [{kind: mac_cell, swizzle: per_step}] (swizzle allowed: "
                f"{list(SWIZZLE_MODES)})"
            )
        data = _keys("faults", data, tuple(f.name for f in fields(cls)))
        for key in ("sites", "targets"):
            if key not in data:
                raise ValueError(f"faults.{key} is required (e.g. sites: [gemm.forward], targets: ['*'])")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}
        out["targets"] = [list(t) if isinstance(t, tuple) else t for t in self.targets]
        return out


PROFILE_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
"""What a profile name may hold (it is a column of results.sqlite and a part of a trial's key)."""


@dataclass(frozen=True)
class FaultProfiles:
    """Named fault spaces, one per *node profile*: the faults one unhealthy machine shows (a lane, a
    bit, a rate), as the study of real unhealthy nodes compares them (Ma et al., ACL 2025). The
    campaign's trials are the union of each profile's cross product, each trial tagged with its
    profile, so a report can give the three levels per node. ``faults: {profiles: {NAME: SPACE}}``,
    each SPACE a ``faults:`` mapping of its own."""

    spaces: tuple[tuple[str, FaultSpace], ...]
    """``(profile, space)`` pairs, in the spec's order."""

    def __post_init__(self) -> None:
        if not self.spaces:
            raise ValueError("faults.profiles must name at least one profile: {NAME: {sites: …, targets: …}}")
        for name, _ in self.spaces:
            if not isinstance(name, str) or not name or not set(name) <= PROFILE_CHARS:
                raise ValueError(
                    f"faults.profiles name {name!r} must be a non-empty string of letters, digits, '_', '.' and '-'"
                )

    def space(self, profile: str) -> FaultSpace:
        """The fault space of ``profile``."""
        return dict(self.spaces)[profile]

    @classmethod
    def from_dict(cls, data: Any) -> FaultProfiles:
        data = _keys("faults (with profiles, each profile holds its own sites, targets, …)", data, ("profiles",))
        profiles = data["profiles"]
        if not isinstance(profiles, Mapping):
            raise TypeError(f"faults.profiles must map profile names to fault spaces, got {profiles!r}")
        out = []
        for name, space in profiles.items():
            try:
                out.append((name, FaultSpace.from_dict(space)))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"faults.profiles.{name}: {exc}") from None
        return cls(tuple(out))

    def to_dict(self) -> dict[str, Any]:
        return {"profiles": {name: space.to_dict() for name, space in self.spaces}}


def fault_section(data: Any) -> FaultSpace | FaultProfiles:
    """``faults:`` of a campaign spec: one fault space, or ``{profiles: {NAME: SPACE, …}}``."""
    if isinstance(data, Mapping) and "profiles" in data:
        return FaultProfiles.from_dict(data)
    return FaultSpace.from_dict(data)
