"""``fedpca owner``: write an owner folder, check it, run the node, inspect its budget.

``init`` (:mod:`fedpca.owner.init`) writes a complete owner folder; ``probe``
(:mod:`fedpca.owner.probe`) checks it end to end; ``serve`` runs the node (flags
override the file); ``budget`` prints the ledger.

Register in ``fedpca.app.cli`` as ``"owner": ("fedpca.owner.cli", "owner_group", ...)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from fedpca.admission import NextQuery
from fedpca.allocator import map_large_blocks
from fedpca.budget_options import budget_delta_options
from fedpca.errors import ConfigError, DataError, KeyFileError
from fedpca.files import database_missing, holds_database
from fedpca.formatting import distinct, printable
from fedpca.logs import configure_logging
from fedpca.owner.config import OwnerConfig, load_config
from fedpca.owner.init import init_command
from fedpca.query import DEFAULT_QUERY_DELTA

__all__ = ["owner_group"]

logger = logging.getLogger(__name__)

_Command = TypeVar("_Command", bound=Callable[..., Any])


def _config_option() -> Callable[[_Command], _Command]:
    """The ``--config`` option every owner command takes (its loader names a missing file)."""
    return click.option(
        "--config",
        "config_path",
        required=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help="The owner's TOML config (owner.toml).",
    )


def _configure_logging(verbose: int) -> None:
    """Log handlers are configured here, in the entry point, and nowhere else.

    A daemon logs INFO by default (connections, tasks, progress); ``-v`` adds
    DEBUG. A DEBUG level already chosen by ``fedpca -vv`` is kept, and so is the
    format chosen by ``fedpca --log-format``.
    """
    configure_logging(logging.DEBUG if verbose > 0 else logging.INFO)


@click.group("owner")
def owner_group() -> None:
    """Run a data-owner node."""


@owner_group.command("serve")
@_config_option()
@click.option("--proxy", metavar="HOST:PORT", help="The proxy (overrides owner.proxy).")
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The owner's table (overrides data.path).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Ledger folder (overrides owner.state_dir).",
)
@click.option(
    "--monitoring-listen",
    help="host:port of /metrics, /healthz, /readyz, or off (overrides monitoring.listen).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Dial the proxy without TLS (local experiments only; overrides tls.insecure).",
)
@click.option(
    "--new-ledger",
    is_flag=True,
    help="Create the budget ledger if it does not exist (`fedpca owner init` creates it; "
    "without this flag a missing ledger is an error).",
)
@click.option("-v", "--verbose", count=True, help="Debug log output.")
def serve_command(
    config_path: Path,
    proxy: str | None,
    data: Path | None,
    state_dir: Path | None,
    monitoring_listen: str | None,
    insecure: bool,
    new_ledger: bool,
    verbose: int,
) -> None:
    """Connect to the proxy and answer tasks until interrupted (SIGINT/SIGTERM).

    Flags override the configuration file.
    """
    from fedpca.monitoring import MonitoringServer
    from fedpca.owner.metrics import OwnerMetrics
    from fedpca.owner.node import OwnerNode
    from fedpca.owner.state_folder import refuse_where_a_node_ran

    _configure_logging(verbose)
    map_large_blocks()  # a long-running process: freed arrays go back to the system
    try:
        config = load_config(config_path).with_overrides(
            proxy=proxy,
            data=data,
            state_dir=state_dir,
            insecure=insecure,
            monitoring_listen=monitoring_listen,
        )
        if not holds_database(config.ledger_path):
            if not new_ledger:
                raise ConfigError(
                    _missing_ledger(config.ledger_path, "(or --state-dir)")
                    + " a new, empty ledger would start this owner's budget again at zero. "
                    "To start a new one here, run `fedpca owner new-ledger` once (on "
                    "Kubernetes, the owner-first-start Job) or pass --new-ledger"
                )
            refuse_where_a_node_ran(config)
        node = OwnerNode(config)
        node.hold_state_folder()  # before the monitoring port: the reason, not the port
        monitoring = None
        if config.monitoring.listen is not None:
            node.metrics = OwnerMetrics(node)
            monitoring = MonitoringServer(
                config.monitoring.listen, node.metrics.registry, live=node.alive, ready=node.ready
            )
            try:
                monitoring.start()
            except BaseException:
                node.release_state_folder()
                raise
    except (ConfigError, DataError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from exc

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("owner %s: received %s, stopping", config.owner.id, signal.Signals(signum).name)
        node.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    try:
        node.run_forever()
    finally:
        if monitoring is not None:
            monitoring.stop()


@owner_group.command("probe")
@_config_option()
@click.option(
    "--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Seconds."
)
@click.option(
    "--local",
    is_flag=True,
    help="Only this node's own setup, not the proxy: a container's startup probe (a node "
    "waiting for its proxy is healthy; its readiness says whether it is connected).",
)
def probe_command(config_path: Path, timeout: float, local: bool) -> None:
    """Check config, data, TLS files, state folder, the proxy and enrolment (exit 1 on a
    failure): before the first serve, and as a Kubernetes exec probe."""
    from fedpca.owner.probe import probe_owner

    ok = probe_owner(
        config_path,
        timeout=timeout,
        report=lambda result: click.echo(result.line()),
        local=local,
    )
    if not ok:
        raise SystemExit(1)


@owner_group.command("budget")
@_config_option()
@budget_delta_options("this owner's")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the ledger's releases as JSON instead: the file `fedpca proxy "
    "import-releases` reads after a proxy database was restored from a backup.",
)
def budget_command(
    config_path: Path, delta: float | None, query_delta: float | None, as_json: bool
) -> None:
    """Print the epsilon spent, the largest epsilon a next query may ask for (found with
    this owner's own checks, for a query with the default zcdp calibration; per analyst,
    with the part of its share used, under budget.analyst_shares), and every release
    recorded in the ledger."""
    from fedpca.dp.next_query import MAX_ADMISSION_CHECKS, largest_admissible_epsilon
    from fedpca.owner.ledger import owner_ledger

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        _print_releases_json(config)
        return
    budget = config.budget
    at_delta = delta if delta is not None else budget.delta
    cap = config.policy.delta_cap(budget)
    if query_delta is not None and query_delta > cap:
        shown, cap_shown = distinct(query_delta, cap)
        raise click.ClickException(
            f"--query-delta {shown} is above this owner's per-query delta cap {cap_shown}: "
            "every such query is refused"
        )
    if not holds_database(config.ledger_path):
        # Not "nothing spent": a wrong folder would report a full budget.
        raise click.ClickException(
            _missing_ledger(config.ledger_path, "")
            + " its budget cannot be read here. On a node not started yet, `fedpca owner "
            "new-ledger` creates it"
        )
    try:
        ledger = owner_ledger(config, read_only=True)
        # Once the ledger opened: before, a ledger of another version was refused
        # below these lines (an operator's walkthrough, stop 42).
        click.echo(f"owner        {config.owner.id}")
        click.echo(f"budget       epsilon={budget.epsilon:g} delta={budget.delta:g}")
        entries = ledger.events()
        outcomes = ledger.release_outcomes()
        events = [entry.event for entry in entries]
        spent = ledger.spent(at_delta)
        shares = ledger.shares

        def next_query_for(analyst: str | None) -> NextQuery:
            # The checks this owner makes before it reserves a release: its policy's cap
            # on one release's epsilon, the analyst's share if any, then its ledger's
            # budget (owner/policy.py, ledger.py).
            return largest_admissible_epsilon(
                events,
                budget,
                min(DEFAULT_QUERY_DELTA, cap) if query_delta is None else query_delta,
                config.privacy.accountant,
                neighbouring=config.privacy.neighbouring,
                max_release_epsilon=config.policy.max_epsilon_per_query,
                fits_share=(
                    None
                    if shares is None or analyst is None
                    else lambda z: shares.admits(events, analyst, z)
                ),
                max_checks=40 if analyst else MAX_ADMISSION_CHECKS,
            )

        analysts = sorted(shares.fractions) if shares is not None else [None]
        next_queries = {analyst: next_query_for(analyst) for analyst in analysts}
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    none_yet = "" if entries else " (no release recorded)"
    click.echo(f"ledger       {config.ledger_path}{none_yet}")
    click.echo(f"spent        epsilon={spent:.6g} at delta={at_delta:g}")
    cap_epsilon = (config.policy.max_epsilon_per_query, budget.delta)
    for analyst, next_query in next_queries.items():
        if shares is not None and analyst is not None:
            used = shares.used(events, analyst)
            click.echo(
                f"analyst      {analyst}: share {shares.share_of(analyst):g} of the budget, "
                f"{used:.2%} of it used"
            )
        click.echo(f"next query   {next_query.summary(per_query_cap=cap_epsilon)}")
        for note in next_query.notes(budget.epsilon, budget.delta):
            click.echo(f"             ({note})")
    if not entries:
        return
    private = sum(1 for e in entries if not e.not_private)
    click.echo(f"releases     {private} private, {len(entries) - private} NOT PRIVATE")
    for entry in entries:
        event = entry.event
        when = datetime.fromtimestamp(event.timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")
        outcome = outcomes.get(event.query_id)
        state = outcome.value if outcome is not None else "reserved"
        if entry.not_private:
            cost = "NOT PRIVATE (epsilon=inf: exhausts a finite budget)"
        else:
            cost = f"epsilon={event.epsilon:g} delta={event.delta:g} z={event.noise_multiplier:.4g}"
        click.echo(
            f"  {when}Z  {event.query_id:<24} {cost:<44} {state:<10} analyst {event.analyst}"
        )


@owner_group.command("import-releases")
@_config_option()
@click.option("--dry-run", is_flag=True, help="Say what would be charged; change nothing.")
@click.argument("export", type=click.Path(dir_okay=False, exists=True, path_type=Path))
def import_releases_command(config_path: Path, dry_run: bool, export: Path) -> None:
    """After restoring the ledger from a backup: charge the releases it forgot.

    EXPORT is the proxy's `fedpca proxy export-releases --owner ID` file: the queries
    with a release this owner's uploads joined, as their analysts signed them. Each one
    the ledger does not hold is charged at the cost the signed query states (what this
    node charged when it answered it); one whose signature does not verify fails the
    whole import. Run it with the node stopped, right after putting the backup in place
    (docs/operations.md, "Backup and restore").
    """
    from fedpca.dp.accounting import compose_epsilon
    from fedpca.owner.ledger import owner_ledger
    from fedpca.owner.release_reentry import reenter_releases
    from fedpca.owner.state_folder import use_state_folder
    from fedpca.release_exports import charged_lines, read_contributed_releases

    try:
        config = load_config(config_path)
        if not holds_database(config.ledger_path):
            # Never a new one: the releases would be charged into an empty ledger.
            raise ConfigError(
                _missing_ledger(config.ledger_path, "") + " put the backup in place first"
            )
        try:
            document = json.loads(export.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {export}: {exc}") from exc
        if not isinstance(document, dict):
            raise ConfigError(f"{export}: not an export of `fedpca proxy export-releases`")
        owner, releases = read_contributed_releases(document, str(export))
        if owner != config.owner.id:
            raise ConfigError(
                f"{export} lists the releases of owner {owner!r}; this node is "
                f"{config.owner.id!r}: nothing was re-entered"
            )
        # A dry run reads the ledger as it is, beside a serving node if need be.
        with contextlib.nullcontext() if dry_run else use_state_folder(config):
            ledger = owner_ledger(config, read_only=dry_run)
            report = reenter_releases(ledger, releases, config.policy, dry_run=dry_run)
            events = [entry.event for entry in ledger.events()]
            if dry_run:
                events += report.entered
            spent = compose_epsilon(
                events,
                config.budget.delta,
                config.privacy.accountant,
                neighbouring=config.privacy.neighbouring,
            )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    verb = "would charge" if dry_run else "charged"
    for line in charged_lines(report.entered, dry_run=dry_run, not_private=""):
        click.echo(line)
    final = "would make final" if dry_run else "made final"
    for task_id in report.kept_charged:
        click.echo(f"{final} {task_id}  (held as not begun; the proxy holds its upload)")
    for task_id, why in report.refused:
        # ``why`` quotes the export's signer: the proxy's text, shown in a terminal.
        click.echo(
            f"not charged  {task_id}  {printable(why)} (this node would not have answered it)"
        )
    click.echo(
        f"{len(report.entered)} release(s) {verb}; {len(report.already_recorded)} already "
        f"recorded ({len(report.kept_charged)} {final}); {len(report.refused)} this "
        "node's policy would not have answered, not charged"
    )
    state = "after this import" if dry_run else "now"
    click.echo(
        f"epsilon spent {state}: {spent:g} of {config.budget.epsilon:g} at "
        f"delta={config.budget.delta:g}"
    )
    if spent > config.budget.epsilon:
        click.echo(
            "the ledger is over its budget: this node refuses every private query (a "
            "higher [budget] would let it answer again)"
        )


def _print_releases_json(config: OwnerConfig) -> None:
    """``owner budget --json``: the ledger's releases (fedpca.release_exports)."""
    from fedpca.owner.ledger import owner_ledger
    from fedpca.release_exports import owner_releases_document

    if not holds_database(config.ledger_path):
        raise click.ClickException(_missing_ledger(config.ledger_path, "") + " nothing to export")
    try:
        ledger = owner_ledger(config, read_only=True)
        outcomes = ledger.release_outcomes()
        releases = []
        for entry in ledger.events():
            outcome = outcomes.get(entry.event.query_id)
            # No task record: not known to be unsent (the import then charges it).
            releases.append((entry.event, outcome.value if outcome is not None else "unknown"))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    document = owner_releases_document(config.owner.id, releases)
    click.echo(json.dumps(document, indent=2, allow_nan=False))


def _missing_ledger(path: Path, override: str) -> str:
    """The start of the error for a budget ledger that does not exist (or is empty)."""
    flag = f" {override}" if override else ""
    return (
        f"the budget ledger {database_missing(path)}. `fedpca owner init` creates it with "
        f"the node's folder; if this node ran before, [owner] state_dir{flag} names the "
        "wrong folder or the ledger was lost (restore it from a backup, docs/operations.md):"
    )


@owner_group.command("backup")
@_config_option()
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="A new folder for the copy (ledger.sqlite3 and shares/), off the state folder's disk.",
)
def backup_command(config_path: Path, out: Path) -> None:
    """Copy this owner's budget ledger, then the shares of its uploads in flight, into a
    new folder, beside a serving node (docs/operations.md, Backup and restore)."""
    from fedpca.owner.backup import backup_owner_state

    try:
        backup = backup_owner_state(load_config(config_path), out)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"backed up the budget ledger ({backup.releases} releases) and {backup.shares} "
        f"kept share(s) of uploads in flight to {backup.folder} (readable by this user "
        "only): restore them together, as state_dir/ledger.sqlite3 and state_dir/shares"
    )


@owner_group.command("new-ledger")
@_config_option()
def new_ledger_command(config_path: Path) -> None:
    """Create this owner's budget ledger in [owner] state_dir, once, before its first
    `serve` (a ledger already there is left as it is).

    For a node whose state folder starts empty (a Kubernetes volume): `serve` then never
    needs --new-ledger, so a volume lost or replaced later is refused instead of
    silently starting the budget at zero."""
    from fedpca.owner.ledger import owner_ledger
    from fedpca.owner.state_folder import refuse_where_a_node_ran

    try:
        config = load_config(config_path)
        if holds_database(config.ledger_path):
            click.echo(f"the budget ledger {config.ledger_path} exists: left as it is")
            return
        refuse_where_a_node_ran(config)
        owner_ledger(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"created the budget ledger {config.ledger_path}: this owner's budget is unspent")


owner_group.add_command(init_command)
