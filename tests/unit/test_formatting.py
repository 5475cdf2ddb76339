"""Numbers in refusals: different values never print alike, and stay short."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedpca.formatting import distinct, shortened

finite = st.floats(allow_nan=False, allow_infinity=True)


def test_short_where_short_is_enough() -> None:
    assert distinct(1.0, 1e-5, 0.5, math.inf) == ("1", "1e-05", "0.5", "inf")
    assert distinct(1 / 3, 2.0) == ("0.333333", "2")
    assert distinct(1.0, 1.0) == ("1", "1")  # equal values print alike
    assert distinct() == ()


def test_more_digits_where_rounding_would_hide_a_difference() -> None:
    # The review's case: "epsilon = 1 ... above ... = 1" with 4 significant digits.
    assert distinct(1.0000004, 1.0) == ("1.0000004", "1")
    assert distinct(1.0 + 2**-52, 1.0) == ("1.0000000000000002", "1")
    assert distinct(1.00000001e-5, 1e-5) == ("1.00000001e-05", "1e-05")


@given(finite, finite)
def test_different_values_print_differently_and_keep_their_order(a: float, b: float) -> None:
    first, second = distinct(a, b)
    if a == b:
        assert float(first) == float(second)  # 0.0 and -0.0 are equal
    else:
        assert first != second
        # Rounding is monotone: text that differs keeps the values' order.
        assert (float(first) < float(second)) is (a < b)


def test_digits_out_of_range() -> None:
    with pytest.raises(ValueError, match="digits"):
        distinct(1.0, digits=0)


def test_a_shortened_text_says_it_was_cut() -> None:
    """Found by a new user: a cancellation's list of declines, cut at 300 characters,
    ended mid-list ("hospital-b: )") and read as the whole list."""
    assert shortened("abc", 3) == "abc"
    assert shortened("owner-1: x, owner-2: y", 12) == "owner-1: x,…"
    assert len(shortened("a" * 500, 300)) == 300
