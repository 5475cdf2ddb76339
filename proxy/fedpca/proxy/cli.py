"""``fedpca proxy``: run the proxy and inspect its state.

``fedpca proxy serve --config proxy.toml`` runs until SIGTERM or SIGINT, then
stops gracefully; on SIGHUP it reads its allow-lists and revoked certificates again.
Once the port is bound it prints exactly one line,
``proxy listening on HOST:PORT`` (flushed), so a parent process can wait for it;
everything else goes to the log (stderr).

``fedpca proxy status --config proxy.toml`` lists the queries in the proxy's
SQLite database (it may run while the proxy is serving: WAL readers do not block).

``fedpca proxy init --out DIR --owners a,b,c --certs CERTS`` writes a complete proxy
folder (:mod:`fedpca.proxy.init`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import signal
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from fedpca.allocator import map_large_blocks
from fedpca.errors import FedpcaError
from fedpca.files import database_missing, holds_database
from fedpca.formatting import printable
from fedpca.logs import configure_logging
from fedpca.messages import QueryState
from fedpca.proxy.config import ProxyConfig, load_config
from fedpca.proxy.init import init_command
from fedpca.proxy.open_files import ensure_open_files, needed_open_files

__all__ = ["proxy_group"]

logger = logging.getLogger(__name__)

_Command = TypeVar("_Command", bound=Callable[..., Any])


def _config_option(help: str = "The proxy's TOML configuration.") -> Callable[[_Command], _Command]:
    """The ``--config`` option every proxy command takes."""
    return click.option(
        "--config",
        "config_path",
        required=True,
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        help=help,
    )


def _configure_logging(verbose: int) -> None:
    """INFO by default (a daemon's log is its only window), DEBUG with -v.

    ``fedpca -v…`` may already have configured the root logger; never make it
    quieter than it is, and keep the format ``fedpca --log-format`` chose.
    """
    configure_logging(logging.DEBUG if verbose else logging.INFO)


def _load(path: Path) -> ProxyConfig:
    try:
        return load_config(path)
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc


@click.group("proxy")
def proxy_group() -> None:
    """Run the proxy (aggregator) and inspect its queries."""


@proxy_group.command("serve")
@_config_option()
@click.option("--listen", help="host:port to bind (overrides proxy.listen; port 0 = any).")
@click.option(
    "--database",
    type=click.Path(dir_okay=False, path_type=Path),
    help="SQLite database (overrides proxy.database).",
)
@click.option(
    "--new-database",
    is_flag=True,
    help="Create the database if it does not exist (`fedpca proxy init` creates it; "
    "without this flag a missing database is an error).",
)
@click.option(
    "--monitoring-listen",
    help="host:port of /metrics, /healthz, /readyz, or off (overrides monitoring.listen).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="No TLS, no authentication (local experiments only; overrides tls.insecure).",
)
@click.option("-v", "--verbose", count=True, help="Debug log output.")
def serve_command(
    config_path: Path,
    listen: str | None,
    database: Path | None,
    new_database: bool,
    monitoring_listen: str | None,
    insecure: bool,
    verbose: int,
) -> None:
    """Serve OwnerService and AnalystService until SIGTERM/SIGINT.

    On SIGHUP (`systemctl reload`) it reads the configuration file again and takes
    its owners.allowed, analysts.allowed and tls.revoked_serials, ending the calls of
    peers no longer accepted; a file that changes anything else is refused whole.
    """
    from fedpca.proxy.server import ProxyServer  # grpc, numpy, phe: only when serving

    # First of all: SIGHUP's default action ends the process, which systemd counts as a
    # clean exit (no restart), so a `systemctl reload` during start-up stopped the proxy
    # for good (found by review). The handlers only queue the signal: SimpleQueue.put is
    # reentrant, where Event.set() taken inside the main thread's own Event.clear()
    # deadlocked it (a review reproduced it with SIGHUPs 0-2 ms apart).
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def queue_signal(signum: int, frame: FrameType | None) -> None:
        signals.put(signum)

    previous = {
        sig: signal.signal(sig, queue_signal)
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
    }
    try:
        _configure_logging(verbose)
        map_large_blocks()  # a long-running process: freed arrays go back to the system

        def read_config() -> ProxyConfig:
            return load_config(config_path).with_overrides(
                listen=listen,
                insecure=insecure,
                database=database,
                monitoring_listen=monitoring_listen,
            )

        try:
            config = read_config()
        except FedpcaError as exc:
            raise click.ClickException(str(exc)) from exc
        _check_database(config, new_database)
        ensure_open_files(needed_open_files(len(config.owners.allowed)))
        server = ProxyServer(config)
        try:
            try:
                address = server.start()
            except (FedpcaError, OSError) as exc:
                raise click.ClickException(f"cannot start the proxy: {exc}") from exc
            click.echo(f"proxy listening on {address}")
            sys.stdout.flush()
            _serve_until_stopped(signals, server, config_path, read_config)
        finally:
            server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_database(config: ProxyConfig, new_database: bool) -> None:
    """Refuse to start on a missing database unless a new one is asked for."""
    from fedpca.proxy.store_database import refuse_where_a_proxy_ran

    if holds_database(config.proxy.database):
        return
    if not new_database:
        raise click.ClickException(
            f"the proxy database {database_missing(config.proxy.database)}. If this proxy "
            "ran before, the path is wrong ([proxy] database or --database) or the "
            "database was lost (restore it from a backup): a new, empty database would "
            "start every analyst's budget again at zero. `fedpca proxy init` creates the "
            "database with the folder; to start a new one here, run `fedpca proxy "
            "new-database` once (on Kubernetes, the proxy-first-start Job) or pass "
            "--new-database"
        )
    try:
        refuse_where_a_proxy_ran(config.proxy.database)
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc


def _serve_until_stopped(
    signals: queue.SimpleQueue[int],
    server: Any,
    config_path: Path,
    read_config: Callable[[], ProxyConfig],
) -> None:
    """Reload on SIGHUP (several pending ones once) until SIGTERM or SIGINT."""
    while True:
        try:
            # With a timeout: the queued signal is also taken if the wait itself is not
            # interrupted by the handler's return.
            pending = [signals.get(timeout=1.0)]
        except queue.Empty:
            continue
        while not signals.empty():
            pending.append(signals.get())
        stops = [signum for signum in pending if signum != signal.SIGHUP]
        if stops:
            logger.info("received %s, stopping", signal.Signals(stops[0]).name)
            return
        _reload(server, config_path, read_config)


def _reload(server: Any, config_path: Path, read_config: Callable[[], ProxyConfig]) -> None:
    """SIGHUP: take the allow-lists and revocations of ``config_path`` as it is now.

    Never ends the serving process: a file that cannot be read, or any other failure,
    is logged and the proxy serves on as before (a review's malformed owner id had the
    reload's error stop the proxy).
    """
    logger.info("received SIGHUP, reading %s again", config_path)
    try:
        config = read_config()
        changes = server.reload(config)
    except FedpcaError as exc:
        logger.error("reload refused, still serving as before: %s", exc)
        return
    except Exception:
        logger.exception("reload failed, still serving as before")
        return
    ensure_open_files(needed_open_files(len(config.owners.allowed)))
    if changes:
        logger.warning("reloaded %s: %s", config_path, "; ".join(changes))
    else:
        logger.info("reloaded %s: no change", config_path)


@proxy_group.command("status")
@_config_option("The proxy's TOML configuration (for the database path).")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([state.value for state in QueryState]),
    help="Only queries in this state (repeat for several; default: every state).",
)
@click.option("--analyst", help="Only the queries of this analyst id.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON list (one object per query, times in UTC ISO 8601) for scripts.",
)
def status_command(
    config_path: Path, states: tuple[str, ...], analyst: str | None, as_json: bool
) -> None:
    """List the proxy's queries, oldest first: id, analyst, state, owners, times, reason."""
    from fedpca.proxy.store import ProxyStore

    config = _load(config_path)
    database = config.proxy.database
    if not holds_database(database):
        raise click.ClickException(
            f"no proxy database: {database_missing(database)} (has the proxy run here?)"
        )
    try:
        store = ProxyStore(database, neighbouring=config.privacy.neighbouring, read_only=True)
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        records = store.queries(*(QueryState(state) for state in states))
    finally:
        store.close()
    listed = [r for r in records if analyst is None or r.analyst_id == analyst]
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "query": record.query_id,
                        "analyst": record.analyst_id,
                        "state": record.state.value,
                        "owners_contributed": record.n_contributed,
                        "quorum": record.quorum,
                        "created": _utc(record.created_at),
                        "deadline": _utc(record.deadline_at),
                        "updated": _utc(record.updated_at),
                        "reason": record.failure_reason,
                    }
                    for record in listed
                ],
                indent=2,
            )
        )
        return
    if not listed:
        click.echo("no queries" if not (states or analyst) else "no such queries")
        return
    rows = [("QUERY", "ANALYST", "STATE", "OWNERS", "CREATED (UTC)", "REASON")]
    rows += [
        (
            record.query_id,
            record.analyst_id,
            record.state.value,
            f"{record.n_contributed}/{record.quorum}",
            _utc(record.created_at)[:16] + "Z",
            # A reason quotes a peer's text in part: shown escaped.
            printable(record.failure_reason or ""),
        )
        for record in listed
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True)]
        click.echo("  ".join([*cells, row[5]]).rstrip())


def _utc(timestamp: float) -> str:
    return (
        datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    )


@proxy_group.command("import-releases")
@_config_option("The proxy's TOML configuration (for the database path and relation).")
@click.option("--dry-run", is_flag=True, help="Say what would be charged; change nothing.")
@click.option(
    "--no-owner-exports",
    is_flag=True,
    help="Import nothing, only let the proxy serve the restored backup: only when no "
    "owner answered a query since the backup was taken.",
)
@click.argument("exports", nargs=-1, type=click.Path(dir_okay=False, exists=True, path_type=Path))
def import_releases_command(
    config_path: Path, dry_run: bool, no_owner_exports: bool, exports: tuple[Path, ...]
) -> None:
    """After restoring the database from a backup: charge the releases it forgot.

    EXPORTS are the owners' `fedpca owner budget --json` files. Every release of a
    query this database does not know is charged to its analyst, once; a query an
    owner began an upload of keeps its charge for good (charged again if refunded here,
    never refunded if still running). Run it with the proxy stopped, right after putting
    the backup in place (docs/operations.md, "Backup and restore"). The proxy refuses
    to serve a copy written by `fedpca proxy backup` until this command has run on it.
    """
    import json

    from fedpca.proxy.release_import import import_releases
    from fedpca.proxy.store import ProxyStore
    from fedpca.proxy.store_database import scratch_copy, use_database
    from fedpca.release_exports import charged_lines, read_owner_releases

    if bool(exports) == no_owner_exports:
        raise click.UsageError(
            "name every owner's `fedpca owner budget --json` export, or pass "
            "--no-owner-exports (only if no owner answered a query since the backup)"
        )
    try:
        config = _load(config_path)
        database = config.proxy.database
        if not holds_database(database):
            # Never a new one: the releases would be charged into an empty database.
            raise click.ClickException(
                f"no proxy database: {database_missing(database)}; put the backup in place "
                "first (docs/operations.md, Backup and restore)"
            )
        releases = []
        for path in exports:
            try:
                document = json.loads(path.read_text(encoding="utf-8"))
            except OSError as exc:
                raise click.ClickException(f"cannot read {path}: {exc}") from exc
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise click.ClickException(
                    f"{path} is not an owner's export (the JSON of `fedpca owner budget "
                    f"--json`): {exc}"
                ) from exc
            if not isinstance(document, dict):
                raise click.ClickException(f"{path}: not an export of `fedpca owner budget --json`")
            releases.extend(read_owner_releases(document, str(path)))
        with (
            use_database(database),
            scratch_copy(database) if dry_run else contextlib.nullcontext(database) as opened,
        ):
            store = ProxyStore(opened, neighbouring=config.privacy.neighbouring)
            try:
                report = import_releases(
                    store, releases, config.privacy.neighbouring, dry_run=dry_run
                )
                if not dry_run:
                    # Listed (metrics, status) like an analyst that submitted.
                    for analyst in sorted({event.analyst for event in report.entered}):
                        limit = config.budget.for_analyst(analyst)
                        store.set_analyst_budget(analyst, limit.epsilon, limit.delta)
            finally:
                store.close()
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    verb = "would charge" if dry_run else "charged"
    not_private = ": exhausts the analyst's budget"
    for line in charged_lines(report.entered, dry_run=dry_run, not_private=not_private):
        click.echo(line)
    final = "would make final" if dry_run else "made final"
    for query_id in report.kept_charged:
        click.echo(f"{final} {query_id}  (still running here; an owner began an upload)")
    undone = "would charge again" if dry_run else "charged again"
    for query_id in report.refund_undone:
        click.echo(f"{undone} {query_id}  (refunded here; an owner began an upload)")
    for query_id in report.disagreements:
        click.echo(f"owners differ {query_id}: their noise multipliers differ; the smallest counts")
    click.echo(
        f"{len(report.entered)} release(s) {verb}; {len(report.kept_charged)} charge(s) "
        f"{final}; {len(report.refund_undone)} refund(s) undone; "
        f"{len(report.already_recorded)} already recorded; {len(report.refunded)} not "
        "charged (refunded here, no upload begun)"
    )
    if report.backup_taken_at is not None:
        may = "would then serve" if dry_run else "will now serve"
        click.echo(f"the proxy {may} this database (a backup taken on {report.backup_taken_at})")


@proxy_group.command("export-releases")
@_config_option("The proxy's TOML configuration (for the database path).")
@click.option("--owner", "owner_id", required=True, help="The owner's id (its certificate's).")
def export_releases_command(config_path: Path, owner_id: str) -> None:
    """Print, as JSON, the queries with a release that an owner's uploads joined: the
    file `fedpca owner import-releases` reads after that owner's ledger was restored
    from a backup. Runs beside a serving proxy (it only reads the database)."""
    import json

    from fedpca.proxy.store import ProxyStore
    from fedpca.query_records import spec_from_dict
    from fedpca.release_exports import ContributedRelease, contributed_releases_document
    from fedpca.transport.certs import validate_node_id

    try:
        validate_node_id(owner_id)
        config = _load(config_path)
        database = config.proxy.database
        if not holds_database(database):
            raise click.ClickException(
                f"no proxy database: {database_missing(database)} (has the proxy run here?)"
            )
        store = ProxyStore(database, neighbouring=config.privacy.neighbouring, read_only=True)
        try:
            joined = store.contributed_releases(owner_id)
        finally:
            store.close()
        releases = [
            ContributedRelease(
                record.query_id, spec_from_dict(record.spec), record.signature, record.signer, at
            )
            for record, at in joined
        ]
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    if not releases:
        # On stderr: the JSON on stdout stays a valid (empty) export.
        click.echo(
            f"owner {owner_id!r} contributed to no query with a release here (is the id right?)",
            err=True,
        )
    document = contributed_releases_document(owner_id, releases)
    click.echo(json.dumps(document, indent=2, allow_nan=False))


@proxy_group.command("backup")
@_config_option("The proxy's TOML configuration (for the database path).")
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="A new file."
)
@click.option(
    "--wait",
    "wait_seconds",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to wait for running queries to finish (0: refuse at once while any runs).",
)
def backup_command(config_path: Path, out: Path, wait_seconds: float) -> None:
    """Copy the proxy's database, beside a serving proxy, when no query holds uploads
    without their noise (mode 0600; docs/operations.md, Backup and restore)."""
    from fedpca.proxy.backup import backup_database

    try:
        config = _load(config_path)
        report = backup_database(config.proxy.database, out, wait_seconds=wait_seconds)
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"backed up {report.queries} queries ({report.bytes} bytes) to {report.path} "
        "(mode 0600): it holds no owner's upload or aggregate without its noise"
    )


@proxy_group.command("new-database")
@_config_option()
def new_database_command(config_path: Path) -> None:
    """Create the proxy's database at [proxy] database, once, before its first `serve`
    (a database already there is left as it is).

    For a proxy whose state volume starts empty (Kubernetes): `serve` then never needs
    --new-database, so a volume lost or replaced later is refused instead of silently
    starting every analyst's budget at zero."""
    from fedpca.proxy.store import ProxyStore
    from fedpca.proxy.store_database import refuse_where_a_proxy_ran

    try:
        config = _load(config_path)
        database = config.proxy.database
        if holds_database(database):
            click.echo(f"the proxy database {database} exists: left as it is")
            return
        refuse_where_a_proxy_ran(database)
        ProxyStore(
            database, neighbouring=config.privacy.neighbouring, announce_creation=False
        ).close()
    except FedpcaError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"created the proxy database {database}: every analyst's budget is unspent")


proxy_group.add_command(init_command)
