"""Packed Paillier on a process pool: homomorphic sums, phe compatibility, validation, serde.

All keys here are TEST-ONLY 512-bit keys (see tests/conftest.py).
"""

from __future__ import annotations

import heapq
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import gmpy2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedpca.codec._worker as worker_module
from fedpca.codec import (
    DEFAULT_OBFUSCATION,
    CryptoPool,
    Obfuscation,
    PackedCiphertexts,
    PackingBounds,
    SlotLayout,
    add_packed,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
    generate_keypair,
    owner_value_bound,
    pack_slots,
    scalar_multiply,
    validate_ciphertexts,
)
from fedpca.codec._worker import encrypt_chunk_djn, encrypt_chunk_standard
from fedpca.codec.paillier import (
    IN_FLIGHT_TASKS_PER_WORKER,
    MAX_STREAM_TASK_CIPHERTEXTS,
    MIN_STREAM_TASK_CIPHERTEXTS,
    djn_exponent_bits,
    security_level,
    stream_task_ciphertexts,
)
from fedpca.errors import (
    CiphertextError,
    ConfigError,
    EncodingOverflowError,
    LayoutError,
)

Keypair = tuple[Any, Any]

# Small bounds so that a 512-bit test key holds many slots: 4 owners of up to 50
# records with |x| <= 1 at 8 fractional bits, plus 1000 units of noise.
BOUNDS = PackingBounds(
    max_abs_per_record=1.0, max_records_per_owner=50, max_owners=4, frac_bits=8, noise_headroom=1000
)
OWNER_BOUND = owner_value_bound(BOUNDS)
VALUE_COUNT = 70


@pytest.fixture(scope="module")
def layout() -> SlotLayout:
    return SlotLayout.from_bounds(BOUNDS, 512, VALUE_COUNT)


def _owner_values(owner_count: int) -> st.SearchStrategy[list[list[int]]]:
    near_bound = st.sampled_from([OWNER_BOUND, -OWNER_BOUND, OWNER_BOUND - 1, -OWNER_BOUND + 1])
    value = st.integers(-OWNER_BOUND, OWNER_BOUND) | near_bound
    vector = st.lists(value, min_size=VALUE_COUNT, max_size=VALUE_COUNT)
    return st.lists(vector, min_size=owner_count, max_size=owner_count)


@pytest.mark.parametrize("obfuscation", list(Obfuscation))
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sum_of_owners_decrypts_to_exact_slot_sums(
    data: st.DataObject,
    obfuscation: Obfuscation,
    pool: CryptoPool,
    layout: SlotLayout,
    test_only_keypair_512: Keypair,
) -> None:
    public_key, private_key = test_only_keypair_512
    owner_count = data.draw(st.integers(1, BOUNDS.max_owners))
    owners = data.draw(_owner_values(owner_count))
    total: PackedCiphertexts | None = None
    for values in owners:
        packed = pool.encrypt_packed(
            public_key,
            np.array(values, dtype=np.int64),
            layout,
            OWNER_BOUND,
            obfuscation=obfuscation,
        )
        total = packed if total is None else add_packed(total, packed)
    assert total is not None
    expected = [sum(column) for column in zip(*owners, strict=True)]
    assert pool.decrypt_packed(private_key, total) == expected


@pytest.mark.parametrize("obfuscation", list(Obfuscation))
def test_max_owners_at_the_bound_plus_noise_at_the_headroom(
    obfuscation: Obfuscation, pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, private_key = test_only_keypair_512
    signs = np.where(np.arange(VALUE_COUNT) % 2 == 0, 1, -1)
    owner = signs * OWNER_BOUND
    noise = signs * BOUNDS.noise_headroom
    total = pool.encrypt_packed(public_key, owner, layout, OWNER_BOUND, obfuscation=obfuscation)
    for _ in range(BOUNDS.max_owners - 1):
        total = add_packed(
            total,
            pool.encrypt_packed(public_key, owner, layout, OWNER_BOUND, obfuscation=obfuscation),
        )
    total = add_packed(
        total,
        pool.encrypt_packed(
            public_key, noise, layout, BOUNDS.noise_headroom, obfuscation=obfuscation
        ),
    )
    expected = (BOUNDS.max_owners * owner + noise).tolist()
    assert pool.decrypt_packed(private_key, total) == expected


def test_out_of_bound_input_is_refused_before_encryption(
    pool: CryptoPool,
    layout: SlotLayout,
    test_only_keypair_512: Keypair,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    public_key, _ = test_only_keypair_512
    encrypted: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> list[int]:
        encrypted.append(1)
        raise AssertionError("encrypt must not be reached")

    monkeypatch.setattr(pool, "encrypt", spy)
    values = np.zeros(VALUE_COUNT, dtype=np.int64)
    values[41] = -(OWNER_BOUND + 1)
    with pytest.raises(EncodingOverflowError, match=f"value {-(OWNER_BOUND + 1)} at index 41"):
        pool.encrypt_packed(public_key, values, layout, OWNER_BOUND)
    noise = np.full(VALUE_COUNT, BOUNDS.noise_headroom + 1, dtype=np.int64)
    with pytest.raises(EncodingOverflowError, match="at index 0"):
        pool.encrypt_packed(public_key, noise, layout, BOUNDS.noise_headroom)
    assert encrypted == []


@pytest.mark.parametrize("obfuscation", list(Obfuscation))
def test_phe_raw_decrypt_returns_the_packed_integer_mod_n(
    obfuscation: Obfuscation, pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, private_key = test_only_keypair_512
    values = [(-1) ** i * (i * 997 % OWNER_BOUND) for i in range(VALUE_COUNT)]
    values[-1] = -OWNER_BOUND  # top slot negative: the packed integer itself is negative
    expected = pack_slots(values, layout, OWNER_BOUND)
    assert expected[-1] < 0
    packed = pool.encrypt_packed(public_key, values, layout, OWNER_BOUND, obfuscation=obfuscation)
    assert [private_key.raw_decrypt(c) for c in packed.ciphertexts] == [
        p % public_key.n for p in expected
    ]


def test_encryption_is_randomised(pool: CryptoPool, test_only_keypair_512: Keypair) -> None:
    public_key, _ = test_only_keypair_512
    for obfuscation in Obfuscation:
        first, second = pool.encrypt(public_key, [5, 5], obfuscation=obfuscation)
        assert first != second


@pytest.mark.parametrize("scalar", [3, -2, 1, 0, -1])
def test_scalar_multiply_multiplies_every_slot(
    scalar: int, pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, private_key = test_only_keypair_512
    values = [(-1) ** i * (i * 31 % OWNER_BOUND) for i in range(VALUE_COUNT)]
    packed = pool.encrypt_packed(public_key, values, layout, OWNER_BOUND)
    product = scalar_multiply(packed, scalar)
    assert product.slot_bound == abs(scalar) * OWNER_BOUND
    assert pool.decrypt_packed(private_key, product) == [scalar * v for v in values]


def test_homomorphic_operations_refuse_possible_overflow(
    pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, _ = test_only_keypair_512
    packed = pool.encrypt_packed(public_key, [0] * VALUE_COUNT, layout, OWNER_BOUND)
    too_large = layout.slot_capacity // OWNER_BOUND + 1
    with pytest.raises(EncodingOverflowError, match="could wrap"):
        scalar_multiply(packed, -too_large)
    total = packed
    with pytest.raises(EncodingOverflowError, match="could wrap"):
        for _ in range(too_large):
            total = add_packed(total, packed)


def test_add_refuses_mismatched_layouts_and_keys(
    pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, _ = test_only_keypair_512
    packed = pool.encrypt_packed(public_key, [1] * VALUE_COUNT, layout, OWNER_BOUND)
    other_layout = SlotLayout(512, layout.slot_bits, layout.slots_per_ciphertext - 1, VALUE_COUNT)
    other = pool.encrypt_packed(public_key, [1] * VALUE_COUNT, other_layout, OWNER_BOUND)
    with pytest.raises(LayoutError):
        add_packed(packed, other)
    other_key, _ = generate_keypair(512, allow_insecure_test_key=True)
    foreign = pool.encrypt_packed(other_key, [1] * VALUE_COUNT, layout, OWNER_BOUND)
    with pytest.raises(CiphertextError, match="different public keys"):
        add_packed(packed, foreign)


def test_layout_must_match_the_key_size(pool: CryptoPool, test_only_keypair_512: Keypair) -> None:
    public_key, _ = test_only_keypair_512
    layout_1024 = SlotLayout.from_bounds(BOUNDS, 1024, 4)
    with pytest.raises(LayoutError, match="1024-bit"):
        pool.encrypt_packed(public_key, [0, 0, 0, 0], layout_1024, OWNER_BOUND)


def test_decrypt_refuses_a_foreign_private_key(
    pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, _ = test_only_keypair_512
    _, other_private = generate_keypair(512, allow_insecure_test_key=True)
    packed = pool.encrypt_packed(public_key, [0] * VALUE_COUNT, layout, OWNER_BOUND)
    with pytest.raises(CiphertextError, match="does not match"):
        pool.decrypt_packed(other_private, packed)


def test_validation_rejects_non_ciphertexts(test_only_keypair_512: Keypair) -> None:
    public_key, private_key = test_only_keypair_512
    n = public_key.n
    n_square = n * n
    validate_ciphertexts([1, n + 1, n_square - 1], public_key)  # units of Z_{n^2}
    for bad in (0, n_square, n_square + 5, -3, private_key.p, 7 * private_key.q, n):
        with pytest.raises(CiphertextError, match="ciphertext 1 "):
            validate_ciphertexts([1, bad], public_key)
    with pytest.raises(CiphertextError, match="not an int"):
        validate_ciphertexts([1.0], public_key)
    # The coprimality check runs once per batch; a bad element anywhere (a multiple of
    # p, of q or of n) is still found and named.
    rng = np.random.default_rng(5)
    units = [int(rng.integers(2, 2**62)) * (n + 1) % n_square for _ in range(40)]
    validate_ciphertexts(units, public_key)
    for position, bad in ((0, private_key.p), (17, 3 * private_key.q), (39, n * 5)):
        batch = list(units)
        batch[position] = bad
        with pytest.raises(CiphertextError, match=f"ciphertext {position} is not coprime"):
            validate_ciphertexts(batch, public_key)


def test_decrypt_validates_its_input(pool: CryptoPool, test_only_keypair_512: Keypair) -> None:
    _, private_key = test_only_keypair_512
    with pytest.raises(CiphertextError, match="not coprime"):
        pool.decrypt(private_key, [private_key.p])


def test_serialisation_round_trip_and_errors(
    pool: CryptoPool, layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, _ = test_only_keypair_512
    packed = pool.encrypt_packed(public_key, list(range(VALUE_COUNT)), layout, OWNER_BOUND)
    data = packed.to_bytes()
    width = 2 * 64  # 2 * ceil(512 / 8)
    assert len(data) == width * layout.n_ciphertexts
    assert PackedCiphertexts.from_bytes(data, public_key, layout, OWNER_BOUND) == packed
    assert ciphertexts_from_bytes(data[:width], public_key, 1) == [packed.ciphertexts[0]]
    for wrong in (data[:-1], data + b"\x00", data[:width]):
        with pytest.raises(CiphertextError, match="expected"):
            PackedCiphertexts.from_bytes(wrong, public_key, layout, OWNER_BOUND)
    with pytest.raises(CiphertextError, match="expected 2 ciphertexts"):
        ciphertexts_from_bytes(data, public_key, 2)
    with pytest.raises(CiphertextError, match="outside"):
        ciphertexts_from_bytes(b"\xff" * width, public_key, 1)
    with pytest.raises(CiphertextError, match="outside"):
        ciphertexts_from_bytes(b"\x00" * width, public_key, 1)
    assert ciphertexts_to_bytes([1], public_key) == b"\x00" * (width - 1) + b"\x01"


def test_packed_ciphertexts_check_their_layout(
    layout: SlotLayout, test_only_keypair_512: Keypair
) -> None:
    public_key, _ = test_only_keypair_512
    with pytest.raises(LayoutError, match="packed ciphertexts"):
        PackedCiphertexts(public_key, layout, (1,), OWNER_BOUND)
    with pytest.raises(EncodingOverflowError):
        PackedCiphertexts(public_key, layout, (1,) * layout.n_ciphertexts, layout.slot_capacity + 1)


def test_nist_security_levels_and_djn_exponent() -> None:
    assert [security_level(bits) for bits in (512, 1024, 2048, 3072, 7680, 15360)] == [
        80,
        80,
        112,
        128,
        192,
        256,
    ]
    assert djn_exponent_bits(2048) == 448
    assert djn_exponent_bits(3072) == 512
    assert DEFAULT_OBFUSCATION is Obfuscation.DJN


def test_djn_window_table_matches_powmod(
    test_only_keypair_512: Keypair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run the worker function in-process with a chosen exponent (including zero
    # bytes and a full top byte) and compare with (1 + m n) h_s^a mod n^2.
    public_key, private_key = test_only_keypair_512
    n = public_key.n
    n_square = n * n
    h_s = int(gmpy2.powmod(n - 4, n, n_square))  # h = -(2^2) mod n
    bits = djn_exponent_bits(512)
    exponents = [
        0,
        1,
        (1 << bits) - 1,
        int.from_bytes(bytes([0, 7, 0, 255] * (bits // 32)), "little"),
    ]
    for exponent in exponents:
        monkeypatch.setattr(worker_module.secrets, "randbits", lambda k, e=exponent: e)
        (ciphertext,) = encrypt_chunk_djn(n, h_s, bits, [12345])
        assert ciphertext == (1 + 12345 * n) * pow(h_s, exponent, n_square) % n_square
        assert private_key.raw_decrypt(ciphertext) == 12345


def test_standard_obfuscator_is_phe_raw_encrypt(
    test_only_keypair_512: Keypair, monkeypatch: pytest.MonkeyPatch
) -> None:
    public_key, _ = test_only_keypair_512
    monkeypatch.setattr(worker_module.secrets, "randbelow", lambda bound: 41)
    (ciphertext,) = encrypt_chunk_standard(public_key.n, [99])
    assert ciphertext == public_key.raw_encrypt(99, r_value=42)


def test_progress_reports_cumulative_counts(test_only_keypair_512: Keypair) -> None:
    public_key, private_key = test_only_keypair_512
    seen: list[int] = []
    with CryptoPool(processes=2, chunk_size=3) as small_chunks:
        ciphertexts = small_chunks.encrypt(public_key, list(range(10)), progress=seen.append)
        assert sorted(seen) == seen and seen[-1] == 10 and len(seen) == 4
        assert small_chunks.decrypt(private_key, ciphertexts) == list(range(10))


def test_streams_read_their_source_only_as_fast_as_the_workers(
    pool: CryptoPool, test_only_keypair_512: Keypair
) -> None:
    # A lazy source (plaintexts packed as they are needed, pages from the network) is
    # read at most IN_FLIGHT_TASKS_PER_WORKER tasks per worker ahead of the consumer,
    # never drained into the queue; results still come back complete and in order.
    public_key, private_key = test_only_keypair_512
    limit = IN_FLIGHT_TASKS_PER_WORKER * pool.processes
    read: list[int] = []

    def plaintexts() -> Iterator[list[int]]:
        for i in range(100):
            read.append(i)
            yield [i, i + 1000]

    stream = pool.encrypt_batches(public_key, plaintexts())
    first = next(stream)
    assert len(read) <= limit
    ciphertexts = first + [c for batch in stream for c in batch]
    assert len(read) == 100
    expected = [v for i in range(100) for v in (i, i + 1000)]
    assert pool.decrypt(private_key, ciphertexts) == expected

    pages_read: list[int] = []

    def pages() -> Iterator[list[int]]:
        for start in range(0, len(ciphertexts), 16):
            pages_read.append(start)
            yield ciphertexts[start : start + 16]

    decrypted = pool.decrypt_stream(private_key, pages())
    head = next(decrypted)
    # Each page is 4 tasks per worker: at most two pages wait before the first is taken.
    assert len(pages_read) <= 2
    assert head + [m for batch in decrypted for m in batch] == expected
    with pytest.raises(EncodingOverflowError, match="not in"):
        list(pool.encrypt_batches(public_key, iter([[1], [public_key.n]])))


def test_map_runs_any_module_function_in_input_order(test_only_keypair_512: Keypair) -> None:
    public_key, private_key = test_only_keypair_512
    items = [(i * 7919) % 101 for i in range(101)]  # scrambled: sorting a chunk reorders it
    seen: list[int] = []
    with CryptoPool(processes=2, chunk_size=1) as crypto_pool:
        # One item per chunk: chunks finish in any order, results come back in input order.
        assert crypto_pool.map(sorted, (), items, progress=seen.append) == items
        assert sorted(seen) == seen and seen[-1] == len(items) and len(seen) == len(items)
        # Fixed arguments go before each chunk, exactly as the built-in decryption uses it.
        ciphertexts = crypto_pool.encrypt(public_key, [5, 6, 7])
        fixed = (public_key.n, private_key.p, private_key.q)
        assert crypto_pool.map(worker_module.decrypt_chunk, fixed, ciphertexts) == [5, 6, 7]
        assert crypto_pool.map(sorted, (), []) == []
    with CryptoPool(processes=1, chunk_size=4) as chunked:
        # sorted() of a chunk of four reorders within the chunk: proof that a chunk,
        # not a single item, is what the function receives.
        assert chunked.map(sorted, (), [4, 3, 2, 1, 8, 7]) == [1, 2, 3, 4, 7, 8]


def test_map_refuses_a_function_that_loses_items() -> None:
    with (
        CryptoPool(processes=1, chunk_size=3) as crypto_pool,
        pytest.raises(ValueError, match="1 results for a chunk of 3 items"),
    ):
        crypto_pool.map(heapq.nsmallest, (1,), [3, 1, 2, 6, 5, 4])


def test_pool_is_reusable_after_close(test_only_keypair_512: Keypair) -> None:
    public_key, private_key = test_only_keypair_512
    crypto_pool = CryptoPool(processes=1, start_method="spawn")
    for _ in range(2):
        with crypto_pool:
            ciphertexts = crypto_pool.encrypt(public_key, [7])
            assert crypto_pool.decrypt(private_key, ciphertexts) == [7]
    assert crypto_pool.encrypt(public_key, []) == []


def test_pool_refuses_fork_and_bad_plaintexts(test_only_keypair_512: Keypair) -> None:
    public_key, _ = test_only_keypair_512
    with pytest.raises(ConfigError, match="fork"):
        CryptoPool(start_method="fork")
    with pytest.raises(EncodingOverflowError, match="plaintext 1"):
        CryptoPool(processes=1).encrypt(public_key, [0, public_key.n])


def test_worker_module_imports_neither_numpy_nor_phe() -> None:
    code = "import sys, fedpca.codec._worker; print('numpy' in sys.modules, 'phe' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("total", "processes", "expected"),
    [
        (3811, 2, MAX_STREAM_TASK_CIPHERTEXTS),  # madelon's share on 2 workers: 15 tasks
        (3811, 8, 120),  # four tasks per worker
        (200, 2, MIN_STREAM_TASK_CIPHERTEXTS),  # small shares: first chunk still quick
        (60_697, 64, 238),
        (1, 0, MIN_STREAM_TASK_CIPHERTEXTS),
    ],
)
def test_stream_tasks_are_about_four_per_worker_within_bounds(
    total: int, processes: int, expected: int
) -> None:
    assert stream_task_ciphertexts(total, processes) == expected
