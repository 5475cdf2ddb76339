"""fedpca analyst role: keys, query client, decryption, PCA/DCA, estimators, reports.

The public names are re-exported lazily (PEP 562) so that ``fedpca analyst --help``
and ``keygen`` do not pay for importing grpc, scipy and matplotlib.

* :class:`FederatedPCA`, :class:`FederatedDCA` - scikit-learn-shaped estimators.
* :class:`FederatedStatistics`, :class:`FederatedHistogram`,
  :class:`FederatedLinearRegression` - private aggregates, several in one release with
  :class:`FederatedQuery`.
* :class:`AnalystClient` - the gRPC client of the proxy's AnalystService.
* :func:`decrypt_result`, :class:`DecodedRelease` - from ciphertexts to noisy statistics.
* :func:`create_analyst_keys`, :func:`load_analyst_private_key` - the analyst's keypair.
* :func:`write_report` - result.json and plots of PCA/DCA;
  :func:`write_aggregate_result` - result.json of aggregates.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .aggregate_estimators import FederatedQuery
    from .aggregate_report import write_aggregate_result
    from .client import AnalystClient, FetchedResult
    from .decode import DecodedRelease, decrypt_result, result_from_packed
    from .estimators import FederatedDCA, FederatedPCA
    from .keys import create_analyst_keys, load_analyst_private_key, load_analyst_public_key
    from .querying import MissingOwnersWarning, run_query
    from .regression import FederatedLinearRegression
    from .report import write_report
    from .statistics import FederatedHistogram, FederatedStatistics

_EXPORTS = {
    "fedpca.analyst.client": ("AnalystClient", "FetchedResult"),
    "fedpca.analyst.decode": ("DecodedRelease", "decrypt_result", "result_from_packed"),
    "fedpca.analyst.estimators": ("FederatedDCA", "FederatedPCA"),
    "fedpca.analyst.querying": ("MissingOwnersWarning", "run_query"),
    "fedpca.analyst.aggregate_estimators": ("FederatedQuery",),
    "fedpca.analyst.aggregate_report": ("write_aggregate_result",),
    "fedpca.analyst.statistics": ("FederatedHistogram", "FederatedStatistics"),
    "fedpca.analyst.regression": ("FederatedLinearRegression",),
    "fedpca.analyst.keys": (
        "create_analyst_keys",
        "load_analyst_private_key",
        "load_analyst_public_key",
    ),
    "fedpca.analyst.report": ("write_report",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "AnalystClient",
    "DecodedRelease",
    "FederatedDCA",
    "FederatedHistogram",
    "FederatedLinearRegression",
    "FederatedPCA",
    "FederatedQuery",
    "FederatedStatistics",
    "FetchedResult",
    "MissingOwnersWarning",
    "create_analyst_keys",
    "decrypt_result",
    "load_analyst_private_key",
    "load_analyst_public_key",
    "result_from_packed",
    "run_query",
    "write_aggregate_result",
    "write_report",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
