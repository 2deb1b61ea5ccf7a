"""The spatial pattern and the temporal schedule of a fault spec (:class:`Pattern`,
:class:`Schedule`), and the helpers every spec dataclass validates and (de)serializes with.

Everything is validated when built; mistakes raise ``ValueError`` (bad value) or ``TypeError``
(bad type) naming the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sdcscope.common.validate import brief, check_int, check_keys, check_mapping, choice, missing_keys, required_fields

from .vocab import (
    ALL,
    MAC_CELL_SINGLE_AXIS,
    PATTERN_KINDS,
    RANDOM,
    SCHEDULE_KINDS,
    SWIZZLE_MODES,
    WARP_SIZE,
)

__all__ = ["Pattern", "Schedule", "FaultSpecError"]

# ---------------------------------------------------------------------------- helpers


class FaultSpecError(ValueError):
    """A fault spec that does not fit the tensor it lands on (its shape, its dtype): a mistake in
    the configuration, never an effect of the fault -- a campaign must not record it as a crash."""


def _index(what: str, value: Any) -> int | str:
    """An index-like field: ``"random"`` or an int >= 0."""
    if isinstance(value, str):
        if value != RANDOM:
            raise ValueError(f"{what} must be {brief(RANDOM)} or an int >= 0, got {brief(value)}")
        return value
    return check_int(what, value)


def _int_pair(what: str, value: Any, minimum: int) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{what} must be a list of two ints, got {brief(value)}")
    return (check_int(f"{what}[0]", value[0], minimum), check_int(f"{what}[1]", value[1], minimum))


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _check_kind_fields(obj: Any, what: str, kinds: Mapping[str, tuple[str, ...]]) -> str:
    """Validate ``obj.kind`` and that only that kind's fields are set."""
    kind = choice(f"{what} kind", obj.kind, kinds)
    for f in fields(obj):
        if f.name != "kind" and f.name not in kinds[kind] and getattr(obj, f.name) is not None:
            raise ValueError(f"{what} kind {brief(kind)} does not take {brief(f.name)}; it takes: {list(kinds[kind])}")
    return kind


def _from_mapping(cls: type, data: Any, what: str, kinds: Mapping[str, tuple[str, ...]] | None = None) -> Any:
    """``cls(**data)``, rejecting unknown keys with a close match (among the fields of
    ``data["kind"]`` first, when ``kinds`` maps kinds to their fields)."""
    check_mapping(what, data)
    names = [f.name for f in fields(cls)]
    kind = data.get("kind")
    check_keys(what, data, names, ["kind", *kinds[kind]] if kinds and kind in kinds else names)
    missing_keys(what, data, required_fields(cls), names)
    return cls(**data)


def _to_dict(obj: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": obj.kind}
    for key in keys:
        value = getattr(obj, key)
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


# --------------------------------------------------------------------------- patterns


@dataclass(frozen=True)
class Pattern:
    """Spatial pattern: which elements of the faulted tensor are hit.

    Index-like fields take ``"random"`` (the default; drawn from the fault generator) or
    an int. Kinds, with the tensor seen as the 2-D view ``[prod(leading dims), last dim]``
    where rows and columns are concerned:

    - ``element``: ``index`` -- a flat index, or a list of ints (one per dimension).
    - ``burst``: ``length`` k >= 1 consecutive flat elements from ``start``.
    - ``row`` / ``column``: ``index`` of one whole row / column of the 2-D view.
    - ``pe``: ``array`` [R, C] of a systolic array and the faulty ``pe`` [r, c]; output
      element (i, j) of the 2-D view is computed by PE (i mod R, j mod C).
    - ``mac_cell``: NVDLA-style MAC cell for ``input_channel`` a and ``output_channel`` b;
      see :func:`.patterns.resolve_indices` for what that selects on each tensor. Options:
      ``array`` [R, C] -- the MAC array (R input-channel rows x C output-channel columns,
      e.g. [8, 8] for NVDLA's small config); cell (a, b) then serves every channel pair
      congruent to (a, b) modulo (R, C), and a random cell is drawn inside the array.
      ``swizzle`` -- ``none`` (default) or ``per_step``: the hardware re-maps logical
      channels to physical lanes with a fresh permutation every step, keyed by
      ``swizzle_seed`` (an int >= 0, default 0) and the step
      (:func:`.patterns.swizzle_permutation`).
      On ``activation`` (a module output) only ``output_channel`` has a meaning, on
      ``gemm.grad_input`` (dX) only ``input_channel``: a fixed value of the other is refused
      (:func:`check_site_pattern`) rather than ignored.
    - ``tensor``: ``ber`` in (0, 1]; every candidate bit of every element flips
      independently with that probability (candidates: the spec's ``bits``, or all).
    - ``strided``: every ``stride``-th flat element (k >= 1) from ``start`` (``"random"``: drawn
      in the first period), to the end of the tensor or ``count`` elements.
    - ``warp``: the tensor's flat elements seen as warps of ``warp_size`` (default 32) threads,
      thread t writing element t; hits ``lanes`` (``"random"``: one drawn lane, ``"all"``: every
      lane, or a list of lane numbers) of warp ``warp`` (``"random"`` or an int), and with
      ``stride`` every ``stride``-th warp from there to the end (or ``count`` warps); without
      ``stride``, ``count`` consecutive warps (default 1).
    """

    kind: str = "element"
    index: int | str | tuple[int, ...] | None = None
    length: int | None = None
    start: int | str | None = None
    array: tuple[int, int] | None = None
    pe: tuple[int, int] | str | None = None
    input_channel: int | str | None = None
    output_channel: int | str | None = None
    ber: float | None = None
    swizzle: str | None = None
    swizzle_seed: int | None = None
    stride: int | None = None
    count: int | None = None
    lanes: tuple[int, ...] | str | None = None
    warp: int | str | None = None
    warp_size: int | None = None

    @property
    def draws(self) -> bool:
        """Whether the pattern draws its elements from the fault generator (so two fault seeds
        may hit different elements)."""
        fields_ = (self.index, self.start, self.pe, self.input_channel, self.output_channel, self.lanes, self.warp)
        # a mac_cell's ``array`` draws nothing itself: only a "random" cell row or column does
        return self.kind == "tensor" or any(v == RANDOM for v in fields_)

    def draws_on(self, site: str) -> bool:
        """:attr:`draws` for a fault on ``site``: a ``mac_cell`` channel that the site's tensor
        does not have (:data:`MAC_CELL_SINGLE_AXIS`) draws nothing that changes the fault."""
        if self.kind == "mac_cell" and site in MAC_CELL_SINGLE_AXIS:
            used = "output_channel" if MAC_CELL_SINGLE_AXIS[site][0] == "input_channel" else "input_channel"
            return getattr(self, used) == RANDOM
        return self.draws

    def __post_init__(self) -> None:
        kind = _check_kind_fields(self, "pattern", PATTERN_KINDS)
        if kind in ("element", "row", "column"):
            index = RANDOM if self.index is None else self.index
            if kind == "element" and isinstance(index, (list, tuple)):
                if not index:
                    raise ValueError("pattern index list must not be empty")
                index = tuple(check_int(f"pattern index[{i}]", v) for i, v in enumerate(index))
            else:
                index = _index("pattern index", index)
            _set(self, "index", index)
        elif kind == "burst":
            if self.length is None:
                raise ValueError("pattern kind 'burst' needs 'length' (an int >= 1)")
            check_int("pattern length", self.length, 1)
            start = RANDOM if self.start is None else self.start
            _set(self, "start", _index("pattern start", start))
        elif kind == "pe":
            if self.array is None:
                raise ValueError("pattern kind 'pe' needs 'array' ([rows, columns] of PEs)")
            rows, cols = _int_pair("pattern array", self.array, 1)
            _set(self, "array", (rows, cols))
            pe = RANDOM if self.pe is None else self.pe
            if isinstance(pe, str):
                pe = _index("pattern pe", pe)
            else:
                pe = _int_pair("pattern pe", pe, 0)
                if pe[0] >= rows or pe[1] >= cols:
                    raise ValueError(
                        f"pattern pe {list(pe)} is outside array {[rows, cols]}; "
                        f"allowed: [0..{rows - 1}, 0..{cols - 1}]"
                    )
            _set(self, "pe", pe)
        elif kind == "mac_cell":
            self._check_mac_cell()
        elif kind == "strided":
            if self.stride is None:
                raise ValueError("pattern kind 'strided' needs 'stride' (an int >= 1: every stride-th element)")
            check_int("pattern stride", self.stride, 1)
            _set(self, "start", _index("pattern start", RANDOM if self.start is None else self.start))
            if self.count is not None:
                check_int("pattern count", self.count, 1)
        elif kind == "warp":
            self._check_warp()
        else:  # tensor
            ber = self.ber
            if isinstance(ber, bool) or not isinstance(ber, (int, float)):
                raise TypeError(f"pattern ber must be a number in (0, 1], got {brief(ber)}")
            if not 0 < ber <= 1:
                raise ValueError(f"pattern ber must be in (0, 1], got {brief(ber)}")
            _set(self, "ber", float(ber))

    def _check_mac_cell(self) -> None:
        array = None
        if self.array is not None:
            array = _int_pair("pattern array", self.array, 1)
            _set(self, "array", array)
        for name, axis in (("input_channel", 0), ("output_channel", 1)):
            value = getattr(self, name)
            value = _index(f"pattern {name}", RANDOM if value is None else value)
            if array is not None and value != RANDOM and value >= array[axis]:
                raise ValueError(
                    f"pattern {name} {value} is outside array {list(array)} "
                    f"([input-channel rows, output-channel columns]); allowed: 0..{array[axis] - 1}"
                )
            _set(self, name, value)
        swizzle = choice("pattern swizzle", "none" if self.swizzle is None else self.swizzle, SWIZZLE_MODES)
        _set(self, "swizzle", swizzle)
        if swizzle == "none":
            if self.swizzle_seed is not None:
                raise ValueError(
                    f"pattern swizzle_seed {brief(self.swizzle_seed)} is only used with swizzle "
                    f"'per_step', but swizzle is 'none'; allowed swizzle: {list(SWIZZLE_MODES)}"
                )
        else:
            seed = 0 if self.swizzle_seed is None else self.swizzle_seed
            _set(self, "swizzle_seed", check_int("pattern swizzle_seed", seed))

    def _check_warp(self) -> None:
        size = check_int("pattern warp_size", WARP_SIZE if self.warp_size is None else self.warp_size, 1)
        _set(self, "warp_size", size)
        lanes = RANDOM if self.lanes is None else self.lanes
        if isinstance(lanes, str):
            _set(self, "lanes", choice("pattern lanes", lanes, (RANDOM, ALL)))
        else:
            lanes = (lanes,) if not isinstance(lanes, (list, tuple)) else tuple(lanes)
            if not lanes:
                raise ValueError(f"pattern lanes must not be empty; allowed: {RANDOM!r}, {ALL!r} or lane numbers")
            lanes = tuple(check_int(f"pattern lanes[{i}]", v) for i, v in enumerate(lanes))
            if max(lanes) >= size:
                raise ValueError(
                    f"pattern lanes {list(lanes)} lie outside a warp of {size} threads (warp_size); allowed: "
                    f"0..{size - 1} (warp_size is the hardware's: {WARP_SIZE} on NVIDIA, 64 on AMD)"
                )
            if len(set(lanes)) != len(lanes):
                raise ValueError(f"pattern lanes must be distinct, got {list(lanes)}")
            _set(self, "lanes", tuple(sorted(lanes)))
        _set(self, "warp", _index("pattern warp", RANDOM if self.warp is None else self.warp))
        for name in ("stride", "count"):
            if getattr(self, name) is not None:
                check_int(f"pattern {name}", getattr(self, name), 1)

    @property
    def swizzled(self) -> bool:
        """Whether the channels are re-mapped every step (``mac_cell`` with ``swizzle: per_step``)."""
        return self.swizzle == "per_step"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Pattern:
        """A pattern from a mapping such as ``{"kind": "row", "index": 3}``."""
        return _from_mapping(cls, data, "pattern", PATTERN_KINDS)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads back (``swizzle: none``, the default, left out)."""
        out = _to_dict(self, PATTERN_KINDS[self.kind])
        if out.get("swizzle") == "none":
            del out["swizzle"]
        if out.get("warp_size") == WARP_SIZE:
            del out["warp_size"]
        return out


# -------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class Schedule:
    """Temporal schedule: at which training steps (and micro-batches) a fault fires.

    - ``transient``: once, at ``step`` and micro-batch ``micro_batch`` (``None``: micro-batch
      0, so the fault is a single event even with gradient accumulation).
    - ``intermittent``: in every event of steps ``start <= step < stop`` (``stop`` ``None``:
      no end) independently with probability ``p``.
    - ``permanent``: in every event from step ``start`` on. In memory (``weight``,
      ``optimizer_state``) it acts once on each value written there: a ``bitflip`` is an
      inverting cell (a value an update computed from the flipped one may read back clean);
      ``stuck_at`` is a bit that always reads 0 or 1.
    - ``periodic``: at steps ``start``, ``start + every``, ``start + 2 every``, ... before ``stop``
      (``None``: no end), each time once, at micro-batch ``micro_batch`` (``None``: 0).

    An *event* is one (step, micro-batch, module, rank) visit of a site; see
    :func:`.schedule.fires`. Every schedule but ``transient`` is one faulty unit firing again
    and again: it :attr:`recurs` -- each firing hits the same elements and bits
    (:func:`.schedule.fault_generator`).
    """

    kind: str
    step: int | None = None
    micro_batch: int | None = None
    p: float | None = None
    start: int | None = None
    stop: int | None = None
    every: int | None = None

    def __post_init__(self) -> None:
        kind = _check_kind_fields(self, "schedule", SCHEDULE_KINDS)
        if self.micro_batch is not None:
            check_int("schedule micro_batch", self.micro_batch)
        if kind == "transient":
            if self.step is None:
                raise ValueError("schedule kind 'transient' needs 'step' (an int >= 0)")
            check_int("schedule step", self.step)
            return
        _set(self, "start", check_int("schedule start", 0 if self.start is None else self.start))
        if kind == "periodic":
            if self.every is None:
                raise ValueError("schedule kind 'periodic' needs 'every' (an int >= 1: steps between firings)")
            check_int("schedule every", self.every, 1)
        if kind in ("intermittent", "periodic") and self.stop is not None:
            if check_int("schedule stop", self.stop) <= self.start:
                raise ValueError(f"schedule stop must be > start ({self.start}) or null, got {brief(self.stop)}")
        if kind == "intermittent":
            p = self.p
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise TypeError(f"schedule p must be a number in [0, 1], got {brief(p)}")
            if not 0 <= p <= 1:
                raise ValueError(f"schedule p must be in [0, 1], got {brief(p)}")
            _set(self, "p", float(p))

    @property
    def recurs(self) -> bool:
        """Whether the schedule models one faulty unit firing again and again, so that every
        firing hits the same elements and bits (all kinds but ``transient``)."""
        return self.kind != "transient"

    @property
    def once_per_step(self) -> bool:
        """Whether the schedule fires in one micro-batch of a step only (``transient``,
        ``periodic``: at ``micro_batch``, default 0)."""
        return self.kind in ("transient", "periodic")

    def covers(self, step: int) -> bool:
        """Whether the schedule can fire at ``step`` at all (cheap; no hashing)."""
        if self.kind == "transient":
            return step == self.step
        if self.kind == "periodic" and (step - self.start) % self.every:
            return False
        return step >= self.start and (self.stop is None or step < self.stop)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """A schedule from a mapping such as ``{"kind": "transient", "step": 5}``."""
        return _from_mapping(cls, data, "schedule", SCHEDULE_KINDS)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads back."""
        return _to_dict(self, SCHEDULE_KINDS[self.kind])
