"""A local fedpca deployment on loopback: the building block of the demo and the tests.

:class:`LocalCluster` lays out a working folder (certificates from a fresh CA, the
analyst's Paillier key, one data file and one TOML config per owner, the proxy's
config), then starts the proxy and the owner nodes as separate OS processes
running the real ``fedpca proxy serve`` / ``fedpca owner serve`` commands over
mutual TLS, and stops them again. Nothing here is a shortcut around the
protocol: the processes only share the files a real deployment would hand out.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from fedpca.errors import ConfigError

logger = logging.getLogger(__name__)

PROXY_READY_MARKER = "proxy listening on"
OWNER_READY_MARKER = "connected to"


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str | Path):
        text = str(value).replace("\\", "\\\\").replace('"', '\\"')
        return f'"{text}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def write_toml(path: Path, document: dict[str, dict[str, Any]]) -> None:
    """Write a two-level TOML document (tables of scalars and lists)."""
    lines: list[str] = []
    for table, entries in document.items():
        lines.append(f"[{table}]")
        lines.extend(
            f"{key} = {_toml_value(value)}" for key, value in entries.items() if value is not None
        )
        lines.append("")
    path.write_text("\n".join(lines))


def split_rows(n_rows: int, n_owners: int, seed: int = 0) -> list[npt.NDArray[np.int64]]:
    """Row indices of each owner: a seeded shuffle cut into near-equal parts."""
    if n_owners < 1:
        raise ConfigError(f"need at least one owner, got {n_owners}")
    if n_rows < n_owners:
        raise ConfigError(f"{n_rows} rows cannot be split over {n_owners} owners")
    order = np.random.default_rng(seed).permutation(n_rows)
    return [np.sort(part) for part in np.array_split(order, n_owners)]


@dataclass
class ManagedProcess:
    """A child process with its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def log_text(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for(self, marker: str, timeout: float) -> None:
        """Block until ``marker`` appears in the log, or fail with the log's tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.log_text():
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        tail = "\n".join(self.log_text().splitlines()[-30:])
        state = (
            "exited with code " + str(self.process.returncode)
            if self.process.poll() is not None
            else f"did not print {marker!r} within {timeout:.0f} s"
        )
        raise RuntimeError(f"{self.name} {state}; last log lines:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL after ``timeout``); then reap leftovers, close the log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill()
        self.log_file.close()

    def kill(self) -> None:
        """SIGKILL the process and everything it started: the crash a durable process must survive.

        The signal goes to the process group (each child runs in its own session),
        as a crash of its machine or container would: a ``kill -9`` of the main pid
        alone leaves its crypto pool's forkserver and workers running as orphans.
        """
        with contextlib.suppress(ProcessLookupError):  # the whole group has already exited
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@dataclass
class LocalCluster:
    """Working folder and processes of a loopback deployment.

    Parameters
    ----------
    workdir : folder for certificates, keys, data, configs, state and logs.
    owner_tables : per owner, the rows (label column first when ``label_column`` is 0).
    key_bits : analyst Paillier key size (2048 or more outside tests).
    label_column : column of the label in the owners' files, or None.
    epsilon_budget, delta_budget : the owners' and the analyst's total budgets.
    max_epsilon_per_query : owners' policy; ``inf`` also allows NOT PRIVATE queries.
    processes_per_node : worker processes each node's crypto pool may use.
    proxy_command : argv that starts the proxy instead of
        ``python -m fedpca.app.cli -v proxy serve``; ``--config <proxy.toml>`` is
        appended. The command must print ``proxy listening on HOST:PORT`` once it
        serves and stop on SIGTERM. Tests use it to run a TEST-ONLY launcher
        (e.g. one with a seeded noise sampler); None runs the real command.
    analyst_ids : the analysts that get a certificate (the first is the analyst of
        :meth:`analyst_connection`).
    allowed_owners : the proxy's ``[owners] allowed`` (None: every owner). An owner left
        out still gets a certificate from the CA, as an unlisted intruder would.
    revoked_owners : owners whose certificate serial the proxy lists in
        ``[tls] revoked_serials``.
    extra_query_signers : more query signers every owner pins (another analyst's signing
        key: a proxy binds each signing key to the first analyst submitting with it).
    proxy_settings, owner_settings : extra keys written into the proxy's TOML tables
        (``{"limits": {...}}``) and into one owner's (``{"owner-1": {"policy": {...}}}``);
        they win over the keys this class writes.
    data_suffix : the owners' data files' format, ``.csv`` or ``.npy`` (large tables).
    """

    workdir: Path
    owner_tables: Sequence[npt.NDArray[np.float64]]
    key_bits: int = 2048
    label_column: int | None = 0
    epsilon_budget: float = 100.0
    delta_budget: float = 1e-3
    max_epsilon_per_query: float = 10.0
    allow_not_private: bool = False
    neighbouring: str = "add-remove"
    """The deployment's neighbouring relation (proxy and every owner state it)."""
    allow_masked_mode: bool = False
    """Owners take part in masked-mode queries (needs ``neighbouring = "replace-one"``)."""
    processes_per_node: int = 0
    heartbeat_seconds: float = 2.0
    extra_env: dict[str, str] = field(default_factory=dict)
    proxy_command: list[str] | None = None
    proxy: ManagedProcess | None = None
    owners: list[ManagedProcess] = field(default_factory=list)
    analyst_ids: tuple[str, ...] = ("analyst",)
    extra_query_signers: tuple[str, ...] = ()
    allowed_owners: Sequence[str] | None = None
    revoked_owners: Sequence[str] = ()
    proxy_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    owner_settings: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    data_suffix: str = ".csv"
    port: int = 0
    key_fingerprint: str = ""
    query_signer: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Child processes run with the working folder as cwd, so every path handed to
        # them must be absolute.
        self.workdir = Path(self.workdir).resolve()

    # ----------------------------------------------------------------- layout
    @property
    def owner_ids(self) -> list[str]:
        return [f"owner-{i + 1}" for i in range(len(self.owner_tables))]

    @property
    def proxy_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def certs_dir(self) -> Path:
        return self.workdir / "certs"

    @property
    def key_dir(self) -> Path:
        return self.workdir / "keys"

    @property
    def proxy_config(self) -> Path:
        return self.workdir / "proxy.toml"

    def owner_config(self, owner_id: str) -> Path:
        return self.workdir / f"{owner_id}.toml"

    def analyst_tls(self, analyst_id: str | None = None) -> Any:
        """TLS files of ``analyst_id`` (default: the first of ``analyst_ids``)."""
        return self.node_tls("analyst", analyst_id or self.analyst_ids[0])

    def node_tls(self, role: str, node_id: str) -> Any:
        """TLS files (CA, certificate, key) of one node: ``role`` is owner, proxy or analyst."""
        from fedpca.transport.certs import CertificateDirectory, NodeIdentity, Role

        return CertificateDirectory(self.certs_dir).node_files(NodeIdentity(Role(role), node_id))

    def analyst_connection(self) -> dict[str, Any]:
        """Keyword arguments that point a FederatedPCA/DCA at this cluster as its analyst."""
        tls = self.analyst_tls()
        return {
            "proxy": self.proxy_address,
            "ca": tls.ca_certificate,
            "cert": tls.certificate,
            "key": tls.private_key,
            "private_key_path": self.key_dir / "analyst.key.json",
        }

    def prepare(self) -> None:
        """Create certificates, the analyst key, owner data files and configs."""
        from fedpca.analyst.keys import create_analyst_keys
        from fedpca.transport.certs import (
            CertificateDirectory,
            NodeIdentity,
            Role,
            init_certificates,
            read_certificate,
        )

        if self.data_suffix not in (".csv", ".npy"):
            raise ConfigError(f"data_suffix must be '.csv' or '.npy', got {self.data_suffix!r}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        init_certificates(self.certs_dir, self.owner_ids, list(self.analyst_ids), force=True)
        self.timings["certificates"] = time.perf_counter() - started

        started = time.perf_counter()
        keys = create_analyst_keys(
            self.key_dir,
            self.key_bits,
            force=True,
            allow_insecure_test_key=self.key_bits < 2048,
        )
        self.key_fingerprint = keys.fingerprint
        self.query_signer = keys.signer
        self.timings["key generation"] = time.perf_counter() - started

        self.port = free_loopback_port()
        directory = CertificateDirectory(self.certs_dir)
        proxy_files = directory.node_files(NodeIdentity(Role.PROXY, "proxy"))
        revoked = [
            format(
                read_certificate(self.node_tls("owner", owner_id).certificate).serial_number, "x"
            )
            for owner_id in self.revoked_owners
        ]
        write_toml(
            self.proxy_config,
            self._with_settings(
                self.proxy_settings,
                {
                    "proxy": {
                        "id": "proxy",
                        "listen": self.proxy_address,
                        "database": "state/proxy.sqlite3",
                        "heartbeat_seconds": self.heartbeat_seconds,
                    },
                    "tls": {
                        "ca": proxy_files.ca_certificate,
                        "cert": proxy_files.certificate,
                        "key": proxy_files.private_key,
                        "revoked_serials": revoked or None,
                    },
                    "owners": {
                        "allowed": list(
                            self.owner_ids if self.allowed_owners is None else self.allowed_owners
                        )
                    },
                    "privacy": {"neighbouring": self.neighbouring},
                    # A verification (epsilon = inf) run only passes an unlimited budget.
                    "budget": {
                        "epsilon": math.inf if self.allow_not_private else self.epsilon_budget,
                        "delta": self.delta_budget,
                    },
                    "crypto": {
                        "processes": self.processes_per_node,
                        # TEST-ONLY keys (below 2048 bits) are refused unless this is set.
                        "allow_insecure_test_keys": True if self.key_bits < 2048 else None,
                    },
                },
            ),
        )
        data_dir = self.workdir / "data"
        data_dir.mkdir(exist_ok=True)
        for owner_id, table in zip(self.owner_ids, self.owner_tables, strict=True):
            path = data_dir / f"{owner_id}{self.data_suffix}"
            if self.data_suffix == ".npy":
                np.save(path, np.asarray(table, dtype=np.float64))
            else:
                np.savetxt(path, table, delimiter=",", fmt="%.17g")
            files = directory.node_files(NodeIdentity(Role.OWNER, owner_id))
            write_toml(
                self.owner_config(owner_id),
                self._with_settings(
                    self.owner_settings.get(owner_id, {}),
                    {
                        "owner": {
                            "id": owner_id,
                            "proxy": self.proxy_address,
                            "state_dir": f"state/{owner_id}",
                        },
                        "tls": {
                            "ca": files.ca_certificate,
                            "cert": files.certificate,
                            "key": files.private_key,
                        },
                        "data": {
                            "path": path,
                            "header": False,
                            "n_columns": int(np.asarray(table).shape[1]),
                            "label_column": self.label_column,
                            # Public capacity: the demo's tables are public anyway.
                            "max_records": max(1, len(table)),
                        },
                        "policy": {
                            "accepted_analyst_keys": [self.key_fingerprint],
                            "accepted_query_signers": [
                                self.query_signer,
                                *self.extra_query_signers,
                            ],
                            "max_epsilon_per_query": self.max_epsilon_per_query,
                            "allow_not_private": self.allow_not_private,
                            "allow_masked_mode": self.allow_masked_mode,
                            # Loopback deployments (demo, tests) run queries of any
                            # quorum down to 1; a real owner's default is 2.
                            "min_quorum": 1,
                        },
                        "privacy": {"neighbouring": self.neighbouring},
                        "budget": {"epsilon": self.epsilon_budget, "delta": self.delta_budget},
                        "crypto": {"processes": self.processes_per_node},
                    },
                ),
            )

    @staticmethod
    def _with_settings(
        settings: dict[str, dict[str, Any]], document: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """``document`` with ``settings``' keys written over its tables' (tables added)."""
        merged = {table: dict(entries) for table, entries in document.items()}
        for table, entries in settings.items():
            merged.setdefault(table, {}).update(entries)
        return merged

    # -------------------------------------------------------------- processes
    def _spawn(
        self, name: str, args: list[str], command: Sequence[str] | None = None
    ) -> ManagedProcess:
        """Start ``command`` (default: this Python's ``-m fedpca.app.cli -v``) plus ``args``."""
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed by ManagedProcess.stop
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        prefix = [sys.executable, "-m", "fedpca.app.cli", "-v"] if command is None else command
        process = subprocess.Popen(
            [*prefix, *args],
            cwd=self.workdir,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: see ManagedProcess.kill
        )
        return ManagedProcess(name, process, log_path, log_file)

    def start_proxy(self, timeout: float = 60.0) -> ManagedProcess:
        """Start the proxy; again after a stop or kill: same config and database.

        Its log file starts afresh: read a killed proxy's log before restarting it.
        """
        config = ["--config", str(self.proxy_config)]
        if self.proxy_command is None:
            # The cluster writes its configs itself (no `proxy init`), so the first start
            # creates the database; later starts find it.
            self.proxy = self._spawn("proxy", ["proxy", "serve", *config, "--new-database"])
        else:
            self.proxy = self._spawn("proxy", config, command=self.proxy_command)
        self.proxy.wait_for(PROXY_READY_MARKER, timeout)
        return self.proxy

    def start_owners(
        self, timeout: float = 60.0, owner_ids: Sequence[str] | None = None, *, wait: bool = True
    ) -> list[ManagedProcess]:
        """Start the owner nodes (all, or those in ``owner_ids``) and wait until connected
        (``wait=False``: do not wait, e.g. for an owner the proxy is expected to refuse)."""
        chosen = self.owner_ids if owner_ids is None else list(owner_ids)
        unknown = sorted(set(chosen) - set(self.owner_ids))
        if unknown:
            raise ConfigError(f"unknown owners {unknown}; this cluster has {self.owner_ids}")
        # As for the proxy: no `owner init` here, so the first start creates the ledger.
        started = [
            self._spawn(
                owner_id,
                ["owner", "serve", "--config", str(self.owner_config(owner_id)), "--new-ledger"],
            )
            for owner_id in chosen
        ]
        self.owners.extend(started)
        for process in started if wait else ():
            process.wait_for(OWNER_READY_MARKER, timeout)
        return started

    def start(self) -> None:
        started = time.perf_counter()
        self.start_proxy()
        self.start_owners()
        self.timings["start processes"] = time.perf_counter() - started

    def stop(self) -> None:
        for process in [*self.owners, *([self.proxy] if self.proxy else [])]:
            process.stop()
        self.owners.clear()
        self.proxy = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
