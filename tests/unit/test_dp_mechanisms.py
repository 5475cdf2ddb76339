"""Privacy parameters, Gaussian mechanisms and release records as frozen values."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from fedpca.dp.calibration import (
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    zcdp_noise_multiplier,
)
from fedpca.dp.mechanisms import GaussianMechanism, PrivacyEvent, PrivacyParams
from fedpca.errors import CalibrationError, ConfigError
from fedpca.query import Calibration


def event(**overrides: object) -> PrivacyEvent:
    fields: dict[str, object] = {
        "query_id": "q-1",
        "analyst": "alice",
        "noise_multiplier": 3.73,
        "epsilon": 1.0,
        "delta": 1e-5,
        "timestamp": 1_700_000_000.25,
    }
    fields.update(overrides)
    return PrivacyEvent(**fields)  # type: ignore[arg-type]


def test_values_are_frozen() -> None:
    for value in (PrivacyParams(1.0, 1e-5), GaussianMechanism(2.0, 1.0), event()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.epsilon = 2.0  # type: ignore[misc, union-attr]


@pytest.mark.parametrize(
    ("epsilon", "delta", "named"),
    [(0.0, 1e-5, "0.0"), (-2.0, 1e-5, "-2.0"), (math.nan, 1e-5, "nan"), (1.0, 0.0, "0.0"),
     (1.0, 1.5, "1.5"), (math.inf, 2.0, "2.0")],
)  # fmt: skip
def test_privacy_params_reject_bad_values_by_name(epsilon: float, delta: float, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        PrivacyParams(epsilon, delta)


def test_infinite_epsilon_is_the_non_private_mode() -> None:
    assert not PrivacyParams(math.inf, 0.0).private
    assert PrivacyParams(0.5, 1e-6).private


def test_gaussian_mechanism_noise_multiplier_and_validation() -> None:
    mechanism = GaussianMechanism(sigma=6.0, l2_sensitivity=2.0)
    assert mechanism.noise_multiplier == 3.0
    assert mechanism.private
    assert not GaussianMechanism(0.0, 1.0).private
    with pytest.raises(ConfigError, match=re.escape("-1.0")):
        GaussianMechanism(-1.0, 1.0)
    with pytest.raises(ConfigError, match=r"l2_sensitivity.*0\.0"):
        GaussianMechanism(1.0, 0.0)


def test_calibrated_mechanism_uses_the_chosen_calibration() -> None:
    params = PrivacyParams(0.5, 1e-6)
    default = GaussianMechanism.calibrated(params, math.sqrt(3))
    assert default.sigma == pytest.approx(zcdp_noise_multiplier(0.5, 1e-6) * math.sqrt(3))
    analytic = GaussianMechanism.calibrated(params, math.sqrt(3), Calibration.ANALYTIC)
    assert analytic.sigma == pytest.approx(analytic_gaussian_sigma(0.5, 1e-6, math.sqrt(3)))
    classic = GaussianMechanism.calibrated(params, 2.0, Calibration.CLASSIC)
    assert classic.sigma == pytest.approx(classic_gaussian_sigma(0.5, 1e-6, 2.0))
    with pytest.raises(CalibrationError, match="analytic"):
        GaussianMechanism.calibrated(PrivacyParams(2.0, 1e-6), 1.0, Calibration.CLASSIC)
    assert GaussianMechanism.calibrated(PrivacyParams(math.inf, 0.0), 1.0).sigma == 0.0


def test_scaling_keeps_the_noise_multiplier() -> None:
    mechanism = GaussianMechanism(3.0, 1.5)
    scaled = mechanism.scaled(2.0**32)
    assert scaled.sigma == 3.0 * 2.0**32
    assert scaled.noise_multiplier == mechanism.noise_multiplier


def test_event_round_trips_through_dict_and_json() -> None:
    original = event()
    assert PrivacyEvent.from_dict(original.to_dict()) == original
    text = original.to_json()
    assert json.loads(text)["noise_multiplier"] == 3.73
    assert PrivacyEvent.from_dict(json.loads(text)) == original


def test_non_private_event_round_trips_through_strict_json() -> None:
    original = event(noise_multiplier=0.0, epsilon=math.inf, delta=0.0)
    assert not original.private
    text = original.to_json()
    assert "Infinity" not in text and json.loads(text)["epsilon"] == "inf"
    assert PrivacyEvent.from_dict(json.loads(text)) == original
    assert PrivacyEvent.from_dict(original.to_dict()) == original


def test_event_default_timestamp_is_now() -> None:
    import time

    before = time.time()
    stamped = PrivacyEvent("q", "a", 2.0, 1.0, 1e-5)
    assert before <= stamped.timestamp <= time.time()


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier=0.0"),
        ({"epsilon": math.inf}, "epsilon=inf"),
        ({"noise_multiplier": -1.0}, "-1.0"),
        ({"noise_multiplier": math.inf, "epsilon": math.inf}, "inf"),
        ({"query_id": ""}, "query_id"),
        ({"analyst": ""}, "analyst"),
        ({"delta": 0.0}, "delta"),
        ({"timestamp": math.nan}, "timestamp"),
    ],
)
def test_inconsistent_events_are_refused(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        event(**overrides)


def test_malformed_records_are_refused_with_the_bad_key() -> None:
    record = event().to_dict()
    with pytest.raises(ConfigError, match="extra"):
        PrivacyEvent.from_dict({**record, "extra": 1})
    missing = dict(record)
    del missing["delta"]
    with pytest.raises(ConfigError, match="delta"):
        PrivacyEvent.from_dict(missing)
    with pytest.raises(ConfigError, match="epsilon"):
        PrivacyEvent.from_dict({**record, "epsilon": "lots"})
    with pytest.raises(ConfigError, match="epsilon"):
        PrivacyEvent.from_dict({**record, "epsilon": True})
