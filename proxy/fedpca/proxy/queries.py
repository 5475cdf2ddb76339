"""A query as the proxy holds it besides its row in the store.

A submitted query is checked once (:func:`validate_query`); its spec is stored as
strict JSON (:mod:`fedpca.query_records`); from the spec follow
its release plan and analyst key (:class:`QueryContext`) and the layouts its
uploads and its result declare (:func:`wire_blocks`, :func:`result_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from phe.paillier import PaillierPublicKey

from fedpca.codec import MIN_KEY_BITS, ciphertext_byte_length, key_fingerprint
from fedpca.errors import ConfigError
from fedpca.messages import CiphertextBlock, blocks_of
from fedpca.protocol import ReleasePlan
from fedpca.query import (
    QuerySpec,
)

__all__ = [
    "QueryContext",
    "result_blocks",
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
# ------------------------------------------------------------- plan <-> layout
def wire_blocks(plan: ReleasePlan) -> tuple[CiphertextBlock, ...]:
    """The layout owners must declare in their upload header, in order."""
    return blocks_of(plan.owner_blocks)


def result_blocks(plan: ReleasePlan) -> tuple[CiphertextBlock, ...]:
    """The layout of the result the proxy returns, in order."""
    return blocks_of(plan.result_blocks)
