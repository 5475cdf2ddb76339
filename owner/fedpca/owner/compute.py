"""From the owner's table to encrypted, packed statistics for one query (no gRPC).

The pipeline of one task, in order. Once the owner has decided to take part (from
public facts only: :mod:`fedpca.owner.policy` and the budget), nothing here can
refuse: whatever the rows hold, the owner uploads a share of the agreed shape.

1. name the query's columns of the table loaded at start-up
   (:meth:`LocalTable.table_for`; the label column is dropped for PCA and
   used for DCA); a schema that does not fit (feature count, label column) is a
   public fact, checked before the budget. Nothing is copied yet;
2. :func:`chosen_rows`: for DCA leave out records whose label is not one of
   the query's public classes (aggregates leave out a histogram's unlisted categories
   later, in step 3); if more records remain than the public cap
   (the query's ``max_records_per_owner`` or this owner's declared capacity,
   whichever is smaller; for DCA per class), keep a uniform random sample of exactly
   that many, with work of a public size either way. The sensitivity the noise is calibrated
   with covers both (a record left out, or one record displacing another of its class:
   :func:`fedpca.stats.worst_case_change`);
3. :func:`fedpca.exact_statistics.fixed_point_statistics` (aggregates:
   :func:`fedpca.aggregates.fixed_point_aggregates`): scale with the query's public bounds
   (values outside are clipped to them), clip rows to the query's norm, quantise,
   and sum exactly on the fixed-point grid, always over the public number of rows the
   cap allows (zero rows pad the real ones), so the time taken depends on public
   facts, not on the data;
4. lay the integers out per owner block; they are within the block's bound by
   construction (checked once more before anything is encrypted);
5. pack and encrypt.

Nothing here logs values or counts derived from the rows.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
from phe import paillier
from threadpoolctl import ThreadpoolController

from fedpca.aggregates import AggregateIntegers, fixed_point_aggregates
from fedpca.codec.ciphertext import PackedCiphertexts
from fedpca.codec.packing import check_slot_values, pack_stream
from fedpca.codec.paillier import (
    DEFAULT_OBFUSCATION,
    CryptoPool,
    Obfuscation,
    stream_task_ciphertexts,
)
from fedpca.errors import ConfigError, EncodingOverflowError, LayoutError
from fedpca.exact_statistics import ChosenRows, FixedPointStatistics, fixed_point_statistics
from fedpca.owner.local_table import QueryColumns
from fedpca.protocol import ReleasePlan
from fedpca.query import QueryKind, QuerySpec

__all__ = [
    "SINGLE_THREAD_BLAS_WORK",
    "EncryptionProgress",
    "analyst_public_key",
    "blas_pools",
    "blas_threads_for",
    "chosen_rows",
    "encode_share",
    "encrypt_share",
    "encrypt_share_stream",
    "padded_rows",
    "record_cap",
    "share_statistics",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

EncryptionProgress = Callable[[int, int], None]
"""``progress(ciphertexts_done, ciphertexts_total)`` over all blocks of a share."""


def analyst_public_key(spec: QuerySpec) -> paillier.PaillierPublicKey:
    """The analyst's Paillier public key carried by the query."""
    return paillier.PaillierPublicKey(spec.analyst_public_key_n)


def record_cap(spec: QuerySpec, capacity: int) -> int:
    """The most records this owner contributes to ``spec`` (per class for DCA).

    The smaller of two public bounds: the query's ``max_records_per_owner`` and the
    owner's declared capacity.
    """
    if capacity < 1:
        raise ConfigError(f"an owner's declared capacity must be >= 1, got {capacity}")
    return min(spec.max_records_per_owner, capacity)


SINGLE_THREAD_BLAS_WORK = 1 << 30
"""Multiply-adds (rows x features^2, the Gram matrix) below which an owner computes its
statistics on one BLAS thread. OpenBLAS's threads keep spinning for a while after
every call before they sleep; for a small table that spinning cost more CPU than the
second thread saved (benchmarks/end_to_end.py, madelon over 10 owners: ~0.2 CPU-s of
the owners' ~1.3 CPU-s outside encryption was OpenBLAS threads, 0.014 s of it the
product itself). 2^30 multiply-adds take about 0.1 s on one core."""

_blas_limit_lock = threading.Lock()


@functools.cache
def blas_pools() -> ThreadpoolController:
    """The process's BLAS thread pools, found once.

    Finding them reads every shared library the process has loaded (a few milliseconds
    for an owner node); :class:`~fedpca.owner.node.OwnerNode` calls this at start-up so
    that no query pays for it. Libraries loaded after the first call are not seen; the
    BLAS that :func:`encode_share` uses is numpy's, loaded with numpy, before.
    """
    return ThreadpoolController()


@contextmanager
def blas_threads_for(work: int) -> Iterator[None]:
    """Run the block on one BLAS thread if ``work`` (multiply-adds) is small.

    ``threadpoolctl`` limits the process's BLAS libraries, so every thread of the
    process is affected while the block runs; the lock keeps two owners in one process
    (tests, benchmarks) from restoring each other's limits out of order.
    """
    if work >= SINGLE_THREAD_BLAS_WORK:
        yield
        return
    with _blas_limit_lock, blas_pools().limit(limits=1, user_api="blas"):
        yield


def padded_rows(spec: QuerySpec, cap: int) -> int:
    """Rows an owner's statistics always process for ``spec``: the cap, times C for DCA."""
    return cap * (len(spec.class_labels) if spec.kind is QueryKind.DCA else 1)


def chosen_rows(
    table: QueryColumns, spec: QuerySpec, cap: int, rng: np.random.Generator | None = None
) -> ChosenRows:
    """The rows that enter this owner's statistics for ``spec``, chosen with work whose
    size is public.

    DCA: records whose label is not one of the query's public class labels are left
    out, and the cap applies to each class. Then, if more than ``cap`` records
    remain (of a class), a uniform sample of exactly ``cap`` of them (without
    replacement) is kept; otherwise all of them, and rows that are no record of the
    class fill the cap (read like records, left out of every statistic). Neither step
    refuses anything.

    The records are chosen from the table kept padded to the owner's public capacity
    (:attr:`~fedpca.owner.local_table.LocalTable.padded`, U = max(N, capacity) rows):
    one random ordering of all U rows, in which each class's records are moved first
    (a stable sort of one small key per row) and the first ``cap`` of each class
    taken. Every step touches all U rows or exactly ``cap`` per class whatever N and
    the classes' sizes hold, so the time taken does not show whether N (or a class's
    size) is above the cap, which the analyst chooses (found by an outside attack:
    sampling only above the cap, and copying only the records kept, timed N exactly
    by bisecting ``max_records_per_owner``). Nothing is copied: the statistics read
    the chosen rows block by block (:class:`ChosenRows`).

    Parameters
    ----------
    table : the query's columns of the owner's table (:meth:`LocalTable.table_for`).
    spec : the public query.
    cap : :func:`record_cap`.
    rng : sampling randomness (tests only; fresh from the OS by default). It must stay
        secret: the sample is part of the mechanism.
    """
    generator = rng if rng is not None else np.random.default_rng()
    universe = table.padding if table.padding is not None else table.source
    if universe.shape[0] == 0:  # no records and no padding (an in-memory table)
        universe = np.zeros((1, universe.shape[1]))
    size, n = int(universe.shape[0]), table.n_records
    is_record = np.arange(size) < n
    dca = spec.kind is QueryKind.DCA
    classes = np.asarray(spec.class_labels if dca else (0.0,), dtype=np.float64)
    # Each row's key: the index of its class, or len(classes) for no record of one
    # (16 bits when they fit: numpy sorts them by radix, in time linear in U).
    key_type = np.int16 if len(classes) < np.iinfo(np.int16).max else np.int32
    key = np.full(size, len(classes), dtype=key_type)
    if dca:
        if table.label_column is None:
            raise LayoutError("a DCA query needs the owner's labels")
        labels = universe[:, table.label_column]
        for index, label in enumerate(classes):
            key = np.where((labels == label) & is_record, index, key).astype(key_type)
    else:
        key = np.where(is_record, 0, key).astype(key_type)
    counts = np.bincount(key, minlength=len(classes) + 1)
    if spec.bounded_owner_tables and int(counts[:-1].max()) > cap:
        # Unreachable for a node: it refuses to start with more records than its
        # capacity and declines a bounded query whose cap is below it (policy).
        raise LayoutError("a query for bounded owner tables reached an owner that samples")
    shuffled = generator.permutation(size)
    # Two sentinels, the smallest key and the largest, so that the keys are never all
    # equal: numpy's radix sort returns at once when they are, which an owner with no
    # record (or, for DCA, no record of the query's classes) showed in its time (an
    # outside attack on this fix). A sentinel sorts after every row of its key, where
    # no class's records are taken from.
    sort_keys = np.concatenate([key[shuffled], np.array([0, len(classes)], dtype=key_type)])
    order = np.argsort(sort_keys, kind="stable")
    # Slices of ``cap`` past the rows read random rows as filler (cap more positions;
    # one fixed row read again and again stayed in cache, so a class listed first
    # showed its size by how much faster the classes after it were read: same attack).
    filler = np.resize(shuffled, max(cap, 2))
    grouped = np.concatenate([np.concatenate([shuffled, filler[:2]])[order], filler])
    with_sentinels = counts + np.eye(1, len(classes) + 1, 0, dtype=np.int64)[0]
    with_sentinels[-1] += 1
    starts = np.concatenate([[0], np.cumsum(with_sentinels)])
    positions = np.concatenate([grouped[starts[c] : starts[c] + cap] for c in range(len(classes))])
    # The records first, then the other rows, each slot's place found by arithmetic on
    # every slot (a sort of the taken flags returned at once when all were alike, i.e.
    # exactly when every class reached the cap).
    taken_per_class = np.minimum(counts[:-1], cap)
    before = np.concatenate([[0], np.cumsum(taken_per_class)[:-1]])
    n_real = int(taken_per_class.sum())
    slot = np.tile(np.arange(cap), len(classes))
    slot_class = np.repeat(np.arange(len(classes)), cap)
    taken = slot < taken_per_class[slot_class]
    place = np.where(
        taken,
        before[slot_class] + slot,
        n_real + slot_class * cap - before[slot_class] + slot - taken_per_class[slot_class],
    )
    ordered = np.empty_like(positions)
    ordered[place] = positions
    slot_labels = None
    if dca:
        slot_labels = np.empty(positions.size)
        slot_labels[place] = classes[slot_class]
        slot_labels = slot_labels[:n_real]
    return ChosenRows(universe, ordered, n_real, table.feature_columns, slot_labels)


def share_statistics(
    spec: QuerySpec,
    table: QueryColumns,
    *,
    capacity: int,
    rng: np.random.Generator | None = None,
) -> FixedPointStatistics | AggregateIntegers:
    """The owner's exact statistics for ``spec`` (steps 2 and 3 above), over the public
    number of rows: the rows of :func:`chosen_rows`, the same work whatever N."""
    cap = record_cap(spec, capacity)
    rows = chosen_rows(table, spec, cap, rng)
    with blas_threads_for(padded_rows(spec, cap) * spec.n_features**2):
        if spec.kind is QueryKind.AGGREGATE:
            return fixed_point_aggregates(rows, spec)
        return fixed_point_statistics(rows, None, spec)


def encode_share(
    spec: QuerySpec,
    table: QueryColumns,
    plan: ReleasePlan,
    *,
    capacity: int,
    rng: np.random.Generator | None = None,
) -> dict[str, IntArray]:
    """Fixed-point values of every owner block of ``plan`` (exact, never refused).

    Parameters
    ----------
    spec : the public query.
    table : the query's columns of the owner's table (:meth:`LocalTable.table_for`).
    plan : ``ReleasePlan.for_query(spec, key_bits)``.
    capacity : the owner's declared (public) capacity in records.
    rng : sampling randomness (tests only; fresh from the OS by default).

    Returns
    -------
    dict
        Block name -> (layout.value_count,) int64 fixed-point values.

    Raises
    ------
    EncodingOverflowError
        Only if a value broke its block's bound, which the construction rules out:
        it would be a bug, and nothing is encrypted.
    """
    statistics = share_statistics(spec, table, capacity=capacity, rng=rng)
    values = plan.owner_integers(statistics)
    encoded: dict[str, IntArray] = {}
    for block in plan.owner_blocks:
        fixed = values[block.name]
        if fixed.shape != (block.layout.value_count,):
            raise LayoutError(
                f"block {block.name!r}: {fixed.shape[0]} values, the layout declares "
                f"{block.layout.value_count}"
            )
        if fixed.size and max(int(fixed.max()), -int(fixed.min())) > block.bound:
            raise EncodingOverflowError(
                f"query {spec.query_id!r}: block {block.name!r} broke its declared bound "
                f"{block.bound} (a bug: the statistics are bounded by construction); nothing "
                "was encrypted"
            )
        encoded[block.name] = fixed
    return encoded


def _task_pieces(
    encoded: Mapping[str, IntArray], plan: ReleasePlan, task: int
) -> list[deque[IntArray]]:
    """Each block's values copied into one array per encryption task of ``task``
    ciphertexts. The stream lets go of the whole arrays and frees each piece once it
    is packed, so the share's 8 bytes per value leave memory as its ciphertexts arrive
    instead of staying beside all of them (at M = 2,000 a 15 MiB share beside 30 MiB
    of ciphertexts)."""
    pieces = []
    for block in plan.owner_blocks:
        whole = encoded[block.name]
        step = task * block.layout.slots_per_ciphertext
        pieces.append(deque(whole[i : i + step].copy() for i in range(0, len(whole), step)))
    return pieces


def _drain(queue: deque[IntArray]) -> Iterator[IntArray]:
    """The queue's items in order, each removed as it is handed out."""
    while queue:
        yield queue.popleft()


def encrypt_share_stream(
    spec: QuerySpec,
    encoded: Mapping[str, IntArray],
    plan: ReleasePlan,
    pool: CryptoPool,
    *,
    obfuscation: Obfuscation = DEFAULT_OBFUSCATION,
    progress: EncryptionProgress | None = None,
) -> Iterator[list[int]]:
    """The ciphertexts of an encoded share in wire order, batch by batch as encrypted.

    Blocks follow ``plan.owner_blocks``; every value is checked against its block's
    bound before anything is encrypted. The plaintexts are packed batch by batch as
    the pool takes them (a whole share's packed plaintexts as Python ints would be
    about 0.6x its ciphertexts again), and batches come back in order while later
    ones are still on the pool, so the caller can send them at once
    (:class:`fedpca.owner.upload.OutgoingUpload`).

    Parameters
    ----------
    spec : the public query (its ``analyst_public_key_n`` is the encryption key).
    encoded : :func:`encode_share`'s values, block name -> fixed-point integers.
    plan : the release plan the values were laid out with.
    pool : the process pool that encrypts.
    obfuscation : DJN or standard obfuscators.
    progress : ``progress(done, total)`` in ciphertexts over all blocks.
    """
    public_key = analyst_public_key(spec)
    n = public_key.n
    for block in plan.owner_blocks:
        count = len(encoded[block.name])
        if count != block.layout.value_count:
            raise LayoutError(
                f"block {block.name!r}: {count} values, the layout declares "
                f"{block.layout.value_count}"
            )
        check_slot_values(encoded[block.name], block.bound)
    total = sum(block.layout.n_ciphertexts for block in plan.owner_blocks)
    task = stream_task_ciphertexts(total, pool.processes)
    pieces = _task_pieces(encoded, plan, task)
    del encoded  # only the caller's reference keeps the whole share now
    done = 0
    for block, queue in zip(plan.owner_blocks, pieces, strict=True):
        packed = pack_stream(_drain(queue), block.layout, block.bound)
        plaintexts = ([p % n for p in batch] for batch in packed)
        for batch in pool.encrypt_batches(public_key, plaintexts, obfuscation=obfuscation):
            done += len(batch)
            if progress is not None:
                progress(done, total)
            yield batch


def encrypt_share(
    spec: QuerySpec,
    table: QueryColumns,
    pool: CryptoPool,
    *,
    capacity: int,
    plan: ReleasePlan | None = None,
    obfuscation: Obfuscation = DEFAULT_OBFUSCATION,
    progress: EncryptionProgress | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, PackedCiphertexts]:
    """Encrypt this owner's whole share of ``spec`` under the analyst key the query carries.

    Parameters
    ----------
    spec : the public query (its ``analyst_public_key_n`` is the encryption key).
    table : the query's columns of the owner's table (:meth:`LocalTable.table_for`).
    pool : the process pool that encrypts.
    capacity : the owner's declared (public) capacity in records.
    plan : the release plan (derived from ``spec`` and the key size if omitted).
    obfuscation : DJN or standard obfuscators.
    progress : ``progress(done, total)`` in ciphertexts over all blocks.
    rng : sampling randomness (tests only).

    Returns
    -------
    dict
        Block name -> packed ciphertexts, in ``plan.owner_blocks`` order.
    """
    public_key = analyst_public_key(spec)
    if plan is None:
        plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    encoded = encode_share(spec, table, plan, capacity=capacity, rng=rng)
    flat: list[int] = []
    for batch in encrypt_share_stream(
        spec, encoded, plan, pool, obfuscation=obfuscation, progress=progress
    ):
        flat.extend(batch)
    shares: dict[str, PackedCiphertexts] = {}
    start = 0
    for block in plan.owner_blocks:
        count = block.layout.n_ciphertexts
        shares[block.name] = PackedCiphertexts(
            public_key, block.layout, tuple(flat[start : start + count]), block.bound
        )
        start += count
    return shares
