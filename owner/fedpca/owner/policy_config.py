"""``[policy]`` of ``owner.toml``: which tasks an owner accepts, and the pinned analysts.

An analyst is pinned twice: by the fingerprint of the Paillier key the owner encrypts
under (``accepted_analyst_keys``) and by the Ed25519 key that signs its queries
(``accepted_query_signers``). ``analyst_key_signers`` ties the two together, key by key:
a query naming a key is answered only if one of that key's signers signed it. Without
it any pinned signer may name any pinned key; with per-analyst budget shares, which are
kept by key, it is required (fedpca.dp.shares): otherwise one analyst could name
another's key, charge that analyst's share and read its use in the decline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import ConfigError
from fedpca.query import RELEASE_KINDS, ReleaseKind
from fedpca.signing import parse_signer

__all__ = [
    "DEFAULT_MAX_TASKS_PER_DAY",
    "DEFAULT_MIN_QUORUM",
    "DELTA_CAP",
    "PolicyConfig",
    "analyst_keys_from",
    "key_signers_from",
    "query_signers_from",
]

DEFAULT_MAX_TASKS_PER_DAY = 100

DEFAULT_MIN_QUORUM = 2
"""An owner contributes to no query of fewer owners unless configured to (a quorum of 1
releases its statistics alone, noised, which an operator should choose knowingly)."""
DELTA_CAP = 1e-5
"""The default per-query delta cap never exceeds this (nor the budget's delta)."""

_FINGERPRINT_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class PolicyConfig:
    """``[policy]``: which tasks this owner accepts (decided from public facts only).

    Attributes
    ----------
    accepted_analyst_keys : fingerprints (``sha256:<hex>``) of the analyst Paillier
        keys this owner encrypts under; any other key is declined.
    accepted_query_signers : the analysts' query-signing keys (``ed25519:<hex>``); a
        task not signed by one of them is declined.
    analyst_key_signers : pinned key -> the pinned signers that may ask for releases
        under it (empty: any pinned signer may name any pinned key; required, and
        covering every pinned key, with budget shares).
    max_epsilon_per_query : largest epsilon of a single release, measured at the
        owner's budget delta (from the release's noise, not its stated epsilon).
    max_delta_per_query : largest delta a query may state (None: the budget's delta,
        at most 1e-5).
    allow_not_private : accept ``epsilon = inf`` verification queries (no noise:
        the analyst learns the exact sums; a finite budget is exhausted by one).
    allow_masked_mode : take part in the masked (published) protocol, in which the
        proxy learns this owner's record count, and whose guarantee for this owner's
        records holds only while no other contributing owner colludes with the
        analyst (docs/privacy.md, masked mode).
    allowed_kinds : release kinds this owner answers: pca, dca, and the aggregate kinds
        stats, histogram and linreg (an aggregate query needs every one it combines).
    allowed_columns : if set, the only file columns (0-based) a query may read; PCA
        reads every feature column, DCA every column, an aggregate query its columns.
    min_quorum : smallest quorum of a query this owner contributes to (default
        :data:`DEFAULT_MIN_QUORUM`, 2: never a release of this owner's statistics alone,
        unless its operator says so).
    max_tasks_per_day : releases this owner takes part in per 24 hours; a task refunded
        (its query cancelled before any upload) still counts, against its own analyst
        only: the cap bounds the computing cancelled queries cost the owner, without
        letting one analyst use up the others' allowance for free.
    state_terms : state this policy, with the table's schema, on the task stream, for
        the proxy to show to analysts (:class:`fedpca.owner_terms.OwnerTerms`; default
        true). False: analysts learn a setting only from a decline, as before terms.
    """

    accepted_analyst_keys: tuple[str, ...]
    max_epsilon_per_query: float
    allow_not_private: bool = False
    accepted_query_signers: tuple[str, ...] = ()
    max_delta_per_query: float | None = None
    allow_masked_mode: bool = False
    allowed_kinds: tuple[ReleaseKind, ...] = RELEASE_KINDS
    allowed_columns: tuple[int, ...] | None = None
    min_quorum: int = DEFAULT_MIN_QUORUM
    max_tasks_per_day: int = DEFAULT_MAX_TASKS_PER_DAY
    analyst_key_signers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    state_terms: bool = True

    def delta_cap(self, budget: PrivacyParams) -> float:
        """The largest per-query delta this owner accepts under ``budget``."""
        if self.max_delta_per_query is not None:
            return self.max_delta_per_query
        return min(budget.delta, DELTA_CAP)


def analyst_keys_from(policy_doc: Mapping[str, Any]) -> tuple[str, ...]:
    """``policy.accepted_analyst_keys``, validated."""
    keys = policy_doc.get("accepted_analyst_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(
            "policy.accepted_analyst_keys must be a list of key fingerprints "
            '("sha256:<64 hex digits>")'
        )
    for index, key in enumerate(keys):
        if not _FINGERPRINT_RE.fullmatch(key):
            raise ConfigError(
                f"policy.accepted_analyst_keys[{index}] = {key!r} is not a key fingerprint "
                '("sha256:" + 64 lowercase hex digits, as printed by the analyst)'
            )
    return tuple(keys)


def query_signers_from(policy_doc: Mapping[str, Any]) -> tuple[str, ...]:
    """``policy.accepted_query_signers``, validated (empty when absent)."""
    signers = policy_doc.get("accepted_query_signers", [])
    if not isinstance(signers, list) or not all(isinstance(k, str) for k in signers):
        raise ConfigError(
            "policy.accepted_query_signers must be a list of query-signing keys "
            '("ed25519:<64 hex digits>")'
        )
    for index, signer in enumerate(signers):
        try:
            parse_signer(signer)
        except ConfigError as exc:
            raise ConfigError(f"policy.accepted_query_signers[{index}]: {exc}") from None
    return tuple(signers)


def key_signers_from(
    policy_doc: Mapping[str, Any], keys: tuple[str, ...], signers: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    """``policy.analyst_key_signers``, validated against the pinned keys and signers
    ({} when absent).

    Raises
    ------
    ConfigError
        Not a table of lists, a key or signer that is not pinned, or a pinned key it
        leaves out (a key left out could be named by any signer).
    """
    table = policy_doc.get("analyst_key_signers", {})
    example = '{ "sha256:<key>" = ["ed25519:<its signer>"] }'
    if not isinstance(table, Mapping):
        raise ConfigError(f"policy.analyst_key_signers must be a table, e.g. {example}")
    pairs: dict[str, tuple[str, ...]] = {}
    for key, listed in table.items():
        where = f"policy.analyst_key_signers[{key!r}]"
        if key not in keys:
            raise ConfigError(f"{where}: not a key in policy.accepted_analyst_keys")
        if (
            not isinstance(listed, list)
            or not listed
            or not all(isinstance(signer, str) for signer in listed)
        ):
            raise ConfigError(f"{where} must be a non-empty list of signers, e.g. {example}")
        for signer in listed:
            if signer not in signers:
                raise ConfigError(f"{where}: {signer!r} is not in policy.accepted_query_signers")
        pairs[str(key)] = tuple(listed)
    missing = [key for key in keys if key not in pairs]
    if pairs and missing:
        raise ConfigError(
            f"policy.analyst_key_signers has no signers for the pinned key {missing[0]!r}: "
            "every key in policy.accepted_analyst_keys needs its signers (any signer could "
            "name a key left out)"
        )
    return pairs
