"""A query as the proxy holds it besides its row in the store.

A submitted query is checked once (:func:`validate_query`); its spec is stored as
strict JSON (:func:`spec_to_dict`, :func:`spec_from_dict`); from the spec follow
its release plan and analyst key (:class:`QueryContext`) and the layouts its
uploads and its result declare (:func:`wire_blocks`, :func:`result_blocks`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from phe.paillier import PaillierPublicKey

from fedpca.codec import MIN_KEY_BITS, ciphertext_byte_length, key_fingerprint
from fedpca.errors import ConfigError
from fedpca.messages import CiphertextBlock, blocks_of
from fedpca.protocol import ReleasePlan
from fedpca.query import (
    Aggregate,
    Calibration,
    Neighbouring,
    ProtocolMode,
    QueryKind,
    QuerySpec,
)

__all__ = [
    "QueryContext",
    "result_blocks",
    "spec_from_dict",
    "spec_to_dict",
    "validate_query",
    "wire_blocks",
]


@dataclass(frozen=True)
class QueryContext:
    """A query's spec with what the proxy derives from it: release plan and analyst key."""

    spec: QuerySpec
    plan: ReleasePlan
    public_key: PaillierPublicKey

    @classmethod
    def of(cls, spec: QuerySpec) -> QueryContext:
        """The context of a stored (already validated) query."""
        public_key = PaillierPublicKey(spec.analyst_public_key_n)
        plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
        return cls(spec, plan, public_key)


def validate_query(
    spec: QuerySpec, *, allow_insecure_test_keys: bool, max_upload_mib: float
) -> QueryContext:
    """Check a submitted query before it is stored, charged or published.

    Raises
    ------
    ConfigError
        Short or malformed analyst key, fingerprint mismatch, invalid deadline,
        uploads larger than ``max_upload_mib``, or a query the release plan cannot
        serve (also LayoutError / EncodingOverflowError / CalibrationError from the
        plan).
    """
    n = spec.analyst_public_key_n
    if n < 3 or n % 2 == 0:
        raise ConfigError("analyst_public_key_n is not a Paillier modulus (must be odd, > 1)")
    bits = n.bit_length()
    if bits < MIN_KEY_BITS and not allow_insecure_test_keys:
        raise ConfigError(f"the analyst key has {bits} bits; at least {MIN_KEY_BITS} are required")
    public_key = PaillierPublicKey(n)
    if key_fingerprint(public_key) != spec.analyst_key_fingerprint:
        raise ConfigError(
            "analyst_key_fingerprint does not match analyst_public_key_n "
            f"(expected {key_fingerprint(public_key)})"
        )
    plan = ReleasePlan.for_query(spec, bits)
    # Uploads are held in memory while their content hash is checked, so the
    # proxy bounds them before any owner is asked to encrypt anything.
    ciphertexts = sum(block.layout.n_ciphertexts for block in plan.owner_blocks)
    upload_mib = ciphertexts * ciphertext_byte_length(bits) / 2**20
    limit = max_upload_mib
    if upload_mib > limit:
        raise ConfigError(
            f"this query needs uploads of {upload_mib:.1f} MiB per owner ({ciphertexts} "
            f"ciphertexts); this proxy accepts at most {limit:g} MiB (proxy.max_upload_mib)"
        )
    return QueryContext(spec, plan, public_key)


# --------------------------------------------------------------- spec <-> JSON
def spec_to_dict(spec: QuerySpec) -> dict[str, Any]:
    """JSON-ready form of a query (strict JSON: an infinite epsilon is ``"inf"``).

    The analyst modulus is written as a hex string: 2048+-bit integers are valid
    JSON, but many JSON readers silently turn them into floats.
    """
    record: dict[str, Any] = {}
    for spec_field in fields(QuerySpec):
        value = getattr(spec, spec_field.name)
        if spec_field.name == "analyst_public_key_n":
            value = format(value, "x")
        elif spec_field.name == "aggregates":
            value = [part.to_dict() for part in value]
        elif isinstance(value, QueryKind | ProtocolMode | Calibration | Neighbouring):
            value = value.value
        elif isinstance(value, tuple):
            value = [_float_out(v) for v in value]
        elif isinstance(value, float):
            value = _float_out(value)
        record[spec_field.name] = value
    return record


def spec_from_dict(record: Mapping[str, Any]) -> QuerySpec:
    """Inverse of :func:`spec_to_dict`.

    Raises
    ------
    ConfigError
        Missing or unknown keys, or values the query refuses.
    """
    names = {f.name for f in fields(QuerySpec)}
    unknown = sorted(set(record) - names)
    if unknown:
        raise ConfigError(f"stored query has unknown keys {unknown}")
    kwargs: dict[str, Any] = {}
    try:
        for name, value in record.items():
            if name == "analyst_public_key_n":
                value = int(value, 16)
            elif name == "aggregates":
                value = tuple(Aggregate.from_dict(part) for part in value)
            elif name == "kind":
                value = QueryKind(value)
            elif name == "mode":
                value = ProtocolMode(value)
            elif name == "calibration":
                value = Calibration(value)
            elif name == "neighbouring":
                value = Neighbouring(value)
            elif isinstance(value, list):
                value = tuple(float(v) for v in value)
            elif name in ("epsilon", "delta", "clip_norm", "deadline_seconds"):
                value = float(value)
            kwargs[name] = value
        return QuerySpec(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"stored query cannot be read back: {exc}") from exc


def _float_out(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


# ------------------------------------------------------------- plan <-> layout
def wire_blocks(plan: ReleasePlan) -> tuple[CiphertextBlock, ...]:
    """The layout owners must declare in their upload header, in order."""
    return blocks_of(plan.owner_blocks)


def result_blocks(plan: ReleasePlan) -> tuple[CiphertextBlock, ...]:
    """The layout of the result the proxy returns, in order."""
    return blocks_of(plan.result_blocks)
