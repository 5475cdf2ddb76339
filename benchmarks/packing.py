"""Packing and unpacking a share: 64-bit words against shifts on Python ints.

Claim measured: slots of at most 63 bits are packed and unpacked with numpy words and
``int.from_bytes``/``int.to_bytes`` (:mod:`fedpca.codec.packing`) instead of a shift and
an add per slot on Python ints, which every owner (its share), the proxy (its noise)
and the analyst (the result) do once a round. Both ways are timed here in one process
on the same values: madelon's layout by default (125,751 values of 62-bit slots, 33 to
a 2048-bit plaintext), uniform in the slot's bound, each timing the best of
``--repeats``.

Usage: python benchmarks/packing.py [--values 125751] [--repeats 5]

The last line reads ``pack_words_ms=… pack_shifts_ms=… unpack_words_ms=…
unpack_shifts_ms=… pack_speedup=… unpack_speedup=…``.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fedpca.codec import packing
from fedpca.codec.packing import SlotLayout

SLOT_BITS = 62
KEY_BITS = 2048


def best_ms(run: Callable[[], Any], repeats: int) -> float:
    """Fastest of ``repeats`` runs, in milliseconds of CPU time."""
    times = []
    for _ in range(repeats):
        started = time.process_time()
        run()
        times.append(time.process_time() - started)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=125_751)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    k = (KEY_BITS - 1) // SLOT_BITS
    layout = SlotLayout(KEY_BITS, SLOT_BITS, k, args.values)
    capacity = layout.slot_capacity
    values = np.random.default_rng(0).integers(-capacity, capacity, size=args.values)
    listed = values.tolist()
    n = (1 << (KEY_BITS - 1)) | secrets.randbits(KEY_BITS - 1) | 1
    packed = packing._pack_words(values, SLOT_BITS, k)
    if packed != packing._pack(listed, SLOT_BITS, k):
        raise SystemExit("the two ways of packing disagree")
    plaintexts = [p % n for p in packed]
    timings = {
        "pack_words_ms": best_ms(lambda: packing._pack_words(values, SLOT_BITS, k), args.repeats),
        "pack_shifts_ms": best_ms(lambda: packing._pack(listed, SLOT_BITS, k), args.repeats),
        "unpack_words_ms": best_ms(
            lambda: packing._unpack_words(plaintexts, layout, n, None, 0), args.repeats
        ),
        "unpack_shifts_ms": best_ms(
            lambda: packing._unpack_shifts(plaintexts, layout, n, None, 0), args.repeats
        ),
    }
    print(
        f"{args.values} values, {SLOT_BITS}-bit slots, {k} to a {KEY_BITS}-bit plaintext "
        f"({layout.n_ciphertexts} plaintexts); best of {args.repeats}, CPU ms"
    )
    for name, ms in timings.items():
        print(f"  {name:<18}{ms:8.2f}")
    pack_speedup = timings["pack_shifts_ms"] / timings["pack_words_ms"]
    unpack_speedup = timings["unpack_shifts_ms"] / timings["unpack_words_ms"]
    print(
        " ".join(f"{name}={ms:.2f}" for name, ms in timings.items())
        + f" pack_speedup={pack_speedup:.2f} unpack_speedup={unpack_speedup:.2f}"
    )


if __name__ == "__main__":
    main()
