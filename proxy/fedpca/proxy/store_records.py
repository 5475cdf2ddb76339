"""The proxy store's records and page arithmetic: what its methods return, the
errors they raise beside :mod:`fedpca.errors`, and how ciphertext bytes are combined.

Split from :mod:`fedpca.proxy.store` so that modules that only read records (the
coordinator, uploads, results, masking) need not know how they are stored.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cached_property
from typing import Any, Protocol

from fedpca.errors import LayoutError, QueryStateError
from fedpca.messages import QueryState
from fedpca.query import QuerySpec

__all__ = [
    "OPEN_STATES",
    "PAGE_CIPHERTEXTS",
    "QUERY_HEAD",
    "UNREACHABLE_QUORUM",
    "CiphertextAlgebra",
    "Contributor",
    "Finalized",
    "Folded",
    "Joined",
    "NotContributingError",
    "QueryClosedError",
    "QueryRecord",
    "UploadCompletion",
    "UploadRecord",
    "contributor_of",
    "page_count",
    "query_record_of",
    "query_summary",
    "quorum_of",
    "stored_block",
    "stored_size",
]

PAGE_CIPHERTEXTS = 512
"""Ciphertexts per aggregate and result page (256 KiB at 2048-bit keys): the unit read
and rewritten when a chunk is folded, and the unit released to the analyst."""

OPEN_STATES = (QueryState.COLLECTING, QueryState.AGGREGATING)


class QueryClosedError(QueryStateError):
    """The query no longer takes this owner's upload: it ended (done, or failed: past its
    deadline, declined by too many owners, cancelled by the analyst) or its contributors
    were fixed without this owner.

    Nothing in the upload is at fault: the servicer says so to the owner (trailing
    metadata :data:`~fedpca.messages.SHARE_RELEASED_METADATA`), whose operator then is
    not alerted for another owner's decline or the analyst's cancellation.
    """


class NotContributingError(QueryClosedError):
    """An owner that is not one of the query's contributors may no longer join it.

    Nothing of this owner was ever folded into the query, so its share is in no result
    (the servicer tells the owner, which may then refund its reservation).
    """


@dataclass(frozen=True)
class QueryRecord:
    query_id: str
    analyst_id: str
    spec_json: str | None
    """The stored query as JSON, when the record was read with it (None: read without
    it, :data:`QUERY_HEAD`; ``ProxyStore.query_spec`` reads it)."""
    summary: Mapping[str, Any]
    """:func:`query_summary` of the query: what its status and listing show."""
    state: QueryState
    created_at: float
    deadline_at: float
    updated_at: float
    n_contributed: int
    failure_reason: str | None
    signature: bytes = b""
    signer: str = ""
    uploads_begun: bool = False
    """An owner began an upload: owners may have spent budget, so no refund."""

    @cached_property
    def spec(self) -> dict[str, Any]:
        """The stored query (:func:`fedpca.query_records.spec_to_dict`'s form), read
        from its JSON on first use only: a histogram's can be megabytes."""
        if self.spec_json is None:
            raise QueryStateError(f"query {self.query_id!r} was read without its statement")
        spec: dict[str, Any] = json.loads(self.spec_json)
        return spec

    @property
    def quorum(self) -> int:
        return quorum_of(self.summary)


def quorum_of(summary: Mapping[str, Any]) -> int:
    """A stored summary's quorum; one that names none (a row the migration could not
    read) is never reached, so such a query closes on no number of owners (review: it
    read as 1, and one owner's upload finished a query of quorum 3)."""
    quorum = summary.get("quorum")
    return quorum if isinstance(quorum, int) and quorum >= 1 else UNREACHABLE_QUORUM


UNREACHABLE_QUORUM = 2**31
"""The quorum of a query whose stored summary names none (:func:`quorum_of`)."""


QUERY_HEAD = (
    "query_id, analyst_id, state, created_at, deadline_at, updated_at, n_contributed, "
    "failure_reason, signature, signer, uploads_begun, summary, stored_bytes"
)
"""The columns of ``queries`` every read takes: all but the query and its plan, which
can be megabytes each (read only where they are used)."""

_SPEC_DEFAULTS = {
    spec_field.name: spec_field.default
    for spec_field in fields(QuerySpec)
    if spec_field.default is not MISSING
}


def stored_size(spec_json: str, plan_json: str, signature: bytes) -> int:
    """The bytes a query takes in ``queries`` (its statement, plan and signature)."""
    return len(spec_json) + len(plan_json) + len(signature)


def query_summary(spec: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, Any]:
    """The few facts of a stored query (``spec``, ``plan``: their stored forms) that its
    status and the analyst's listing show, kept in a column of their own.

    Neither then reads the query itself: a histogram of 125,000 public bin edges is
    2.2 MiB of JSON, and a review listed 30 such queries in 14.5 s a call (4 calls at
    once), holding Python's lock, while another analyst's calls waited.
    """

    def ciphertexts(blocks: str) -> int:
        return sum(int(block.get("n_ciphertexts", 0)) for block in plan.get(blocks, ()))

    def value(name: str) -> Any:  # a key an older version left out: the field's default
        found = spec.get(name, _SPEC_DEFAULTS.get(name))
        return getattr(found, "value", found)

    return {
        "kind": value("kind"),
        "mode": value("mode"),
        "epsilon": value("epsilon"),
        "delta": value("delta"),
        "quorum": int(value("quorum") or 1),
        "aggregates": list(dict.fromkeys(part.get("kind") for part in spec.get("aggregates", ()))),
        "owner_ciphertexts": ciphertexts("owner_blocks"),
        "result_ciphertexts": ciphertexts("result_blocks"),
        "key_bits": plan.get("key_bits"),
    }


@dataclass(frozen=True)
class UploadRecord:
    query_id: str
    owner_id: str
    upload_id: str
    content_sha256: str
    n_ciphertexts: int
    public_count: int | None
    accepted_at: float


@dataclass(frozen=True)
class Contributor:
    """An owner whose upload is part of a query's result."""

    owner_id: str
    upload_id: str
    covered: int
    """Ciphertexts of its upload folded so far, from the start in wire order."""
    public_count: int | None
    joined_at: float


@dataclass(frozen=True)
class Joined:
    """What :meth:`ProxyStore.join` found or did."""

    covered: int
    """Ciphertexts of this upload already folded (chunks below are skipped)."""
    duplicate: bool = False
    """This very upload was accepted before (a retry): nothing is folded."""
    fixed: bool = False
    """This owner was the last contributor the quorum needed: the set is now fixed."""


@dataclass(frozen=True)
class Folded:
    """What :meth:`ProxyStore.fold_chunk` did."""

    folded: bool
    """False: the chunk was below the contributor's mark and skipped."""
    covered: int


@dataclass(frozen=True)
class Finalized:
    """What :meth:`ProxyStore.finalize_pages` did."""

    new_pages: int
    pages_final: int
    done: bool
    """Every page is final; the query moved to DONE."""


@dataclass(frozen=True)
class UploadCompletion:
    """What completing an upload did to its query (the servicer turns it into the
    owner's :class:`fedpca.messages.UploadReceipt`)."""

    duplicate: bool
    """True when this exact upload had already been accepted (a harmless retry)."""
    n_contributed: int
    """Owners whose uploads the query has accepted, including this one."""


class CiphertextAlgebra(Protocol):
    """The group operation on serialised ciphertexts (homomorphic addition lives in
    the codec; the store only sees fixed-width byte strings)."""

    width: int
    """Bytes per ciphertext."""

    def add(self, current: bytes, data: bytes) -> bytes:
        """Element-wise product of two equally long runs of ciphertexts."""
        ...

    def subtract(self, current: bytes, data: bytes) -> bytes:
        """Element-wise ``current · data⁻¹``: takes ``data`` out of ``current``."""
        ...


def page_count(total_ciphertexts: int, page_ciphertexts: int = PAGE_CIPHERTEXTS) -> int:
    """Pages of ``page_ciphertexts`` that hold ``total_ciphertexts``."""
    return -(-total_ciphertexts // page_ciphertexts)


def stored_block(blocks: Mapping[str, bytes], name: str) -> bytes:
    """Block ``name`` of stored ciphertext data (an aggregate split by block, a result)."""
    data = blocks.get(name)
    if data is None:
        raise LayoutError(f"stored data has no block {name!r}")
    return data


def query_record_of(row: sqlite3.Row) -> QueryRecord:
    return QueryRecord(
        query_id=str(row["query_id"]),
        analyst_id=str(row["analyst_id"]),
        # sqlite3.Row's `in` looks among the values, not the column names.
        spec_json=str(row["spec"]) if "spec" in row.keys() else None,  # noqa: SIM118
        summary=json.loads(row["summary"]),
        state=QueryState(row["state"]),
        created_at=float(row["created_at"]),
        deadline_at=float(row["deadline_at"]),
        updated_at=float(row["updated_at"]),
        n_contributed=int(row["n_contributed"]),
        failure_reason=row["failure_reason"],
        signature=bytes(row["signature"]),
        signer=str(row["signer"]),
        uploads_begun=bool(row["uploads_begun"]),
    )


def contributor_of(row: sqlite3.Row) -> Contributor:
    return Contributor(
        owner_id=str(row["owner_id"]),
        upload_id=str(row["upload_id"]),
        covered=int(row["covered"]),
        public_count=None if row["public_count"] is None else int(row["public_count"]),
        joined_at=float(row["joined_at"]),
    )
