"""The ``fedpca`` console entry point: one subcommand group per role.

Subcommands are imported lazily so that ``fedpca --help`` and short commands do
not pay for importing grpc, scipy and matplotlib.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import click

# gRPC's C core writes its own lines to stderr (e.g. "I1124 ... Handshake failed" for
# every peer refused at the TLS handshake), outside fedpca's log format (--log-format
# json promises one object per line). Keep its errors only, unless the operator asks
# for more (GRPC_VERBOSITY=INFO to see each refused handshake). Read when grpc is first
# imported: subcommands import it lazily, after this line.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from fedpca import logs
from fedpca.version import build_description

# name -> (module, attribute, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "dp": ("fedpca.app.dp_cli", "dp_group", "Differential-privacy calibration and accounting."),
    "certs": ("fedpca.app.certs_cli", "certs_group", "Create and inspect TLS certificates."),
    "owner": ("fedpca.owner.cli", "owner_group", "Run a data-owner node."),
    "proxy": ("fedpca.proxy.cli", "proxy_group", "Run the proxy (aggregator)."),
    "analyst": ("fedpca.analyst.cli", "analyst_group", "Analyst: keys, PCA, DCA, aggregates."),
    "demo": ("fedpca.app.demo", "demo_command", "Run proxy, owners and analyst on loopback."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = _SUBCOMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attribute, _ = entry
        command: click.Command = getattr(importlib.import_module(module_name), attribute)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _SUBCOMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def configure_logging(verbosity: int, log_format: str | None = None) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logs.configure_logging(level, log_format)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
# "fedpca, version 0.2.0 (wire protocol 4)": builds of one release may speak different
# wire protocols, and nodes of different ones cannot work together.
@click.version_option(build_description(), prog_name="fedpca")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option(
    "--log-format",
    type=click.Choice([f.value for f in logs.LogFormat]),
    default=None,
    help=f"Log lines as text or one JSON object per line [${logs.LOG_FORMAT_ENV}, else text].",
)
def main(verbose: int, log_format: str | None, **_: Any) -> None:
    """Federated, differentially private PCA/DCA.

    Owners encrypt local scatter shares under the analyst's Paillier key, a proxy
    aggregates them and adds calibrated noise under encryption, and the analyst
    decrypts only differentially private statistics.
    """
    logs.one_line_warnings()
    try:
        configure_logging(verbose, log_format)
    except ValueError as exc:
        raise click.UsageError(f"${logs.LOG_FORMAT_ENV}: {exc}") from None


if __name__ == "__main__":
    main()
