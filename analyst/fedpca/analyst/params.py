"""scikit-learn's parameter conventions for the analyst's estimators.

Constructor arguments are stored as given; ``get_params``/``set_params`` read and write
them by the names of ``__init__``'s parameters, and the repr shows those that differ
from their defaults. Written out here rather than inheriting ``sklearn.base.BaseEstimator``
because scikit-learn is not a runtime dependency of fedpca.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Self

from fedpca.errors import ConfigError, FedpcaError

__all__ = ["NotFittedError", "SklearnParams", "check_number", "differs", "required_epsilon"]


class NotFittedError(FedpcaError, ValueError, AttributeError):
    """An estimator was used before ``fit`` (same bases as scikit-learn's)."""


class SklearnParams:
    """``get_params``, ``set_params`` and ``__repr__`` over ``__init__``'s parameters, and
    the hook that checks post-processing parameters before a query is submitted."""

    def check_post_processing(self) -> None:
        """Refuse post-processing parameters that cannot work, before anything is
        submitted (and charged); the estimators that have such parameters check them."""

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

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's tags, for its helpers (``check_is_fitted``, ``clone``) when it
        is installed; called only by scikit-learn (1.6 and later ask every estimator for
        them: ``check_is_fitted`` raised AttributeError without them, found by an
        analyst's walkthrough). ``fit`` takes a schema, not data (no input validation),
        and its results are noisy (non-deterministic)."""
        from sklearn.utils import Tags, TargetTags

        return Tags(
            estimator_type=None,
            target_tags=TargetTags(required=False),
            no_validation=True,
            non_deterministic=True,
        )

    def __repr__(self) -> str:
        signature = inspect.signature(type(self).__init__)
        changed = [
            f"{name}={getattr(self, name)!r}"
            for name, parameter in signature.parameters.items()
            if name != "self" and differs(getattr(self, name), parameter.default)
        ]
        return f"{type(self).__name__}({', '.join(changed)})"


def differs(value: Any, default: Any) -> bool:
    """Whether a parameter's ``value`` is not ``default`` (arrays always differ)."""
    try:
        return bool(value != default)
    except ValueError:  # numpy arrays compare elementwise
        return True


def check_number(
    value: Any, name: str, *, low: float, high: float | None = None, low_open: bool = True
) -> float:
    """``value`` as a finite float above ``low`` (or at it, unless ``low_open``) and below
    ``high``: what an estimator's post-processing parameter must be, checked before
    anything is submitted (numpy scalars welcome, booleans and text not).

    Raises
    ------
    ConfigError
    """
    number = None
    if not isinstance(value, bool | str):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
    inside = number is not None and math.isfinite(number)
    if inside and number is not None:
        inside = (number > low if low_open else number >= low) and (high is None or number < high)
    if not inside or number is None:
        side = "(" if low_open else "["
        span = f"{side}{low:g}, {high:g})" if high is not None else f"{side}{low:g}, inf)"
        raise ConfigError(f"{name} must be a finite number in {span}, got {value!r}")
    return number


def required_epsilon(epsilon: Any) -> float:
    """The estimator's ``epsilon`` as a float, refused when not given.

    It defaulted to 1: an estimator built without it spent 1 of the analyst's budget
    unasked, where the CLI requires ``--epsilon`` (a new analyst's walkthrough).

    Raises
    ------
    ConfigError
    """
    if epsilon is None:
        raise ConfigError(
            "epsilon is required: the privacy cost of the release, charged to your budget "
            "(epsilon=float('inf') releases without noise, NOT PRIVATE, to verify a deployment)"
        )
    return float(epsilon)
