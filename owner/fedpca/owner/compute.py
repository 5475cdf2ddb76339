"""From the owner's table to encrypted, packed statistics for one query (no gRPC).

The pipeline of one task, in order:

1. pick the query's columns from the table loaded at start-up
   (:meth:`LocalTable.table_for`; the label column is dropped for PCA and
   used for DCA);
2. refuse before any work if the table has more records than the query's
   public ``max_records_per_owner``: the slot width was sized for that many, and
   an owner that exceeded it could carry into the next slot of the sum;
3. scale with the query's public bounds and clip rows
   (:func:`~fedpca.preprocess.preprocess_for_query`);
4. local sufficient statistics, laid out per owner block by the release plan;
5. stochastic fixed-point encoding with the query's ``frac_bits``;
6. check every block against its declared bound, then pack and encrypt
   (all blocks are checked before the first ciphertext is computed).

Nothing here logs values derived from the rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from phe import paillier

from fedpca.codec.ciphertext import PackedCiphertexts
from fedpca.codec.paillier import DEFAULT_OBFUSCATION, CryptoPool, Obfuscation
from fedpca.errors import ConfigError, EncodingOverflowError, LayoutError, PolicyError
from fedpca.owner.config import DataConfig, OutOfBounds
from fedpca.owner.statistics import local_statistics
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import ReleasePlan
from fedpca.query import QueryKind, QuerySpec
from fedpca.tables import OwnerTable, load_table

__all__ = [
    "EncryptionProgress",
    "LocalTable",
    "analyst_public_key",
    "encode_share",
    "encrypt_share",
    "spec_digest",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

EncryptionProgress = Callable[[int, int], None]
"""``progress(ciphertexts_done, ciphertexts_total)`` over all blocks of a share."""


@dataclass(frozen=True, eq=False)
class LocalTable:
    """Every column of the owner's file, loaded once at start-up.

    Attributes
    ----------
    columns : (N, K) float64, all columns of the file (label column included).
    label_column : 0-based index of the configured label column, or None.
    source : the file the table was read from (for messages).
    """

    columns: FloatArray
    label_column: int | None
    source: str

    def __post_init__(self) -> None:
        # A private read-only copy: a task must never see another task's edits.
        columns = np.array(self.columns, dtype=np.float64)
        columns.setflags(write=False)
        object.__setattr__(self, "columns", columns)
        if self.columns.ndim != 2 or self.columns.shape[0] == 0:
            raise ValueError(f"{self.source}: expected a non-empty 2-D table")
        if self.label_column is not None:
            k = self.n_columns
            if not -k <= self.label_column < k:
                raise ConfigError(
                    f"{self.source}: data.label_column = {self.label_column} is out of range "
                    f"for {k} columns"
                )
            object.__setattr__(self, "label_column", self.label_column % k)

    @classmethod
    def load(cls, data: DataConfig) -> LocalTable:
        """Load the configured file (DataError with the loader's message if it is bad)."""
        table = load_table(data.path, header=data.header)
        return cls(table.features, data.label_column, str(data.path))

    @property
    def n_records(self) -> int:
        return int(self.columns.shape[0])

    @property
    def n_columns(self) -> int:
        return int(self.columns.shape[1])

    def table_for(self, spec: QuerySpec) -> OwnerTable:
        """Features (and labels for DCA) of this table as ``spec`` needs them.

        Raises
        ------
        PolicyError
            If the query's feature count does not match this owner's data, its
            label column does not exist or differs from the configured one, or
            the data holds labels outside the query's public class labels. The
            messages name counts and columns, never values.
        """
        if spec.kind is QueryKind.DCA:
            label = spec.label_column if spec.label_column is not None else self.label_column
            if label is None:
                raise PolicyError(
                    f"query {spec.query_id!r} is a DCA query without a label column, and this "
                    "owner has no data.label_column"
                )
            if not 0 <= label < self.n_columns:
                raise PolicyError(
                    f"query {spec.query_id!r} reads labels from column {label}; this owner's "
                    f"data has {self.n_columns} columns"
                )
            if self.label_column is not None and label != self.label_column:
                # Using the configured label column as a feature would release labels
                # the owner declared as such under a feature's bounds.
                raise PolicyError(
                    f"query {spec.query_id!r} reads labels from column {label}; this owner's "
                    f"labels are in column {self.label_column}"
                )
        else:
            label = self.label_column
        if label is None:
            features, labels = self.columns, None
        else:
            features = np.delete(self.columns, label, axis=1)
            labels = self.columns[:, label]
        if features.shape[1] != spec.n_features:
            raise PolicyError(
                f"query {spec.query_id!r} has {spec.n_features} features; this owner's data has "
                f"{features.shape[1]}" + (" (label column excluded)" if label is not None else "")
            )
        if spec.kind is QueryKind.DCA:
            assert labels is not None
            unknown = ~np.isin(labels, np.asarray(spec.class_labels, dtype=np.float64))
            if unknown.any():
                raise PolicyError(
                    f"query {spec.query_id!r}: {int(unknown.sum())} of this owner's records carry "
                    f"labels outside the query's {len(spec.class_labels)} public class labels"
                )
            return OwnerTable(np.ascontiguousarray(features), labels.copy())
        return OwnerTable(np.ascontiguousarray(features), None)


def analyst_public_key(spec: QuerySpec) -> paillier.PaillierPublicKey:
    """The analyst's Paillier public key carried by the query."""
    return paillier.PaillierPublicKey(spec.analyst_public_key_n)


def spec_digest(spec: QuerySpec) -> str:
    """SHA-256 over every public parameter of ``spec`` (binds a ledger entry to one query)."""
    fields = dataclasses.asdict(spec)
    text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode_share(
    spec: QuerySpec,
    table: OwnerTable,
    plan: ReleasePlan,
    *,
    out_of_bounds: OutOfBounds = "clip",
    rng: np.random.Generator | None = None,
) -> dict[str, IntArray]:
    """Fixed-point values of every owner block of ``plan``, checked against their bounds.

    Parameters
    ----------
    spec : the public query.
    table : the owner's features (N, M) and labels (N,) for DCA.
    plan : ``ReleasePlan.for_query(spec, key_bits)``.
    out_of_bounds : "clip" or "refuse" values outside the query's public bounds.
    rng : source of the stochastic-rounding coins (tests only; fresh by default).

    Returns
    -------
    dict
        Block name -> (layout.value_count,) int64 fixed-point values.

    Raises
    ------
    EncodingOverflowError
        If the table has more records than ``spec.max_records_per_owner`` or a
        value exceeds its block's bound (checked for every block before returning).
    DataError
        If preprocessing refuses the rows (e.g. ``out_of_bounds="refuse"``).
    """
    n_records = int(table.features.shape[0])
    if n_records > spec.max_records_per_owner:
        raise EncodingOverflowError(
            f"query {spec.query_id!r}: this owner holds {n_records} records, more than the "
            f"query's max_records_per_owner={spec.max_records_per_owner} that sizes the packed "
            "slots; nothing was encrypted"
        )
    rows = preprocess_for_query(table.features, spec, out_of_bounds)
    statistics = local_statistics(rows, table.labels, spec)
    # Each statistic is rounded once, even where a block repeats it (masked mode).
    values = plan.owner_integers(statistics, rng)
    encoded: dict[str, IntArray] = {}
    for block in plan.owner_blocks:
        fixed = values[block.name]
        if fixed.shape != (block.layout.value_count,):
            raise LayoutError(
                f"block {block.name!r}: {fixed.shape[0]} values, the layout declares "
                f"{block.layout.value_count}"
            )
        # Refuse here, naming the block but no value: the values are private.
        if fixed.size and int(np.abs(fixed).max()) > block.bound:
            raise EncodingOverflowError(
                f"query {spec.query_id!r}: block {block.name!r} holds a value beyond its declared "
                f"bound |value| <= {block.bound}; nothing was encrypted"
            )
        encoded[block.name] = fixed
    return encoded


def encrypt_share(
    spec: QuerySpec,
    table: OwnerTable,
    pool: CryptoPool,
    *,
    plan: ReleasePlan | None = None,
    out_of_bounds: OutOfBounds = "clip",
    obfuscation: Obfuscation = DEFAULT_OBFUSCATION,
    progress: EncryptionProgress | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, PackedCiphertexts]:
    """Encrypt this owner's share of ``spec`` under the analyst key the query carries.

    Parameters
    ----------
    spec : the public query (its ``analyst_public_key_n`` is the encryption key).
    table : the owner's features and labels (:meth:`LocalTable.table_for`).
    pool : the process pool that encrypts.
    plan : the release plan (derived from ``spec`` and the key size if omitted).
    out_of_bounds : "clip" or "refuse" values outside the public bounds.
    obfuscation : DJN or standard obfuscators.
    progress : ``progress(done, total)`` in ciphertexts over all blocks.
    rng : stochastic-rounding coins (tests only).

    Returns
    -------
    dict
        Block name -> packed ciphertexts, in ``plan.owner_blocks`` order.

    Raises
    ------
    EncodingOverflowError
        Before any encryption, if the data exceed the query's public bounds.
    """
    public_key = analyst_public_key(spec)
    if plan is None:
        plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    encoded = encode_share(spec, table, plan, out_of_bounds=out_of_bounds, rng=rng)
    total = sum(block.layout.n_ciphertexts for block in plan.owner_blocks)
    shares: dict[str, PackedCiphertexts] = {}
    done_before = 0
    for block in plan.owner_blocks:

        def report(done: int, offset: int = done_before) -> None:
            if progress is not None:
                progress(offset + done, total)

        shares[block.name] = pool.encrypt_packed(
            public_key,
            encoded[block.name],
            block.layout,
            block.bound,
            obfuscation=obfuscation,
            progress=report,
        )
        done_before += block.layout.n_ciphertexts
    return shares


def share_summary(shares: Mapping[str, PackedCiphertexts]) -> dict[str, Any]:
    """Public shape of an encrypted share (for logs): ciphertexts per block."""
    return {name: len(packed.ciphertexts) for name, packed in shares.items()}
