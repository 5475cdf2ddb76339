"""``host:port`` addresses: one rule for what every role dials and listens on, checked
where an address is given (flags, ``init``, the loaders)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fedpca.analyst.cli import analyst_group
from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.errors import ConfigError
from fedpca.transport.addresses import address_problem, check_address


@pytest.mark.parametrize(
    "value",
    ["proxy.example.org:50051", "localhost:1", "127.0.0.1:65535", "[::1]:50051", "[fe80::1]:7"],
)
def test_host_port_is_accepted(value: str) -> None:
    assert address_problem(value) is None
    assert check_address(value, "proxy") == value


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("localhost", "has no port (e.g. localhost:50051)"),
        ("", "has no port"),
        (":50051", "has no host"),
        ("::1:50051", "an IPv6 address goes in brackets"),
        ("[::1:50051", "does not close"),
        ("[::1]", "has no port"),
        ("[proxy]:1", "is not an IPv6 address"),
        ("my host:1", "is not a host name or IP address"),
        ("localhost:http", "is not a number"),
        ("localhost:\u0661", "is not a number"),  # another script's digit one
        ("localhost:0", "out of range (1 to 65535)"),
        ("localhost:65536", "out of range"),
        ("localhost:" + "9" * 5000, "out of range"),
    ],
)
def test_anything_else_is_refused_naming_the_setting(value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match="--proxy must be 'host:port'") as info:
        check_address(value, "--proxy")
    assert problem in str(info.value)


def test_port_zero_is_only_for_listening() -> None:
    assert address_problem("0.0.0.0:0", listening=True) is None
    assert "0 = any free port" in str(address_problem("0.0.0.0:70000", listening=True))


def test_the_analyst_refuses_a_proxy_without_port_when_it_is_given(tmp_path: Path) -> None:
    """A new operator's review: analyst.toml with ``proxy = "localhost"`` was accepted
    and failed only when a command tried to connect."""
    config = tmp_path / "analyst.toml"
    config.write_text('proxy = "localhost"\ninsecure = true\n')
    with pytest.raises(ConfigError, match="proxy must be 'host:port'") as info:
        load_analyst_config(config)
    assert str(config) in str(info.value)
    # The --proxy flag of every analyst command, before any connection is tried.
    result = CliRunner().invoke(analyst_group, ["budget", "--proxy", "localhost", "--insecure"])
    assert result.exit_code == 2 and "Invalid value for '--proxy'" in result.output
    assert "has no port" in result.output
