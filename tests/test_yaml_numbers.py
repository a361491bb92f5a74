"""How the policy's YAML reads numbers and booleans (policy/yamldoc.py): YAML 1.2's core forms, finite, at most
MAX_DIGITS digits for an integer; everything else is text (a schema error where a number is expected) or, under an
explicit !!int / !!float / !!bool tag, an error at its position. Properties, with hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.errors import PolicyError
from policy.yamldoc import MAX_DIGITS, YamlDocument


def read(scalar: str) -> object:
    return YamlDocument.parse(f"v: {scalar}\n", "p.yaml").data["v"]


@given(st.integers(min_value=-(10**MAX_DIGITS - 1), max_value=10**MAX_DIGITS - 1))
def test_an_integer_written_in_decimal_reads_as_itself(n: int) -> None:
    assert read(str(n)) == n and type(read(str(n))) is int
    assert read(f"!!int {n}") == n


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_float_written_by_python_reads_as_itself(x: float) -> None:
    text = repr(x)
    if "inf" in text or "nan" in text:  # pragma: no cover - excluded by the strategy
        return
    assert read(text) == x


@given(st.text(alphabet="0123456789+-._:eEinfaINFA", min_size=1, max_size=12))
def test_no_scalar_reads_as_a_number_that_is_not_finite_or_not_its_decimal_reading(text: str) -> None:
    try:
        value = read(text)
    except PolicyError:
        return  # an error with its position is always acceptable
    if isinstance(value, float):
        assert math.isfinite(value), text
        assert text.lstrip("+-")[:1] != "0" or text.lstrip("+-")[:2] in ("0.", "0e", "0E") or text.lstrip("+-") == "0"
        assert value == float(text)
    elif isinstance(value, int) and not isinstance(value, bool):
        assert value == int(text, 10) and (text.lstrip("+-") == "0" or not text.lstrip("+-").startswith("0")), text


@pytest.mark.parametrize("scalar", [".nan", ".NaN", ".inf", "-.inf", "1:30", "1:30.0", "1_000", "0443", "0o17", "0x1F",
                                    "00.5", "yes", "no", "on", "off", "y", "n"])
def test_yaml_1_1_forms_are_text(scalar: str) -> None:
    assert read(scalar) == scalar


@pytest.mark.parametrize("scalar", ["!!int 0120", "!!int 1:20", "!!int 0x10", "!!int 1_0", "!!float .nan",
                                    "!!float .inf", "!!float 1e999", "!!bool yes", "!!bool on", "1" * (MAX_DIGITS + 1),
                                    "1e400", "-1e400"])
def test_what_is_not_yaml_1_2_or_not_finite_is_an_error_at_its_position(scalar: str) -> None:
    with pytest.raises(PolicyError) as caught:
        read(scalar)
    assert (caught.value.line, caught.value.column) == (1, 4), str(caught.value)


def test_the_schema_takes_no_fraction_where_a_whole_number_is_expected() -> None:
    from policy.loader import parse_policy

    with pytest.raises(PolicyError) as caught:
        parse_policy("version: 1\nports:\n  connect: [443.0]\n", "p.yaml")
    assert "443.0" in str(caught.value) and "p.yaml:3:" in str(caught.value)
