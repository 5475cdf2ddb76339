"""``fedpca analyst``: keys, private PCA/DCA queries and the privacy budget.

Commands::

    fedpca analyst keygen --out DIR [--bits 2048|3072] [--force]
    fedpca analyst pca --proxy ADDR --components K --epsilon E --delta D --features M \\
        --bounds LO:HI|LO:HI,…|none [--mode stats|masked] [...] --out result.json
    fedpca analyst dca ... --label-column C --classes -1,1 --out result.json
    fedpca analyst budget --proxy ADDR [--delta D] [--query-delta D]
    fedpca analyst list|status QUERY|fetch QUERY --out result.json|cancel QUERY
    fedpca analyst stats|histogram|linreg ...   (fedpca.analyst.aggregate_cli)

Connection settings may come from ``--config analyst.toml``
(:mod:`fedpca.analyst.config`); flags override it.

Refused or failed queries exit with a one-line message and no traceback: exit
code 3 when a privacy budget refused the release (the proxy's, or that of every owner
that declined it), 4 when one of the proxy's limits
refused it for now (nothing charged), 1 for every other error.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from fedpca.allocator import map_large_blocks
from fedpca.analyst import init as analyst_init
from fedpca.analyst import query_commands
from fedpca.analyst.cli_connection import connection_config, connection_options
from fedpca.analyst.cli_output import (
    dca_ridge_options,
    noise_sd_draws_option,
    result_out_option,
    written_or_fetchable,
)
from fedpca.analyst.config import AnalystConfig
from fedpca.analyst.interrupts import (
    INTERRUPTED_EXIT_CODE,
    TERMINATED_EXIT_CODE,
    Terminated,
    sigterm_interrupts,
)
from fedpca.analyst.keys import (
    DEFAULT_KEY_BITS,
    SUPPORTED_KEY_BITS,
    create_analyst_keys,
    refuse_to_overwrite,
)
from fedpca.analyst.owner_wait import OWNERS_CONNECT_SECONDS
from fedpca.analyst.release_summary import measure_component_noise, print_release_summary
from fedpca.budget_options import DELTA, budget_delta_options
from fedpca.column_options import COLUMNS
from fedpca.errors import BUDGET_REFUSALS, ConfigError, FedpcaError, OverloadError
from fedpca.query import Calibration, Neighbouring, ProtocolMode

__all__ = ["analyst_group"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

BUDGET_EXIT_CODE = 3
BUSY_EXIT_CODE = 4


class _Refused(click.ClickException):
    """A release refused by the privacy budget (distinct exit code for scripts)."""

    exit_code = BUDGET_EXIT_CODE


class _Busy(click.ClickException):
    """Refused for now by a proxy bound, nothing charged (distinct exit code: retry)."""

    exit_code = BUSY_EXIT_CODE


@contextmanager
def _errors() -> Iterator[None]:
    """Turn fedpca errors into one-line CLI errors (no traceback)."""
    try:
        yield
    except BUDGET_REFUSALS as exc:
        raise _Refused(str(exc)) from None
    except OverloadError as exc:
        raise _Busy(str(exc)) from None
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or ''}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------- keygen
@contextmanager
def _spinner(message: str) -> Iterator[None]:
    """A spinner with elapsed seconds on stderr while a slow step runs."""
    stream = sys.stderr
    if not stream.isatty():
        click.echo(f"{message} ...", err=True)
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def spin() -> None:
        for frame in itertools.cycle("|/-\\"):
            if done.wait(0.1):
                break
            stream.write(f"\r{frame} {message} {time.monotonic() - start:4.1f} s")
            stream.flush()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        stream.write(f"\r{message} done in {time.monotonic() - start:.1f} s\n")
        stream.flush()


class _AnalystGroup(click.Group):
    """Runs each command with SIGTERM handled like Ctrl-C (:mod:`fedpca.analyst.interrupts`):
    a query being waited for is cancelled and the decryption pool shut down, then the
    command exits 143 (130 for Ctrl-C, which click reported as "Aborted!", exit 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        with sigterm_interrupts():
            try:
                return super().invoke(ctx)
            except Terminated:
                click.echo("terminated (SIGTERM)", err=True)
                raise click.exceptions.Exit(TERMINATED_EXIT_CODE) from None
            except KeyboardInterrupt:
                click.echo("interrupted (Ctrl-C)", err=True)
                raise click.exceptions.Exit(INTERRUPTED_EXIT_CODE) from None


@click.group("analyst", cls=_AnalystGroup)
def analyst_group() -> None:
    """Analyst: keys, private PCA/DCA and aggregate queries, budget.

    \b
    Exit status: 0 done; 1 error; 2 usage error; 3 refused by the privacy
    budget (the proxy's, or every declining owner's); 4 refused for now by one
    of the proxy's limits (queries open or submitted today, calls in flight), or
    fewer owners connected than the quorum: nothing was charged, retry later;
    130 interrupted by Ctrl-C, 143 ended by SIGTERM (a query being waited for is
    cancelled).
    """
    # A process of its own (the estimators, as library code, leave a host process's
    # allocator alone): what decryption freed goes back to the system before the solve.
    map_large_blocks()


@analyst_group.command("keygen")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for analyst.key.json and analyst.signing.pem (both 0600) and analyst.pub.json.",
)
@click.option(
    "--bits",
    type=click.Choice([str(b) for b in SUPPORTED_KEY_BITS]),
    default=str(DEFAULT_KEY_BITS),
    show_default=True,
    help="Paillier modulus size (3072 = 128-bit security).",
)
@click.option(
    "--force", is_flag=True, help="Replace an existing key (old results become unreadable)."
)
def keygen_command(out: Path, bits: str, force: bool) -> None:
    """Generate the analyst's Paillier keypair and query-signing key.

    Owners pin both printed values: the Paillier fingerprint in
    policy.accepted_analyst_keys and the signing key in policy.accepted_query_signers.
    The fingerprint is printed last.
    """
    with _errors():
        refuse_to_overwrite(out, force=force)
    with _errors(), _spinner(f"generating a {bits}-bit Paillier key"):
        files = create_analyst_keys(out, int(bits), force=force)
    click.echo(f"private key (keep secret, 0600): {files.private_key}")
    click.echo(f"signing key (keep secret, 0600): {files.signing_key}")
    click.echo(f"public key (give to owners):     {files.public_key}")
    click.echo("query signer (owners pin it in policy.accepted_query_signers):")
    click.echo(files.signer)
    click.echo("fingerprint (owners pin it in policy.accepted_analyst_keys):")
    click.echo(files.fingerprint)


# ----------------------------------------------------------------- queries
def _parse_epsilon(_: click.Context, __: click.Parameter, value: str) -> float:
    try:
        epsilon = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number (or 'inf')") from None
    if not epsilon > 0:
        raise click.BadParameter("epsilon must be > 0 (or inf for NO privacy)")
    return epsilon


def _parse_classes(_: click.Context, __: click.Parameter, value: str | None) -> tuple[float, ...]:
    if value is None:
        return ()
    try:
        classes = tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None
    # A usage error, before keys or the network (a walkthrough's `--classes 1,1` exited 1).
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise click.BadParameter(f"{value!r}: name at least two different classes")
    if not all(math.isfinite(c) for c in classes):
        raise click.BadParameter(f"{value!r}: class labels must be finite numbers")
    return classes


COLLECTION_OPTIONS: list[Callable[[Any], Any]] = [
    click.option(
        "--quorum",
        type=click.IntRange(min=1),
        default=None,
        help="Owners that must contribute [every owner the proxy accepts]. A smaller "
        "quorum lets collection close before the others upload.",
    ),
    click.option(
        "--deadline",
        type=float,
        default=300.0,
        show_default=True,
        help="Seconds the proxy collects uploads.",
    ),
    click.option(
        "--wait-for-owners",
        is_flag=True,
        help="Submit even when fewer owners than the quorum are connected (the query waits "
        "for them until its deadline, stays charged if it fails after an upload began). "
        f"Without it the command waits {OWNERS_CONNECT_SECONDS:g} s for them, then refuses.",
    ),
    click.option(
        "--max-records-per-owner",
        type=click.IntRange(min=1),
        default=1 << 20,
        show_default=True,
        help="Public bound on the records each owner contributes; it sizes packed slots. "
        "An owner with more uses a random sample of this many (docs/privacy.md).",
    ),
    click.option(
        "--max-owners",
        type=click.IntRange(min=1),
        default=1 << 8,
        show_default=True,
        help="Public bound that sizes packed slots.",
    ),
    click.option(
        "--bounded-owner-tables",
        is_flag=True,
        help="Add/remove only: calibrate for owners that enforce their public capacity "
        "(data.enforce_max_records), so the noise covers one added record and no swap; "
        "other owners decline (docs/privacy.md).",
    ),
    click.option(
        "--key-dir",
        type=click.Path(exists=True, path_type=Path),
        help="Directory of analyst.key.json (or set key_dir in --config).",
    ),
]
"""Options every release command shares: quorum, deadline, the public bounds that size
the packed slots, and the analyst's key directory."""


def _query_options(function: F) -> F:
    options: list[Callable[[Any], Any]] = [
        click.option(
            "--components",
            "n_components",
            type=click.IntRange(min=1),
            required=True,
            help="Components to report (k, at most the features); `fetch ID "
            "--n-components K` takes another number from the same release, free.",
        ),
        click.option(
            "--epsilon",
            required=True,
            callback=_parse_epsilon,
            help="Privacy loss of this release ('inf' = no noise, NOT PRIVATE).",
        ),
        click.option(
            "--delta", type=DELTA, help="Privacy failure probability (required unless inf)."
        ),
        click.option(
            "--calibration",
            type=click.Choice([c.value for c in Calibration]),
            default=Calibration.ZCDP.value,
            show_default=True,
            help="zcdp: proven for the discrete Gaussian fedpca samples; analytic and "
            "classic: the continuous Gaussian's calibrations (docs/privacy.md).",
        ),
        click.option(
            "--neighbouring",
            type=click.Choice([n.value for n in Neighbouring]),
            default=None,
            help="The neighbouring relation (epsilon, delta) are stated for; it must be the "
            "deployment's. Default: the relation the proxy reports for the deployment "
            "(replace-one for pca --mode masked).",
        ),
        click.option(
            "--features",
            "n_features",
            type=click.IntRange(min=1),
            help="Number of feature columns M in the owners' files (label excluded); "
            "with --columns, their number (required without --columns).",
        ),
        click.option(
            "--columns",
            type=COLUMNS,
            help="The owners' file columns (0-based) that are the features, in order, "
            "e.g. 1,2,5; --bounds are then theirs, in this order [every column but the "
            "label].",
        ),
        click.option(
            "--bounds",
            required=True,
            help="Public feature bounds: LO:HI (every feature) or LO:HI,LO:HI,… (M); or "
            "none (raw units, each row clipped to --clip-norm: say so explicitly).",
        ),
        click.option(
            "--clip-norm",
            type=float,
            default=1.0,
            show_default=True,
            help="Each row, scaled by --bounds, is clipped to this L2 norm: it bounds one "
            "record's effect, so the noise (docs/privacy.md).",
        ),
        *COLLECTION_OPTIONS,
        click.option(
            "--sample",
            type=click.Path(dir_okay=False, exists=True, path_type=Path),
            help="Your own CSV sample to project in a plot.",
        ),
        click.option(
            "--workers", type=click.IntRange(min=1), help="Decryption processes [all cores]."
        ),
        result_out_option("result.json to write (plots go next to it)."),
        noise_sd_draws_option,
    ]
    for option in reversed(options):
        function = option(function)
    return connection_options(function)


def _warn_not_private() -> None:
    banner = "!" * 72
    click.secho(banner, fg="red", bold=True, err=True)
    click.secho(
        "  epsilon = inf: NO NOISE. This release is NOT PRIVATE.\n"
        "  Use it only to verify a deployment on test data.",
        fg="red",
        bold=True,
        err=True,
    )
    click.secho(banner, fg="red", bold=True, err=True)


def _run(
    estimator_factory: Callable[..., Any],
    params: dict[str, Any],
    sample_label_column: int | None,
) -> None:
    """Shared body of ``pca`` and ``dca``: fit, report, summarise."""
    from fedpca.analyst.querying import MissingOwnersWarning
    from fedpca.analyst.report import write_report
    from fedpca.tables import load_columns, load_table

    epsilon: float = params["epsilon"]
    delta: float | None = params["delta"]
    if math.isfinite(epsilon) and delta is None:
        raise click.UsageError("--delta is required with a finite --epsilon")
    if not math.isfinite(epsilon):
        _warn_not_private()
    out: Path = params["out"]
    if params["n_features"] is None and params["columns"] is None:
        raise click.UsageError("give --features M (or --columns naming the feature columns)")
    if params["bounds"].strip().lower() == "none":
        click.secho(
            "note: --bounds none: features are used in raw units and each row is clipped to "
            f"norm {params['clip_norm']:g}. Unless the owners' features already lie within "
            "about [-1, 1], clipping dominates and the components say little; give the "
            "public feature ranges with --bounds LO:HI or LO:HI,LO:HI,...",
            fg="yellow",
            err=True,
        )
    with _errors():
        connection = _estimator_connection(params)
        sample = labels = None
        if params["sample"] is not None and params["columns"] is not None:
            sample, labels = load_columns(params["sample"], params["columns"], sample_label_column)
        elif params["sample"] is not None:
            sample, labels = load_table(
                params["sample"],
                label_column=sample_label_column,
                n_features=params["n_features"],
            )
        estimator = estimator_factory(
            params["n_components"],
            bounds=params["bounds"],
            columns=params["columns"],
            clip_norm=params["clip_norm"],
            **_estimator_settings(params, connection, epsilon, delta),
        )
        with warnings.catch_warnings():
            # The summary below prints the warning in red; Python's copy would repeat it.
            warnings.simplefilter("ignore", MissingOwnersWarning)
            estimator.fit(params["n_features"])
        if sample is not None:
            # The sample is raw; the components live in the preprocessed space.
            sample = estimator.preprocess(sample)
        measure_component_noise(estimator, params["noise_sd_draws"])
        with written_or_fetchable(estimator.query_id_):
            files = write_report(out, estimator, sample=sample, labels=labels)
    print_release_summary(estimator, files)


def _params_connection(params: dict[str, Any], key_dir: Path | None = None) -> AnalystConfig:
    """:func:`_connection` from a command's parsed connection options."""
    return connection_config(
        params["config_path"],
        params["proxy"],
        params["ca"],
        params["cert"],
        params["key"],
        params["insecure"],
        params["server_name"],
        key_dir,
    )


def _estimator_connection(params: dict[str, Any]) -> AnalystConfig:
    """The proxy connection and analyst key directory a query command's options name."""
    connection = _params_connection(params, params["key_dir"])
    if connection.key_dir is None:
        raise ConfigError("no analyst key: pass --key-dir DIR or set key_dir in --config")
    return connection


def _estimator_settings(
    params: dict[str, Any], connection: AnalystConfig, epsilon: float, delta: float | None
) -> dict[str, Any]:
    """The estimator parameters every query command sets alike: privacy, collection
    (:data:`COLLECTION_OPTIONS`), the connection, workers and the progress display."""
    tls = connection.tls
    return {
        "epsilon": epsilon,
        "delta": delta if delta is not None else 0.0,
        "calibration": params["calibration"],
        "neighbouring": params["neighbouring"],
        "quorum": params["quorum"],
        "deadline_seconds": params["deadline"],
        "wait_for_owners": params["wait_for_owners"],
        "max_records_per_owner": params["max_records_per_owner"],
        "max_owners": params["max_owners"],
        "bounded_owner_tables": params["bounded_owner_tables"],
        "proxy": connection.proxy,
        "ca": None if tls is None else tls.ca_certificate,
        "cert": None if tls is None else tls.certificate,
        "key": None if tls is None else tls.private_key,
        "insecure": connection.insecure,
        "server_name_override": connection.server_name,
        "private_key_path": connection.key_dir,
        "n_jobs": params["workers"],
        "verbose": True,
        "on_status": _submission_announcer(),
    }


def _submission_announcer() -> Callable[[Any], None]:
    """A status callback that says once that the query was submitted, with its quorum.

    Declines are shown one line each by the estimator's progress display; a failure's
    reason ends the command as its error message.
    """
    announced: list[str] = []

    def on_status(status: Any) -> None:
        if not announced:
            announced.append(status.query_id)
            click.echo(
                f"query {status.query_id} submitted (quorum {status.quorum} of "
                f"{status.owners_registered} registered owners; Ctrl-C or SIGTERM cancels it)",
                err=True,
            )

    return on_status


@analyst_group.command("pca")
@click.option(
    "--mode",
    type=click.Choice([m.value for m in ProtocolMode]),
    default=ProtocolMode.STATS.value,
    show_default=True,
    help="stats: noisy sufficient statistics; masked: corrected Wang & Chang (no mean).",
)
@click.option(
    "--no-label",
    is_flag=True,
    help="The --sample CSV has no label column (default: label in column 0).",
)
@_query_options
def pca_command(mode: str, no_label: bool, **params: Any) -> None:
    """Run a differentially private federated PCA and write result.json and plots."""
    from fedpca.analyst.estimators import FederatedPCA

    def factory(n_components: int, **kwargs: Any) -> FederatedPCA:
        return FederatedPCA(n_components, mode=mode, **kwargs)

    _run(factory, params, None if no_label else 0)


@analyst_group.command("dca")
@click.option(
    "--label-column",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Column of the label in the owners' files (and in --sample).",
)
@click.option(
    "--classes",
    required=True,
    callback=_parse_classes,
    help="Public class labels, comma-separated (e.g. -1,1).",
)
@dca_ridge_options
@_query_options
def dca_command(
    label_column: int,
    classes: tuple[float, ...],
    rho: float | None,
    rho_prime: float | None,
    **params: Any,
) -> None:
    """Run a differentially private federated DCA and write result.json and plots."""
    from fedpca.analyst.estimators import FederatedDCA

    def factory(n_components: int, **kwargs: Any) -> FederatedDCA:
        return FederatedDCA(
            n_components,
            classes=classes,
            label_column=label_column,
            rho=rho,
            rho_prime=rho_prime,
            **kwargs,
        )

    _run(factory, params, label_column)


@analyst_group.command("budget")
@connection_options
@budget_delta_options("the proxy's")
def budget_command(
    proxy: str | None,
    config_path: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    server_name: str | None,
    insecure: bool,
    delta: float | None,
    query_delta: float | None,
) -> None:
    """Show the analyst's cumulative privacy loss as the proxy accounts it, and the
    largest epsilon its next query may ask for (found with the proxy's admission rule,
    for a query with the default zcdp calibration)."""
    from fedpca.analyst.client import AnalystClient
    from fedpca.transport.certs import TlsMaterial

    with _errors():
        connection = connection_config(config_path, proxy, ca, cert, key, insecure, server_name)
        assert connection.proxy is not None
        tls = None if connection.tls is None else TlsMaterial.load(connection.tls)
        with AnalystClient(
            connection.proxy,
            tls,
            insecure=connection.insecure,
            server_name_override=connection.server_name,
        ) as client:
            status = client.budget(delta, query_delta)
    limit_delta = status.limit_delta if status.limit_delta is not None else status.delta
    click.echo(f"analyst:            {status.analyst_id}")
    click.echo(f"releases:           {status.n_releases}")
    click.echo(f"budget:             epsilon {status.epsilon_limit:.6g} at delta {limit_delta:g}")
    click.echo(f"epsilon spent:      {status.epsilon_spent:.6g} at delta {status.delta:g}")
    if status.next_query is None:
        click.echo("next query:         not reported by this proxy (an older version)")
        return
    click.echo(f"next query:         {status.next_query.summary()}")
    for note in status.next_query.notes(status.epsilon_limit, limit_delta):
        click.echo(f"                    ({note})")
    # Found by an analyst's walkthrough: an epsilon every owner would decline was shown
    # as what the next query may ask for. The owners' caps are theirs, not the proxy's.
    if status.next_query.epsilon > 0:
        click.echo(f"                    ({OWNERS_CAP_NOTE})")


OWNERS_CAP_NOTE = (
    "what this proxy admits; each owner may cap a query lower "
    "(policy.max_epsilon_per_query) and declines one above its cap"
)


# `fedpca analyst list|status|fetch|cancel`: defined in their own module with the
# connection options above; `fedpca analyst init` writes an analyst folder.
query_commands.register(analyst_group, connection_options, _errors, _params_connection)
analyst_group.add_command(analyst_init.init_command)


# `stats`, `histogram` and `linreg` (aggregate queries) register themselves on import.
import fedpca.analyst.aggregate_cli  # noqa: E402, F401
