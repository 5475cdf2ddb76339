"""Exact discrete Gaussian draws, many at a time, with integer arithmetic only.

Written here because no library does it at the speed the proxy needs: OpenDP's exact
sampler costs about 8 µs a value (``benchmarks/noise_sampler.py`` prints the ratio to
this one), which is 100 CPU-seconds for the 12.5 million values of one query at 5,000
features, and the other exact samplers found (diffprivlib, the reference code of
Canonne, Kamath & Steinke) draw one value at a time in Python. Floating-point samplers
are not an option: their low-order bits can reveal the input (Mironov 2012).

What is drawn: Y with P[Y = y] proportional to exp(-y^2 / (2 sigma^2)) for every integer
y, where sigma is the float given, read as the exact rational p / q it represents
(below 1 it is first rounded *up* to a multiple of 2^-52, which only adds noise).

How (docs/privacy.md, "The discrete Gaussian and the proven bound", has the proof):
Karney's algorithm D (Karney 2016, "Sampling exactly from the normal distribution",
with mean 0), each of its exponential coin flips made by Canonne, Kamath & Steinke's
Bernoulli(exp(-gamma)) loop (2020, Algorithm 1) on coins of rational probability:

1. k >= 0 with P[k] = exp(-k/2) (1 - exp(-1/2)): the successes of Bernoulli(exp(-1/2))
   before its first failure; kept with probability exp(-1/2)^(k (k - 1)).
2. A sign s, and j uniform in [0, ceil(sigma)); with i0 = ceil(k sigma) and
   x = (i0 + j - k sigma) / sigma, rejected unless x < 1 (and -0 is rejected).
3. Kept with probability exp(-x)^k exp(-x^2 / 2); the value is s (i0 + j).

A candidate survives with probability proportional to exp(-(k + x)^2 / 2) =
exp(-(i0 + j)^2 / (2 sigma^2)), and every integer has exactly one (k, j, s): the
survivors are the discrete Gaussian. Candidates are drawn in batches and the survivors
kept in the order they were drawn, which is exactly a rejection sampler's output.

Every coin is Bernoulli(a / b) for integers a <= b < 2^64: a uniform integer below b
(a random word, redrawn if it falls in the short range that would bias ``word mod b``)
compared with a. The words come from ``random_bytes``, the operating system's CSPRNG by
default; tests pass a seeded source to be reproducible. No step rounds or uses floats.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpca.errors import ConfigError

__all__ = [
    "LARGEST_SIGMA",
    "MAX_NOISE_BOUND",
    "SATURATED",
    "RandomBytes",
    "exact_scale",
    "sample_discrete_gaussian",
]

RandomBytes = Callable[[int], bytes]
"""Source of uniformly random bytes: ``random_bytes(n)`` returns ``n`` of them."""

LARGEST_SIGMA = float(1 << 59)
"""Largest scale accepted: it keeps every product below in 64 bits, and it is above every
scale a noise bound of at most 2^62 (:data:`MAX_NOISE_BOUND`) allows (about 2^58.4), so
whatever a plan accepts can be drawn."""

MAX_NOISE_BOUND = 1 << 62
"""Largest noise bound (headroom) fedpca accepts (:mod:`fedpca.dp.noise` and the plans
refuse a larger one up front); every draw beyond the bound in use is refused."""

SATURATED = MAX_NOISE_BOUND + 1
"""What a draw beyond :data:`MAX_NOISE_BOUND` in magnitude is returned as (with its
sign): int64 cannot hold every such draw, and every caller refuses it either way."""

LARGEST_K = 30
"""Largest k (|value| < (k + 1) sigma) worked out in 64-bit words; a larger one, whose
chance is below exp(-450) a value, is worked out in Python's integers."""

BATCH_CANDIDATES = 1 << 16
"""Candidates drawn at a time, which bounds the memory of one call (some 100 bytes a
candidate while it is drawn) whatever the size asked for."""

_DENOMINATOR_BITS = 52
_U1 = np.uint64(1)

UIntArray = NDArray[np.uint64]
BoolArray = NDArray[np.bool_]


def exact_scale(sigma: float) -> tuple[int, int]:
    """The scale drawn at, as a fraction p / q >= sigma with q <= 2^52 and p <= 2^59.

    A float at or above 1, or an int, is already such a fraction, exactly; below 1 a
    float is rounded up to a multiple of 2^-52 (more noise, never less).
    """
    # Only a float or an int is read exactly as p / q with p and q in the ranges the
    # 64-bit arithmetic below relies on (a longdouble or a Decimal could carry more bits).
    if isinstance(sigma, bool) or not isinstance(sigma, float | int):
        raise ConfigError(f"the discrete Gaussian's sigma must be a float, got {sigma!r}")
    if not (math.isfinite(sigma) and 0 < sigma <= LARGEST_SIGMA):
        raise ConfigError(
            f"the discrete Gaussian's sigma must be finite, > 0 and at most 2^59, got {sigma!r}"
        )
    # An int is its own fraction: float() would round one above 2^53 to the nearest
    # float, sometimes below it (less noise than asked; found by review).
    p, q = (sigma, 1) if isinstance(sigma, int) else sigma.as_integer_ratio()
    if q > 1 << _DENOMINATOR_BITS:
        p = math.ceil(Fraction(p, q) * (1 << _DENOMINATOR_BITS))
        q = 1 << _DENOMINATOR_BITS
    if not (0 < p <= 1 << 59 and 0 < q <= 1 << _DENOMINATOR_BITS):
        raise ConfigError(f"sigma {sigma!r} read as {p}/{q}, outside the sampler's range")
    return p, q


def sample_discrete_gaussian(
    sigma: float, size: int, *, random_bytes: RandomBytes = os.urandom
) -> NDArray[np.int64]:
    """``size`` independent draws of N_Z(0, sigma^2), exactly (see the module's text),
    except that a draw beyond 2^62 in magnitude comes back as +-:data:`SATURATED`.

    Raises
    ------
    ConfigError
        For a sigma that is not a finite float or int in (0, 2^59], or a negative size.
    """
    if size < 0:
        raise ConfigError(f"noise size must be >= 0, got {size!r}")
    p, q = exact_scale(sigma)
    coins = _Coins(random_bytes)
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        wanted = size - filled
        # Half of the candidates survive at scales of 1 and above (a quarter below 1,
        # where most j give x >= 1): ask for 2.25 times the values wanted, so most
        # calls take one batch.
        batch = min(BATCH_CANDIDATES, wanted * 9 // 4 + 64)
        drawn = _survivors(p, q, batch, coins)
        take = min(drawn.size, wanted)
        out[filled : filled + take] = drawn[:take]
        filled += take
    return out


class _Coins:
    """Exact uniform integers and coins from a byte source."""

    def __init__(self, random_bytes: RandomBytes) -> None:
        self._random_bytes = random_bytes

    def _words(self, count: int, dtype: type[np.unsignedinteger[Any]]) -> NDArray[Any]:
        width = np.dtype(dtype).itemsize
        data = self._random_bytes(count * width)
        if len(data) != count * width:
            raise ConfigError(f"random_bytes returned {len(data)} bytes, expected {count * width}")
        return np.frombuffer(data, dtype=dtype).copy()

    def below(self, bound: UIntArray) -> UIntArray:
        """Uniform integers in [0, bound) elementwise (every bound >= 1).

        Drawn as words of the narrowest type holding the bounds (a byte for the small
        bounds most coins have) and redrawn while below 2^w mod bound: the words kept
        then span a whole number of multiples of the bound, so ``word mod bound`` is
        exactly uniform.
        """
        if bound.size == 0:
            return np.zeros(0, dtype=np.uint64)
        largest = int(bound.max())
        dtype = np.uint8 if largest <= 0xFF else np.uint16 if largest <= 0xFFFF else np.uint64
        narrow: NDArray[Any] = bound.astype(dtype)
        # 2^w mod bound, computed as (2^w - bound) mod bound in w-bit arithmetic.
        reject_below: NDArray[Any] = (np.zeros_like(narrow) - narrow) % narrow
        words = self._words(bound.size, dtype)
        redraw = np.flatnonzero(words < reject_below)
        while redraw.size:
            words[redraw] = self._words(redraw.size, dtype)
            redraw = redraw[words[redraw] < reject_below[redraw]]
        return (words % narrow).astype(np.uint64)

    def one_in(self, denominators: UIntArray) -> BoolArray:
        """Bernoulli(1 / d) for each d."""
        return self.below(denominators) == 0

    def fraction(self, numerators: UIntArray, denominator: int) -> BoolArray:
        """Bernoulli(a / denominator) for each a (0 <= a <= denominator)."""
        return self.below(np.full(numerators.size, denominator, dtype=np.uint64)) < numerators

    def exp_minus(
        self, count: int, gamma_over: Callable[[NDArray[np.intp], UIntArray], BoolArray]
    ) -> BoolArray:
        """Bernoulli(exp(-gamma_i)) for ``count`` values gamma_i in [0, 1].

        Canonne, Kamath & Steinke's loop: K = 1, 2, ... while Bernoulli(gamma / K)
        succeeds; the result is whether the K it stopped at is odd, which happens with
        probability sum_i (-gamma)^i / i! = exp(-gamma). ``gamma_over(indices, K)``
        flips Bernoulli(gamma_i / K) for the elements still looping.
        """
        result = np.empty(count, dtype=bool)
        looping = np.arange(count)
        k = np.uint64(1)
        while looping.size:
            success = gamma_over(looping, np.full(looping.size, k, dtype=np.uint64))
            result[looping[~success]] = bool(int(k) & 1)
            looping = looping[success]
            k += _U1
        return result

    def exp_minus_half(self, count: int) -> BoolArray:
        """``count`` independent Bernoulli(exp(-1/2)): gamma / K = 1 / (2K)."""
        return self.exp_minus(count, lambda _looping, k: self.one_in(2 * k))


def _survivors(p: int, q: int, candidates: int, coins: _Coins) -> NDArray[np.int64]:
    """Run algorithm D on ``candidates`` candidates at scale p / q; the survivors'
    values in the order drawn."""
    # Step 1: k is the number of successes before a failure; the first `candidates`
    # runs of one unbounded stream of coins (bits are added until that many runs have
    # ended: cutting the stream at a fixed length would bias the run it cuts).
    flips = coins.exp_minus_half(candidates * 3)
    failures = np.flatnonzero(~flips)
    while failures.size < candidates:
        flips = np.concatenate((flips, coins.exp_minus_half(candidates)))
        failures = np.flatnonzero(~flips)
    ends = failures[:candidates]
    k = (np.diff(ends, prepend=-1) - 1).astype(np.uint64)
    # ... kept with probability exp(-1/2)^(k (k - 1)): that many further coins, all
    # successes. Each candidate takes its own consecutive stretch of a second stream.
    needed = k * (k - _U1) * (k > 0)
    stream = coins.exp_minus_half(int(needed.sum()))
    failures_before = np.concatenate(([0], np.cumsum(~stream)))
    stop = np.cumsum(needed).astype(np.intp)
    start = stop - needed.astype(np.intp)
    k = k[failures_before[stop] == failures_before[start]]
    # Step 2. Integer form of x = (i0 + j - k sigma) / sigma = a / p.
    count = k.size
    negative = coins.one_in(np.full(count, 2, dtype=np.uint64))
    j = coins.below(np.full(count, (p + q - 1) // q, dtype=np.uint64))
    in_range, a, magnitudes = _position(k, j, p, q)
    keep = in_range & ~((a == 0) & (k == 0) & negative)
    # Step 3, for the candidates still kept: exp(-x)^k, as k independent
    # Bernoulli(exp(-x)) that must all succeed (Bernoulli(x / K) is Bernoulli(x) and
    # Bernoulli(1 / K), independent coins) ...
    alive = np.flatnonzero(keep)
    a_alive = a[alive]
    owner = np.repeat(np.arange(alive.size), k[alive].astype(np.intp))
    a_each = a_alive[owner]
    success = coins.exp_minus(
        owner.size, lambda looping, kk: coins.fraction(a_each[looping], p) & coins.one_in(kk)
    )
    survived = np.ones(alive.size, dtype=bool)
    survived[owner[~success]] = False
    # ... and exp(-x^2 / 2): Bernoulli(x^2 / (2K)) is Bernoulli(x), again, and 1 / (2K).
    survived &= coins.exp_minus(
        alive.size,
        lambda looping, kk: (
            coins.fraction(a_alive[looping], p)
            & coins.fraction(a_alive[looping], p)
            & coins.one_in(2 * kk)
        ),
    )
    keep = alive[survived]
    magnitude = magnitudes[keep]
    return np.where(negative[keep], -magnitude, magnitude)


def _position(
    k: UIntArray, j: UIntArray, p: int, q: int
) -> tuple[BoolArray, UIntArray, NDArray[np.int64]]:
    """For each candidate: whether x < 1, a = x p (meaningful where x < 1) and the
    magnitude i0 + j, saturated at :data:`SATURATED`.

    In 64-bit words while k <= :data:`LARGEST_K`, where no product can overflow (with
    p <= 2^59 and q <= 2^52, k p + q and q (i0 + j) <= (k + 1) p + q stay below
    31 * 2^59 + 2^52 < 2^64); otherwise, an event below exp(-450) a value, in Python's
    integers.
    """
    if k.size == 0 or int(k.max()) <= LARGEST_K:
        p64, q64 = np.uint64(p), np.uint64(q)
        i0 = (k * p64 + q64 - _U1) // q64
        a = q64 * (i0 + j) - k * p64
        magnitude = np.minimum(i0 + j, np.uint64(SATURATED)).astype(np.int64)
        return a < p64, a, magnitude
    big_k, big_j = k.astype(object), j.astype(object)
    big_i0 = (big_k * p + q - 1) // q
    big_a = q * (big_i0 + big_j) - big_k * p
    in_range = (big_a < p).astype(bool)
    a = np.where(in_range, big_a, 0).astype(np.uint64)
    magnitude = np.minimum(big_i0 + big_j, SATURATED).astype(np.int64)
    return in_range, a, magnitude
