"""``fedpca analyst list|status|fetch|cancel``: the analyst's queries by id; and
``fedpca analyst deployment``: the deployment's public facts (owners connected).

An analyst sees only its own queries (the proxy scopes query ids by analyst). A
query's result stays stored at the proxy once it is DONE (for the proxy's
``keep_results_days``, 30 by default), so ``fetch`` can download
and decrypt it again, e.g. after the command that submitted it was interrupted during
decryption; ``cancel`` stops a query that is still collecting uploads (its charge is
refunded if no owner had begun an upload).

The commands are defined by :func:`register`, which ``fedpca.analyst.cli`` calls with
its connection options, so that both share one definition of how to reach the proxy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from fedpca.analyst.cli_output import dca_ridge_options, noise_sd_draws_option, result_out_option
from fedpca.analyst.owner_terms_view import owner_terms_lines
from fedpca.errors import ConfigError, QueryStateError
from fedpca.formatting import printable, shortened
from fedpca.messages import (
    CANCELLED_REASON,
    Charge,
    DeploymentInfo,
    QueryState,
    QueryStatus,
    QuerySummary,
)
from fedpca.query import AggregateKind, QueryKind

__all__ = ["register"]


def _status_lines(status: QueryStatus, summary: QuerySummary | None = None) -> list[str]:
    registered = status.owners_registered or "?"
    lines = [f"query:       {status.query_id}"]
    if summary is not None:
        privacy = (
            "NOT PRIVATE (epsilon = inf)"
            if math.isinf(summary.epsilon)
            else f"epsilon {summary.epsilon:g}, delta {summary.delta:g}"
        )
        created = summary.created_at.strftime("%Y-%m-%d %H:%M:%S UTC")
        lines += [
            f"kind:        {kind_cell(summary)}",
            f"privacy:     {privacy}",
            f"created:     {created}",
        ]
    lines += [
        f"state:       {status.state.value}",
        f"owners:      {status.owners_contributed} contributed, {status.owners_uploading} "
        f"uploading, {status.owners_declined} declined; quorum {status.quorum} of "
        f"{registered} registered",
    ]
    if status.deadline is not None:
        lines.append(f"deadline:    {status.deadline.isoformat(timespec='seconds')}")
    lines.extend(f"declined:    {decline.line()}" for decline in status.declines)
    if status.failure_reason:
        lines.append(f"failed:      {status.failure_reason}")
    if status.result_deleted_at is not None:
        lines.append(
            f"result:      deleted by the proxy on "
            f"{status.result_deleted_at.isoformat(timespec='seconds')}, older than it keeps "
            "results: it can no longer be fetched"
        )
    lines.append(f"charge:      {status.charge.describe(status.state)}")
    return lines


def _deployment_lines(info: DeploymentInfo) -> list[str]:
    absent = info.absent_owners_note()
    return [
        f"proxy:            {printable(info.proxy_id)} (fedpca "
        f"{printable(info.software_version)}, protocol {info.protocol_version})",
        f"owners:           {info.owners_connected} of {info.owners_registered} registered "
        "connected now" + (f" ({absent})" if absent else ""),
        f"neighbouring:     {info.neighbouring.value}",
        f"accountant:       {printable(info.accountant)}",
        f"delta per query:  at most {info.max_delta_per_query:g}",
        f"budget:           epsilon {info.budget_epsilon:g} at delta {info.budget_delta:g} "
        f"(analyst {printable(info.analyst_id)}; `fedpca analyst budget` shows the spend)",
        f"proxy clock:      {info.server_time.isoformat(timespec='seconds')}",
    ]


LIST_REASON_CHARACTERS = 100
"""A failure reason in ``analyst list`` is cut to this length (every owner's decline can
make it several hundred characters); ``analyst status ID`` prints it whole."""


def kind_cell(item: QuerySummary) -> str:
    """The KIND/MODE column of ``fedpca analyst list``: ``pca/masked``, ``dca/stats``;
    an aggregate query only as ``aggregate:stats+histogram``, since it has one mode (it
    read ``aggregate:stats/stats``)."""
    return item.what if item.aggregates else f"{item.what}/{item.mode.value}"


def _charge_cell(charge: Charge) -> str:
    """The CHARGE column of ``fedpca analyst list``: one word ("?" from an older proxy)."""
    return "?" if charge is Charge.UNKNOWN else charge.value


def _write_aggregates(
    release: Any,
    registered: int,
    timings: dict[str, float],
    out: Path,
    post_processing: dict[str, Any],
) -> None:
    """result.json of a fetched aggregate release, as the command that asked for it
    writes it (its post-processing options given again), and the summary of every
    aggregate, as that command prints it."""
    import warnings

    from fedpca.analyst.aggregate_report import fitted_from_release, write_aggregate_result
    from fedpca.analyst.aggregate_summary import echo_aggregates
    from fedpca.analyst.querying import MissingOwnersWarning
    from fedpca.analyst.release_summary import print_owners

    with warnings.catch_warnings():
        # print_owners prints the warning in red; Python's copy would repeat it.
        warnings.simplefilter("ignore", MissingOwnersWarning)
        fitted = fitted_from_release(
            release,
            owners_registered=registered,
            timings=timings,
            post_processing=post_processing,
        )
    path = write_aggregate_result(out, fitted)
    click.echo(f"query:       {fitted.query_id_}")
    print_owners(fitted)
    echo_aggregates(fitted)
    if fitted.not_private_:
        click.secho("release: NOT PRIVATE (epsilon = inf)", fg="red", bold=True)
    else:
        click.echo(f"release: ({fitted.epsilon_:g}, {fitted.delta_:g})-DP")
    click.echo(str(path))


def register(
    group: click.Group,
    connection_options: Callable[[Any], Any],
    errors: Callable[[], Any],
    connection: Callable[..., Any],
) -> None:
    """Add ``list``, ``deployment``, ``status``, ``fetch`` and ``cancel`` to the analyst
    ``group``.

    Parameters
    ----------
    group : the ``fedpca analyst`` group.
    connection_options : decorator adding --proxy/--config/--ca/--cert/--key/... .
    errors : context manager turning fedpca errors into one-line CLI errors.
    connection : ``connection(params, key_dir)`` merges --config and a command's
        parsed connection flags into an :class:`~fedpca.analyst.config.AnalystConfig`.
    """

    @contextmanager
    def client(params: dict[str, Any], key_dir: Path | None = None) -> Iterator[Any]:
        """An open AnalystClient and the analyst's key folder (flag, else config)."""
        from fedpca.analyst.client import AnalystClient
        from fedpca.transport.certs import TlsMaterial

        merged = connection(params, key_dir)
        tls = None if merged.tls is None else TlsMaterial.load(merged.tls)
        with AnalystClient(
            merged.proxy,
            tls,
            insecure=merged.insecure,
            server_name_override=merged.server_name,
        ) as opened:
            yield opened, merged.key_dir

    @group.command("list")
    @connection_options
    @click.option(
        "--limit",
        type=click.IntRange(min=1, max=1000),
        default=50,
        show_default=True,
        help="List at most this many queries, newest first.",
    )
    def list_command(limit: int, **params: Any) -> None:
        """List your queries at the proxy, newest first.

        REASON is cut at 100 characters (`status ID` prints it whole). CHARGE says where
        each query's epsilon stands on your ledger: charged,
        refunded (it failed before any owner began an upload), or reserved (still
        open: refunded if it fails before any owner begins an upload)."""
        with errors(), client(params) as (opened, _):
            queries = opened.list_queries(limit)
        if not queries:
            click.echo("no queries")
            return
        header = ("QUERY", "CREATED (UTC)", "KIND/MODE", "STATE", "OWNERS", "EPSILON", "CHARGE")
        rows = [(*header, "REASON")]
        for item in queries:
            status = item.status
            registered = status.owners_registered or "?"
            rows.append(
                (
                    printable(status.query_id),  # the proxy's text, shown in a terminal
                    item.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    kind_cell(item),
                    status.state.value,
                    f"{status.owners_contributed}/{status.quorum} of {registered}",
                    f"{item.epsilon:g}",
                    _charge_cell(status.charge),
                    shortened(status.failure_reason or "", LIST_REASON_CHARACTERS),
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(7)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:7], widths, strict=True)]
            click.echo("  ".join([*cells, row[7]]).rstrip())

    @group.command("deployment")
    @connection_options
    def deployment_command(**params: Any) -> None:
        """Show the deployment as the proxy states it to you: owners registered and
        connected now (a query's default quorum is every registered owner), the
        neighbouring relation and accountant, the delta cap, your budget, and the
        terms each connected owner states (what it answers: kinds, columns, epsilon and
        delta per query, quorum)."""
        with errors(), client(params) as (opened, _):
            info = opened.describe(with_owner_terms=True)
        for line in [*_deployment_lines(info), *owner_terms_lines(info)]:
            click.echo(line)

    @group.command("status")
    @click.argument("query_id")
    @connection_options
    def status_command(query_id: str, **params: Any) -> None:
        """Show one query's kind, privacy parameters, creation time, state, owners,
        declines, failure reason and charge."""
        with errors(), client(params) as (opened, _):
            status = opened.status(query_id)
            # What the query states, as `list` shows it (absent if the proxy cannot
            # read the query's statement any more: the status still prints).
            listed = opened.list_queries(query_id=query_id)
        for line in _status_lines(status, listed[0] if listed else None):
            click.echo(line)

    @group.command("cancel")
    @click.argument("query_id")
    @connection_options
    def cancel_command(query_id: str, **params: Any) -> None:
        """Cancel a query whose uploads are still arriving (collecting or aggregating).

        The charge is refunded only if no owner had begun an upload."""
        with errors(), client(params) as (opened, _):
            receipt = opened.cancel(query_id)
        reason = receipt.status.failure_reason or "failed"
        if reason != CANCELLED_REASON:
            # Cancelling changes nothing then; the query's end is not news of this call.
            click.echo(f"query {query_id} had already failed, nothing to cancel: {reason}")
        else:
            click.echo(f"query {query_id}: {reason}")
        if receipt.refunded:
            click.echo("charge: refunded (no owner had begun an upload)")
        else:
            click.echo("charge: stands (an owner had begun an upload, or it had failed before)")

    @group.command("fetch")
    @click.argument("query_id")
    @connection_options
    @click.option(
        "--key-dir",
        type=click.Path(exists=True, path_type=Path),
        help="Directory of analyst.key.json (or set key_dir in --config).",
    )
    @result_out_option("result.json to write (plots go next to it).")
    @click.option("--workers", type=click.IntRange(min=1), help="Decryption processes.")
    @click.option(
        "--n-components",
        type=click.IntRange(min=1),
        help="pca/dca: components to take from the release (default the query's; any "
        "number up to the features, charged nothing more).",
    )
    @click.option(
        "--ddof",
        type=click.IntRange(min=0),
        help="stats: divide variances by N - DDOF, as the query's own --ddof (default 0).",
    )
    @click.option("--no-clip", is_flag=True, help="stats: keep raw noisy values (as stats).")
    @click.option("--no-clamp", is_flag=True, help="histogram: keep negative noisy counts.")
    @click.option("--alpha", help="linreg: ridge regulariser, auto or a number >= 0.")
    @click.option("--no-intercept", is_flag=True, help="linreg: fit through the origin.")
    @dca_ridge_options
    @noise_sd_draws_option
    @click.option(
        "--as-pca",
        is_flag=True,
        help="dca: the principal components of the records of the query's classes, from "
        "the same release (e.g. when too few classes were found for a DCA).",
    )
    def fetch_command(
        query_id: str,
        key_dir: Path | None,
        out: Path,
        workers: int | None,
        n_components: int | None,
        ddof: int | None,
        no_clip: bool,
        no_clamp: bool,
        alpha: str | None,
        no_intercept: bool,
        rho: float | None,
        rho_prime: float | None,
        noise_sd_draws: int | None,
        as_pca: bool,
        **params: Any,
    ) -> None:
        """Download and decrypt the stored result of a DONE query again.

        A release is post-processed with the defaults of its command (``dca``,
        ``stats``, ``histogram``, ``linreg``) unless the options below say otherwise: give
        the ones the query's own command was given (e.g. its ``--rho``, which is not
        stored with the query) to get its result again; others give another result of
        the same release (post-processing is free: nothing is charged). A DCA release may
        also be read as a PCA of its classes' records (``--as-pca``).
        """
        post_processing: dict[str, Any] = {
            "clip": not no_clip,
            "clamp": not no_clamp,
            "fit_intercept": not no_intercept,
        }
        if ddof is not None:
            post_processing["ddof"] = ddof
        if alpha is not None:
            try:
                post_processing["alpha"] = alpha if alpha == "auto" else float(alpha)
            except ValueError:
                raise click.BadParameter(
                    f"--alpha must be 'auto' or a number, got {alpha!r}"
                ) from None
        import warnings

        from fedpca.analyst import keys
        from fedpca.analyst.decode import decrypt_result
        from fedpca.analyst.estimators import FederatedDCA, FederatedPCA
        from fedpca.analyst.querying import (
            MissingOwnersWarning,
            ProgressDisplay,
            charged_release,
        )
        from fedpca.analyst.release_summary import measure_component_noise, print_release_summary
        from fedpca.analyst.report import write_report
        from fedpca.codec.paillier import CryptoPool
        from fedpca.signing import signer_id

        with errors():
            with client(params, key_dir) as (opened, analyst_key_dir):
                if analyst_key_dir is None:
                    raise ConfigError(
                        "no analyst key: pass --key-dir DIR or set key_dir in --config"
                    )
                private_key = keys.load_analyst_private_key(analyst_key_dir)
                # The result must be of a query this analyst signed: its own signing key
                # (kept next to the Paillier key) says which.
                signer = signer_id(keys.load_analyst_signing_key(analyst_key_dir))
                status = opened.status(query_id, action="fetch the result of query")
                if status.state is not QueryState.DONE:
                    raise QueryStateError(
                        f"query {query_id} is {status.state.value}"
                        + (f" ({status.failure_reason})" if status.failure_reason else "")
                        + ": only a DONE query has a result"
                    )
                # As the proxy recorded it when the query was asked: the allow-list may
                # have changed since (an operator's walkthrough, stop 42). An older
                # proxy does not say: today's count then.
                registered = status.owners_registered or opened.describe().owners_registered
                started = time.perf_counter()
                fetched = opened.fetch(query_id, public_key=private_key.public_key, signer=signer)
                fetch_seconds = time.perf_counter() - started
            # Before decrypting, the slow part (a reviewer waited 12 s for this refusal).
            given = {
                "--ddof": ddof is not None,
                "--no-clip": no_clip,
                "--no-clamp": no_clamp,
                "--alpha": alpha is not None,
                "--no-intercept": no_intercept,
                "--rho": rho is not None,
                "--rho-prime": rho_prime is not None,
                "--as-pca": as_pca,
                "--noise-sd-draws": noise_sd_draws is not None,
            }
            _check_fetch_options(fetched.query, n_components, [k for k, v in given.items() if v])
            started = time.perf_counter()
            # Progress as `pca` shows it (5-10 s of silence here before: an operator's
            # walkthrough, stop 42).
            display = ProgressDisplay()
            display.fetched(fetched.result.payload.total_ciphertexts)
            with CryptoPool(workers) as pool:
                release = decrypt_result(
                    fetched.result, private_key, pool=pool, progress=display.decrypted
                )
            timings = {"fetch": fetch_seconds, "decrypt": time.perf_counter() - started}
            if release.kind is QueryKind.AGGREGATE:
                _write_aggregates(release, registered, timings, out, post_processing)
                return
            chosen: dict[str, Any] = {} if n_components is None else {"n_components": n_components}
            estimator: FederatedPCA | FederatedDCA
            if release.kind not in (QueryKind.PCA, QueryKind.DCA):
                raise ConfigError(f"fetch cannot report {release.kind.value} queries")
            factory: type[FederatedPCA | FederatedDCA] = FederatedPCA
            if release.kind is QueryKind.DCA and not as_pca:
                factory = FederatedDCA
                chosen.update(rho=rho, rho_prime=rho_prime)
            with warnings.catch_warnings():
                # The summary prints the warning in red; Python's copy repeated it (an
                # operator's walkthrough, stop 42), as `pca` and `dca` already knew.
                warnings.simplefilter("ignore", MissingOwnersWarning)
                # Its error says what the release still gives (a DCA's PCA), as the
                # query's own command does (a walkthrough's plain fetch did not).
                with charged_release(query_id):
                    estimator = factory.from_result(
                        release, owners_registered=registered, timings=timings, **chosen
                    )
            measure_component_noise(estimator, noise_sd_draws)
            files = write_report(out, estimator)
        print_release_summary(estimator, files)


_FETCH_OPTION_KINDS: dict[str, tuple[AggregateKind | QueryKind, ...]] = {
    "--ddof": (AggregateKind.STATS,),
    "--no-clip": (AggregateKind.STATS,),
    "--no-clamp": (AggregateKind.HISTOGRAM,),
    "--alpha": (AggregateKind.LINREG,),
    "--no-intercept": (AggregateKind.LINREG,),
    "--rho": (QueryKind.DCA,),
    "--rho-prime": (QueryKind.DCA,),
    "--as-pca": (QueryKind.DCA,),
    "--noise-sd-draws": (QueryKind.PCA, QueryKind.DCA),
}
"""The aggregate, or kind of query, each post-processing option of ``fetch`` applies to."""


def _check_fetch_options(spec: Any, n_components: int | None, given: list[str]) -> None:
    """Refuse, as a usage error, an option of ``fetch`` that the query's release cannot
    take: they were checked only after the decryption, or silently ignored."""
    released = {part.kind for part in spec.aggregates}
    what = spec.kind.value + (
        f" ({', '.join(sorted(k.value for k in released))})" if released else ""
    )
    if n_components is not None:
        if released:
            raise click.UsageError(f"--n-components: query {spec.query_id} is {what}")
        if n_components > spec.n_features:
            raise click.UsageError(
                f"--n-components {n_components}: query {spec.query_id} has "
                f"{spec.n_features} features"
            )
    if "--as-pca" in given and {"--rho", "--rho-prime"} & set(given):
        raise click.UsageError("--rho and --rho-prime are DCA ridges; --as-pca takes none")
    applicable = {*released, spec.kind}
    for option in given:
        kinds = _FETCH_OPTION_KINDS[option]
        if not applicable.intersection(kinds):
            raise click.UsageError(
                f"{option} applies to {' and '.join(kind.value for kind in kinds)}; query "
                f"{spec.query_id} is {what}"
            )
