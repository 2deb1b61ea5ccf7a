"""``FaultSpec``: what a fault is, where it lands and when it fires (:class:`Pattern`, :class:`Schedule`).

Everything is validated when a spec is built; mistakes raise ``ValueError`` (bad value)
or ``TypeError`` (bad type) naming the value and what is allowed. Checks that need the
tensor (its dtype, its shape) are :func:`.apply.check_spec`; a spec that does not fit the
tensor it is applied to raises :class:`FaultSpecError`. Fault files: :func:`.load.load_specs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from fnmatch import fnmatchcase
from typing import Any

from sdcscope.common.validate import brief, check_int, choice

from .formats import FORMATS, check_bits, get_format
from .ops import BIT_MODELS, MODELS, check_burst
from .shapes import FaultSpecError, Pattern, Schedule, _from_mapping, _set
from .vocab import (
    COLLECTIVE_SITES,
    DIRECTIONS,
    GEMM_OPERANDS,
    LINK_SITES,
    PATTERN_KINDS,
    SITES,
    STEP_SITES,
    TOKEN_MODELS,
    check_site_pattern,
)

__all__ = ["Pattern", "Schedule", "FaultSpec", "FaultSpecError"]

# ------------------------------------------------------------------------- fault spec

_WIDEST = max(FORMATS.values(), key=lambda f: f.width)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One fault: site, target modules, fault model, bits, format, pattern, schedule.

    - ``target``: shell pattern(s) on qualified module names, a str or a list of them.
    - ``bits``: bit positions in the stored format; needed by ``bitflip``/``stuck_at_*``
      (with the ``tensor`` pattern they are optional and restrict the candidate bits),
      not taken by ``random_value``/``zero``. Without ``format`` they are checked here
      against the widest format and again against the tensor's dtype when applied.
    - ``burst_bits``: a multi-bit burst within a word: each hit element gets ``burst_bits``
      adjacent bits, at a position drawn per element, inside ``bits`` (then a contiguous range,
      e.g. the exponent field) or anywhere in the word (``bits`` left out); for the bit models.
    - ``format``: the format the fault lives in (see :func:`.ops.apply_fault`), ``None``
      for the faulted tensor's own dtype.
    - ``rank``: the rank the fault lives on, ``None`` for every rank.
    - ``seed``: keys the fault's random draws (with step, micro-batch, module and rank).
    - ``state_key``: for ``optimizer_state``, the state entry (``exp_avg``, ...);
      ``None`` for all state tensors of the parameter.
    """

    site: str
    target: str | tuple[str, ...]
    model: str
    bits: tuple[int, ...] | None = None
    burst_bits: int | None = None
    format: str | None = None
    pattern: Pattern = field(default_factory=Pattern)
    schedule: Schedule
    rank: int | None = 0
    seed: int = 0
    state_key: str | None = None
    phase: str | None = None
    """For site ``comm``: corrupt the gradient bucket ``before`` or ``after`` the all-reduce; for
    ``comm.all_gather``: the ``forward`` all-gather (the default) or the ``backward`` re-gather;
    for ``comm.all_to_all``: which of the MoE layer's all-to-alls (``dispatch``, the default); for
    ``comm.p2p``: the ``forward`` activation (the default) or the ``backward`` gradient."""
    source: int | None = None
    """For ``comm.all_gather``: the rank whose part of the gathered parameter is corrupted; for
    ``comm.all_to_all``: the rank whose token rows (or outputs, gradients) are corrupted; for
    ``comm.p2p``: the neighbouring stage's rank the transfer came from (``rank``: where it arrived)."""
    direction: str | None = None
    """For ``comm.all_gather`` and ``comm.all_to_all``: ``recv`` (default: what arrived on ``rank`` from ``source``) or
    ``send`` (what left ``source``: every receiver's copy; ``rank`` then is ``source`` or null)."""
    operand: str | None = None
    """For a GEMM site (``gemm.*``) of an FP8 layer: what the fault hits, one of
    :data:`~.vocab.GEMM_OPERANDS` (``None``: the result, as on every GEMM)."""

    def __post_init__(self) -> None:
        choice("site", self.site, SITES)
        target = (self.target,) if isinstance(self.target, str) else self.target
        if not isinstance(target, (list, tuple)) or not target:
            raise TypeError(f"target must be a str or a non-empty list of str, got {brief(self.target)}")
        for t in target:
            if not isinstance(t, str) or not t:
                raise TypeError(f"target patterns must be non-empty str, got {brief(t)}")
        _set(self, "target", tuple(target))
        model = choice("model", self.model, MODELS + TOKEN_MODELS)
        if model in TOKEN_MODELS and self.site != "dispatch":
            raise ValueError(
                f"model {brief(model)} drops or duplicates a token of an MoE dispatch: it needs site 'dispatch', "
                f"not {brief(self.site)}; models for site {brief(self.site)}: {list(MODELS)}"
            )
        if model in TOKEN_MODELS and self.pattern == Pattern():  # the default: one random slot
            _set(self, "pattern", Pattern(kind="row"))
        for name, cls in (("pattern", Pattern), ("schedule", Schedule)):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                _set(self, name, cls.from_dict(value))
            elif not isinstance(value, cls):
                raise TypeError(f"{name} must be a mapping or a {cls.__name__}, got {brief(value)}")
        check_site_pattern(self.site, self.pattern)
        if model in TOKEN_MODELS and self.pattern.kind != "row":
            raise ValueError(
                f"model {brief(model)} hits one whole slot of the dispatch: pattern kind 'row' (index: the slot, "
                f"or random), not {brief(self.pattern.kind)}"
            )
        if model in TOKEN_MODELS and self.format is not None:
            raise ValueError(f"model {brief(model)} moves whole rows: it takes no format, got {brief(self.format)}")
        if self.format is not None:
            get_format(self.format)
        self._check_bits(model)
        if self.rank is not None:
            check_int("rank", self.rank)
        check_int("seed", self.seed, None)
        if self.state_key is not None:
            if not isinstance(self.state_key, str):
                raise TypeError(f"state_key must be a str, got {brief(self.state_key)}")
            if self.site != "optimizer_state":
                raise ValueError(
                    f"state_key {brief(self.state_key)} is only used with site 'optimizer_state', "
                    f"not {brief(self.site)}"
                )
        if self.phase is not None:
            phases = {"comm": ("before", "after"), **COLLECTIVE_SITES}.get(self.site) or ()
            if not phases:
                raise ValueError(
                    f"phase {brief(self.phase)} is only used with sites 'comm', 'comm.all_gather', "
                    "'comm.all_to_all' and 'comm.p2p', "
                    f"not {brief(self.site)}"
                )
            choice("phase" if self.site == "comm" else f"{self.site} phase", self.phase, phases)
        self._check_link()
        if self.operand is not None:
            if not self.site.startswith("gemm."):
                raise ValueError(
                    f"operand {brief(self.operand)} is only used with the gemm.* sites, not {brief(self.site)}"
                )
            choice("operand", self.operand, GEMM_OPERANDS)
        if self.site in STEP_SITES and self.schedule.micro_batch is not None:
            raise ValueError(
                f"site {brief(self.site)} runs once per step, so schedule micro_batch "
                f"{brief(self.schedule.micro_batch)} would never fire; micro_batch is for sites "
                f"{[s for s in SITES if s not in STEP_SITES]}"
            )

    def _check_link(self) -> None:
        """``source`` and ``direction``: a collective fault's link (:data:`~.vocab.LINK_SITES` only)."""
        for name in ("source", "direction"):
            if getattr(self, name) is not None and self.site not in LINK_SITES:
                raise ValueError(
                    f"{name} {brief(getattr(self, name))} is only used with sites {list(LINK_SITES)}, "
                    f"not {brief(self.site)}"
                )
        if self.site not in LINK_SITES:
            return
        if self.source is None:
            what = {
                "comm.all_gather": "part of the parameter",
                "comm.all_to_all": "token rows",
                "comm.p2p": "transfer (the sending stage's rank)",
            }[self.site]
            raise ValueError(f"site {self.site!r} needs source: the rank whose {what} is corrupted")
        check_int("source", self.source)
        if self.site == "comm.p2p":
            if self.rank is None:
                raise ValueError("site 'comm.p2p' needs rank: the destination rank the transfer arrived on")
            if self.direction not in (None, "recv"):
                raise ValueError(
                    f"direction {brief(self.direction)}: site 'comm.p2p' corrupts what arrived on rank (recv)"
                )
            return
        if self.direction is not None:
            choice("direction", self.direction, DIRECTIONS)
        if self.direction == "send" and self.rank not in (None, self.source):
            raise ValueError(
                f"direction 'send' corrupts what left source {self.source} on every receiver; rank "
                f"{brief(self.rank)} must be the source or null"
            )

    def _check_bits(self, model: str) -> None:
        bits, ber, burst = self.bits, self.pattern.kind == "tensor", self.burst_bits
        if model not in BIT_MODELS:
            if ber:
                raise ValueError(
                    f"pattern 'tensor' flips bits; it needs a model in {list(BIT_MODELS)}, not {brief(model)}"
                )
            if bits or burst is not None:
                what = "bits" if bits else "burst_bits"
                raise ValueError(f"model {brief(model)} takes no {what}; bits are for {list(BIT_MODELS)}")
            _set(self, "bits", None)
            return
        if burst is not None:
            self._check_burst(bits, burst, ber)
            return
        if bits is None:
            if not ber:
                raise ValueError(f"model {brief(model)} needs bits (a non-empty list of bit positions)")
            return
        if not isinstance(bits, (list, tuple)):
            raise TypeError(f"bits must be a list of ints, got {brief(bits)}")
        if not bits:
            raise ValueError(f"bits must not be empty for model {brief(model)}")
        if self.format is not None:
            _set(self, "bits", check_bits(bits, self.format))
            return
        try:
            _set(self, "bits", check_bits(bits, _WIDEST))
        except ValueError as exc:
            raise ValueError(
                f"{exc} (the widest format; without 'format', bits are checked again "
                "against the tensor's dtype when applied)"
            ) from None

    def _check_burst(self, bits: Any, burst: Any, ber: bool) -> None:
        check_int("burst_bits", burst, 1)
        if ber:
            raise ValueError(
                "burst_bits with pattern 'tensor': that pattern draws its own bits; use burst_bits with one "
                f"of {[k for k in PATTERN_KINDS if k != 'tensor']}"
            )
        if bits is not None and (not isinstance(bits, (list, tuple)) or not bits):
            raise TypeError(f"bits must be a non-empty list of ints (the range a burst lies in), got {brief(bits)}")
        bits = None if bits is None else tuple(bits)
        try:
            check_burst(burst, _WIDEST if self.format is None else get_format(self.format), bits)
        except ValueError as exc:
            if self.format is not None or bits is not None:  # bits bound the burst, whatever the format
                raise
            raise ValueError(
                f"{exc} (the widest format; without 'format', it is checked again against the tensor's dtype "
                "when applied)"
            ) from None
        _set(self, "bits", bits)

    def matches(self, module: str) -> bool:
        """Whether the qualified module name ``module`` matches one of the targets."""
        return any(fnmatchcase(module, t) for t in self.target)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSpec:
        """A spec from a mapping (as read from YAML/JSON)."""
        return _from_mapping(cls, data, "fault spec")

    def to_dict(self) -> dict[str, Any]:
        """A plain mapping (lists, no tuples) that :meth:`from_dict` reads back; fields
        whose value is ``None`` and whose default is ``None`` are left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if isinstance(value, (Pattern, Schedule)):
                value = value.to_dict()
            elif f.name == "target" and len(value) == 1:
                value = value[0]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out
