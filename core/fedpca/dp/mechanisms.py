"""Privacy parameters, the Gaussian mechanism and release records as frozen values.

These are plain data: calibration (:mod:`fedpca.dp.calibration`) turns privacy
parameters into a mechanism, accounting (:mod:`fedpca.dp.accounting`) composes
release records, and the ledgers other roles keep store :class:`PrivacyEvent`
through :meth:`PrivacyEvent.to_dict` / :meth:`PrivacyEvent.to_json`.

The one number accounting needs from a Gaussian release is its *noise multiplier*
``z = sigma / l2_sensitivity``: two Gaussian mechanisms with the same ``z`` have the
same privacy loss distribution whatever their scale, which is why the noise of a
release can be expressed in real units, in fixed-point integer units, or split
across sections (:mod:`fedpca.dp.allocation`) without changing its accounting.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fedpca.errors import ConfigError
from fedpca.query import Calibration, Neighbouring

__all__ = ["GaussianMechanism", "PrivacyEvent", "PrivacyParams"]


def _check_epsilon_delta(epsilon: float, delta: float, what: str) -> None:
    # epsilon = inf is the explicit "no noise, NOT PRIVATE" verification mode; any
    # delta is then meaningless, so only its range is checked.
    if math.isnan(epsilon) or not epsilon > 0:
        raise ConfigError(f"{what}: epsilon must be > 0 (or inf for no noise), got {epsilon!r}")
    if math.isinf(epsilon):
        if not 0 <= delta <= 1:
            raise ConfigError(f"{what}: delta must be in [0, 1], got {delta!r}")
    elif not 0 < delta < 1:
        raise ConfigError(f"{what}: delta must be in (0, 1), got {delta!r}")


@dataclass(frozen=True)
class PrivacyParams:
    """An (epsilon, delta) pair: the target of one release or a total budget.

    Attributes
    ----------
    epsilon : float
        ``> 0``; ``math.inf`` means no privacy at all (verification runs, or an
        unlimited budget).
    delta : float
        In ``(0, 1)`` for finite epsilon; any value in ``[0, 1]`` when epsilon is inf.

    Raises
    ------
    ConfigError
        If either value is out of range (the message names it).
    """

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        _check_epsilon_delta(self.epsilon, self.delta, "PrivacyParams")

    @property
    def private(self) -> bool:
        """False only for ``epsilon = inf``."""
        return math.isfinite(self.epsilon)


@dataclass(frozen=True)
class GaussianMechanism:
    """Additive Gaussian noise of standard deviation ``sigma`` per coordinate.

    Attributes
    ----------
    sigma : float
        Noise standard deviation, ``>= 0``. ``0`` is the non-private verification mode.
    l2_sensitivity : float
        L2 sensitivity of the released vector under the adjacency relation in force,
        in the same units as ``sigma``; finite and ``> 0``.
    """

    sigma: float
    l2_sensitivity: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ConfigError(f"sigma must be finite and >= 0, got {self.sigma!r}")
        if not (math.isfinite(self.l2_sensitivity) and self.l2_sensitivity > 0):
            raise ConfigError(f"l2_sensitivity must be finite and > 0, got {self.l2_sensitivity!r}")

    @property
    def noise_multiplier(self) -> float:
        """``z = sigma / l2_sensitivity``, the only quantity accounting depends on."""
        return self.sigma / self.l2_sensitivity

    @property
    def private(self) -> bool:
        return self.sigma > 0

    @classmethod
    def calibrated(
        cls,
        params: PrivacyParams,
        l2_sensitivity: float,
        calibration: Calibration = Calibration.ZCDP,
    ) -> GaussianMechanism:
        """The mechanism with the smallest sigma meeting ``params`` for this sensitivity.

        ``params.epsilon = inf`` gives ``sigma = 0`` (NOT PRIVATE).

        Raises
        ------
        CalibrationError
            If the calibration is not valid for ``params`` (e.g. classic with epsilon >= 1).
        """
        from fedpca.dp.calibration import calibrate_noise_multiplier

        z = calibrate_noise_multiplier(params.epsilon, params.delta, calibration)
        return cls(sigma=z * l2_sensitivity, l2_sensitivity=l2_sensitivity)

    def scaled(self, factor: float) -> GaussianMechanism:
        """The same mechanism in other units (e.g. ``2**frac_bits``): same noise multiplier."""
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"scale factor must be finite and > 0, got {factor!r}")
        return GaussianMechanism(self.sigma * factor, self.l2_sensitivity * factor)


def _float_from_record(name: str, value: Any) -> float:
    # Ledgers written through JSON carry inf as the string "inf" (strict JSON has no
    # infinity); SQLite REAL columns carry it as a float.
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"PrivacyEvent field {name!r} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"PrivacyEvent field {name!r} is not a number: {value!r}") from None


@dataclass(frozen=True)
class PrivacyEvent:
    """One release charged to a privacy budget: the record a ledger stores.

    Attributes
    ----------
    query_id : str
        The query whose result was released.
    analyst : str
        Who received it (the budget is per analyst and per data owner).
    noise_multiplier : float
        ``z``: the release's noise, per section, divided by the largest change one
        neighbouring pair (under ``neighbouring``) makes to it (docs/privacy.md,
        "Sensitivities"); ``0`` for the NOT PRIVATE verification mode. Accounting
        needs nothing else from a Gaussian release.
    epsilon, delta : float
        The per-release target the noise was calibrated for (informative: budgets
        are checked by composing noise multipliers, not by adding epsilons).
    neighbouring : Neighbouring
        The relation z was computed under; a ledger composes only events of its own
        deployment's relation.
    sensitivity : float
        The release's L2 sensitivity under ``neighbouring``, in the units of its
        noise's standard deviation ``sigma = z * sensitivity`` (the first section's
        sigma; the default split gives every section the same sigma at clip norm 1).
    delta_extra : float
        delta spent outside the Gaussian part (the masked mode's statistical mask,
        M 2^-40); composition adds these terms linearly.
    timestamp : float
        POSIX seconds (UTC) of the release; defaults to now.

    Raises
    ------
    ConfigError
        If a field is out of range, or ``noise_multiplier = 0`` and ``epsilon`` is
        finite (or vice versa): a noiseless release always costs an infinite budget.
    """

    query_id: str
    analyst: str
    noise_multiplier: float
    epsilon: float
    delta: float
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    sensitivity: float = 1.0
    delta_extra: float = 0.0
    timestamp: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not self.query_id:
            raise ConfigError("PrivacyEvent: query_id must be non-empty")
        if not self.analyst:
            raise ConfigError("PrivacyEvent: analyst must be non-empty")
        try:
            object.__setattr__(self, "neighbouring", Neighbouring(self.neighbouring))
        except ValueError:
            raise ConfigError(
                f"PrivacyEvent: unknown neighbouring relation {self.neighbouring!r}"
            ) from None
        z = self.noise_multiplier
        if not (math.isfinite(z) and z >= 0):
            raise ConfigError(f"PrivacyEvent: noise_multiplier must be finite and >= 0, got {z!r}")
        _check_epsilon_delta(self.epsilon, self.delta, "PrivacyEvent")
        if (z == 0) != math.isinf(self.epsilon):
            raise ConfigError(
                "PrivacyEvent: noise_multiplier = 0 (no noise) goes with epsilon = inf and only "
                f"then; got noise_multiplier={z!r}, epsilon={self.epsilon!r}"
            )
        if not (math.isfinite(self.sensitivity) and self.sensitivity > 0):
            raise ConfigError(
                f"PrivacyEvent: sensitivity must be finite and > 0, got {self.sensitivity!r}"
            )
        if not (math.isfinite(self.delta_extra) and 0 <= self.delta_extra < 1):
            raise ConfigError(
                f"PrivacyEvent: delta_extra must be in [0, 1), got {self.delta_extra!r}"
            )
        if not math.isfinite(self.timestamp):
            raise ConfigError(f"PrivacyEvent: timestamp must be finite, got {self.timestamp!r}")

    @property
    def private(self) -> bool:
        return self.noise_multiplier > 0

    @property
    def params(self) -> PrivacyParams:
        return PrivacyParams(self.epsilon, self.delta)

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value, floats kept as floats (``inf`` included)."""
        record = asdict(self)
        record["neighbouring"] = self.neighbouring.value
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> PrivacyEvent:
        """Inverse of :meth:`to_dict`; also accepts ``"inf"`` strings from JSON.

        Raises
        ------
        ConfigError
            On missing or unknown keys, or values of the wrong type.
        """
        required = {"query_id", "analyst", "noise_multiplier", "epsilon", "delta", "timestamp"}
        optional = {"neighbouring", "sensitivity", "delta_extra"}
        missing = required - record.keys()
        unknown = record.keys() - required - optional
        if missing or unknown:
            raise ConfigError(
                f"PrivacyEvent record: missing keys {sorted(missing)}, "
                f"unknown keys {sorted(unknown)}"
            )
        for name in ("query_id", "analyst"):
            if not isinstance(record[name], str):
                raise ConfigError(f"PrivacyEvent field {name!r} must be a string")
        extra: dict[str, Any] = {}
        if "neighbouring" in record:
            if not isinstance(record["neighbouring"], str):
                raise ConfigError("PrivacyEvent field 'neighbouring' must be a string")
            extra["neighbouring"] = record["neighbouring"]
        for name in ("sensitivity", "delta_extra"):
            if name in record:
                extra[name] = _float_from_record(name, record[name])
        return cls(
            query_id=record["query_id"],
            analyst=record["analyst"],
            noise_multiplier=_float_from_record("noise_multiplier", record["noise_multiplier"]),
            epsilon=_float_from_record("epsilon", record["epsilon"]),
            delta=_float_from_record("delta", record["delta"]),
            timestamp=_float_from_record("timestamp", record["timestamp"]),
            **extra,
        )

    def to_strict_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` for strict JSON (no ``Infinity`` token): an infinite epsilon
        is written as ``"inf"``, which :meth:`from_dict` reads back."""
        record = self.to_dict()
        if math.isinf(self.epsilon):
            record["epsilon"] = "inf"
        return record

    def to_json(self) -> str:
        """Strict JSON of :meth:`to_strict_dict`, keys sorted."""
        return json.dumps(self.to_strict_dict(), allow_nan=False, sort_keys=True)
