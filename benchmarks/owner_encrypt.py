"""Owner-side encryption benchmark: one scatter share of madelon, packed and encrypted.

Scales the madelon features with their public bounds 0..999 to [-1, 1], clips rows to
L2 norm <= 1, computes one owner's scatter share (upper triangle of XᵀX, the sum
vector, the count), encodes, packs with realistic public bounds and encrypts with the
codec's default obfuscator on all cores.  In the same run it measures

* ratio_vs_published: the published design's cost (one phe ``encrypt(float)`` with a
  full r^n obfuscator per entry of the full M x M matrix, timed on a sample and
  extrapolated) divided by the codec's time;
* speedup_over_bare: the time of a plain gmpy2 loop computing the same number of
  obfuscators (same variant, same number of processes) divided by the codec's time.

Both timed sections start their process pools cold, so start-up is charged to both.
The last line is ``ratio_vs_published=<float> speedup_over_bare=<float>``.

Usage: python benchmarks/owner_encrypt.py [--data PATH] [--features 500] [--key-bits 2048]
       [--processes N] [--obfuscation djn|standard] [--published-sample 200]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import secrets
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import gmpy2
import numpy as np
from numpy.typing import NDArray

from fedpca.codec import (
    DEFAULT_OBFUSCATION,
    CryptoPool,
    Obfuscation,
    PackingBounds,
    SlotLayout,
    encode_fixed_point,
    generate_keypair,
    owner_value_bound,
    pack_slots,
    upper_triangle,
)
from fedpca.codec.paillier import djn_exponent_bits
from fedpca.data import dataset_path

DEFAULT_DATA = dataset_path("madelon")  # the bundled copy (label in column 0)

# Public feature bounds of madelon (documented in the dataset's README).
FEATURE_MIN, FEATURE_MAX = 0.0, 999.0
NOISE_SIGMA = 100.0  # real units
NOISE_TAIL = 64  # headroom in standard deviations: P(|noise| > 64 sigma) ~ 1e-890 per slot


def _bounds() -> PackingBounds:
    frac_bits = 32
    return PackingBounds(
        max_abs_per_record=1.0,  # |x_i x_j| <= 1, |x_i| <= 1 and the count adds 1
        max_records_per_owner=2**20,
        max_owners=2**8,
        frac_bits=frac_bits,
        noise_headroom=math.ceil(NOISE_TAIL * NOISE_SIGMA * 2**frac_bits),
    )


def _load_rows(path: Path, features: int) -> NDArray[np.float64]:
    if not path.is_file():
        sys.exit(
            f"error: dataset not found at {path}; pass --data PATH (a CSV with the label in "
            "column 0)"
        )
    table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    if table.shape[1] - 1 < features:
        sys.exit(f"error: {path} has {table.shape[1] - 1} features, --features asks {features}")
    raw = table[:, 1 : 1 + features]  # column 0 is the class label
    scaled = np.clip((raw - FEATURE_MIN) / (FEATURE_MAX - FEATURE_MIN) * 2.0 - 1.0, -1.0, 1.0)
    norms = np.linalg.norm(scaled, axis=1, keepdims=True)
    return np.asarray(scaled / np.maximum(norms, 1.0), dtype=np.float64)


def _bare_obfuscators(n: int, h_s: int, exponent_bits: int, count: int, djn: bool) -> int:
    """Plain gmpy2 loop: ``count`` obfuscators, one powmod each (runs in a worker)."""
    n_square = gmpy2.mpz(n) * n
    base = gmpy2.mpz(h_s)
    last = gmpy2.mpz(0)
    for _ in range(count):
        if djn:
            last = gmpy2.powmod(base, secrets.randbits(exponent_bits), n_square)
        else:
            last = gmpy2.powmod(secrets.randbelow(n - 1) + 1, n, n_square)
    return int(last % 2)


def _time_bare_loop(
    n: int, count: int, processes: int, obfuscation: Obfuscation, start_method: str
) -> float:
    x = secrets.randbelow(n - 1) + 1
    h_s = int(gmpy2.powmod((-x * x) % n, n, gmpy2.mpz(n) * n))
    exponent_bits = djn_exponent_bits(n.bit_length())
    shares = [count // processes + (1 if i < count % processes else 0) for i in range(processes)]
    djn = obfuscation is Obfuscation.DJN
    start = time.perf_counter()
    with ProcessPoolExecutor(
        max_workers=processes, mp_context=multiprocessing.get_context(start_method)
    ) as executor:
        futures = [
            executor.submit(_bare_obfuscators, n, h_s, exponent_bits, share, djn)
            for share in shares
        ]
        for future in futures:
            future.result()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="madelon CSV path")
    parser.add_argument("--features", type=int, default=500, help="M, features used")
    parser.add_argument("--key-bits", type=int, default=2048, help="Paillier modulus bits")
    parser.add_argument(
        "--processes",
        type=int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        help="worker processes (default: all cores)",
    )
    parser.add_argument(
        "--obfuscation",
        choices=[o.value for o in Obfuscation],
        default=DEFAULT_OBFUSCATION.value,
        help="obfuscator variant (default: the codec's default)",
    )
    parser.add_argument(
        "--published-sample", type=int, default=200, help="phe encryptions timed to extrapolate"
    )
    args = parser.parse_args()
    obfuscation = Obfuscation(args.obfuscation)
    processes = args.processes or os.cpu_count() or 1

    rows = _load_rows(args.data, args.features)
    n_rows, m = rows.shape
    print(f"data: {args.data} ({n_rows} rows, {m} features, rows clipped to L2 norm <= 1)")

    start = time.perf_counter()
    public_key, private_key = generate_keypair(args.key_bits)
    print(f"key: {args.key_bits}-bit, generated in {time.perf_counter() - start:.1f} s (not timed)")

    start = time.perf_counter()
    scatter = rows.T @ rows
    share = np.concatenate([upper_triangle(scatter), rows.sum(axis=0), [float(n_rows)]])
    stats_seconds = time.perf_counter() - start
    bounds = _bounds()
    print(
        f"scatter share: {share.size} values ({share.size - m - 1} upper-triangle entries, "
        f"{m} sums, 1 count), computed in {stats_seconds:.3f} s (not part of the codec time)"
    )

    # Codec: encode + pack + encrypt, starting from a cold pool.
    start = time.perf_counter()
    encoded = encode_fixed_point(share, bounds.frac_bits)
    layout = SlotLayout.from_bounds(bounds, args.key_bits, share.size)
    with CryptoPool(processes) as pool:
        packed = pool.encrypt_packed(
            public_key, encoded, layout, owner_value_bound(bounds), obfuscation=obfuscation
        )
        codec_seconds = time.perf_counter() - start
        warm_start = time.perf_counter()
        pool.encrypt_packed(
            public_key, encoded, layout, owner_value_bound(bounds), obfuscation=obfuscation
        )
        warm_seconds = time.perf_counter() - warm_start
        start_method = pool.start_method

    # Spot-check: phe's own raw_decrypt returns the packed integers mod n.
    expected = pack_slots(encoded, layout, owner_value_bound(bounds))
    for index in (0, layout.n_ciphertexts // 2, layout.n_ciphertexts - 1):
        assert private_key.raw_decrypt(packed.ciphertexts[index]) == expected[index] % public_key.n

    print(
        f"layout: slot_bits={layout.slot_bits} slots_per_ciphertext={layout.slots_per_ciphertext} "
        f"(frac_bits={bounds.frac_bits}, max_records_per_owner=2^20, max_owners=2^8, "
        f"noise headroom {NOISE_TAIL} sigma for sigma={NOISE_SIGMA:g})"
    )
    print(f"obfuscation: {obfuscation.value}, processes: {processes} ({start_method})")
    print(f"ciphertexts: {layout.n_ciphertexts}")
    print(f"seconds: {codec_seconds:.3f} (encode + pack + encrypt, pool started cold)")
    print(f"matrix entries per second: {share.size / codec_seconds:,.0f}")
    print(f"seconds with a warm pool (second call, for reference): {warm_seconds:.3f}")

    # (a) Published design: one phe encrypt(float) with full r^n per entry of the M x M matrix.
    sample = scatter.ravel()[: args.published_sample].tolist()
    start = time.perf_counter()
    for value in sample:
        public_key.encrypt(value)
    per_entry = (time.perf_counter() - start) / len(sample)
    published_seconds = per_entry * m * m
    print(
        f"published design: phe encrypt(float) {per_entry * 1e3:.2f} ms x {m}*{m} = {m * m} "
        f"entries = {published_seconds:.0f} s (EXTRAPOLATED from {len(sample)} timed "
        "encryptions, one process)"
    )

    # (b) Bare loop: the same number of obfuscators with plain gmpy2.powmod.
    bare_seconds = _time_bare_loop(
        public_key.n, layout.n_ciphertexts, processes, obfuscation, start_method
    )
    print(
        f"bare gmpy2 loop: {layout.n_ciphertexts} {obfuscation.value} obfuscators by powmod on "
        f"{processes} processes (pool started cold): {bare_seconds:.3f} s"
    )
    print(
        f"ratio_vs_published={published_seconds / codec_seconds:.1f} "
        f"speedup_over_bare={bare_seconds / codec_seconds:.3f}"
    )


if __name__ == "__main__":
    main()
