"""The validation toolkit: wrong types are refused naming the key and the value."""

from __future__ import annotations

import math

import pytest

from sdcscope.common.validate import check_bool, check_float, check_non_negative, check_positive


@pytest.mark.parametrize(
    "check,value",
    [
        (check_bool, "no"),
        (check_bool, 0),
        (check_bool, None),
        (check_positive, True),
        (check_positive, "3"),
        (check_non_negative, False),
        (check_non_negative, 1.0),
        (check_float, True),
        (check_float, "0.5"),
        (check_float, math.nan),
    ],
)
def test_validators_refuse_wrong_types_naming_key_and_value(check, value):
    # a wrong type is a TypeError, a wrong value of the right type (NaN) a ValueError
    wrong_type = not (isinstance(value, float) and math.isnan(value))
    with pytest.raises(TypeError if wrong_type else ValueError, match=rf"^knob={value!r} must be"):
        check("knob", value)
    check("knob", True if check is check_bool else 1)  # a right value passes


def test_brief_names_a_short_value_as_repr_and_cuts_a_long_one():
    from sdcscope.common.validate import BRIEF_CHARS, brief

    for value in ("gemm.fwd", [1, 2, 3], {"kind": "row"}, 1.5, None, ("a", 2)):
        assert brief(value) == repr(value)
    nested = [[["x" * 50] * 50] * 50] * 50
    assert len(brief(nested)) <= BRIEF_CHARS and brief(nested).startswith("[[[")
    assert len(brief("y" * 10**6)) <= BRIEF_CHARS
