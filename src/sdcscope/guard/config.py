"""``GuardConfig``: every knob of the guard, with defaults a user would choose, loadable from YAML."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sdcscope.common.io import load_yaml, read_text
from sdcscope.common.validate import (
    build_config,
    check_bool,
    check_choice,
    check_float,
    check_positive,
    did_you_mean,
)
from sdcscope.detect import ABFTConfig, CollectivesConfig, DispatchConfig, NonFiniteConfig, SpikeConfig
from sdcscope.detect.protocol import Registration, registered
from sdcscope.detect.state import StateChecksumConfig
from sdcscope.localize.ledger import LedgerConfig
from sdcscope.mitigate import LRBackoffConfig, PolicyConfig, RankGuardConfig, SnapshotConfig, ZClipConfig
from sdcscope.observe import MetricsConfig

_NESTED = {
    "metrics": MetricsConfig,
    "nonfinite": NonFiniteConfig,
    "loss_spike": SpikeConfig,
    "grad_spike": SpikeConfig,
    "abft": ABFTConfig,
    "dispatch": DispatchConfig,
    "state_checksum": StateChecksumConfig,
    "collectives": CollectivesConfig,
    "snapshots": SnapshotConfig,
    "lr_backoff": LRBackoffConfig,
    "zclip": ZClipConfig,
    "policy": PolicyConfig,
    "ranks": RankGuardConfig,
    "ledger": LedgerConfig,
}


def _build_section(cls, value: dict, name: str):
    """``build_config`` of one section; an error that does not say which section it is about
    (``c=-1 must be ...``, ``window=0 ...``: loss_spike or grad_spike?) is prefixed with it."""
    try:
        return build_config(cls, value, name)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        if any(alias in msg for alias in (name, name.replace("_", " "), name.rstrip("s"))):
            raise
        try:
            new = type(exc)(f"guard {name}: {msg}")
        except Exception:  # an exception type that takes other arguments: leave it as it is
            raise exc from None
        raise new from None


PROFILES: dict[str, dict[str, Any]] = {
    "minimal": {"abft": None},
    "balanced": {"abft": {"order": "rotation", "layer_fraction": 0.05}},
    "full": {"abft": {}},
}
"""What each ``profile`` sets in the sections the user did not give (their price and coverage:
docs/guard.md, ``benchmarks/bench_guard_cost.py`` and ``bench_guard_coverage.py``). ``minimal``:
no ABFT -- the state checksums, non-finite and spike detectors and the metrics; ``balanced``:
also ABFT on a rotation that checks each GEMM layer once every 20 steps (5 % of the layers a
step: a persistent GEMM fault is caught within 20 steps, a transient one in its step with
probability 0.05), every layer after any finding; ``full``: every GEMM every step."""
DEFAULT_PROFILE = "balanced"


class _NotGiven:
    """The default of a section a profile presets: "the user did not give it", which a section
    given equal to its default (``abft=ABFTConfig()``) must not be mistaken for."""

    def __repr__(self) -> str:
        return "<the profile's>"


NOT_GIVEN = _NotGiven()


@dataclass(kw_only=True)
class GuardConfig:
    """A section set to ``None`` (``null`` in YAML) is switched off."""

    profile: str = DEFAULT_PROFILE
    """``minimal`` | ``balanced`` | ``full`` (:data:`PROFILES`): what the sections you do not give
    are. A section you give is kept, equal to its default or not, and means the same as a mapping
    (YAML, ``from_dict``) or as an object: ``abft: {c: 9}`` is ``abft=ABFTConfig(c=9)``, the
    section's own defaults for the keys you did not write (``ABFTConfig()`` checks every layer). ``None``
    switches a section off. ``balanced``, the default, samples the GEMMs it checks (escalating to
    all of them on any finding); ``full`` checks every GEMM every step. Once built, every section
    is given: ``dataclasses.replace`` and a ``to_dict``/``from_dict`` round trip keep them, so to
    change the profile of a config build a new one."""

    metrics: MetricsConfig | None = field(default_factory=MetricsConfig)
    nonfinite: NonFiniteConfig | None = field(default_factory=NonFiniteConfig)
    loss_spike: SpikeConfig | None = field(default_factory=SpikeConfig.loss)
    grad_spike: SpikeConfig | None = field(default_factory=SpikeConfig.grad_norm)
    abft: ABFTConfig | None = NOT_GIVEN  # type: ignore[assignment]  # resolved in __post_init__
    """Checksums of the Linear and attention products, forward, dX and dW: the profile's sample of
    them (``balanced``) or every one every step (``full``); ``budget`` (e.g. 0.02) samples layers
    and steps to an overhead budget instead."""
    dispatch: DispatchConfig | None = field(default_factory=DispatchConfig)
    """The exact check of every mixture-of-experts token dispatch (token counts and an integer
    checksum of the permuted rows per expert, :mod:`sdcscope.detect.dispatch`): nothing to do in
    a model without one."""
    state_checksum: StateChecksumConfig | None = field(default_factory=StateChecksumConfig)
    collectives: CollectivesConfig | None = field(default_factory=CollectivesConfig)
    """FSDP2's collectives, checked online (:mod:`sdcscope.detect.collectives`): each parameter
    all-gather exactly (integer digests of what left each rank and what arrived), each gradient
    reduce-scatter against its rounding bound; a model without FSDP2 units has none to check."""
    detectors: dict[str, Any] = field(default_factory=dict)
    """The sections of registered detectors that are not built in (:mod:`sdcscope.detect.protocol`):
    ``{name: settings}``, a mapping or the registration's config object switching one on (``{}``:
    its defaults), ``None`` off; one not named stays off. A name that is not registered is refused,
    naming those that are (register the detector before building the config)."""
    replay: bool = True
    """Re-execute a step that raised a detection, from the pre-step state with the same data and
    RNG: a result that differs was a transient fault (the clean re-run is used), one that repeats
    is a data/optimization effect or a persistent fault."""
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    lr_backoff: LRBackoffConfig = field(default_factory=LRBackoffConfig)
    zclip: ZClipConfig | None = None
    """Adaptive gradient clipping on every step (off by default: the engine clips at 1.0)."""
    qk_clip: float | None = None
    """Max attention logit above which W_q, W_k of that layer are rescaled (QK-clip); None: off."""
    invariants: str | None = None
    """An invariants file (``sdcscope invariants infer``) checked online every step."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ranks: RankGuardConfig | None = field(default_factory=RankGuardConfig)
    """Data-parallel runs (a Guard given ``ddp=``): cross-rank gradient signatures, replica hash
    checks, rank localization by replay, the device ledger and quarantine
    (:mod:`sdcscope.guard.ranks`); ignored in a single process, required under DDP."""
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    """The device ledger of a single process (``run_dir/ledger.json``): findings per device and
    site; ``strikes`` findings at one site within ``window`` steps make them ``persistent`` (the
    policy's ``*:persistent`` rule: a clean stop by default), and each suspicion gives ABFT full
    coverage for ``cooldown`` steps (:mod:`sdcscope.guard.strikes`). Under DDP the rank guard
    keeps the ledger with ``ranks.ledger``."""
    stall_after: int | None = 20
    """Steps without progress in a row -- vetoed, rolled back, skipped for a GradScaler overflow,
    or re-run after a rollback only to be rolled back again before getting any further -- after
    which the guard reports ``guard: stalled`` (a fault it cannot repair: training makes no
    progress) and :attr:`Guard.stalled` turns true; None: never."""
    strict: bool = False
    """Re-raise the guard's own internal errors instead of reporting them as events."""
    fleet_history: str | None = None
    """A fleet history directory (:mod:`sdcscope.localize.history`, docs/fleet.md): when the guard
    closes, the run's device ledger -- convictions, strikes, screens -- is recorded there (by the
    writing rank), so that later jobs see a device convicted again as a repeat offender. Needs a
    ledger file (a run directory or ``ledger=``). None: not recorded (``sdcscope fleet record``
    does it afterwards)."""

    def __post_init__(self) -> None:
        check_choice("guard profile", self.profile, PROFILES)
        for name, preset in PROFILES[self.profile].items():
            value = getattr(self, name)
            if value is NOT_GIVEN:  # the profile's; a section the user gave is the user's, whole
                setattr(self, name, None if preset is None else dict(preset))
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, _build_section(cls, dict(value), name))
            elif value is not None and not isinstance(value, cls):
                raise TypeError(f"guard {name} must be a mapping or {cls.__name__}, got {value!r}")
        self.detectors = _detector_sections(self.detectors)
        for name in ("snapshots", "lr_backoff", "policy", "ledger"):
            if getattr(self, name) is None:
                raise ValueError(f"guard {name} cannot be null")
        if self.qk_clip is not None:
            check_float("guard qk_clip", self.qk_clip, low=0.0, low_open=True)
        if self.invariants is not None and not isinstance(self.invariants, (str, os.PathLike)):
            raise TypeError(f"guard invariants={self.invariants!r} must be a file path or null")
        if self.fleet_history is not None and not isinstance(self.fleet_history, (str, os.PathLike)):
            raise TypeError(f"guard fleet_history={self.fleet_history!r} must be a directory path or null")
        if self.invariants is not None and not os.path.isfile(str(self.invariants)):
            raise FileNotFoundError(f"guard invariants file {str(self.invariants)!r} does not exist")
        for name in ("replay", "strict"):
            check_bool(f"guard {name}", getattr(self, name))
        if self.stall_after is not None:
            check_positive("guard stall_after", self.stall_after)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> GuardConfig:
        """From a mapping of sections and knobs (as read from YAML/JSON); missing ones keep their
        defaults. ``None`` -- what an empty YAML file (or one holding only comments or ``null``)
        loads as -- means every default, as ``{}`` does. Anything else that is not a mapping (a
        list, even an empty one, a string, a number, a bool) is refused with ``TypeError``: a
        guard config is a mapping, and an empty list or ``0`` is a mistake, not "defaults"."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise TypeError(
                f"guard config must be a mapping of sections (metrics, abft, ...) or null "
                f"for the defaults, got {type(data).__name__} {data!r}"
            )
        return build_config(cls, dict(data), "guard config")

    @classmethod
    def load(cls, path: str | os.PathLike) -> GuardConfig:
        """From a YAML/JSON file; errors name the file and the bad key or value. The file holds
        the guard mapping itself (``profile: full``) or that mapping under one top-level ``guard``
        key (``guard: {profile: full}``, the form the docs and a campaign spec write); anything
        beside ``guard`` is refused. An empty file (or one holding only comments or ``null``, or
        ``guard: null``) is every default; a document that is not a mapping (a list, a string, a
        number) is refused (see :meth:`from_dict`)."""
        where = repr(str(path))
        try:
            data = load_yaml(read_text(path), where)
        except FileNotFoundError:
            raise FileNotFoundError(f"guard config {where} does not exist") from None
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"guard config {where} must hold a mapping, got {data!r}")
        try:
            return cls.from_dict(unwrap(data))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"guard config {where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def detector_section(self, reg: Registration) -> Any:
        """The section configuring the registered detector ``reg`` (None: off): a built-in's own
        field, any other's entry of :attr:`detectors`."""
        if reg.name not in _FIELDS:
            return self.detectors.get(reg.name)
        if _NESTED.get(reg.name) is not reg.config:
            raise ValueError(
                f"detector {reg.name!r} is registered with {reg.config.__name__}, but guard {reg.name} is "
                f"another section; register it under a name that is not a guard setting"
            )
        return getattr(self, reg.name)


assert all(
    f.default is NOT_GIVEN for f in fields(GuardConfig) if any(f.name in preset for preset in PROFILES.values())
), "a section a profile presets must default to NOT_GIVEN"


_FIELDS = frozenset(f.name for f in fields(GuardConfig))


def _detector_sections(value: Any) -> dict[str, Any]:
    """``GuardConfig.detectors`` checked against the registry, each mapping built into its
    registration's config."""
    if not isinstance(value, Mapping):
        raise TypeError(f"guard detectors must be a mapping of detector name to its settings, got {value!r}")
    own = {r.name: r for r in registered() if r.name not in _FIELDS}
    sections = {}
    for name, section in value.items():
        if name in _FIELDS:
            raise ValueError(f"guard detectors: {name!r} is a section of its own: set guard {name} itself")
        if name not in own:
            raise ValueError(
                f"guard detectors: unknown detector {name!r}{did_you_mean(name, own)}; "
                f"registered: {', '.join(own) or 'none'}"
            )
        cls = own[name].config
        if isinstance(section, Mapping):
            section = _build_section(cls, dict(section), f"detectors {name}")
        elif section is not None and not isinstance(section, cls):
            raise TypeError(f"guard detectors {name} must be a mapping, {cls.__name__} or null, got {section!r}")
        sections[name] = section
    return sections


def unwrap(data: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The guard mapping of a config document: ``data`` itself, or what its one top-level
    ``guard`` key holds (``guard: {profile: full}``); a ``guard`` key beside other keys is refused,
    naming them (a wrapped config and loose sections: which one is meant?)."""
    if not isinstance(data, Mapping) or "guard" not in data:
        return data
    others = sorted(str(k) for k in data if k != "guard")
    if others:
        raise ValueError(
            f"a top-level 'guard' key wraps the whole guard config, but {others} stand beside it; "
            "put them under 'guard:' or drop the 'guard:' wrapper"
        )
    return data["guard"]
