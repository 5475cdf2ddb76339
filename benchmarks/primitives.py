"""Cost of one Paillier operation of each kind at a given key size, on one core.

Prints milliseconds per operation, measured in one run, for: phe's full encryption
(r^n obfuscator), the DJN obfuscator by plain powmod of a short exponent, the DJN
obfuscator by fedpca's fixed-base window table (the codec's default path), phe's CRT
decryption, and one homomorphic addition. These explain the other benchmarks: owner
encryption cost is the DJN-table figure per packed ciphertext, the analyst's cost is
the CRT-decryption figure per packed ciphertext.

Usage: python benchmarks/primitives.py [--key-bits 2048] [--repeat 200]

The last line reads ``decrypt_over_djn_table=<float> full_over_djn_table=<float>``.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable

import gmpy2

from fedpca.codec import generate_keypair
from fedpca.codec._worker import encrypt_chunk_djn
from fedpca.codec.paillier import djn_exponent_bits


def per_call(function: Callable[[], object], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - started) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    public_key, private_key = generate_keypair(args.key_bits)
    n = public_key.n
    n_square = gmpy2.mpz(n) * n
    bits = djn_exponent_bits(args.key_bits)
    x = secrets.randbelow(n - 2) + 2
    h_s = int(gmpy2.powmod((-x * x) % n, n, n_square))
    encrypt_chunk_djn(n, h_s, bits, [1])  # builds and caches the window table
    ciphertexts = [public_key.raw_encrypt(secrets.randbelow(n)) for _ in range(args.repeat)]
    it = iter(ciphertexts * 2)

    full = per_call(lambda: public_key.raw_encrypt(secrets.randbelow(n)), args.repeat)
    djn_powmod = per_call(lambda: gmpy2.powmod(h_s, secrets.randbits(bits), n_square), args.repeat)
    table_chunk = [secrets.randbelow(n) for _ in range(args.repeat)]
    started = time.perf_counter()
    encrypt_chunk_djn(n, h_s, bits, table_chunk)
    djn_table = (time.perf_counter() - started) / args.repeat
    decrypt = per_call(lambda: private_key.raw_decrypt(next(it)), args.repeat)
    add = per_call(lambda: gmpy2.mpz(ciphertexts[0]) * ciphertexts[1] % n_square, args.repeat)

    print(f"{args.key_bits}-bit key, {args.repeat} operations each, one process")
    rows = [
        ("phe encryption, full r^n obfuscator", full),
        (f"DJN obfuscator, {bits}-bit exponent by powmod", djn_powmod),
        ("DJN encryption with the fixed-base window table", djn_table),
        ("phe CRT decryption", decrypt),
        ("homomorphic addition (c1 c2 mod n^2)", add),
    ]
    for name, seconds in rows:
        print(f"  {name:<50}{seconds * 1e3:9.3f} ms")
    ratios = f"decrypt_over_djn_table={decrypt / djn_table:.2f} "
    print(ratios + f"full_over_djn_table={full / djn_table:.2f}")


if __name__ == "__main__":
    main()
