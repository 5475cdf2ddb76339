"""``fedpca owner probe``: check an owner node's whole setup, one line per check.

Usable by hand before the first ``serve`` and as a Kubernetes exec probe: it exits 0
when every check passes, 1 otherwise. In order:

1. **config** - ``owner.toml`` loads (every key known and valid);
2. **data** - the table loads and its schema is what the config says (columns,
   label column); records are not looked at beyond their shape;
3. **tls** - CA, certificate and key belong together and name this owner; a
   certificate close to expiry is reported;
4. **state** - the ledger folder exists or can be created, and is writable;
5. **proxy** - every address of the proxy is tried and its certificate verified
   against the CA and the host name (:mod:`fedpca.transport.diagnose`);
6. **enrolled** - the proxy answers Hello with this owner's certificate, i.e. it is on
   the proxy's allow-list and not revoked.

Checks after a failed one that they depend on are skipped and say so.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedpca.errors import FedpcaError
from fedpca.files import database_missing, holds_database
from fedpca.formatting import exact, first_of
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger_rows import recorded_relations
from fedpca.transport.certs import TlsMaterial

if TYPE_CHECKING:
    from fedpca.owner.local_table import LocalTable

__all__ = ["ProbeResult", "probe_owner"]

EXPIRY_WARNING_DAYS = 30


@dataclass(frozen=True)
class ProbeResult:
    """One check: its name, whether it passed (None: skipped) and one line of detail."""

    name: str
    ok: bool | None
    detail: str

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[self.ok]
        return f"{mark}  {self.name:<9} {self.detail}"


LABEL_VALUES_SHOWN = 10
"""Distinct label values the probe names; it counts the others."""


def _label_values(table: LocalTable) -> str:
    """The label column's distinct values, for the owner's operator alone: a DCA query
    names its classes exactly as the tables hold them, and one naming values a table
    lacks is charged for noise (a walkthrough of stop 45: the probe said nothing of
    them, so an owner could not tell the analyst -1,1 from 0,1)."""
    if table.label_column is None or table.n_records == 0:
        return ""
    values = np.unique(table.columns[:, table.label_column])
    # Every digit: a query's class must equal a label exactly (0.1 is not 0.1000001).
    shown = first_of([exact(value) for value in values], LABEL_VALUES_SHOWN)
    return f"; label values (shown here only, not sent to the proxy): {shown}"


def probe_owner(
    config_path: Path,
    *,
    timeout: float = 10.0,
    report: Callable[[ProbeResult], None],
    local: bool = False,
) -> bool:
    """Run the checks of an owner's setup, ``report`` each; True if all passed.

    With ``local``, only this node's own setup (config, data, TLS files, state): the
    proxy and the enrolment are reported as skipped, so a container's startup probe
    does not restart a node that would wait for its proxy anyway."""
    from fedpca.owner.config import load_config
    from fedpca.owner.local_table import LocalTable
    from fedpca.owner.policy import check_allowed_columns
    from fedpca.tables import describe_columns

    results: list[ProbeResult] = []

    def record(name: str, ok: bool | None, detail: str) -> None:
        result = ProbeResult(name, ok, detail)
        results.append(result)
        report(result)

    try:
        config = load_config(config_path)
    except FedpcaError as exc:
        record("config", False, str(exc))
        for name in ("data", "tls", "state", "proxy", "enrolled"):
            record(name, None, "needs a valid config")
        return False
    record("config", True, f"{config_path}: owner {config.owner.id}, proxy {config.owner.proxy}")

    try:
        table = LocalTable.load(config.data)
        check_allowed_columns(config.policy, table)
    except (FedpcaError, ValueError) as exc:
        record("data", False, str(exc))
    else:
        layout = describe_columns(table.n_columns, table.label_column)
        cap = config.data.max_records
        sampled = (
            f"; it holds more records than max_records: queries use a uniform sample of {cap} "
            "(raise data.max_records to use them all)"
            if table.n_records > cap
            else ""
        )
        record(
            "data",
            True,
            f"{config.data.path}: {layout}; max_records {cap} (public){sampled}"
            + _label_values(table),
        )

    tls = None
    if config.tls.insecure:
        record("tls", None, "tls.insecure = true: no TLS (local experiments only)")
    else:
        tls = _check_tls(config, record)

    _check_state(config, record)
    if local:
        for name in ("proxy", "enrolled"):
            record(name, None, "not checked (--local)")
        return all(result.ok is not False for result in results)

    from fedpca.transport.diagnose import diagnose_connection

    diagnosis = diagnose_connection(
        config.owner.proxy,
        None if tls is None else tls.root_certificates,
        timeout=timeout,
    )
    if diagnosis.problem is not None:
        record("proxy", False, diagnosis.problem)
    elif not diagnosis.reachable:
        record("proxy", False, f"{config.owner.proxy} unreachable: {diagnosis.summary()}")
    else:
        record("proxy", True, f"{config.owner.proxy}: {diagnosis.summary()}")

    if results[-1].ok and (tls is not None or config.tls.insecure):
        _check_enrolled(config, tls, timeout, record)
    else:
        record("enrolled", None, "needs a reachable proxy and valid TLS files")
    return all(result.ok is not False for result in results)


def _check_tls(
    config: OwnerConfig, record: Callable[[str, bool | None, str], None]
) -> TlsMaterial | None:
    from fedpca.transport.certs import (
        NodeIdentity,
        Role,
        private_key_exposure,
        read_certificate,
    )

    try:
        files = config.tls.files()
        tls = TlsMaterial.load(files)
        expected = NodeIdentity(Role.OWNER, config.owner.id)
        if tls.identity != expected:
            record("tls", False, f"{files.certificate} certifies {tls.identity}, not {expected}")
            return None
        expires = read_certificate(files.certificate).not_valid_after_utc
    except FedpcaError as exc:
        record("tls", False, str(exc))
        return None
    left = expires - dt.datetime.now(dt.UTC)  # TlsMaterial.load refused an expired one
    soon = left.days < EXPIRY_WARNING_DAYS
    exposure = private_key_exposure(files.private_key)
    record(
        "tls",
        True,
        f"{tls.identity}, valid until {expires:%Y-%m-%d}"
        + (f" (only {left.days} days left: renew it)" if soon else "")
        + ("" if exposure is None else f" (warning: {exposure})"),
    )
    return tls


def _check_state(config: OwnerConfig, record: Callable[[str, bool | None, str], None]) -> None:
    state_dir, ledger = config.owner.state_dir, config.ledger_path
    relation = config.privacy.neighbouring.value
    existing = state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        record("state", False, f"{state_dir}: {existing} is not a writable folder")
    elif not holds_database(ledger):
        # `owner serve` refuses to start on a ledger that does not exist (or is empty).
        record(
            "state",
            False,
            f"{database_missing(ledger)}: if this node ran before, state_dir names the wrong "
            "folder or the ledger was lost (restore it from a backup); on a first start "
            "`fedpca owner new-ledger` creates it",
        )
    elif others := recorded_relations(ledger) - {relation}:
        record(
            "state",
            False,
            f"{ledger} holds releases recorded under {', '.join(sorted(others))} adjacency, "
            f"but this configuration accounts under {relation}: every query would be declined",
        )
    else:
        record("state", True, f"{state_dir} holds the budget ledger, writable")


def _check_enrolled(
    config: OwnerConfig,
    tls: TlsMaterial | None,
    timeout: float,
    record: Callable[[str, bool | None, str], None],
) -> None:
    import grpc

    from fedpca.messages import OwnerHello
    from fedpca.transport import serde
    from fedpca.transport.channels import insecure_channel, secure_channel
    from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
    from fedpca.version import __version__

    target = config.owner.proxy
    if tls is not None:
        channel = secure_channel(target, tls)
    else:
        channel = insecure_channel(target, node_id=config.owner.id)
    with channel:
        stub = owner_grpc.OwnerServiceStub(channel)
        hello = serde.owner_hello_to_proto(OwnerHello(config.owner.id, __version__))
        try:
            info = serde.proxy_info_from_proto(stub.Hello(hello, timeout=timeout))
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            record("enrolled", False, f"{code.name if code else 'error'}: {details}")
            return
        except FedpcaError as exc:
            record("enrolled", False, f"the proxy's answer is malformed: {exc}")
            return
    record(
        "enrolled",
        True,
        f"proxy {info.proxy_id} (fedpca {info.software_version}) accepts "
        f"{info.authenticated_node_id}",
    )
