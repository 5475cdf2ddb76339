"""Gaussian calibration: from (epsilon, delta, L2 sensitivity) to sigma, and back.

Three calibrations are offered:

* **zcdp** (the default): the noise multiplier z whose zero-concentrated DP,
  rho = 1/(2 z^2), converts to the requested (epsilon, delta) with the best known
  conversion (Canonne, Kamath & Steinke 2020, Prop. 12; Asoodeh et al. 2021), as
  implemented by dp_accounting's RDP accountant. The discrete Gaussian fedpca samples
  satisfies rho-zCDP exactly like the continuous one, so this is a *proven* bound for
  the mechanism as implemented. The two below are exact or tail bounds for the
  *continuous* Gaussian and are kept as labelled options;
* **classic** (Dwork & Roth 2014, Thm A.1): ``sigma = Delta * sqrt(2 ln(1.25/delta)) / epsilon``,
  a tail-bound argument that is only valid for ``epsilon < 1``;
* **analytic** (Balle & Wang 2018, Thm 8): the exact condition for the Gaussian
  mechanism to be (epsilon, delta)-DP,

      delta(sigma) = Phi(Delta/(2 sigma) - epsilon sigma/Delta)
                     - e^epsilon Phi(-Delta/(2 sigma) - epsilon sigma/Delta) <= delta,

  solved for the smallest sigma. Valid for every epsilon > 0, and never larger than
  the classic sigma.

Scale invariance: delta(sigma) depends on sigma and Delta only through
``z = sigma / Delta`` (substitute and both arguments of Phi become functions of z), so
everything is solved for Delta = 1 and multiplied by Delta afterwards.

Numerics: for large epsilon the second term is ``e^epsilon`` times a tiny tail
probability and for small delta both terms are tiny and nearly equal, so delta is
evaluated in log space with ``scipy.special.log_ndtr``:
``log delta = log Phi(a) + log1p(-exp(epsilon + log Phi(b) - log Phi(a)))``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

# Loaded with the module (a quarter of a CPU-second): every role that plans a release
# calibrates with it, and loading it inside the first query put that time in the round.
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from scipy.optimize import brentq
from scipy.special import erfcx, log_ndtr

from fedpca.errors import CalibrationError
from fedpca.query import Calibration

__all__ = [
    "RDP_ORDERS",
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "calibrate_noise_multiplier",
    "calibrate_sigma",
    "classic_gaussian_sigma",
    "gaussian_epsilon",
    "zcdp_epsilon",
    "zcdp_noise_multiplier",
]

logger = logging.getLogger(__name__)

# brentq stops when the bracket is below xtol + rtol*|x|; rtol cannot go under
# 4 machine epsilons. The root is then within a few ulps, and a final ulp walk
# makes the returned sigma satisfy the inequality in floating point.
_RTOL = 4 * 2.220446049250313e-16
_MAX_ULP_STEPS = 64
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_LOG2 = math.log(2.0)


def _check_finite_params(epsilon: float, delta: float) -> None:
    if math.isnan(epsilon) or not 0 < epsilon < math.inf:
        raise CalibrationError(f"epsilon must be finite and > 0, got {epsilon!r}")
    if math.isnan(delta) or not 0 < delta < 1:
        raise CalibrationError(f"delta must be in (0, 1), got {delta!r}")


def _check_sensitivity(sensitivity: float) -> None:
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise CalibrationError(f"L2 sensitivity must be finite and > 0, got {sensitivity!r}")


def _log_delta(z: float, epsilon: float) -> float:
    """``log delta`` of the Gaussian mechanism with noise multiplier ``z`` at ``epsilon``.

    With ``a = 1/(2z) - epsilon z`` and ``b = a - 1/z``,
    ``delta = Phi(a) - e^eps Phi(b) = Phi(a) * (1 - exp(r))`` where
    ``r = eps + log Phi(b) - log Phi(a) < 0``.

    Computing r from three logs cancels catastrophically when delta << Phi(a)
    (small epsilon with tiny delta: both log Phi are about -100 while r is about
    -1e-6). Writing ``Phi(x) = erfcx(-x/sqrt 2) exp(-x^2/2) / 2`` and using
    ``(b^2 - a^2)/2 = epsilon`` (expand b = a - 1/z), the epsilon cancels exactly:
    ``r = log erfcx(-b/sqrt 2) - log erfcx(-a/sqrt 2)``, a difference of two smooth,
    well-conditioned terms. erfcx(-x/sqrt 2) grows like 2 exp(x^2/2) for x > 0, so
    that form is only used while it cannot overflow (a below 20); above, Phi(a) is
    1 to within 1e-88 and the direct form has nothing to cancel against.
    """
    a = 0.5 / z - epsilon * z
    b = a - 1.0 / z
    log_phi_a = float(log_ndtr(a))
    if a < 20.0:
        log_ratio = float(np.log(erfcx(-b * _INV_SQRT2)) - np.log(erfcx(-a * _INV_SQRT2)))
    else:
        log_ratio = epsilon + float(log_ndtr(b)) - log_phi_a
    # The divergence is strictly positive for finite z, so r < 0 mathematically; r >= 0
    # can only be rounding when delta is negligible even next to Phi(a) * 1e-16.
    if log_ratio >= 0.0:
        return -math.inf
    # log(1 - e^r): log1p(-exp(r)) is accurate for r < -log 2, log(-expm1(r)) above.
    if log_ratio > -_LOG2:
        return log_phi_a + math.log(-math.expm1(log_ratio))
    return log_phi_a + math.log1p(-math.exp(log_ratio))


def _root(function: Callable[[float], float], lo: float, hi: float, what: str) -> float:
    """brentq's root in [lo, hi]; its failures become a CalibrationError naming ``what``.

    brentq raises RuntimeError when it does not converge, which happens at absurd
    parameters (epsilon = 1e300 puts z near 1e-150, where 1/(2z) - epsilon z cancels
    catastrophically), and ValueError when an end point is not finite.
    """
    try:
        return float(brentq(function, lo, hi, xtol=1e-300, rtol=_RTOL, maxiter=500))
    except (RuntimeError, ValueError) as exc:
        raise CalibrationError(
            f"{what} cannot be computed ({exc}); the parameters are far outside any "
            "meaningful privacy guarantee"
        ) from None


def analytic_gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """Exact delta at which the Gaussian mechanism is (epsilon, delta)-DP (Balle & Wang, Thm 8).

    Parameters
    ----------
    sigma : float
        Noise standard deviation, ``> 0``.
    epsilon : float
        ``>= 0`` and finite.
    sensitivity : float
        L2 sensitivity, ``> 0``.

    Returns
    -------
    float
        ``Phi(Delta/(2 sigma) - eps sigma/Delta) - e^eps Phi(-Delta/(2 sigma) - eps sigma/Delta)``.
    """
    _check_sensitivity(sensitivity)
    if not (math.isfinite(sigma) and sigma > 0):
        raise CalibrationError(f"sigma must be finite and > 0, got {sigma!r}")
    if math.isnan(epsilon) or not 0 <= epsilon < math.inf:
        raise CalibrationError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    return math.exp(_log_delta(sigma / sensitivity, epsilon))


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Classic Gaussian calibration ``Delta * sqrt(2 ln(1.25/delta)) / epsilon``.

    Raises
    ------
    CalibrationError
        If ``epsilon >= 1`` (the tail bound behind the formula does not hold there;
        use the analytic calibration), or any parameter is out of range.
    """
    _check_finite_params(epsilon, delta)
    _check_sensitivity(sensitivity)
    if epsilon >= 1:
        raise CalibrationError(
            f"the classic Gaussian calibration is only valid for epsilon < 1, got epsilon="
            f"{epsilon!r}; use the analytic calibration instead, valid for every epsilon > 0 "
            "(calibration='analytic' in Python, --calibration analytic for a query on the "
            "command line, --mechanism analytic for fedpca dp calibrate)"
        )
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Smallest sigma making the Gaussian mechanism (epsilon, delta)-DP (Balle & Wang, Thm 8).

    Parameters
    ----------
    epsilon : float
        Finite, ``> 0``.
    delta : float
        In ``(0, 1)``.
    sensitivity : float
        L2 sensitivity, ``> 0``.

    Returns
    -------
    float
        sigma with ``analytic_gaussian_delta(sigma, epsilon, sensitivity) <= delta`` and
        equal to it up to a few ulps of sigma.

    Raises
    ------
    CalibrationError
        If a parameter is out of range, or the root cannot be found (an absurd
        epsilon such as 1e300).
    """
    _check_finite_params(epsilon, delta)
    _check_sensitivity(sensitivity)
    log_target = math.log(delta)

    def excess(z: float) -> float:
        return _log_delta(z, epsilon) - log_target

    # delta(z) falls monotonically from 1 (z -> 0) to 0 (z -> inf), so doubling and
    # halving from z = 1 brackets the unique root.
    # One of the two loops leaves its end at 1, the other moves it, so lo < hi.
    lo = hi = 1.0
    while excess(lo) <= 0:
        lo /= 2.0
    while excess(hi) > 0:
        hi *= 2.0
    z = _root(excess, lo, hi, f"the analytic calibration of epsilon={epsilon!r}, delta={delta!r}")
    for _ in range(_MAX_ULP_STEPS):
        if excess(z) <= 0:
            break
        z = math.nextafter(z, math.inf)
    else:  # pragma: no cover - brentq's bracket is a few ulps wide
        raise CalibrationError(
            f"analytic calibration did not converge for epsilon={epsilon!r}, delta={delta!r}"
        )
    return z * sensitivity


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon for which one Gaussian release with this ``z`` is (epsilon, delta)-DP.

    The inverse of the analytic calibration: ``gaussian_epsilon(analytic_gaussian_sigma(e, d), d)``
    is ``e`` up to root-finding precision. ``z = 0`` gives ``inf``.

    Raises
    ------
    CalibrationError
        If ``noise_multiplier < 0`` or delta is outside ``(0, 1)``.
    """
    if math.isnan(delta) or not 0 < delta < 1:
        raise CalibrationError(f"delta must be in (0, 1), got {delta!r}")
    z = noise_multiplier
    if not (math.isfinite(z) and z >= 0):
        raise CalibrationError(f"noise_multiplier must be finite and >= 0, got {z!r}")
    if z == 0:
        return math.inf
    log_target = math.log(delta)

    def excess(epsilon: float) -> float:
        return _log_delta(z, epsilon) - log_target

    # delta is decreasing in epsilon; if even epsilon = 0 meets the target, the release
    # is (0, delta)-DP.
    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2.0
    eps = _root(excess, 0.0, hi, f"epsilon of noise_multiplier={z!r} at delta={delta!r}")
    for _ in range(_MAX_ULP_STEPS):
        if excess(eps) <= 0:
            break
        eps = math.nextafter(eps, math.inf)
    return eps


RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *range(11, 64),
    *(64.0 * 2.0 ** (k / 8) for k in range(0, 113)),
)
"""Renyi orders alpha at which the zCDP curve rho * alpha is converted to (epsilon, delta):
dp_accounting's default grid below 64, then 8 orders per doubling up to 2^20, so that
small epsilons (whose best order is in the thousands) are not over-estimated. Any order
gives a valid bound; the conversion takes the best one."""


def zcdp_epsilon(noise_multiplier: float, delta: float) -> float:
    """epsilon at ``delta`` of a rho-zCDP release, rho = 1/(2 z^2) (the proven bound).

    The Renyi divergence of order alpha of a Gaussian release - continuous or discrete
    on the integer grid (Canonne, Kamath & Steinke 2020, Thm 14) - is at most
    alpha / (2 z^2); dp_accounting's RDP accountant converts that curve with
    epsilon = min over alpha of
    alpha rho + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1).
    ``z = 0`` gives ``inf``.

    Raises
    ------
    CalibrationError
        If ``noise_multiplier < 0`` or delta is outside ``(0, 1)``.
    """
    if math.isnan(delta) or not 0 < delta < 1:
        raise CalibrationError(f"delta must be in (0, 1), got {delta!r}")
    z = noise_multiplier
    if not (math.isfinite(z) and z >= 0):
        raise CalibrationError(f"noise_multiplier must be finite and >= 0, got {z!r}")
    if z == 0:
        return math.inf
    accountant = RdpAccountant(orders=list(RDP_ORDERS))
    accountant.compose(dp_event.GaussianDpEvent(z))
    return float(accountant.get_epsilon(delta))


_ROUNDING_STEPS = 64
"""ulps :func:`zcdp_noise_multiplier` may raise its closed-form z by to absorb rounding."""


def zcdp_noise_multiplier(epsilon: float, delta: float) -> float:
    """Smallest z with ``zcdp_epsilon(z, delta) <= epsilon`` (to float rounding).

    :func:`zcdp_epsilon` is the minimum over the orders alpha > 1.01 of
    ``alpha rho + c(alpha)``, ``c(alpha) = log(1 - 1/alpha) - log(delta alpha)/(alpha - 1)``,
    with rho = 1/(2 z^2). That minimum is at most epsilon exactly when one order has
    ``alpha rho + c(alpha) <= epsilon``, so the largest rho that fits is the maximum over
    the orders of ``(epsilon - c(alpha)) / alpha``: solved in one pass here, instead of a
    bisection that called the accountant ~45 times (0.2 s on every plan of a query, on
    the owner's path to its first ciphertext). The accountant itself then checks the
    result, which is raised by a few ulps if rounding left it a hair short.

    Raises
    ------
    CalibrationError
        If a parameter is out of range.
    """
    _check_finite_params(epsilon, delta)
    orders = np.array([alpha for alpha in RDP_ORDERS if alpha > 1.01])
    offsets = np.log1p(-1.0 / orders) - np.log(delta * orders) / (orders - 1.0)
    with np.errstate(over="ignore"):
        rho = float(np.max((epsilon - offsets) / orders))
    if not rho > 0:
        raise CalibrationError(f"no noise multiplier reaches epsilon={epsilon!r}")
    z = 1.0 / math.sqrt(2.0 * rho) if math.isfinite(rho) else 0.0
    if z > 1e12:
        raise CalibrationError(f"no noise multiplier reaches epsilon={epsilon!r}")
    if z < 1e-150:
        raise CalibrationError(
            f"epsilon={epsilon!r} at delta={delta!r} asks for almost no noise (z < 1e-150)"
        )
    for _ in range(_ROUNDING_STEPS):
        if zcdp_epsilon(z, delta) <= epsilon:
            return z
        z = math.nextafter(z, math.inf)
    raise CalibrationError(  # pragma: no cover - the closed form is within a few ulps
        f"calibrating epsilon={epsilon!r} at delta={delta!r} did not converge"
    )


def calibrate_noise_multiplier(
    epsilon: float, delta: float, calibration: Calibration | str = Calibration.ZCDP
) -> float:
    """Noise multiplier ``z = sigma / Delta`` of a single (epsilon, delta) Gaussian release.

    ``epsilon = inf`` returns ``0.0``: no noise, the NOT PRIVATE verification mode
    (whatever the calibration, since no calibration is involved).

    Raises
    ------
    CalibrationError
        If the parameters are out of range for the chosen calibration.
    """
    try:
        method = Calibration(calibration)
    except ValueError:
        choices = ", ".join(c.value for c in Calibration)
        raise CalibrationError(
            f"unknown calibration {calibration!r}; choose one of {choices}"
        ) from None
    if math.isinf(epsilon) and epsilon > 0:
        logger.warning("epsilon = inf: no noise will be added, the release is NOT PRIVATE")
        return 0.0
    if method is Calibration.CLASSIC:
        return classic_gaussian_sigma(epsilon, delta)
    if method is Calibration.ANALYTIC:
        return analytic_gaussian_sigma(epsilon, delta)
    return zcdp_noise_multiplier(epsilon, delta)


def calibrate_sigma(
    epsilon: float,
    delta: float,
    sensitivity: float,
    calibration: Calibration | str = Calibration.ZCDP,
) -> float:
    """sigma of a single (epsilon, delta) Gaussian release with this L2 sensitivity.

    See :func:`calibrate_noise_multiplier`; ``epsilon = inf`` gives ``0.0``.
    """
    _check_sensitivity(sensitivity)
    return calibrate_noise_multiplier(epsilon, delta, calibration) * sensitivity
