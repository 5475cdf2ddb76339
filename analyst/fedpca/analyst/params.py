"""scikit-learn's parameter conventions for the analyst's estimators.

Constructor arguments are stored as given; ``get_params``/``set_params`` read and write
them by the names of ``__init__``'s parameters, and the repr shows those that differ
from their defaults. Written out here rather than inheriting ``sklearn.base.BaseEstimator``
because scikit-learn is not a runtime dependency of fedpca.
"""

from __future__ import annotations

import inspect
from typing import Any, Self

from fedpca.errors import ConfigError, FedpcaError

__all__ = ["NotFittedError", "SklearnParams"]


class NotFittedError(FedpcaError, ValueError, AttributeError):
    """An estimator was used before ``fit`` (same bases as scikit-learn's)."""


class SklearnParams:
    """``get_params``, ``set_params`` and ``__repr__`` over ``__init__``'s parameters."""

    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return [name for name in signature.parameters if name != "self"]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Constructor parameters (scikit-learn convention; ``deep`` is accepted)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> Self:
        """Set constructor parameters (scikit-learn convention)."""
        valid = set(self._param_names())
        for name, value in params.items():
            if name not in valid:
                raise ConfigError(f"{type(self).__name__} has no parameter {name!r}")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        signature = inspect.signature(type(self).__init__)
        changed = [
            f"{name}={getattr(self, name)!r}"
            for name, parameter in signature.parameters.items()
            if name != "self" and _differs(getattr(self, name), parameter.default)
        ]
        return f"{type(self).__name__}({', '.join(changed)})"


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except ValueError:  # numpy arrays compare elementwise
        return True
