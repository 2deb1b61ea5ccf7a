"""APIArg and APIOutput: what recorded API calls are given, and what they return.

Both learn from the fields of recorded calls, separately for training steps and evaluation:

- ``constant``: the same value in every call of every reference: the set of parameters
  ``clip_grad_norm_`` clips, its ``max_norm``, the train/eval flag of the dropout modules at
  forward, the dtype a forward returns, the shift between a forward's token input and the
  targets of its loss (1: next-token prediction), whether a scheduler drives the optimizer,
  the parameters ``optimizer.step`` applies a weight decay to where others get none (biases
  and norms excluded: a step that decays the norms too, or every parameter alike, breaks it);
- ``distinct``: never the same value twice within a run: the checksum of each training batch
  (a repeat means the data order repeats, e.g. the same shuffle every epoch);
- ``range``: finite and within learned bounds: the loss a backward starts from, the gradient
  norm ``clip_grad_norm_`` returns, the learning rate at ``optimizer.step``.

A float is a constant only if it never varied in the references (a learning rate that settles
after warm-up is a range, so that another configuration's rate does not raise alarms); a
learning rate is a range even then (references that all ran at one constant rate do not make
another rate a mistake: ``[0, rate x margin]``).  Fields
that record a style (``spec.STYLE_FIELDS``: how ``zero_grad`` was called) are not learned, nor
are the causality probe's (``spec.PROBE_FIELDS``: the ``Causal`` relation's).

``APIArgRatio`` relates two arguments of one call instead: each param group's learning rate
(``group1.lr``, ...) keeps a constant ratio to the first group's (``lr``).  A schedule scales
every group alike, so the ratio is exact where the rates themselves vary over the run and
between configurations; a range on each rate has to admit a 10x error, the ratio does not.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, ClassVar

from sdcscope.common.validate import check_choice
from sdcscope.invariants.names import (
    close_matches,
    compress,
    from_hex,
    mask_of,
    names_of,
    resolve,
)
from sdcscope.invariants.relations.base import (
    APPLIED,
    Check,
    InferConfig,
    Relation,
    View,
    as_number,
    check_bounds,
    decays_to_zero,
    in_bounds,
    learn_min_step,
    register,
    widen,
)
from sdcscope.invariants.spec import (
    APIS,
    FINGERPRINT_FIELDS,
    MASK_FIELDS,
    PHASES,
    PROBE_FIELDS,
    SELECTIVE_FIELDS,
    STYLE_FIELDS,
    Invariant,
    Precondition,
)

WHERE = {"train": "in training steps", "eval": "in evaluation"}
GROUP_FIELD = re.compile(r"group\d+\.(.+)\Z")
"""A per-param-group field (``group1.lr``) and, in the group, the first group's field (``lr``)."""
RATIO_TOL = 1e-3
"""Relative tolerance of a learned ratio: rates computed as base rate x one factor round
differently per group (float32 rates on a device: ~1e-7); a misconfigured group is off by 2x+."""


class _CallField(Relation):
    key: ClassVar[str]
    modes: ClassVar[tuple[str, ...]]
    optional = {"value": (bool, int, float, str, list), "bounds": list}

    @classmethod
    def _owns(cls, field: str) -> bool:
        raise NotImplementedError

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_choice(f"{cls.name} api", params["api"], APIS)
        check_choice(f"{cls.name} mode", params["mode"], cls.modes)
        field, mode = params[cls.key], params["mode"]
        if not cls._owns(field):
            rule = "outputs start with 'out'" if cls.key == "output" else "arguments do not start with 'out'"
            raise ValueError(f"{cls.name}: {field!r} is not an {cls.key} field ({rule})")
        expect = {"constant": "value", "range": "bounds", "distinct": None}[mode]
        extra = ({"value", "bounds"} & set(params)) - {expect}
        if extra or (expect and expect not in params):
            raise ValueError(
                f"{cls.name} mode {mode!r} takes {'param ' + repr(expect) if expect else 'no value or bounds'}"
            )
        if mode == "range":
            check_bounds(cls.name, params["bounds"])
        if mode == "distinct" and field not in FINGERPRINT_FIELDS:
            raise ValueError(f"{cls.name}: mode 'distinct' applies to {sorted(FINGERPRINT_FIELDS)} only")
        if field in MASK_FIELDS and mode == "constant":
            v = params["value"]
            if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
                raise ValueError(f"{cls.name}: {field!r} value must be a list of parameter name patterns")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        out = []
        for phase in PHASES:
            table: dict[tuple[str, str], list[list]] = defaultdict(lambda: [[] for _ in traces])
            for ti, t in enumerate(traces):
                params = t.header["params"]
                for r in t.phase(phase):
                    for api, fields in r["calls"]:
                        for field, v in fields.items():
                            if (
                                v is None
                                or not cls._owns(field)
                                or (api, field) in STYLE_FIELDS
                                or field in PROBE_FIELDS
                            ):
                                continue
                            if field in MASK_FIELDS:
                                v = tuple(names_of(from_hex(v), params))
                            table[(api, field)][ti].append((r["step"], v))
            for (api, field), per in sorted(table.items()):
                inv = cls._infer_one(phase, api, field, per, traces[0].header["params"], config)
                if inv is not None:
                    out.append(inv)
        return out

    @classmethod
    def _infer_one(cls, phase, api, field, per, params, config) -> Invariant | None:
        support = sum(len(p) for p in per)
        if not all(per) or support < config.min_support:
            return None
        k, mode, extra = 0, None, {}
        values = [v for p in per for _, v in p]
        numbers = [as_number(v) for v in values]
        if field in FINGERPRINT_FIELDS:
            distinct = all(len({v for _, v in p}) == len(p) for p in per)
            if phase == "train" and "distinct" in cls.modes and distinct:
                mode = "distinct"
        elif all(n is not None for n in numbers):
            if all(n == n and abs(n) != float("inf") for n in numbers):
                if len(set(numbers)) == 1 and not decays_to_zero(field):
                    mode, extra = "constant", {"value": values[0]}
                else:
                    bounds = widen(min(numbers), max(numbers), config.margin, field)
                    mode, extra = "range", {"bounds": bounds}
        else:
            target = per[0][-1][1]
            k = learn_min_step([[(s, v == target) for s, v in p] for p in per], config)
            if k is not None:
                value = compress(target, params) if field in MASK_FIELDS else target
                mode, extra = "constant", {"value": value}
        if mode is None:
            return None
        return Invariant(
            id=f"{cls.key}.{phase}.{api}.{field}",
            relation=cls.name,
            params={"api": api, cls.key: field, "mode": mode, **extra},
            precondition=Precondition(
                phase=phase, min_step=k, when=APPLIED if mode == "range" and phase == "train" else ()
            ),
            description=cls._describe(phase, api, field, mode, extra),
            support=support,
        )

    @classmethod
    def _describe(cls, phase, api, field, mode, extra) -> str:
        verb = "is called with" if cls.key == "arg" else "returns"
        what = {
            "constant": lambda: f"{verb} {field} = {extra['value']}",
            "distinct": lambda: f"never sees the same {field} twice in a run",
            "range": lambda: f"{verb} a finite {field} within [{extra['bounds'][0]:.4g}, {extra['bounds'][1]:.4g}]",
        }[mode]()
        return f"{WHERE[phase]}, {api} {what}"

    @classmethod
    def bind(cls, inv, header):
        return _FieldCheck(inv, header, cls.key)


@register
class APIArg(_CallField):
    name = "APIArg"
    key = "arg"
    modes = ("constant", "distinct", "range")
    required = {"api": str, "arg": str, "mode": str}

    @classmethod
    def _owns(cls, field: str) -> bool:
        return not field.startswith("out")


@register
class APIOutput(_CallField):
    name = "APIOutput"
    key = "output"
    modes = ("constant", "range")
    required = {"api": str, "output": str, "mode": str}

    @classmethod
    def _owns(cls, field: str) -> bool:
        return field.startswith("out")


class _FieldCheck(Check):
    def __init__(self, inv: Invariant, header: dict[str, Any], key: str) -> None:
        super().__init__(inv)
        p = inv.params
        self.api, self.field, self.mode = p["api"], p[key], p["mode"]
        self.params = header["params"]
        self.value, self.bounds = p.get("value"), p.get("bounds")
        self.module = self.api
        if self.field.endswith(".training") and self.field != "training":
            modules = header["mode_modules"].get(self.field)
            if not modules:
                raise ValueError(
                    f"invariant {inv.id!r}: the model has no {self.field.split('.')[0]} module"
                    f"{close_matches(self.field, list(header['mode_modules']))}"
                )
            self.module = modules[0]
        if self.field in MASK_FIELDS and self.mode == "constant":
            self.mask = mask_of(resolve(self.value, self.params, f"invariant {inv.id!r}: tensor"), self.params)
        self.seen: dict[Any, int] = {}

    def needs(self):
        if self.field in FINGERPRINT_FIELDS:
            return {"input_fingerprint": True}
        return {"target_shift": True} if self.field == "target_shift" else {}

    def check(self, view: View):
        if self.mode == "distinct":
            return self._repeat(view)
        for fields in view.fields.get(self.api, ()):
            v = fields.get(self.field)
            if v is None:
                if self.field in SELECTIVE_FIELDS and self.mode == "constant":
                    return [
                        (self.module, self._evidence(expected=self.value, observed="every parameter treated alike"))
                    ]
                continue
            bad = self._judge(v)
            if bad is not None:
                return [bad]
        return []

    def _repeat(self, view: View) -> list[tuple[str, dict[str, Any]]]:
        """A value seen in an earlier step, or earlier in this one.  Not a repeat: a replay of
        the step (gradients zeroed in between, see ``View.replays``) or the same step run again
        after a restart (a rollback: the same step number in a later record)."""
        replaying, here = view.replays()[0], set()
        for i, (api, fields) in enumerate(view.rec["calls"]):
            v = fields.get(self.field) if api == self.api and i not in replaying else None
            if v is None:
                continue
            first = self.seen.get(v, view.step)
            if v in here or first != view.step:
                return [(self.module, self._evidence(value=v, first_seen_step=first))]
            here.add(v)
            self.seen[v] = view.step
        return []

    def _judge(self, v: Any) -> tuple[str, dict[str, Any]] | None:
        if self.mode == "range":
            x = as_number(v)
            if x is None or not in_bounds(x, self.bounds):
                return self.module, self._evidence(value=v, bounds=self.bounds)
        elif self.field in MASK_FIELDS:
            got = from_hex(v)
            if got != self.mask:
                missing = names_of(self.mask & ~got, self.params)
                extra = names_of(got & ~self.mask, self.params)
                return (missing or extra)[0], self._evidence(
                    expected=self.value,
                    missing=missing[:10],
                    n_missing=len(missing),
                    extra=extra[:10],
                    n_extra=len(extra),
                )
        elif v != self.value:
            return self.module, self._evidence(expected=self.value, observed=v)
        return None

    def _evidence(self, **facts: Any) -> dict[str, Any]:
        return {"api": self.api, "field": self.field, **facts}


def _ratio(fields: dict[str, Any], arg: str, base: str) -> float | None:
    """fields[arg] / fields[base] where both are finite numbers and the base is not 0."""
    x, y = as_number(fields.get(arg)), as_number(fields.get(base))
    if x is None or not y or not math.isfinite(x) or not math.isfinite(y):
        return None
    return x / y


@register
class APIArgRatio(Relation):
    name = "APIArgRatio"
    required = {"api": str, "arg": str, "base": str, "ratio": (int, float)}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_choice("APIArgRatio api", params["api"], APIS)
        if params["arg"] == params["base"] or as_number(params["ratio"]) is None:
            raise ValueError(f"APIArgRatio: arg and base must differ and ratio be a number, not {params!r}")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        out = []
        for phase in PHASES:
            table: dict[tuple[str, str, str], list[list[float]]] = defaultdict(lambda: [[] for _ in traces])
            for ti, t in enumerate(traces):
                for r in t.phase(phase):
                    for api, fields in r["calls"]:
                        for field in fields:
                            m = GROUP_FIELD.match(field)
                            if m and (ratio := _ratio(fields, field, m.group(1))) is not None:
                                table[(api, field, m.group(1))][ti].append(ratio)
            for (api, arg, base), per in sorted(table.items()):
                values = [v for p in per for v in p]
                lo, hi = min(values), max(values)
                if not all(per) or len(values) < config.min_support or not math.isclose(lo, hi, rel_tol=RATIO_TOL):
                    continue
                ratio = (lo + hi) / 2
                out.append(
                    Invariant(
                        id=f"arg.{phase}.{api}.{arg}.per.{base}",
                        relation=cls.name,
                        params={"api": api, "arg": arg, "base": base, "ratio": ratio},
                        precondition=Precondition(phase=phase),
                        description=f"{WHERE[phase]}, {api} is called with {arg} = {ratio:.6g} x {base}",
                        support=len(values),
                    )
                )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _RatioCheck(inv)


class _RatioCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        p = inv.params
        self.api, self.arg, self.base, self.ratio = p["api"], p["arg"], p["base"], p["ratio"]

    def check(self, view: View):
        for fields in view.fields.get(self.api, ()):
            ratio = _ratio(fields, self.arg, self.base)
            if ratio is not None and not math.isclose(ratio, self.ratio, rel_tol=RATIO_TOL):
                return [
                    (
                        self.api,
                        {
                            "api": self.api,
                            "field": self.arg,
                            "base": self.base,
                            "expected_ratio": self.ratio,
                            "observed_ratio": ratio,
                            "observed": {self.arg: fields[self.arg], self.base: fields[self.base]},
                        },
                    )
                ]
        return []
