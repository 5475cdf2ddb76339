"""Slot packing with balanced signed digits: bounds, layout arithmetic, refusal, speed."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from fractions import Fraction

import gmpy2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedpca.codec import (
    PackingBounds,
    SlotLayout,
    check_owner_count,
    owner_value_bound,
    pack_slots,
    packing,
    slot_value_bound,
    unpack_slots,
)
from fedpca.codec.packing import check_slot_values, pack_stream, unpack_range
from fedpca.errors import EncodingOverflowError, LayoutError

# The bounds the owner benchmark uses: rows clipped to norm 1, 2^20 records per
# owner, 2^8 owners, 32 fractional bits, noise headroom of 64 sigma for sigma = 100.
REALISTIC = PackingBounds(
    max_abs_per_record=1.0,
    max_records_per_owner=2**20,
    max_owners=2**8,
    frac_bits=32,
    noise_headroom=64 * 100 * 2**32,
)


def _smallest_modulus(key_bits: int) -> int:
    """The smallest odd number with exactly key_bits bits: the worst case for |P| < n/2."""
    return (1 << (key_bits - 1)) + 1


def test_owner_and_slot_bounds_follow_the_formula() -> None:
    assert owner_value_bound(REALISTIC) == 2**52 + 1
    assert slot_value_bound(REALISTIC) == 2**8 * (2**52 + 1) + 64 * 100 * 2**32
    # 0.1 is not a binary fraction; the bound must not be rounded down.
    bounds = PackingBounds(0.1, 1000, 3, 10, 0)
    assert owner_value_bound(bounds) == -(-Fraction(0.1) * 1000 * 2**10 // 1) + 1
    assert owner_value_bound(bounds) >= 0.1 * 1000 * 2**10 + 1


def test_realistic_layout() -> None:
    layout = SlotLayout.from_bounds(REALISTIC, 2048, 125_751)
    assert layout.slot_bits == slot_value_bound(REALISTIC).bit_length() + 1 == 62
    assert layout.slots_per_ciphertext == 2047 // 62 == 33
    assert layout.n_ciphertexts == 3811
    assert layout.slot_capacity >= slot_value_bound(REALISTIC)


@given(
    st.floats(0.0, 1e6),
    st.integers(1, 2**30),
    st.integers(1, 2**12),
    st.integers(0, 40),
    st.integers(0, 2**80),
    st.sampled_from([512, 1024, 2048, 3072]),
)
def test_layout_uses_as_many_slots_as_the_inequality_allows(
    max_abs: float, records: int, owners: int, frac_bits: int, headroom: int, key_bits: int
) -> None:
    bounds = PackingBounds(max_abs, records, owners, frac_bits, headroom)
    try:
        layout = SlotLayout.from_bounds(bounds, key_bits, 10)
    except EncodingOverflowError:
        assert slot_value_bound(bounds).bit_length() + 1 > key_bits - 1
        return
    assert layout.slot_capacity >= slot_value_bound(bounds)
    assert layout.slot_bits * layout.slots_per_ciphertext <= key_bits - 1
    assert layout.slot_bits * (layout.slots_per_ciphertext + 1) > key_bits - 1


@pytest.mark.parametrize("key_bits", [512, 2048])
@pytest.mark.parametrize("sign", [1, -1])
def test_extreme_slots_decode_with_the_smallest_modulus(key_bits: int, sign: int) -> None:
    # Every slot at +-capacity maximises |P|; it must still stay below n/2 for the
    # smallest n with key_bits bits, or "P > n/2 means negative" would misdecode.
    layout = SlotLayout(key_bits, 62, (key_bits - 1) // 62, 3 * ((key_bits - 1) // 62))
    n = _smallest_modulus(key_bits)
    values = [sign * layout.slot_capacity] * layout.value_count
    packed = pack_slots(values, layout, layout.slot_capacity)
    assert all(2 * abs(p) < n for p in packed)
    assert unpack_slots([p % n for p in packed], layout, n) == values


def test_one_more_slot_than_the_inequality_allows_is_refused() -> None:
    with pytest.raises(LayoutError, match="do not fit"):
        SlotLayout(2048, 62, 34, 100)


small_layout = SlotLayout(key_bits=512, slot_bits=20, slots_per_ciphertext=25, value_count=60)


@given(st.data())
def test_pack_unpack_round_trip(data: st.DataObject) -> None:
    bound = small_layout.slot_capacity
    values = data.draw(
        st.lists(
            st.integers(-bound, bound) | st.sampled_from([bound, -bound, 0, 1, -1]),
            min_size=60,
            max_size=60,
        )
    )
    n = data.draw(st.integers(2**511, 2**512 - 1).map(lambda x: x | 1))
    packed = pack_slots(np.array(values, dtype=np.int64), small_layout, bound)
    assert len(packed) == small_layout.n_ciphertexts == 3
    assert unpack_slots([p % n for p in packed], small_layout, n) == values


@given(
    st.lists(
        st.lists(
            st.integers(-1000, 1000) | st.sampled_from([1000, -1000]), min_size=60, max_size=60
        ),
        min_size=1,
        max_size=8,
    )
)
def test_packed_integers_add_slot_wise(owners: list[list[int]]) -> None:
    # The tightest width from_bounds would choose for these owners.
    layout = SlotLayout(512, 1 + (1000 * len(owners)).bit_length(), 5, 60)
    n = _smallest_modulus(512)
    total = [0] * layout.n_ciphertexts
    for values in owners:
        total = [t + p for t, p in zip(total, pack_slots(values, layout, 1000), strict=True)]
    expected = [sum(column) for column in zip(*owners, strict=True)]
    assert unpack_slots([t % n for t in total], layout, n) == expected


def test_scalar_multiple_of_packed_integer_multiplies_every_slot() -> None:
    layout = SlotLayout(512, 30, 10, 20)
    n = _smallest_modulus(512)
    values = list(range(-10, 10))
    packed = pack_slots(values, layout, 10)
    assert unpack_slots([(-7 * p) % n for p in packed], layout, n) == [-7 * v for v in values]


@pytest.mark.parametrize("bad_value", [1001, -1001, 2**63 - 1, -(2**63)])
@pytest.mark.parametrize("container", ["numpy", "list"])
def test_out_of_bound_values_are_refused_with_index_and_value(
    bad_value: int, container: str
) -> None:
    layout = SlotLayout(512, 20, 25, 40)
    values = [5] * 40
    values[17] = bad_value
    payload = np.array(values, dtype=np.int64) if container == "numpy" else values
    with pytest.raises(EncodingOverflowError, match=f"value {bad_value} at index 17"):
        pack_slots(payload, layout, 1000)


def test_values_at_the_bound_are_accepted() -> None:
    layout = SlotLayout(512, 20, 25, 4)
    assert unpack_slots(
        [p % _smallest_modulus(512) for p in pack_slots([1000, -1000, 0, 999], layout, 1000)],
        layout,
        _smallest_modulus(512),
    ) == [1000, -1000, 0, 999]


def test_bound_larger_than_slot_capacity_is_refused() -> None:
    layout = SlotLayout(512, 20, 25, 2)
    with pytest.raises(EncodingOverflowError, match="exceeds the slot capacity"):
        pack_slots([0, 0], layout, 2**19)
    pack_slots([0, 0], layout, 2**19 - 1)


def test_wrong_value_count_is_a_layout_error() -> None:
    with pytest.raises(LayoutError, match="declares 4 values, got 3"):
        pack_slots([1, 2, 3], SlotLayout(512, 20, 25, 4), 10)


def test_non_integers_are_refused() -> None:
    layout = SlotLayout(512, 20, 25, 2)
    with pytest.raises(TypeError):
        pack_slots(np.array([0.5, 1.0]), layout, 10)
    with pytest.raises(TypeError):
        pack_slots([1, 0.5], layout, 10)  # type: ignore[list-item]


def test_unpack_detects_a_wrapped_slot() -> None:
    layout = SlotLayout(512, 20, 25, 30)
    n = _smallest_modulus(512)
    packed = pack_slots([0] * 30, layout, 10)
    # A carry into the unused top slots of the last plaintext cannot come from
    # in-bound sums: unpacking must refuse it instead of returning garbage.
    corrupted = [packed[0] % n, (packed[1] + (1 << (20 * 5))) % n]
    with pytest.raises(EncodingOverflowError, match="packed plaintext 1"):
        unpack_slots(corrupted, layout, n)
    # A slot outside the declared bound is refused when the bound is given.
    over = [p % n for p in pack_slots([0] * 29 + [11], layout, 11)]
    with pytest.raises(EncodingOverflowError, match="slot 29 decoded outside the declared bound"):
        unpack_slots(over, layout, n, bound=10)


def test_unpack_checks_count_and_key_size() -> None:
    layout = SlotLayout(512, 20, 25, 30)
    with pytest.raises(LayoutError, match="2 packed ciphertexts, got 1"):
        unpack_slots([0], layout, _smallest_modulus(512))
    with pytest.raises(LayoutError, match="512-bit modulus"):
        unpack_slots([0, 0], layout, _smallest_modulus(1024))


@given(st.data())
def test_packing_a_stream_of_pieces_equals_packing_the_whole(data: st.DataObject) -> None:
    # Pieces of any sizes (empty ones too) straddling ciphertext boundaries: the
    # concatenated output is pack_slots of the concatenation and unpacks to the values.
    bound = small_layout.slot_capacity
    values = data.draw(st.lists(st.integers(-bound, bound), min_size=60, max_size=60))
    cuts = sorted(data.draw(st.lists(st.integers(0, 60), max_size=8)))
    edges = [0, *cuts, 60]
    pieces = [np.array(values[a:b], dtype=np.int64) for a, b in itertools.pairwise(edges)]
    streamed = [p for batch in pack_stream(pieces, small_layout, bound) for p in batch]
    assert streamed == pack_slots(values, small_layout, bound)
    n = _smallest_modulus(512)
    assert unpack_slots([p % n for p in streamed], small_layout, n) == values


def test_pieces_of_whole_ciphertexts_are_packed_as_they_arrive() -> None:
    layout = SlotLayout(512, 20, 5, 23)
    read: list[int] = []

    def pieces() -> Iterator[list[int]]:
        for start in range(0, 23, 10):
            read.append(start)
            yield list(range(start, min(23, start + 10)))

    stream = pack_stream(pieces(), layout, 100)
    assert len(next(stream)) == 2 and read == [0]  # the first piece only
    assert [len(batch) for batch in stream] == [2, 1] and read == [0, 10, 20]


def test_a_stream_refuses_out_of_bound_values_and_wrong_counts() -> None:
    layout = SlotLayout(512, 20, 5, 12)
    pieces = [np.arange(6, dtype=np.int64), np.array([0, 0, 0, 0, 5000, 0], dtype=np.int64)]
    stream = pack_stream(pieces, layout, 1000)
    assert len(next(stream)) == 1  # the first piece went through before the bad one
    with pytest.raises(EncodingOverflowError, match="value 5000 at index 10"):
        next(stream)
    with pytest.raises(LayoutError, match="declares 12 values, got 11"):
        list(pack_stream([[1] * 5, [1] * 6], layout, 10))
    with pytest.raises(LayoutError, match="declares 12 values, got at least 13"):
        list(pack_stream([[1] * 7, [1] * 6], layout, 10))


def test_checking_values_names_the_first_offender_in_the_whole_vector() -> None:
    check_slot_values(np.array([3, -3, 0], dtype=np.int64), 3)
    with pytest.raises(EncodingOverflowError, match="value -4 at index 101"):
        check_slot_values(np.array([0, -4, 9], dtype=np.int64), 3, first=100)
    with pytest.raises(LayoutError, match="one-dimensional"):
        check_slot_values(np.zeros((2, 2), dtype=np.int64), 3)


def test_unpacking_a_range_equals_the_slice_of_the_whole() -> None:
    layout = SlotLayout(512, 20, 25, 60)
    n = _smallest_modulus(512)
    values = list(range(-30, 30))
    plaintexts = [p % n for p in pack_slots(values, layout, 30)]
    assert unpack_range(plaintexts[1:], layout, n, 30, first=1) == values[25:]
    assert unpack_range(plaintexts[1:2], layout, n, first=1) == values[25:50]
    with pytest.raises(LayoutError, match="outside the layout"):
        unpack_range(plaintexts[1:], layout, n, first=2)
    # Messages name positions in the whole layout.
    over = [p % n for p in pack_slots([0] * 59 + [31], layout, 31)]
    with pytest.raises(EncodingOverflowError, match="slot 59 decoded outside the declared bound"):
        unpack_range(over[2:], layout, n, 30, first=2)


def test_owner_count_beyond_max_owners_is_refused() -> None:
    check_owner_count(REALISTIC, 2**8)
    with pytest.raises(EncodingOverflowError, match="257 contributing owners"):
        check_owner_count(REALISTIC, 2**8 + 1)


def test_invalid_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_abs_per_record"):
        PackingBounds(float("nan"), 1, 1, 0, 0)
    with pytest.raises(ValueError, match="max_owners"):
        PackingBounds(1.0, 1, 0, 0, 0)
    with pytest.raises(ValueError, match="noise_headroom"):
        PackingBounds(1.0, 1, 1, 0, -1)


def test_packing_round_trips_a_madelon_sized_share() -> None:
    layout = SlotLayout.from_bounds(REALISTIC, 2048, 125_751)
    bound = owner_value_bound(REALISTIC)
    rng = random.Random(3)
    values = np.array([rng.randint(-bound, bound) for _ in range(125_751)], dtype=np.int64)
    n = _smallest_modulus(2048)
    packed = pack_slots(values, layout, bound)
    assert len(packed) == layout.n_ciphertexts
    unpacked = unpack_slots([p % n for p in packed], layout, n)
    assert unpacked == values.tolist()


@given(st.data())
def test_words_and_shifts_pack_and_unpack_alike(data: st.DataObject) -> None:
    # Slots of at most 63 bits are packed and unpacked with 64-bit words; the plain
    # shifts on Python ints are the reference: the same plaintexts, the same values,
    # the same refusals, for every width, slot count and a short last plaintext.
    shift = data.draw(st.integers(2, 63))
    k = data.draw(st.integers(1, 2046 // shift))
    count = data.draw(st.integers(1, 3 * k))
    layout = SlotLayout(2048, shift, k, count)
    capacity = layout.slot_capacity
    values = data.draw(
        st.lists(
            st.integers(-capacity, capacity) | st.sampled_from([capacity, -capacity, 0]),
            min_size=count,
            max_size=count,
        )
    )
    packed = packing._pack_words(np.array(values, dtype=np.int64), shift, k)
    assert packed == packing._pack(values, shift, k)
    n = data.draw(st.integers(2**2047, 2**2048 - 1).map(lambda x: x | 1))
    plaintexts = [p % n for p in packed]
    first = data.draw(st.integers(0, layout.n_ciphertexts - 1))
    page = plaintexts[first:]
    bound = data.draw(st.integers(0, capacity))
    results = []
    for unpack in (packing._unpack_words, packing._unpack_shifts):
        try:
            results.append(unpack(page, layout, n, bound, first))
        except EncodingOverflowError as exc:
            results.append(str(exc))
    assert results[0] == results[1]
    # A carry into the slot above a plaintext's own is refused alike (or, when the
    # plaintext fills all key_bits - 1 bits, decoded alike: that carry wraps mod n).
    top = count - (layout.n_ciphertexts - 1) * k
    wrapped = (packed[-1] + (1 << (shift * top))) % n
    results = []
    for unpack in (packing._unpack_words, packing._unpack_shifts):
        try:
            results.append(unpack([wrapped], layout, n, None, layout.n_ciphertexts - 1))
        except EncodingOverflowError as exc:
            results.append(str(exc))
    assert results[0] == results[1]
    if 1 << (shift * top + 1) < n:
        assert isinstance(results[0], str)


def test_slots_wider_than_a_word_round_trip() -> None:
    # 70-bit slots take the shifts on Python ints, whole and streamed.
    layout = SlotLayout(2048, 70, 29, 100)
    capacity = layout.slot_capacity
    rng = random.Random(3)
    values = [rng.randint(-capacity, capacity) for _ in range(100)]
    packed = pack_slots(values, layout, capacity)
    pieces = [values[:41], values[41:]]
    assert [p for batch in pack_stream(pieces, layout, capacity) for p in batch] == packed
    n = _smallest_modulus(2048)
    assert unpack_slots([p % n for p in packed], layout, n, capacity) == values


def test_unpacking_takes_any_integer_type() -> None:
    # Decryption may hand back gmpy2 or numpy integers: each is decoded as its int.
    layout = SlotLayout(32, 10, 3, 5)
    n = (1 << 31) + 11
    plaintexts = [p % n for p in pack_slots([1, -2, 3, -4, 5], layout, 5)]
    for converted in ([gmpy2.mpz(p) for p in plaintexts], np.array(plaintexts)):
        assert unpack_slots(converted, layout, n) == [1, -2, 3, -4, 5]


@pytest.mark.parametrize("slot_bits", [20, 80])  # 64-bit words, and Python ints
def test_a_page_is_unpacked_whole_before_a_bad_plaintext_is_reported(
    slot_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: unpacking stopped at the first plaintext that did not decode, so
    how long a page took said where that plaintext was, to a proxy that built the page
    from an owner's ciphertext. Every plaintext is now unpacked, then the first
    failure raised."""
    from fedpca.codec import packing

    k = 500 // slot_bits
    layout = SlotLayout(512, slot_bits, k, 8 * k)
    n = _smallest_modulus(512)
    packed = [p % n for p in pack_slots([0] * (8 * k), layout, 10)]
    wrapped = (packed[0] + (1 << (slot_bits * k))) % n  # a carry past its last slot
    real_signed = packing._signed
    signed_calls: list[int] = []

    def counted(plaintext: int, modulus: int, index: int) -> int:
        signed_calls.append(index)
        return real_signed(plaintext, modulus, index)

    monkeypatch.setattr(packing, "_signed", counted)
    with pytest.raises(EncodingOverflowError, match="packed plaintext 0 does not decode"):
        unpack_range([wrapped, *packed[1:]], layout, n, 10)
    assert signed_calls == list(range(8))  # was: [0]
    signed_calls.clear()
    over = [p % n for p in pack_slots([11] + [0] * (8 * k - 1), layout, 11)]
    with pytest.raises(EncodingOverflowError, match="slot 0 decoded outside"):
        unpack_range(over, layout, n, 10)
    assert signed_calls == list(range(8))
