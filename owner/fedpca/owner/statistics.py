"""An owner's local sufficient statistics (scatter share, sum, count, class sums).

The rows must already be preprocessed (fedpca.preprocess): the per-record
sensitivity the proxy calibrates noise with assumes ‖x‖₂ <= clip_norm, so this
module re-checks the clip and refuses rows that violate it rather than
silently releasing under-noised statistics.
"""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from fedpca.errors import DataError
from fedpca.query import QueryKind, QuerySpec
from fedpca.stats import StatisticsSpec, SufficientStatistics

__all__ = ["local_statistics"]

logger = logging.getLogger(__name__)

# Relative slack on the clip check: clip_rows guarantees ‖x‖ <= c exactly, but
# rows clipped elsewhere (or a float32 round trip) may overshoot by rounding.
# The codec's fixed-point rounding is far coarser than this.
_CLIP_TOLERANCE = 1e-9


def _spec_of(spec_or_query: StatisticsSpec | QuerySpec) -> StatisticsSpec:
    if isinstance(spec_or_query, QuerySpec):
        return StatisticsSpec.from_query(spec_or_query)
    return spec_or_query


def _symmetric_gram(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    gram = x.T @ x
    # Mirror the upper triangle: only it is released, and an exactly symmetric
    # matrix keeps to_vector/from_vector an identity.
    upper = np.triu(gram)
    return upper + np.triu(gram, 1).T


def local_statistics(
    rows: npt.ArrayLike,
    labels: npt.ArrayLike | None,
    spec_or_query: StatisticsSpec | QuerySpec,
) -> SufficientStatistics:
    """Sufficient statistics of one owner's preprocessed records.

    Parameters
    ----------
    rows : (N, M) preprocessed records, every row with ‖x‖₂ <= clip_norm.
    labels : (N,) class labels (DCA; each must be one of the public
        ``class_labels``), or None for PCA (ignored if given).
    spec_or_query : the statistics spec, or the public query it is derived from.

    Returns
    -------
    SufficientStatistics with scatter R = XᵀX (M, M), sums v (M,), count N and,
    for DCA, class_sums (C, M) and class_counts (C,) in ``class_labels`` order.

    Raises
    ------
    DataError
        Wrong shape or feature count, non-finite values, a row longer than the
        clip norm, missing labels, or a label that is not a public class label
        (the message names the 1-based record).
    """
    spec = _spec_of(spec_or_query)
    x = np.asarray(rows, dtype=np.float64)
    if x.ndim != 2:
        raise DataError(f"expected a 2-D table of records, got shape {x.shape}")
    if x.shape[1] != spec.n_features:
        raise DataError(f"records have {x.shape[1]} features, the query has {spec.n_features}")
    if not np.isfinite(x).all():
        r = int(np.argwhere(~np.isfinite(x))[0][0])
        raise DataError(f"record {r + 1} (1-based) has a non-finite value")
    norms = np.linalg.norm(x, axis=1)
    too_long = np.flatnonzero(norms > spec.clip_norm * (1.0 + _CLIP_TOLERANCE))
    if too_long.size:
        raise DataError(
            f"record {too_long[0] + 1} (1-based) has norm above clip_norm={spec.clip_norm} "
            f"({too_long.size} such records); preprocess the rows before computing statistics"
        )
    scatter = _symmetric_gram(x)
    if spec.kind is QueryKind.PCA:
        logger.debug("computed PCA statistics over %d records, M=%d", len(x), x.shape[1])
        return SufficientStatistics(scatter, x.sum(axis=0), float(len(x)))

    if labels is None:
        raise DataError("a DCA query needs class labels for every record")
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if y.shape[0] != x.shape[0]:
        raise DataError(f"{x.shape[0]} records but {y.shape[0]} labels")
    known = np.isin(y, np.asarray(spec.class_labels))
    if not known.all():
        r = int(np.flatnonzero(~known)[0])
        raise DataError(
            f"record {r + 1} (1-based) has label {float(y[r])}, which is not one of the public "
            f"class labels {spec.class_labels}"
        )
    class_sums = np.zeros((spec.n_classes, spec.n_features))
    class_counts = np.zeros(spec.n_classes)
    for c, label in enumerate(spec.class_labels):
        members = y == label
        class_sums[c] = x[members].sum(axis=0)
        class_counts[c] = float(members.sum())
    logger.debug(
        "computed DCA statistics over %d records, M=%d, C=%d", len(x), x.shape[1], spec.n_classes
    )
    return SufficientStatistics.for_classes(scatter, class_sums, class_counts)
