"""The query an analyst submits, as a frozen value object shared by every role.

A query fixes everything public about one release: which statistics are summed,
the public bounds that make per-record sensitivity finite, the privacy
parameters, the protocol mode, and the analyst key the owners must encrypt to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

from fedpca.errors import ConfigError

QUERY_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""Query ids appear in log lines, file names and the proxy's keys: a safe alphabet."""


class QueryKind(StrEnum):
    PCA = "pca"
    DCA = "dca"


class ProtocolMode(StrEnum):
    STATS = "stats"
    """Noisy sufficient statistics: noise on R, v, N (per-class sums for DCA)."""
    MASKED = "masked"
    """Corrected Wang & Chang protocol: mean masking + symmetric noise on the scatter."""


class Calibration(StrEnum):
    """How the noise multiplier of a release is derived from its (epsilon, delta)."""

    ZCDP = "zcdp"
    """Default. The discrete Gaussian's zero-concentrated DP (rho = 1/(2 z^2), Canonne,
    Kamath & Steinke 2020) converted to (epsilon, delta) with the best known conversion:
    a proven bound for the mechanism fedpca runs."""
    ANALYTIC = "analytic"
    """Balle & Wang's exact condition for the *continuous* Gaussian; for the discrete
    sampler fedpca uses it is a close approximation, not a proof (docs/privacy.md)."""
    CLASSIC = "classic"
    """Dwork & Roth's tail bound for the continuous Gaussian, epsilon < 1 only."""


class Neighbouring(StrEnum):
    """The neighbouring relation a deployment states its guarantee for (docs/privacy.md)."""

    ADD_REMOVE = "add-remove"
    """Default: D' is D with one record added or removed (counts are private)."""
    REPLACE_ONE = "replace-one"
    """D' is D with one record replaced by another (record counts are public)."""


@dataclass(frozen=True)
class QuerySpec:
    """Public description of one query.

    Attributes
    ----------
    kind : pca or dca.
    n_features : number of feature columns M (the label column excluded).
    feature_lower, feature_upper : public per-feature bounds, each of length M, or
        both empty for "no bounds" (raw values are used, only the row clip applies).
    clip_norm : every row is scaled down to L2 norm <= clip_norm before summing.
    epsilon, delta : privacy parameters of this release; ``epsilon = inf`` means
        no noise at all (verification only, NOT PRIVATE).
    calibration : zcdp (default, proven for the discrete Gaussian), analytic or classic.
    neighbouring : the neighbouring relation (epsilon, delta) refer to; the proxy and
        every owner refuse a query stated for another relation than their deployment's.
    mode : stats or masked.
    n_components : number of components the analyst asks for.
    label_column : column holding the class label (DCA), counted in the owners' files.
    class_labels : the public list of class labels (DCA); an owner leaves records of
        other labels out of its statistics (the sensitivity accounts for it).
    quorum : minimum number of owners that must contribute.
    deadline_seconds : how long the proxy waits for uploads after the query is published.
    max_records_per_owner, max_owners : public bounds used to size packed slots; an
        owner holding more records contributes a uniform sample of this many.
    frac_bits : fixed-point fractional bits.
    analyst_public_key_n : the analyst's Paillier modulus n.
    analyst_key_fingerprint : fingerprint of that key (owners pin it).
    query_id : unique id assigned by the analyst client.
    """

    query_id: str
    kind: QueryKind
    n_features: int
    epsilon: float
    delta: float
    n_components: int
    analyst_public_key_n: int
    analyst_key_fingerprint: str
    feature_lower: tuple[float, ...] = ()
    feature_upper: tuple[float, ...] = ()
    clip_norm: float = 1.0
    calibration: Calibration = Calibration.ZCDP
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    mode: ProtocolMode = ProtocolMode.STATS
    label_column: int | None = None
    class_labels: tuple[float, ...] = ()
    quorum: int = 1
    deadline_seconds: float = 300.0
    max_records_per_owner: int = 1 << 20
    max_owners: int = 1 << 8
    frac_bits: int = 32
    noise_weights: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        if not QUERY_ID_PATTERN.fullmatch(self.query_id):
            raise ConfigError(
                f"query_id must be 1 to 128 letters, digits, '.', '_' or '-', got "
                f"{self.query_id[:40]!r}" + ("..." if len(self.query_id) > 40 else "")
            )
        if self.n_features < 1:
            raise ConfigError(f"n_features must be >= 1, got {self.n_features}")
        if not (self.epsilon > 0):
            raise ConfigError(f"epsilon must be > 0 (or inf for no noise), got {self.epsilon}")
        if math.isfinite(self.epsilon) and not (0 < self.delta < 1):
            raise ConfigError(f"delta must be in (0, 1), got {self.delta}")
        if not (0 <= self.delta < 1):  # epsilon = inf: delta unused, but still a number
            raise ConfigError(f"delta must be in [0, 1) when epsilon = inf, got {self.delta}")
        if not (1 <= self.n_components <= self.n_features):
            raise ConfigError(
                f"n_components must be in [1, {self.n_features}], got {self.n_components}"
            )
        if len(self.feature_lower) != len(self.feature_upper):
            raise ConfigError("feature_lower and feature_upper must have the same length")
        if self.feature_lower and len(self.feature_lower) != self.n_features:
            raise ConfigError(
                f"bounds given for {len(self.feature_lower)} features, query has {self.n_features}"
            )
        for j, (lo, hi) in enumerate(zip(self.feature_lower, self.feature_upper, strict=True)):
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ConfigError(f"feature {j}: bounds must be finite with lower < upper")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ConfigError(f"clip_norm must be finite and > 0, got {self.clip_norm}")
        if not all(math.isfinite(label) for label in self.class_labels):
            raise ConfigError("class_labels must be finite numbers")
        if self.kind is QueryKind.PCA and self.class_labels:
            raise ConfigError("a PCA query takes no class_labels")
        if self.kind is QueryKind.DCA:
            if self.label_column is None:
                raise ConfigError("a DCA query needs label_column")
            if len(self.class_labels) < 2:
                raise ConfigError("a DCA query needs at least two public class labels")
            if len(set(self.class_labels)) != len(self.class_labels):
                raise ConfigError("class_labels must be distinct")
        if self.quorum < 1 or self.quorum > self.max_owners:
            raise ConfigError(f"quorum must be in [1, max_owners={self.max_owners}]")
        if self.deadline_seconds <= 0:
            raise ConfigError("deadline_seconds must be > 0")
        if self.max_records_per_owner < 1:
            raise ConfigError("max_records_per_owner must be >= 1")
        if not (8 <= self.frac_bits <= 48):
            raise ConfigError(f"frac_bits must be in [8, 48], got {self.frac_bits}")
        if any(not (w > 0 and math.isfinite(w)) for w in self.noise_weights):
            raise ConfigError("noise_weights must be positive and finite")

    @property
    def private(self) -> bool:
        """False only for the verification mode epsilon = inf (no noise at all)."""
        return math.isfinite(self.epsilon)

    @property
    def has_bounds(self) -> bool:
        return bool(self.feature_lower)

    @property
    def n_classes(self) -> int:
        return len(self.class_labels)


def spec_digest(spec: QuerySpec) -> str:
    """``sha256:<hex>`` over every public parameter of ``spec``, canonically encoded.

    What the analyst signs and what an owner's ledger keys a release by: two specs with
    the same digest describe the same release.
    """
    fields = dataclasses.asdict(spec)
    text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
