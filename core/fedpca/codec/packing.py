"""Packing many signed fixed-point values into one Paillier plaintext.

Layout: balanced signed digits.  A packed plaintext is the signed integer

    P = sum_s d_s * 2^(B*s),    d_s in [-2^(B-1), 2^(B-1)),

reduced mod n for encryption.  Because P is an ordinary integer (no per-slot
offsets), adding two packed plaintexts adds them slot by slot and multiplying by
any signed integer multiplies every slot, as long as no slot leaves its digit
range and |P| stays below n/2, which is what the public :class:`PackingBounds`
guarantee and what :func:`pack_slots` enforces before anything is encrypted.

Why hand-written: python-paillier, gmpy2 and the other Paillier libraries encrypt
one number per plaintext; none offers slot packing with declared bounds, and the
operation is a few lines of shift-and-add on Python ints, so there is nothing worth
depending on. Slots of at most 63 bits (every layout up to hundreds of owners at
2048 bits: 62 bits at madelon's 500 features) are packed and unpacked with numpy
instead, as 64-bit words turned into Python ints with ``int.from_bytes`` (and back
with ``int.to_bytes``): for 125,751 values in 3,811 plaintexts ``benchmarks/packing.py``
measured 9.2 ms to pack and 18.3 ms to unpack with shifts on Python ints, 4.1 and 7.1 ms
with words.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from ..errors import EncodingOverflowError, LayoutError

logger = logging.getLogger(__name__)

_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class PackingBounds:
    """Public bounds that size every slot of a query; never derived from private data.

    Parameters
    ----------
    max_abs_per_record : float
        Largest |contribution| of one record to one slot, in real units (1.0 for
        every entry of x xᵀ and x when rows are clipped to ‖x‖₂ ≤ 1).
    max_records_per_owner : int
        Largest number of records one owner may sum into a slot.
    max_owners : int
        Largest number of owners whose packed ciphertexts are added together.
    frac_bits : int
        Fractional bits f of the fixed-point encoding.
    noise_headroom : int
        Largest |noise| the proxy may add to one slot, in fixed-point units.
    """

    max_abs_per_record: float
    max_records_per_owner: int
    max_owners: int
    frac_bits: int
    noise_headroom: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_abs_per_record) and self.max_abs_per_record >= 0):
            raise ValueError(
                f"max_abs_per_record must be finite and >= 0, got {self.max_abs_per_record!r}"
            )
        for name in ("max_records_per_owner", "max_owners"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("frac_bits", "noise_headroom"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def owner_value_bound(bounds: PackingBounds) -> int:
    """Largest |slot value| one owner may pack: ``ceil(N_max * a_max * 2^f) + 1``.

    An owner sums its records in floating point and encodes the sum once, so the
    only rounding step is one stochastic rounding, which moves the value by less
    than 1 in fixed-point units: hence the ``+ 1``.  Computed exactly with
    rationals so that no float rounding can make the bound too small.
    """
    exact = (
        Fraction(bounds.max_abs_per_record) * bounds.max_records_per_owner * (1 << bounds.frac_bits)
    )
    return math.ceil(exact) + 1


def slot_value_bound(bounds: PackingBounds) -> int:
    """Largest |slot value| after summing all owners and adding noise.

    ``max_owners * owner_value_bound + noise_headroom``.
    """
    return bounds.max_owners * owner_value_bound(bounds) + bounds.noise_headroom


def check_owner_count(bounds: PackingBounds, n_owners: int) -> None:
    """Refuse aggregating more owners than the slot width was sized for.

    Raises
    ------
    EncodingOverflowError
        If ``n_owners > bounds.max_owners``.
    """
    if n_owners < 0:
        raise ValueError(f"n_owners must be >= 0, got {n_owners}")
    if n_owners > bounds.max_owners:
        raise EncodingOverflowError(
            f"{n_owners} contributing owners exceed max_owners={bounds.max_owners} "
            "the packed slots were sized for; their sum could overflow a slot"
        )


@dataclass(frozen=True)
class SlotLayout:
    """How ``value_count`` signed values are spread over packed ciphertexts.

    Parameters
    ----------
    key_bits : int
        Bit length of the Paillier modulus n (n has exactly this many bits).
    slot_bits : int
        Slot width B, sign included.
    slots_per_ciphertext : int
        Slots k in one packed plaintext (the last one may use fewer).
    value_count : int
        Number of values packed.
    """

    key_bits: int
    slot_bits: int
    slots_per_ciphertext: int
    value_count: int

    def __post_init__(self) -> None:
        if self.slot_bits < 2:
            raise LayoutError(f"slot_bits must be >= 2 (one sign bit), got {self.slot_bits}")
        if self.slots_per_ciphertext < 1:
            raise LayoutError(f"slots_per_ciphertext must be >= 1, got {self.slots_per_ciphertext}")
        if self.value_count < 0:
            raise LayoutError(f"value_count must be >= 0, got {self.value_count}")
        # See from_bounds: B * k <= key_bits - 1 is what keeps |P| < n / 2.
        if self.slot_bits * self.slots_per_ciphertext > self.key_bits - 1:
            raise LayoutError(
                f"{self.slots_per_ciphertext} slots of {self.slot_bits} bits do not fit a "
                f"{self.key_bits}-bit modulus (need slot_bits * slots <= key_bits - 1)"
            )

    @property
    def n_ciphertexts(self) -> int:
        """Number of packed ciphertexts, ``ceil(value_count / slots_per_ciphertext)``."""
        return -(-self.value_count // self.slots_per_ciphertext)

    @property
    def slot_capacity(self) -> int:
        """Largest |slot value| that decodes correctly: ``2^(B-1) - 1``."""
        return (1 << (self.slot_bits - 1)) - 1

    @classmethod
    def from_bounds(cls, bounds: PackingBounds, key_bits: int, value_count: int) -> SlotLayout:
        """Derive the slot width and slots per ciphertext from public bounds.

        Parameters
        ----------
        bounds : PackingBounds
        key_bits : int
            Bit length of n.
        value_count : int
            Number of values to pack.

        Raises
        ------
        EncodingOverflowError
            If one slot does not even fit the modulus.

        Notes
        -----
        With V = slot_value_bound(bounds), B = V.bit_length() + 1 gives
        V <= 2^(B-1) - 1, so every slot digit stays inside [-2^(B-1), 2^(B-1)).
        Then

            |P| <= V * sum_{s<k} 2^(B s) = V (2^(B k) - 1) / (2^B - 1) < 2^(B k - 1),

        because V / (2^B - 1) <= (2^(B-1) - 1) / (2^B - 1) < 1/2.  n has exactly
        key_bits bits, so n >= 2^(key_bits - 1) and n / 2 >= 2^(key_bits - 2).
        Hence |P| < n / 2 whenever B k - 1 <= key_bits - 2, i.e. B k <= key_bits - 1,
        and k = floor((key_bits - 1) / B).  |P| < n / 2 is exactly what makes
        "P mod n > n/2 means negative" decode every packed plaintext uniquely.
        """
        slot_bits = slot_value_bound(bounds).bit_length() + 1
        slots = (key_bits - 1) // slot_bits
        if slots < 1:
            raise EncodingOverflowError(
                f"a {slot_bits}-bit slot does not fit a {key_bits}-bit modulus; "
                "lower the declared bounds or use a larger key"
            )
        return cls(key_bits, slot_bits, slots, value_count)


def _check_bound(layout: SlotLayout, bound: int) -> None:
    if bound < 0:
        raise ValueError(f"bound must be >= 0, got {bound}")
    if bound > layout.slot_capacity:
        raise EncodingOverflowError(
            f"declared bound {bound} exceeds the slot capacity {layout.slot_capacity} "
            f"of {layout.slot_bits}-bit slots"
        )


def _bounded_ints(
    values: NDArray[np.integer] | Sequence[int], bound: int, first: int = 0
) -> list[int]:
    """Return the values as Python ints after refusing any |value| > bound.

    ``first`` is the index of ``values[0]`` in the whole vector (for messages).
    """
    if isinstance(values, np.ndarray) and values.dtype.kind == "i":
        check_slot_values(values, bound, first)
        return values.tolist()
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise LayoutError(f"values must be one-dimensional, got shape {values.shape}")
        if values.dtype.kind not in "uO":
            raise TypeError(f"packing takes encoded integers, got dtype {values.dtype}")
        values = values.tolist()
    items = list(values)
    for index, value in enumerate(items, first):
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise TypeError(f"value at index {index} is {type(value).__name__}, not an int")
        if not -bound <= value <= bound:
            raise EncodingOverflowError(
                f"value {int(value)} at index {index} exceeds the declared bound "
                f"|value| <= {bound}; nothing was packed or encrypted"
            )
    return [int(v) for v in items]


def check_slot_values(values: NDArray[np.integer], bound: int, first: int = 0) -> None:
    """Refuse a one-dimensional integer array holding any |value| > bound.

    Vectorised, without converting anything to Python ints, so a caller can check a
    whole vector before packing it piece by piece (:func:`pack_stream`).

    Parameters
    ----------
    values : numpy.ndarray of signed integers, one-dimensional.
    bound : int
    first : index of ``values[0]`` in the whole vector (for the message).

    Raises
    ------
    EncodingOverflowError
        Naming the first offending index and value.
    LayoutError
        If ``values`` is not one-dimensional.
    """
    if values.ndim != 1:
        raise LayoutError(f"values must be one-dimensional, got shape {values.shape}")
    if bound > _INT64_MAX or not values.size:
        return
    if int(values.max()) <= bound and int(values.min()) >= -bound:
        return
    index = int(np.flatnonzero((values > bound) | (values < -bound))[0])
    raise EncodingOverflowError(
        f"value {int(values[index])} at index {first + index} exceeds the declared "
        f"bound |value| <= {bound}; nothing was packed or encrypted"
    )


_WORD_SLOT_BITS = 63
"""Largest slot width packed with 64-bit words: a slot's field, its digit and every
bound it is checked against then fit numpy's int64/uint64."""


def _word_geometry(shift: int, k: int) -> tuple[int, list[tuple[int, int, bool]]]:
    """64-bit words per plaintext and, per slot, (word, bit offset, spills into the next)."""
    places = []
    for slot in range(k):
        word, offset = divmod(slot * shift, 64)
        places.append((word, offset, offset + shift > 64))
    return (k * shift) // 64 + 1, places


def _ints_from_fields(fields: NDArray[np.uint64], shift: int) -> list[int]:
    """Row j -> sum_i fields[j, i] 2^(i shift), for fields below 2^shift <= 2^63."""
    count, k = fields.shape
    words_per_row, places = _word_geometry(shift, k)
    by_slot = np.ascontiguousarray(fields.T)  # one contiguous row per slot
    words = np.zeros((words_per_row, count), dtype=np.uint64)
    for slot, (word, offset, spills) in enumerate(places):
        words[word] |= by_slot[slot] << np.uint64(offset)  # bits above 64 drop out here...
        if spills:
            words[word + 1] |= by_slot[slot] >> np.uint64(64 - offset)  # ...and land here
    raw = words.T.astype("<u8").tobytes()
    width = 8 * words_per_row
    return [int.from_bytes(raw[row * width : (row + 1) * width], "little") for row in range(count)]


def _fields_from_ints(values: Sequence[int], shift: int, k: int) -> NDArray[np.uint64]:
    """Inverse of :func:`_ints_from_fields` for ints in [0, 2^(k shift)): (count, k)."""
    words_per_row, places = _word_geometry(shift, k)
    width = 8 * words_per_row
    raw = b"".join(value.to_bytes(width, "little") for value in values)
    words = np.frombuffer(raw, dtype="<u8").reshape(len(values), words_per_row).T.copy()
    mask = np.uint64((1 << shift) - 1)
    by_slot = np.empty((k, len(values)), dtype=np.uint64)
    for slot, (word, offset, spills) in enumerate(places):
        column = words[word] >> np.uint64(offset)
        if spills:
            column |= words[word + 1] << np.uint64(64 - offset)
        by_slot[slot] = column & mask
    return by_slot.T


def _half_offsets(shift: int, k: int) -> list[int]:
    """``offsets[m]`` = sum over m slots of 2^(shift - 1) 2^(shift s): adding it to a
    plaintext of m balanced digits in [-2^(B-1), 2^(B-1)) makes each a B-bit field."""
    half = 1 << (shift - 1)
    offsets = [0]
    for slot in range(k):
        offsets.append(offsets[-1] + (half << (shift * slot)))
    return offsets


def _pack_words(digits: NDArray[np.int64], shift: int, k: int) -> list[int]:
    """:func:`_pack` for int64 digits of slots of at most 63 bits, with 64-bit words.

    P = sum_s d_s 2^(B s) is sum_s (d_s + 2^(B-1)) 2^(B s) - offset, where every
    d_s + 2^(B-1) is a plain B-bit field (no borrow between slots).
    """
    count = -(-len(digits) // k)
    half = np.int64(1 << (shift - 1))
    padded = np.full(count * k, -half, dtype=np.int64)  # short last plaintext: field 0
    padded[: len(digits)] = digits
    fields = (padded + half).view(np.uint64).reshape(count, k)
    offsets = _half_offsets(shift, k)
    unsigned = _ints_from_fields(fields, shift)
    last = len(digits) - (count - 1) * k
    packed = [value - offsets[k] for value in unsigned]
    if last != k:
        packed[-1] = unsigned[-1] - offsets[last]
    return packed


def _bounded_digits(
    values: NDArray[np.integer] | Sequence[int], bound: int, first: int = 0
) -> NDArray[np.int64]:
    """:func:`_bounded_ints` as an int64 array (``bound`` below 2^63)."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "i":
        check_slot_values(values, bound, first)
        return values.astype(np.int64, copy=False)
    return np.asarray(_bounded_ints(values, bound, first), dtype=np.int64)


def _pack(items: Sequence[int], shift: int, k: int) -> list[int]:
    packed: list[int] = []
    for start in range(0, len(items), k):
        plaintext = 0
        # Horner from the top slot down: P = (...(d_{k-1} 2^B + d_{k-2}) 2^B ...) + d_0.
        # Negative digits simply borrow from the slot above; unpacking undoes it.
        for digit in reversed(items[start : start + k]):
            plaintext = (plaintext << shift) + digit
        packed.append(plaintext)
    return packed


def pack_slots(
    values: NDArray[np.integer] | Sequence[int], layout: SlotLayout, bound: int
) -> list[int]:
    """Pack signed integers into signed packed plaintexts, refusing out-of-bound values.

    Parameters
    ----------
    values : numpy.ndarray of int64 or sequence of int, shape (layout.value_count,)
        Fixed-point encoded values.
    layout : SlotLayout
    bound : int
        The bound these values are declared against: ``owner_value_bound(bounds)``
        for an owner's scatter share, ``bounds.noise_headroom`` for the proxy's
        noise vector.  Must not exceed ``layout.slot_capacity``.

    Returns
    -------
    list of int, shape (layout.n_ciphertexts,)
        Signed packed plaintexts P with |P| < 2^(key_bits - 2) <= n / 2; encrypt
        ``P mod n``.

    Raises
    ------
    EncodingOverflowError
        If any |value| > bound (message names index and value) or the bound does
        not fit the slots.  Raised before anything is packed.
    LayoutError
        If the number of values differs from ``layout.value_count``.
    """
    if len(values) != layout.value_count:
        raise LayoutError(f"layout declares {layout.value_count} values, got {len(values)}")
    _check_bound(layout, bound)
    shift, k = layout.slot_bits, layout.slots_per_ciphertext
    if shift <= _WORD_SLOT_BITS:
        return _pack_words(_bounded_digits(values, bound), shift, k)
    return _pack(_bounded_ints(values, bound), shift, k)


def pack_stream(
    pieces: Iterable[NDArray[np.integer] | Sequence[int]], layout: SlotLayout, bound: int
) -> Iterator[list[int]]:
    """:func:`pack_slots` of values that arrive in consecutive pieces, packed as they come.

    Yields, after each piece, the packed plaintexts of every ciphertext whose slots are
    all in (pieces of a multiple of ``layout.slots_per_ciphertext`` values each give
    exactly their own ciphertexts), so only one piece is ever held as Python ints.
    The concatenated output equals ``pack_slots`` of the concatenated pieces.

    Raises
    ------
    EncodingOverflowError
        A value of a piece exceeds ``bound`` (checked before that piece is packed; the
        index is the value's position in the whole vector), or the bound does not fit.
    LayoutError
        The pieces hold more or fewer values than ``layout.value_count`` (found once
        the surplus arrives, or at the end).
    """
    _check_bound(layout, bound)
    shift, k = layout.slot_bits, layout.slots_per_ciphertext
    if shift <= _WORD_SLOT_BITS:
        yield from _pack_stream_words(pieces, layout, bound)
        return
    carry: list[int] = []
    seen = 0
    for piece in pieces:
        _check_stream_count(layout, seen + len(piece))
        items = _bounded_ints(piece, bound, seen)
        seen += len(items)
        if carry:
            items = carry + items
        whole = len(items) - len(items) % k
        if whole:
            yield _pack(items[:whole], shift, k)
        carry = items[whole:]
    if seen != layout.value_count:
        raise LayoutError(f"layout declares {layout.value_count} values, got {seen}")
    if carry:
        yield _pack(carry, shift, k)


def _pack_stream_words(
    pieces: Iterable[NDArray[np.integer] | Sequence[int]], layout: SlotLayout, bound: int
) -> Iterator[list[int]]:
    """:func:`pack_stream` for slots of at most 63 bits (:func:`_pack_words`)."""
    shift, k = layout.slot_bits, layout.slots_per_ciphertext
    carry = np.zeros(0, dtype=np.int64)
    seen = 0
    for piece in pieces:
        _check_stream_count(layout, seen + len(piece))
        digits = _bounded_digits(piece, bound, seen)
        seen += len(digits)
        if len(carry):
            digits = np.concatenate([carry, digits])
        whole = len(digits) - len(digits) % k
        if whole:
            yield _pack_words(digits[:whole], shift, k)
        carry = digits[whole:].copy()  # not a view of the caller's checked array
    if seen != layout.value_count:
        raise LayoutError(f"layout declares {layout.value_count} values, got {seen}")
    if len(carry):
        yield _pack_words(carry, shift, k)


def _check_stream_count(layout: SlotLayout, at_least: int) -> None:
    if at_least > layout.value_count:
        raise LayoutError(f"layout declares {layout.value_count} values, got at least {at_least}")


def unpack_slots(
    plaintexts: Sequence[int], layout: SlotLayout, modulus: int, bound: int | None = None
) -> list[int]:
    """Recover signed slot values from decrypted packed plaintexts.

    Parameters
    ----------
    plaintexts : sequence of int, shape (layout.n_ciphertexts,)
        Decrypted plaintexts in [0, n).
    layout : SlotLayout
    modulus : int
        The Paillier modulus n.
    bound : int, optional
        If given, every decoded |slot value| must be at most this.

    Returns
    -------
    list of int, shape (layout.value_count,)
        Signed slot values (Python ints; sums may exceed int64).

    Raises
    ------
    EncodingOverflowError
        If a plaintext does not decode into its slots (some slot overflowed, or the
        ciphertext does not belong to this layout) or a value exceeds ``bound``.
    LayoutError
        On a count or key-size mismatch.
    """
    if len(plaintexts) != layout.n_ciphertexts:
        raise LayoutError(
            f"layout declares {layout.n_ciphertexts} packed ciphertexts, got {len(plaintexts)}"
        )
    return unpack_range(plaintexts, layout, modulus, bound)


def unpack_range(
    plaintexts: Sequence[int],
    layout: SlotLayout,
    modulus: int,
    bound: int | None = None,
    first: int = 0,
) -> list[int]:
    """:func:`unpack_slots` of some consecutive packed plaintexts of a layout.

    ``plaintexts`` are the layout's ciphertexts ``first, first + 1, ...`` (e.g. one
    result page as it is decrypted); returns their slot values, which are the
    layout's values from ``first * layout.slots_per_ciphertext`` on. Messages name
    positions in the whole layout.

    Raises
    ------
    EncodingOverflowError, LayoutError
        As :func:`unpack_slots`; LayoutError also when the range leaves the layout.
    """
    if first < 0 or first + len(plaintexts) > layout.n_ciphertexts:
        raise LayoutError(
            f"packed ciphertexts {first}..{first + len(plaintexts) - 1} are outside the "
            f"layout's {layout.n_ciphertexts}"
        )
    if modulus.bit_length() != layout.key_bits:
        raise LayoutError(
            f"layout is for a {layout.key_bits}-bit modulus, got {modulus.bit_length()} bits"
        )
    if layout.slot_bits <= _WORD_SLOT_BITS:
        return _unpack_words(plaintexts, layout, modulus, bound, first)
    return _unpack_shifts(plaintexts, layout, modulus, bound, first)


def _unpack_shifts(
    plaintexts: Sequence[int], layout: SlotLayout, modulus: int, bound: int | None, first: int
) -> list[int]:
    """:func:`unpack_range` digit by digit with shifts on Python ints (any slot width)."""
    shift = layout.slot_bits
    full = 1 << shift
    half = full >> 1
    mask = full - 1
    k = layout.slots_per_ciphertext
    values: list[int] = []
    failure: EncodingOverflowError | None = None
    for index, plaintext in enumerate(plaintexts, first):
        signed = _signed(plaintext, modulus, index)
        for _ in range(min(k, layout.value_count - index * k)):
            digit = signed & mask
            if digit >= half:
                digit -= full
            values.append(digit)
            signed = (signed - digit) >> shift
        if signed != 0 and failure is None:
            failure = _undecodable(index)
    if bound is not None:
        outside = [i for i, value in enumerate(values, first * k) if not -bound <= value <= bound]
        if outside and failure is None:
            failure = _outside_bound(outside[0], bound)
    return _values_or(failure, values)


def _values_or(failure: EncodingOverflowError | None, values: list[int]) -> list[int]:
    """``values``, or ``failure`` raised. Both unpackers do all their work first, and
    then raise: how long a page took said where its first bad plaintext was, to a
    proxy that built the page from an owner's ciphertext (found by review)."""
    if failure is not None:
        raise failure
    return values


def _signed(plaintext: int, modulus: int, index: int) -> int:
    """A decrypted packed plaintext in [0, n) as the signed P it stands for (an int)."""
    if not 0 <= plaintext < modulus:
        raise ValueError(f"plaintext {index} is not in [0, n)")
    plaintext = int(plaintext)  # numpy or gmpy2 integers too
    # |P| < n/2 by construction, so the upper half of Z_n holds the negatives.
    return plaintext - modulus if plaintext > modulus >> 1 else plaintext


def _undecodable(index: int) -> EncodingOverflowError:
    return EncodingOverflowError(
        f"packed plaintext {index} does not decode into its slots: a slot "
        "overflowed or the ciphertext does not belong to this layout"
    )


def _outside_bound(index: int, bound: int) -> EncodingOverflowError:
    # Not the value: decrypted, it may be what a hostile proxy put in a page (an
    # owner's share without noise), and errors reach logs.
    return EncodingOverflowError(f"slot {index} decoded outside the declared bound {bound}")


def _unpack_words(
    plaintexts: Sequence[int], layout: SlotLayout, modulus: int, bound: int | None, first: int
) -> list[int]:
    """:func:`unpack_range` for slots of at most 63 bits, with 64-bit words.

    Adding 2^(B-1) to every digit of P (the ``offset`` below, over the slots the
    plaintext holds) makes each one a plain B-bit field: P decodes into its m slots
    exactly when 0 <= P + offset < 2^(B m), which is what the shift-and-subtract
    loop of :func:`_unpack_shifts` checks by its remainder.
    """
    shift, k = layout.slot_bits, layout.slots_per_ciphertext
    half = 1 << (shift - 1)
    offsets = _half_offsets(shift, k)
    shifted: list[int] = []
    failure: EncodingOverflowError | None = None
    for index, plaintext in enumerate(plaintexts, first):
        slots = min(k, layout.value_count - index * k)
        value = _signed(plaintext, modulus, index) + offsets[slots]
        if not 0 <= value < 1 << (shift * slots):
            failure = failure or _undecodable(index)
            value = 0  # the page is unpacked whole all the same (_values_or)
        shifted.append(value)
    digits = _fields_from_ints(shifted, shift, k).view(np.int64) - np.int64(half)
    count = min(len(plaintexts) * k, layout.value_count - first * k)
    values = digits.reshape(-1)[:count]
    if bound is not None and bound < half and count:  # a larger bound holds every digit
        outside = np.flatnonzero((values > bound) | (values < -bound))
        if len(outside) and failure is None:
            failure = _outside_bound(first * k + int(outside[0]), bound)
    return _values_or(failure, values.tolist())
