"""The ``--out`` of the analyst commands that write a result (``pca``, ``dca``,
``stats``, ``histogram``, ``linreg``, ``fetch``).

A query is charged to the privacy budget when it is submitted and its result is
written only once it has been decrypted, so a path that cannot be written is refused
when the command line is read, before anything is sent: the folder must exist (it is
not created: a mistyped folder is more likely than a wanted new one), be a folder and
take a new file, and the path must not be a folder or a file that cannot be replaced.
Should the write still fail later (the folder removed meanwhile), the error says how
to write the stored result again with ``fetch``.

Also the options ``pca``, ``dca`` and ``fetch`` share for post-processing a PCA or
DCA release (free: nothing more is charged): the DCA ridges, and how many redraws of
the noise measure the components' noise sd.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from fedpca.errors import ConfigError

__all__ = [
    "dca_ridge_options",
    "noise_sd_draws_option",
    "output_problem",
    "result_out_option",
    "written_or_fetchable",
]

F = TypeVar("F", bound=Callable[..., Any])


def output_problem(path: Path) -> str | None:
    """Why a result could not be written to ``path`` now, or None."""
    folder = path.parent
    if not folder.exists():
        return f"the folder {folder} does not exist (create it first)"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if path.is_dir():
        return f"{path} is a folder; name the result file in it (e.g. {path / 'result.json'})"
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"{path} cannot be replaced (not writable)"
        if not path.is_file():
            return None  # a device such as /dev/stdout: nothing is created beside it
    try:
        # Creating a file is the sure test: os.access lets root pass where a read-only
        # or pseudo file system refuses, and the result (and plots) are created here.
        descriptor, probe = tempfile.mkstemp(dir=folder, prefix=".fedpca-out-", suffix=".tmp")
        os.close(descriptor)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot create files in {folder}: {exc.strerror or exc}"
    return None


def _check(_: click.Context, __: click.Parameter, value: Path | None) -> Path | None:
    if value is not None:
        problem = output_problem(value)
        if problem is not None:
            raise click.BadParameter(f"{problem}. Nothing was sent to the proxy")
    return value


def result_out_option(help_text: str) -> Callable[[F], F]:
    """The required ``--out`` option, checked when the command line is read."""
    return click.option(
        "--out",
        required=True,
        type=click.Path(dir_okay=False, path_type=Path),
        callback=_check,
        help=f"{help_text} Its folder must exist.",
    )


@contextmanager
def written_or_fetchable(query_id: str) -> Iterator[None]:
    """Turn a failure to write a query's result into an error that says the result is
    stored at the proxy and how to write it again."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(
            f"cannot write the result: {exc.filename or ''}: {exc.strerror or exc}. Query "
            f"{query_id} was answered and its result stays stored at the proxy (30 days by "
            f"default): write it with `fedpca analyst fetch {query_id} --out PATH`"
        ) from exc


def _finite_ridge(
    _: click.Context, parameter: click.Parameter, value: float | None
) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def dca_ridge_options(function: F) -> F:
    """``--rho`` and ``--rho-prime``: the ridges of Kung's DCA (default: derived from the
    noisy release, :func:`fedpca.analyst.solvers.dca_from_statistics`)."""
    function = click.option(
        "--rho-prime",
        type=click.FloatRange(min=0.0),
        callback=_finite_ridge,
        help="dca: ridge on the between-class scatter (default 0.1 x rho).",
    )(function)
    # rho > 0: the noisy S_W is projected onto the PSD cone, so without a ridge it is
    # singular (a walkthrough's --rho 0 was charged, then failed).
    return click.option(
        "--rho",
        type=click.FloatRange(min=0.0, min_open=True),
        callback=_finite_ridge,
        help="dca: ridge on the within-class scatter (default 0.02 x its largest "
        "eigenvalue); larger when the within-class scatter is singular.",
    )(function)


def _draws(_: click.Context, __: click.Parameter, value: int | None) -> int | None:
    # One draw has no spread; refused when the command line is read, not after the
    # decryption (a walkthrough's --noise-sd-draws 1 failed 1.5 s in).
    if value == 1:
        raise click.BadParameter("0 (skip) or at least 2: one draw has no spread")
    return value


def noise_sd_draws_option(function: F) -> F:
    """``--noise-sd-draws``: redraws of the noise for the components' noise sd and
    bound (:mod:`fedpca.analyst.component_noise`); None: the automatic number."""
    return click.option(
        "--noise-sd-draws",
        type=click.IntRange(min=0),
        callback=_draws,
        help="pca/dca: redraws of the noise that measure how far it moves each component "
        "and its value, and for pca the explained variances' noise bound (free; 0 skips "
        "it, else at least 2) [200 up to about 170 features, fewer above, at least 30: "
        "each is one eigendecomposition, for pca with the bound one more of every "
        "eigenvalue].",
    )(function)
