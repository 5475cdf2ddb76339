"""``fedpca owner init``: write a complete, working owner folder.

One command per owner instead of six edits of a shared example: the folder
(:mod:`fedpca.transport.bundle`) holds ``owner.toml`` with every path relative to it,
the owner's TLS files under ``tls/`` and an empty ``state/`` for the budget ledger. The
analyst's Paillier key fingerprint and query signer (both printed by ``fedpca analyst
keygen``) are pinned; the public capacity ``max_records`` must be given: it is read by
every analyst and the proxy, so it is never taken or suggested from the data (a missing
flag is refused, showing the table's size to the operator only). The written file is read
back with the owner's own loader, and the data file's schema is checked when it can be
read from here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import click

from fedpca.budget_options import NUMBER
from fedpca.column_options import COLUMNS
from fedpca.errors import ConfigError, DataError, FedpcaError
from fedpca.files import holds_database
from fedpca.owner.config import (
    OwnerConfig,
    load_config,
)
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.ledger_rows import recorded_relations
from fedpca.owner.policy import columns_outside
from fedpca.owner.policy_config import DEFAULT_MAX_TASKS_PER_DAY, DEFAULT_MIN_QUORUM
from fedpca.owner.state_folder import refuse_where_a_node_ran
from fedpca.query import RELEASE_KINDS, Neighbouring
from fedpca.toml_config import toml_value
from fedpca.transport.addresses import check_address, click_address
from fedpca.transport.bundle import (
    STATE_DIR,
    TLS_DIR,
    config_path,
    refuse_changed_settings,
    settings_given,
    writing_folder,
)
from fedpca.transport.certs import NodeIdentity, Role, TlsFiles, validate_node_id
from fedpca.transport.tls_options import tls_file_options

__all__ = [
    "CONFIG_NAME",
    "init_command",
    "render_owner_config",
    "write_owner_folder",
]

CONFIG_NAME = "owner.toml"


def render_owner_config(
    *,
    owner_id: str,
    proxy: str,
    data: str,
    header: str,
    label_column: int | None,
    max_records: int,
    analyst_keys: list[str],
    signers: list[str],
    neighbouring: Neighbouring,
    max_epsilon_per_query: float,
    max_delta_per_query: float | None,
    allow_masked_mode: bool,
    kinds: list[str],
    min_quorum: int,
    max_tasks_per_day: int,
    budget_epsilon: float,
    budget_delta: float,
    state_dir: str,
    monitoring_listen: str | None,
    n_columns: int | None = None,
    equal_shares: bool = False,
    allowed_columns: Sequence[int] | None = None,
) -> str:
    """The text of an owner.toml for a node folder (paths relative to it)."""
    header_value: bool | str = {"yes": True, "no": False}.get(header, "auto")
    lines = [
        "# fedpca owner node, written by `fedpca owner init`.",
        "# Run: fedpca owner serve --config owner.toml (paths are relative to this file).",
        "# The node only dials out to the proxy; it never listens (except [monitoring]).",
        "",
        "[owner]",
        f"id = {toml_value(owner_id)}   # the id in this owner's certificate",
        f"proxy = {toml_value(proxy)}",
        f"state_dir = {toml_value(state_dir)}   # budget ledger, shares being uploaded",
        "",
        "[tls]",
        f"ca = {toml_value(f'{TLS_DIR}/ca.pem')}",
        f"cert = {toml_value(f'{TLS_DIR}/cert.pem')}",
        f"key = {toml_value(f'{TLS_DIR}/key.pem')}",
        "",
        "[data]",
        f"path = {toml_value(data)}",
        f"header = {toml_value(header_value)}",
    ]
    if label_column is not None:
        lines.append(
            f"label_column = {label_column}   # 0-based; dropped for PCA, the class for DCA"
        )
    if n_columns is not None:
        lines.append(
            f"n_columns = {n_columns}   # the file's columns, label included: a CSV export "
            "without records still loads"
        )
    lines += [
        f"max_records = {max_records}   # PUBLIC: the most records a query uses (a uniform",
        "#   sample if the file holds more); every analyst and the proxy see this number",
        "enforce_max_records = false   # true: max_records is a hard limit fixed in advance",
        "#   (the node does not start with more records; queries may then use bounded-owner-",
        "#   table noise). Never raise it because the table outgrew it (docs/privacy.md)",
        "",
        "[privacy]",
        f"neighbouring = {toml_value(neighbouring.value)}   # the proxy's and every owner's",
        "",
        "[policy]",
        "# The analyst's Paillier key and query-signing key (`fedpca analyst keygen`).",
        f"accepted_analyst_keys = {toml_value(analyst_keys)}",
        # A signer given for two keys (one analyst's two keys) is pinned once.
        f"accepted_query_signers = {toml_value(list(dict.fromkeys(signers)))}",
        *_pairing_lines(analyst_keys, signers),
        f"max_epsilon_per_query = {toml_value(max_epsilon_per_query)}   # at the budget's delta",
    ]
    if max_delta_per_query is not None:
        lines.append(f"max_delta_per_query = {toml_value(max_delta_per_query)}")
    lines += [
        "allow_not_private = false   # never answer epsilon = inf queries",
        f"allow_masked_mode = {toml_value(allow_masked_mode)}   # masked mode publishes N",
        f"allowed_kinds = {toml_value(kinds)}",
        *(
            []
            if allowed_columns is None
            else [
                f"allowed_columns = {toml_value(list(allowed_columns))}   # the only file "
                "columns (0-based) a query may read"
            ]
        ),
        f"min_quorum = {min_quorum}   # never contribute to a query of fewer owners",
        f"max_tasks_per_day = {max_tasks_per_day}",
        "",
        "[budget]   # the total (epsilon, delta) this owner will ever spend",
        f"epsilon = {toml_value(budget_epsilon)}",
        f"delta = {toml_value(budget_delta)}",
        *_shares_lines(analyst_keys, equal_shares),
        "",
        "[crypto]",
        "processes = 0   # 0 = all cores",
        'obfuscation = "djn"   # or "standard" (full r^n, one assumption less)',
    ]
    if monitoring_listen is not None:
        lines += [
            "",
            "[monitoring]   # HTTP /metrics, /healthz, /readyz (no TLS: keep it internal)",
            f"listen = {toml_value(monitoring_listen)}",
        ]
    return "\n".join(lines) + "\n"


def _table_facts(path: Path, header: str, label_column: int | None) -> tuple[int, int] | None:
    """(records, feature columns) of the data file, or None if it cannot be read here."""
    from fedpca.tables import load_table

    if not path.is_file():
        return None
    table = load_table(
        path, label_column=label_column, header={"yes": True, "no": False}.get(header, "auto")
    )
    return int(table.features.shape[0]), int(table.features.shape[1])


def _pairing_lines(analyst_keys: list[str], signers: list[str]) -> list[str]:
    """``analyst_key_signers`` pairing the i-th key with the i-th signer, when there are
    as many of each (one analyst each); otherwise none (any signer may name any key)."""
    if len(analyst_keys) != len(signers):
        return []
    table = ", ".join(
        f"{toml_value(key)} = {toml_value([signer])}"
        for key, signer in zip(analyst_keys, signers, strict=True)
    )
    return [
        "# each key answered only for its own analyst's signer",
        f"analyst_key_signers = {{ {table} }}",
    ]


def _shares_lines(analyst_keys: list[str], equal_shares: bool) -> list[str]:
    """``analyst_shares`` giving each pinned key an equal part of the budget, if asked."""
    if not equal_shares:
        return []
    fraction = 1.0 / len(analyst_keys)
    table = ", ".join(f"{toml_value(key)} = {fraction!r}" for key in analyst_keys)
    return [
        "# each analyst key's part: a decline tells an analyst nothing of the others' spend",
        f"analyst_shares = {{ {table} }}",
    ]


def write_owner_folder(
    out: Path,
    *,
    owner_id: str,
    proxy: str,
    data: Path,
    max_records: int | None,
    analyst_keys: list[str],
    signers: list[str],
    certs: Path | None = None,
    tls_files: TlsFiles | None = None,
    header: str = "auto",
    label_column: int | None = None,
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
    max_epsilon_per_query: float = 1.0,
    max_delta_per_query: float | None = None,
    allow_masked_mode: bool = False,
    kinds: list[str] | None = None,
    allowed_columns: Sequence[int] | None = None,
    min_quorum: int = DEFAULT_MIN_QUORUM,
    max_tasks_per_day: int = DEFAULT_MAX_TASKS_PER_DAY,
    budget_epsilon: float = 3.0,
    budget_delta: float = 1e-5,
    state_dir: Path | None = None,
    monitoring_listen: str | None = None,
    force: bool = False,
    replace_settings: bool = False,
    equal_shares: bool = False,
    requested_settings: Sequence[str] = (),
) -> tuple[OwnerConfig, tuple[int, int] | None]:
    """Write an owner folder; return its configuration and the data's (records, features).

    ``data`` is the table's path on this machine (relative paths: to the current
    folder); the configuration names it relative to ``out`` when it lies inside it.
    With ``force`` over an existing owner.toml, a changed setting is refused unless
    ``replace_settings`` or it is among ``requested_settings`` (dotted keys, those of
    the flags given: :func:`~fedpca.transport.bundle.refuse_changed_settings`).

    Raises
    ------
    ConfigError
        A missing ``max_records`` (the table's size is shown, no value suggested), no
        pinned key or signer, an address that is not ``host:port`` (these before
        anything is written), TLS files that are missing or not this owner's, an
        existing folder without ``force``, or values the owner's loader refuses. What
        the call wrote is then undone (:func:`~fedpca.transport.bundle.writing_folder`).
    DataError
        The data file exists but cannot be read as a table.
    """
    validate_node_id(owner_id)
    check_address(proxy, "--proxy")
    if monitoring_listen is not None:
        check_address(monitoring_listen, "--monitoring-listen", listening=True)
    facts = _table_facts(data, header, label_column)
    if allowed_columns is not None and facts is not None:
        width = facts[1] + (label_column is not None)
        outside = columns_outside(allowed_columns, width)
        if outside:
            raise ConfigError(
                f"--allowed-columns names column {outside[0]}, but {data} has {width} "
                f"columns (0 to {width - 1}, the label included)"
            )
    if max_records is None:
        if facts is None:
            raise ConfigError(
                "--max-records is required: the most records this owner will ever "
                "contribute to a query. It is PUBLIC (every analyst and the proxy see it); "
                "queries use a uniform sample when the data holds more"
            )
        # No suggestion computed from the count: any number derived from it (even a
        # rounded one) published as max_records tells neighbouring tables apart.
        raise ConfigError(
            f"--max-records is required. It is PUBLIC: every analyst and the proxy see it. "
            f"({data} holds {facts[0]} records today; this is shown here only.) Choose it "
            "without looking at that count, e.g. the most records this table could ever "
            "hold by your institution's policy: a value taken or rounded from today's "
            "count reveals the count. Queries use a uniform sample when the data holds more"
        )
    if not analyst_keys or not signers:
        raise ConfigError(
            "pin the analyst: --analyst-key sha256:... and --analyst-signer ed25519:... "
            "(both printed by `fedpca analyst keygen`)"
        )
    repeated = [key for n, key in enumerate(analyst_keys) if key in analyst_keys[:n]]
    if repeated:
        raise ConfigError(f"--analyst-key {repeated[0]} is given twice: give each key once")
    if equal_shares and len(analyst_keys) != len(signers):
        raise ConfigError(
            "--equal-analyst-shares pairs each --analyst-key with the --analyst-signer given "
            f"in the same place: give as many of each (got {len(analyst_keys)} "
            f"key{'s' * (len(analyst_keys) != 1)} and {len(signers)} "
            f"signer{'s' * (len(signers) != 1)})"
        )
    text = render_owner_config(
        owner_id=owner_id,
        proxy=proxy,
        data=config_path(data, out),
        header=header,
        label_column=label_column,
        max_records=max_records,
        analyst_keys=analyst_keys,
        signers=signers,
        neighbouring=neighbouring,
        max_epsilon_per_query=max_epsilon_per_query,
        max_delta_per_query=max_delta_per_query,
        allow_masked_mode=allow_masked_mode,
        kinds=kinds or [k.value for k in RELEASE_KINDS],
        allowed_columns=allowed_columns,
        min_quorum=min_quorum,
        max_tasks_per_day=max_tasks_per_day,
        budget_epsilon=budget_epsilon,
        budget_delta=budget_delta,
        state_dir=STATE_DIR if state_dir is None else config_path(state_dir, out),
        monitoring_listen=monitoring_listen,
        equal_shares=equal_shares,
        # Declared for text and .npy files: without records their export may carry no
        # width (an empty file, an array of shape (0,)); a Parquet schema always does.
        n_columns=(
            facts[1] + (label_column is not None)
            if facts is not None and data.suffix.lower() not in (".parquet", ".pq")
            else None
        ),
    )
    also = () if state_dir is None else (state_dir,)
    with writing_folder(out, CONFIG_NAME, force=force, also=also) as folder:
        folder.install_tls(NodeIdentity(Role.OWNER, owner_id), certs=certs, files=tls_files)
        if state_dir is None:
            folder.make_state()
        path = out / CONFIG_NAME
        refuse_changed_settings(
            path,
            text,
            replace_settings=replace_settings,
            requested=requested_settings,
            settable=[key for keys in _FLAG_SETTINGS.values() for key in keys],
        )
        path.write_text(text, encoding="utf-8")
        config = load_config(path)
        # Made here, so that `owner serve` may refuse to start on a ledger that does not
        # exist: a wrong state_dir would otherwise start this owner's budget again at zero.
        # Never where a node ran and its ledger is gone (init --force, --state-dir).
        if not holds_database(config.ledger_path):
            refuse_where_a_node_ran(config)
        relation = config.privacy.neighbouring.value
        others = recorded_relations(config.ledger_path) - {relation}
        if others:
            raise ConfigError(
                f"the budget ledger {config.ledger_path} holds releases recorded under "
                f"{', '.join(sorted(others))} adjacency; with --neighbouring {relation} "
                "this node would decline every query. A deployment keeps one relation "
                "(docs/privacy.md); keep its relation, or start a new ledger in another "
                "state folder"
            )
        owner_ledger(config)
    return config, facts


def _split(values: tuple[str, ...]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


_FLAG_SETTINGS = {
    "owner_id": ("owner.id",),
    "proxy": ("owner.proxy",),
    "state_dir": ("owner.state_dir",),
    "data": ("data.path", "data.n_columns"),
    "label_column": ("data.label_column", "data.n_columns"),
    "header": ("data.header",),
    "max_records": ("data.max_records",),
    "neighbouring": ("privacy.neighbouring",),
    "analyst_keys": ("policy.accepted_analyst_keys", "policy.analyst_key_signers"),
    "signers": ("policy.accepted_query_signers", "policy.analyst_key_signers"),
    "max_epsilon_per_query": ("policy.max_epsilon_per_query",),
    "max_delta_per_query": ("policy.max_delta_per_query",),
    "allow_masked_mode": ("policy.allow_masked_mode",),
    "kinds": ("policy.allowed_kinds",),
    "allowed_columns": ("policy.allowed_columns",),
    "min_quorum": ("policy.min_quorum",),
    "max_tasks_per_day": ("policy.max_tasks_per_day",),
    "budget_epsilon": ("budget.epsilon",),
    "budget_delta": ("budget.delta",),
    "equal_analyst_shares": ("budget.analyst_shares",),
    "monitoring_listen": ("monitoring",),
}
"""The settings in owner.toml each flag of ``init`` writes: with ``--force``, changes
to them are what was asked (shares dropped only with ``--equal-analyst-shares`` given
or ``--replace-settings``)."""


@click.command("init")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The owner's folder to create (owner.toml, tls/, state/).",
)
@click.option("--id", "owner_id", required=True, help="The owner id (as in its certificate).")
@click.option(
    "--proxy",
    required=True,
    metavar="HOST:PORT",
    callback=click_address(),
    help="The proxy, as owners dial it.",
)
@click.option(
    "--certs",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Directory from `fedpca certs init`; this owner's files are copied from it.",
)
@tls_file_options
@click.option(
    "--data",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The owner's table (CSV, .npy, Parquet) as the node will read it.",
)
@click.option(
    "--label-column",
    type=int,
    help="0-based column of the class label (DCA; negative counts from the end) [none].",
)
@click.option(
    "--header",
    type=click.Choice(["auto", "yes", "no"]),
    default="auto",
    show_default=True,
    help="Whether the CSV's first line names the columns (auto: when it is not all numbers).",
)
@click.option(
    "--max-records",
    type=click.IntRange(min=1),
    help="PUBLIC capacity: the most records a query uses (required). Choose it without "
    "looking at the table's size: a value taken or rounded from it reveals it.",
)
@click.option(
    "--analyst-key",
    "analyst_keys",
    multiple=True,
    help="Pinned Paillier key fingerprint sha256:... (repeatable).",
)
@click.option(
    "--analyst-signer",
    "signers",
    multiple=True,
    help="Pinned query signer ed25519:... (repeatable). Given once per --analyst-key, in "
    "the same order, each key is answered only for its own signer.",
)
@click.option(
    "--neighbouring",
    type=click.Choice([n.value for n in Neighbouring]),
    default=Neighbouring.ADD_REMOVE.value,
    show_default=True,
    help="The adjacency the ledger accounts under; must be the proxy's (docs/privacy.md).",
)
@click.option(
    "--max-epsilon-per-query",
    type=NUMBER,
    default=1.0,
    show_default=True,
    help="Decline any query asking more (policy.max_epsilon_per_query).",
)
@click.option("--max-delta-per-query", type=NUMBER, help="[the budget's delta, at most 1e-5]")
@click.option(
    "--budget-epsilon",
    type=NUMBER,
    default=3.0,
    show_default=True,
    help="This owner's total privacy budget over every query it answers.",
)
@click.option(
    "--budget-delta", type=NUMBER, default=1e-5, show_default=True, help="The budget's delta."
)
@click.option(
    "--equal-analyst-shares",
    is_flag=True,
    help="Give each pinned analyst key an equal share of the budget (budget.analyst_shares): "
    "a decline then tells an analyst nothing of the others' spending.",
)
@click.option("--allow-masked-mode", is_flag=True, help="Take part in masked mode (publishes N).")
@click.option(
    "--kinds",
    default=",".join(k.value for k in RELEASE_KINDS),
    show_default=True,
    help="Release kinds answered (policy.allowed_kinds).",
)
@click.option(
    "--allowed-columns",
    type=COLUMNS,
    help="The only file columns (0-based, the label's counted) a query may read, e.g. "
    "1,2,5 (policy.allowed_columns) [every column].",
)
@click.option(
    "--min-quorum",
    type=click.IntRange(min=1),
    default=DEFAULT_MIN_QUORUM,
    show_default=True,
    help="Smallest quorum this owner contributes to (1: its statistics may be released alone).",
)
@click.option(
    "--max-tasks-per-day",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_TASKS_PER_DAY,
    show_default=True,
    help="Queries answered in any 24 hours, at most; an analyst's refunded ones count "
    "against it (policy.max_tasks_per_day).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Ledger folder [OUT/state].",
)
@click.option(
    "--monitoring-listen",
    callback=click_address(listening=True),
    help="host:port of /metrics and health (off by default).",
)
@click.option("--force", is_flag=True, help="Write the folder again (state/ is kept).")
@click.option(
    "--replace-settings",
    is_flag=True,
    help="With --force: accept changes to the existing configuration's settings.",
)
def init_command(
    out: Path,
    owner_id: str,
    proxy: str,
    certs: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    data: Path,
    label_column: int | None,
    header: str,
    max_records: int | None,
    analyst_keys: tuple[str, ...],
    signers: tuple[str, ...],
    neighbouring: str,
    max_epsilon_per_query: float,
    max_delta_per_query: float | None,
    budget_epsilon: float,
    budget_delta: float,
    equal_analyst_shares: bool,
    allow_masked_mode: bool,
    kinds: str,
    allowed_columns: tuple[int, ...] | None,
    min_quorum: int,
    max_tasks_per_day: int,
    state_dir: Path | None,
    monitoring_listen: str | None,
    force: bool,
    replace_settings: bool,
) -> None:
    """Write a complete owner folder: owner.toml, its TLS files and state/."""
    try:
        files = None
        if any((ca, cert, key)):
            if not all((ca, cert, key)) or certs is not None:
                raise ConfigError("give --certs DIR, or all of --ca, --cert and --key")
            assert ca is not None and cert is not None and key is not None
            files = TlsFiles(ca, cert, key)
        elif certs is None:
            raise ConfigError("give --certs DIR (from `fedpca certs init`) or --ca/--cert/--key")
        config, facts = write_owner_folder(
            out,
            owner_id=owner_id,
            proxy=proxy,
            data=data,
            max_records=max_records,
            analyst_keys=_split(analyst_keys),
            signers=_split(signers),
            certs=certs,
            tls_files=files,
            header=header,
            label_column=label_column,
            neighbouring=Neighbouring(neighbouring),
            max_epsilon_per_query=max_epsilon_per_query,
            max_delta_per_query=max_delta_per_query,
            allow_masked_mode=allow_masked_mode,
            kinds=_split((kinds,)),
            allowed_columns=allowed_columns,
            min_quorum=min_quorum,
            max_tasks_per_day=max_tasks_per_day,
            budget_epsilon=budget_epsilon,
            budget_delta=budget_delta,
            state_dir=state_dir,
            monitoring_listen=monitoring_listen,
            force=force,
            replace_settings=replace_settings,
            equal_shares=equal_analyst_shares,
            requested_settings=settings_given(_FLAG_SETTINGS),
        )
    except (FedpcaError, DataError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {out / CONFIG_NAME}")
    click.echo(f"  owner           {config.owner.id} -> proxy {config.owner.proxy}")
    if facts is None:
        click.secho(
            f"  data            {config.data.path} is not readable from here: set data.n_columns "
            "by hand, or run this again with --force once the table is there (until then "
            "`fedpca owner probe` and the node refuse to start)",
            fg="yellow",
        )
    else:
        from fedpca.tables import describe_columns

        records, features = facts
        n_columns = features + (label_column is not None)
        label = None if label_column is None else label_column % n_columns
        click.echo(f"  data            {records} records, {describe_columns(n_columns, label)}")
        if records > config.data.max_records:
            click.echo(
                f"                  queries use a uniform sample of {config.data.max_records}"
            )
    click.echo(f"  max_records     {config.data.max_records} (PUBLIC)")
    click.echo(f"  budget ledger   {config.ledger_path}")
    epsilon = config.budget.epsilon
    click.echo(
        f"  budget          epsilon {epsilon if math.isfinite(epsilon) else 'unlimited'} at "
        f"delta {config.budget.delta:g}; at most {config.policy.max_epsilon_per_query:g} "
        "per query"
    )
    if config.policy.allowed_columns is not None:
        listed = ", ".join(str(c) for c in config.policy.allowed_columns)
        click.echo(f"  columns         queries may read only columns {listed}")
    for analyst, fraction in config.analyst_shares.items():
        click.echo(f"  share           {fraction:.6g} of it for analyst {analyst}")
    pairs = config.policy.analyst_key_signers
    for pinned in config.policy.accepted_analyst_keys:
        if pairs:
            click.echo(f"  analyst key     {pinned} for signer {', '.join(pairs[pinned])}")
        else:
            click.echo(f"  analyst key     {pinned}")
    if not pairs:
        click.secho(
            "  signers         not paired with keys (not one --analyst-signer per "
            "--analyst-key): any pinned signer may name any pinned key",
            fg="yellow",
        )
    click.echo(f"run: fedpca owner serve --config {out / CONFIG_NAME}")
