"""``GuardConfig``: every knob of the guard, with defaults a user would choose, loadable from YAML."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sdcscope.common.io import load_yaml, read_text
from sdcscope.common.validate import build_config, check_bool, check_choice, check_float, check_positive
from sdcscope.detect import ABFTConfig, NonFiniteConfig, SpikeConfig
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
    "state_checksum": StateChecksumConfig,
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
    "balanced": {"abft": {"order": "random", "layer_fraction": 0.05}},
    "full": {"abft": {}},
}
"""What each ``profile`` sets in the sections left at their defaults (their price and coverage:
docs/guard.md, ``benchmarks/bench_guard_cost.py`` and ``bench_guard_coverage.py``). ``minimal``:
no ABFT -- the state checksums, non-finite and spike detectors and the metrics; ``balanced``:
also ABFT on a random 5 % of the GEMM layers each step (a transient GEMM fault is checked with
probability 0.05 in its step), every layer after any finding; ``full``: every GEMM every step."""
_DEFAULT_SECTIONS = {"abft": ABFTConfig}


@dataclass(kw_only=True)
class GuardConfig:
    """A section set to ``None`` (``null`` in YAML) is switched off."""

    profile: str = "balanced"
    """``minimal`` | ``balanced`` | ``full`` (:data:`PROFILES`): the defaults of the sections you
    leave unset; a section you give keeps your keys over the profile's. ``balanced``, the default,
    samples the GEMMs it checks (escalating to all of them on any finding); ``full`` checks every
    GEMM every step."""

    metrics: MetricsConfig | None = field(default_factory=MetricsConfig)
    nonfinite: NonFiniteConfig | None = field(default_factory=NonFiniteConfig)
    loss_spike: SpikeConfig | None = field(default_factory=SpikeConfig.loss)
    grad_spike: SpikeConfig | None = field(default_factory=SpikeConfig.grad_norm)
    abft: ABFTConfig | None = field(default_factory=ABFTConfig)
    """Checksums of the Linear and attention products, forward, dX and dW: the profile's sample of
    them (``balanced``) or every one every step (``full``); ``budget`` (e.g. 0.02) samples layers
    and steps to an overhead budget instead."""
    state_checksum: StateChecksumConfig | None = field(default_factory=StateChecksumConfig)
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

    def __post_init__(self) -> None:
        check_choice("guard profile", self.profile, PROFILES)
        for name, preset in PROFILES[self.profile].items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # the user's keys over the profile's
                setattr(self, name, value if preset is None else {**preset, **value})
            elif value == _DEFAULT_SECTIONS[name]():  # left at its default: the profile's
                setattr(self, name, None if preset is None else dict(preset))
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, _build_section(cls, dict(value), name))
            elif value is not None and not isinstance(value, cls):
                raise TypeError(f"guard {name} must be a mapping or {cls.__name__}, got {value!r}")
        for name in ("snapshots", "lr_backoff", "policy", "ledger"):
            if getattr(self, name) is None:
                raise ValueError(f"guard {name} cannot be null")
        if self.qk_clip is not None:
            check_float("guard qk_clip", self.qk_clip, low=0.0, low_open=True)
        if self.invariants is not None and not isinstance(self.invariants, (str, os.PathLike)):
            raise TypeError(f"guard invariants={self.invariants!r} must be a file path or null")
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
        """From a YAML/JSON file; errors name the file and the bad key or value. An empty file
        (or one holding only comments or ``null``) is every default; a document that is not a
        mapping (a list, a string, a number) is refused (see :meth:`from_dict`)."""
        try:
            data = load_yaml(read_text(path), repr(str(path)))
        except FileNotFoundError:
            raise FileNotFoundError(f"guard config {str(path)!r} does not exist") from None
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"guard config {str(path)!r} must hold a mapping, got {data!r}")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"guard config {str(path)!r}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
