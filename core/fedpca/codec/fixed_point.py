"""Fixed-point encoding of real values as integers ``round(x * 2^f)``.

Stochastic rounding (floor plus a Bernoulli(fractional part) carry) is the default
because it is unbiased: E[encode(x)] = x * 2^f exactly, so the rounding error of a
sum over many owners has mean zero instead of accumulating a systematic drift.
Round-to-nearest is available for callers that need determinism.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..errors import EncodingOverflowError

logger = logging.getLogger(__name__)

Rounding = Literal["stochastic", "nearest"]

# Encoded magnitudes must stay below 2^62: float64 -> int64 conversion is undefined
# at 2^63 (float64 cannot even represent 2^63 - 1), and the spare bit leaves room
# for the +1 of stochastic rounding and for adding a few encodings in int64 without
# wrapping.
INT64_SAFE_LIMIT = 1 << 62

_MAX_FRAC_BITS = 1000  # beyond this 2^f is not a finite float64


def _first_bad_index(bad: NDArray[np.bool_]) -> tuple[int, ...] | int:
    flat = int(np.flatnonzero(bad)[0])
    if bad.ndim == 1:
        return flat
    return tuple(int(i) for i in np.unravel_index(flat, bad.shape))


def encode_fixed_point(
    values: ArrayLike,
    frac_bits: int,
    *,
    rounding: Rounding = "stochastic",
    rng: np.random.Generator | None = None,
) -> NDArray[np.int64]:
    """Encode real values as fixed-point integers with ``frac_bits`` fractional bits.

    Parameters
    ----------
    values : array_like of float, any shape
        Real values to encode.
    frac_bits : int
        Number of fractional bits f (``x`` becomes ``round(x * 2^f)``), f >= 0.
    rounding : {"stochastic", "nearest"}
        ``"stochastic"`` returns ``floor(x 2^f) + Bernoulli(frac(x 2^f))`` (unbiased);
        ``"nearest"`` rounds half to even.
    rng : numpy.random.Generator, optional
        Source of the rounding coins (a fresh OS-seeded generator when omitted).
        Pass a seeded generator only in tests.

    Returns
    -------
    numpy.ndarray of int64, same shape as ``values``

    Raises
    ------
    EncodingOverflowError
        If any value is not finite or its encoding would reach ``INT64_SAFE_LIMIT``
        in magnitude; the message names the first offending index and value.
    """
    if not 0 <= frac_bits <= _MAX_FRAC_BITS:
        raise ValueError(f"frac_bits must be in [0, {_MAX_FRAC_BITS}], got {frac_bits}")
    if rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    array = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.ldexp(array, frac_bits)
    # Below 2^62 the float64 spacing is at most 2^9, so anything that passes this
    # test floors/rounds (plus the stochastic carry) to an integer below 2^62.
    bad = ~np.isfinite(scaled) | (np.abs(scaled) >= float(INT64_SAFE_LIMIT))
    if bad.any():
        index = _first_bad_index(bad)
        raise EncodingOverflowError(
            f"value {array[index]!r} at index {index} does not fit a signed 64-bit "
            f"fixed-point encoding with {frac_bits} fractional bits "
            f"(|x * 2^{frac_bits}| must be finite and below 2^62)"
        )
    if rounding == "nearest":
        return np.rint(scaled).astype(np.int64)
    generator = rng if rng is not None else np.random.default_rng()
    floor = np.floor(scaled)
    # scaled - floor(scaled) is computed exactly in float64, so the carry
    # probability is exactly the fractional part and E[result] = scaled.
    carry = generator.random(size=scaled.shape) < (scaled - floor)
    return floor.astype(np.int64) + carry


def decode_fixed_point(
    values: NDArray[np.integer] | Sequence[int], frac_bits: int
) -> NDArray[np.float64]:
    """Decode fixed-point integers (of any size) back to floats ``v / 2^f``.

    Parameters
    ----------
    values : numpy.ndarray of int, any shape, or sequence of Python int, shape (count,)
        Encoded values.  Slot sums after homomorphic aggregation may exceed int64,
        so plain Python ints of any size are accepted.
    frac_bits : int
        The fractional bits the values were encoded with.

    Returns
    -------
    numpy.ndarray of float64
        Same shape as an ndarray input, shape (count,) for a sequence.
    """
    if frac_bits < 0:
        raise ValueError(f"frac_bits must be >= 0, got {frac_bits}")
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        # int64 -> float64 rounds once; scaling by a power of two is then exact.
        return np.ldexp(values.astype(np.float64), -frac_bits)
    scale = 1 << frac_bits
    if isinstance(values, np.ndarray):
        shape: tuple[int, ...] = values.shape
        items = values.ravel().tolist()
    else:
        items = list(values)
        shape = (len(items),)
    # int / int is correctly rounded in Python for integers of any size.
    flat = np.fromiter((int(v) / scale for v in items), dtype=np.float64, count=len(items))
    return flat.reshape(shape)
