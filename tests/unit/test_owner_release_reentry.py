"""Re-entering the releases a restored owner ledger forgot.

An operator's review (stop 37) found that an owner's ledger restored from a backup
forgot every release made since, silently: the analysts could spend that part of the
owner's budget again, and fedpca had no command to re-enter them (only advice to lower
the budget by hand). `fedpca proxy export-releases --owner ID` now writes the queries
with a release that owner's uploads joined, as their analysts signed them, and `fedpca
owner import-releases` charges each one the ledger lacks at the cost the signed query
states.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_proxy_cli import write_config
from test_proxy_coordinator import (
    Clock,
    finish_with_owners,
    key,
    make_config,
    make_coordinator,
    make_spec,
    owners_for,
)

from fedpca.codec import CryptoPool, key_fingerprint
from fedpca.dp.accounting import Accountant, compose_epsilon
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import ConfigError
from fedpca.owner.cli import owner_group
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.proxy.cli import proxy_group
from fedpca.query import spec_digest
from fedpca.query_records import spec_from_dict, spec_to_dict
from fedpca.release_exports import read_contributed_releases
from helpers import SECOND_TEST_SIGNER, TEST_SIGNER, dataset_table, signed

BUDGET = PrivacyParams(10.0, 1e-5)
EVENT_FIELDS = ("noise_multiplier", "epsilon", "delta", "neighbouring", "sensitivity")


def _charged_by_proxy(store: Any, query_id: str) -> PrivacyEvent:
    (record,) = [r for r in store.releases("alice") if r["query_id"] == query_id]
    return PrivacyEvent.from_dict(record)


@pytest.fixture
def deployment(tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any) -> dict[str, Any]:
    """A proxy database in which owner-0's uploads joined q1 and q2 and not q3, and an
    owner-0 ledger backed up after q1: it holds q1 only."""
    public_key, _ = test_only_keypair_512
    (tmp_path / "state").mkdir()
    clock = Clock()
    clock.now = time.time()  # the proxy checks the signing time against the real one
    coordinator = make_coordinator(tmp_path / "state", pool, make_config(10.0), clock=clock)
    features = dataset_table("ionosphere")[:, 1:]
    owners = owners_for([features[0:120], features[120:240], features[240:]])
    runs = {"q1": (1.0, owners), "q2": (0.5, owners[:2]), "q3": (0.7, owners[1:])}
    digests: dict[str, str] = {}
    for query_id, (epsilon, joined) in runs.items():
        spec = make_spec(public_key, query_id, epsilon=epsilon, delta=1e-6, quorum=len(joined))
        # Signed by the analyst at the proxy's time: uploads join within the query's life.
        spec = dataclasses.replace(spec, issued_at=clock.now)
        digests[query_id] = spec_digest(spec)
        coordinator.submit("alice", signed(spec))
        finish_with_owners(coordinator, pool, public_key, joined, query_id)
    charged = {q: _charged_by_proxy(coordinator.store, key(q)) for q in runs}
    proxy_config, _ = write_config(tmp_path)
    owner_config = tmp_path / "owner-0" / "owner.toml"
    owner_config.parent.mkdir()
    owner_config.write_text(
        '[owner]\nid = "owner-0"\nproxy = "127.0.0.1:9"\nstate_dir = "state"\n'
        '[tls]\ninsecure = true\n[data]\npath = "data.csv"\nmax_records = 10\nn_columns = 35\n'
        f'[policy]\naccepted_analyst_keys = ["{key_fingerprint(public_key)}"]\n'
        f'accepted_query_signers = ["{TEST_SIGNER}"]\nmax_epsilon_per_query = 1.0\n'
        "[budget]\nepsilon = 10.0\ndelta = 1e-5\n"
    )
    ledger = BudgetLedger(tmp_path / "owner-0" / "state" / "ledger.sqlite3")
    # What the node recorded when it answered q1: the release, under the analyst's key.
    q1 = PrivacyEvent.from_dict({**charged["q1"].to_dict(), "analyst": key_fingerprint(public_key)})
    ledger.reserve(q1, BUDGET, spec_digest=digests["q1"])
    ledger.record_task(q1.query_id, TaskOutcome.UPLOADED)
    return {
        "coordinator": coordinator,
        "charged": charged,
        "fingerprint": key_fingerprint(public_key),
        "proxy_config": proxy_config,
        "owner_config": owner_config,
        "ledger": ledger,
        "tmp_path": tmp_path,
    }


def _export(deployment: dict[str, Any], owner: str = "owner-0") -> Path:
    result = CliRunner().invoke(
        proxy_group,
        ["export-releases", "--config", str(deployment["proxy_config"]), "--owner", owner],
    )
    assert result.exit_code == 0, result.output
    path = deployment["tmp_path"] / f"{owner}-contributed.json"
    path.write_text(result.stdout)
    return path


def _import(deployment: dict[str, Any], export: Path, *flags: str) -> Any:
    return CliRunner().invoke(
        owner_group,
        ["import-releases", "--config", str(deployment["owner_config"]), *flags, str(export)],
    )


def test_the_proxy_exports_the_releases_an_owners_uploads_joined(
    deployment: dict[str, Any],
) -> None:
    export = _export(deployment)
    owner, releases = read_contributed_releases(json.loads(export.read_text()), str(export))
    assert owner == "owner-0"
    assert [r.task_id for r in releases] == [key("q1"), key("q2")]  # not q3: it did not join
    assert all(r.signer == TEST_SIGNER and r.signature for r in releases)
    assert [r.spec.epsilon for r in releases] == [1.0, 0.5]
    (q3,) = read_contributed_releases(
        json.loads(_export(deployment, "owner-2").read_text()), "owner-2"
    )[1][1:]
    assert q3.task_id == key("q3")


def test_import_charges_what_the_restored_ledger_forgot_at_the_signed_cost(
    deployment: dict[str, Any],
) -> None:
    ledger: BudgetLedger = deployment["ledger"]
    export = _export(deployment)
    result = _import(deployment, export)
    assert result.exit_code == 0, result.output
    assert f"charged      {key('q2')}" in result.output
    assert "1 release(s) charged; 1 already recorded (0 made final); 0 " in result.output
    entries = {entry.event.query_id: entry.event for entry in ledger.events()}
    assert sorted(entries) == [key("q1"), key("q2")]
    # The cost is the one the proxy charged the analyst for the same query.
    proxy_q2 = deployment["charged"]["q2"]
    assert entries[key("q2")].analyst == deployment["fingerprint"]
    for name in EVENT_FIELDS:
        assert getattr(entries[key("q2")], name) == getattr(proxy_q2, name), name
    spent = compose_epsilon(
        [deployment["charged"][q] for q in ("q1", "q2")], BUDGET.delta, Accountant.ZCDP
    )
    assert f"epsilon spent now: {spent:g} of 10" in result.output
    # The task is known as answered: a re-delivery is not answered again.
    task = ledger.task(key("q2"))
    assert task is not None and task.outcome is TaskOutcome.UPLOADED and task.upload_started
    assert ledger.is_handled(key("q2"))
    # A second import finds everything recorded.
    again = _import(deployment, export)
    assert again.exit_code == 0, again.output
    assert "0 release(s) charged; 2 already recorded" in again.output


def test_a_dry_run_changes_nothing_and_reports_the_spend_after(
    deployment: dict[str, Any],
) -> None:
    ledger_path = deployment["ledger"].path
    before = {p.name: p.read_bytes() for p in ledger_path.parent.glob("ledger.sqlite3*")}
    result = _import(deployment, _export(deployment), "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"would charge {key('q2')}" in result.output
    spent = compose_epsilon(
        [deployment["charged"][q] for q in ("q1", "q2")], BUDGET.delta, Accountant.ZCDP
    )
    assert f"epsilon spent after this import: {spent:g}" in result.output
    after = {p.name: p.read_bytes() for p in ledger_path.parent.glob("ledger.sqlite3*")}
    assert after == before
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_an_altered_query_fails_the_whole_import(deployment: dict[str, Any]) -> None:
    export = _export(deployment)
    document = json.loads(export.read_text())
    # A proxy that cheapens q2 in its export: its analyst's signature no longer holds.
    document["releases"][1]["query"]["epsilon"] = 0.01
    export.write_text(json.dumps(document))
    result = _import(deployment, export)
    assert result.exit_code == 1
    assert "nothing was re-entered" in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_a_query_signed_by_a_key_this_owner_does_not_accept_is_listed_not_charged(
    deployment: dict[str, Any],
) -> None:
    config: Path = deployment["owner_config"]
    config.write_text(config.read_text().replace(TEST_SIGNER, SECOND_TEST_SIGNER))
    result = _import(deployment, _export(deployment))
    assert result.exit_code == 0, result.output
    assert f"not charged  {key('q2')}  signed by {TEST_SIGNER}, not in" in result.output
    # q1, which the ledger holds, stays charged and is not said to be "not charged".
    assert f"not charged  {key('q1')}" not in result.output
    assert "1 already recorded" in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_a_release_held_as_reserved_is_made_final_even_if_its_signer_was_rotated(
    deployment: dict[str, Any],
) -> None:
    """Review: the backup held q2 as reserved, then the operator rotated the query
    signer (routine). The import skipped q2 as "not charged" and left it reserved, so
    the next withdrawal refunded a release the proxy had folded."""
    ledger: BudgetLedger = deployment["ledger"]
    q2 = PrivacyEvent.from_dict(
        {**deployment["charged"]["q2"].to_dict(), "analyst": deployment["fingerprint"]}
    )
    ledger.reserve(q2, BUDGET)
    config: Path = deployment["owner_config"]
    config.write_text(config.read_text().replace(TEST_SIGNER, SECOND_TEST_SIGNER))
    result = _import(deployment, _export(deployment))
    assert result.exit_code == 0, result.output
    assert f"made final {key('q2')}" in result.output and "not charged  " not in result.output
    assert not ledger.end_task(key("q2"), TaskOutcome.CANCELLED)  # nothing refunded
    assert [e.event.query_id for e in ledger.events()] == [key("q1"), key("q2")]


def test_one_query_is_charged_once_whatever_its_task_ids(deployment: dict[str, Any]) -> None:
    """Review: a proxy listed q2 again under p0/q2 ... p299/q2; each was charged, and one
    signed query drained the owner's budget (ε 10.8 of 10). A node answers a signed
    query once whatever its task id: the import refuses such an export, and one that
    lists under a new id a query the ledger holds under another."""
    export = _export(deployment)
    document = json.loads(export.read_text())
    q1, q2 = document["releases"]
    for copies, why in (
        ([q2, {**q2, "task": "p0/q2"}], f"one query under tasks '{key('q2')}' and 'p0/q2'"),
        ([{**q1, "task": "p0/q1"}], f"is the query this ledger holds as '{key('q1')}'"),
    ):
        export.write_text(json.dumps({**document, "releases": copies}))
        result = _import(deployment, export)
        assert result.exit_code == 1, result.output
        assert why in result.output and "nothing was re-entered" in result.output
        assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_a_task_id_that_names_no_analyst_is_refused_and_printed_escaped(
    deployment: dict[str, Any],
) -> None:
    """Review: the analyst part of a task id was never checked, so terminal control
    sequences reached the ledger and the operator's screen."""
    export = _export(deployment)
    document = json.loads(export.read_text())
    document["releases"][1]["task"] = "\x1b[2K\r\x1b[1Ax/q2"
    export.write_text(json.dumps(document))
    result = _import(deployment, export)
    assert result.exit_code == 1, result.output
    assert "is not the proxy's key of query 'q2'" in result.output
    assert "\x1b" not in result.output and "\r" not in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_another_owners_export_is_refused(deployment: dict[str, Any]) -> None:
    result = _import(deployment, _export(deployment, "owner-1"))
    assert result.exit_code == 1
    assert "lists the releases of owner 'owner-1'; this node is 'owner-0'" in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_a_release_of_another_relation_is_refused_by_the_ledger(tmp_path: Path) -> None:
    from fedpca.query import Neighbouring

    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    event = PrivacyEvent(
        "alice/q", "sha256:" + "ab" * 32, 2.0, 1.0, 1e-6, neighbouring=Neighbouring.REPLACE_ONE
    )
    with pytest.raises(ConfigError, match=r"replace-one adjacency.*nothing was re-entered"):
        ledger.reenter([(event, "sha256:x", True)])
    assert ledger.events() == []


def test_a_malformed_export_is_named() -> None:
    with pytest.raises(ConfigError, match="not an export of `fedpca proxy export-releases`"):
        read_contributed_releases({"format": "fedpca-owner-releases/1"}, "x.json")
    document = {
        "format": "fedpca-proxy-contributed-releases/1",
        "owner": "owner-0",
        "releases": [{"task": "alice/q", "signer": "s", "joined_at": 1.0, "query": {}}],
    }
    with pytest.raises(ConfigError, match=r"x.json: release 0: "):
        read_contributed_releases(document, "x.json")


def test_a_release_the_backup_held_as_not_begun_is_never_refunded_after(
    deployment: dict[str, Any],
) -> None:
    """Review: a backup taken after the reservation of q2 and before its upload began
    held q2 as reserved; the import left it so, and the withdrawal a restarted node
    handles refunded a release the proxy had folded."""
    ledger: BudgetLedger = deployment["ledger"]
    q2 = PrivacyEvent.from_dict(
        {**deployment["charged"]["q2"].to_dict(), "analyst": deployment["fingerprint"]}
    )
    ledger.reserve(q2, BUDGET)  # reserved; its upload had not begun at the backup
    result = _import(deployment, _export(deployment))
    assert result.exit_code == 0, result.output
    assert f"made final {key('q2')}" in result.output
    assert "0 release(s) charged; 2 already recorded (1 made final)" in result.output
    # Final, so never answered again: a proxy delivering q2 again had it answered with
    # a new share (the task stayed reserved, and a reservation found is answered).
    assert ledger.is_handled(key("q2"))
    assert ledger.task(key("q2")).outcome is TaskOutcome.ABANDONED  # began, cannot go on
    assert not ledger.end_task(key("q2"), TaskOutcome.CANCELLED)  # nothing refunded
    assert [e.event.query_id for e in ledger.events()] == [key("q1"), key("q2")]


def test_two_queries_under_one_task_id_fail_the_import(deployment: dict[str, Any]) -> None:
    """Review: a proxy listed another (cheaper) signed query under q2's task id ahead of
    q2; the ledger kept the cheaper one while the output printed q2's cost."""
    export = _export(deployment)
    document = json.loads(export.read_text())
    real = document["releases"][1]
    # Another query with q2's id, validly signed (e.g. another analyst's), far cheaper.
    cheaper = signed(dataclasses.replace(spec_from_dict(real["query"]), epsilon=0.05))
    forged = {
        **real,
        "query": spec_to_dict(cheaper.spec),
        "signature": cheaper.signature.hex(),
        "signer": cheaper.signer,
    }
    document["releases"].insert(1, forged)
    export.write_text(json.dumps(document))
    result = _import(deployment, export)
    assert result.exit_code == 1
    assert f"two different queries under task '{key('q2')}'" in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("joined_at", 10**400, "release 1: int too large"),
        ("joined_at", 4e9, "outside the time from the query's signing to its deadline"),
        # Review: a join long past counted towards no day's policy.max_tasks_per_day.
        ("joined_at", -1e15, "outside the time from the query's signing to its deadline"),
        ("joined_at", "signed-1h", "outside the time from the query's signing to its deadline"),
        ("epsilon", 10**400, "release 1: stored query cannot be read back"),
    ],
)
def test_out_of_range_numbers_are_named_not_a_traceback(
    deployment: dict[str, Any], field: str, value: Any, message: str
) -> None:
    export = _export(deployment)
    document = json.loads(export.read_text())
    if field == "epsilon":
        document["releases"][1]["query"]["epsilon"] = value
    elif value == "signed-1h":
        signed_at = spec_from_dict(document["releases"][1]["query"]).issued_at
        document["releases"][1][field] = signed_at - 3600
    else:
        document["releases"][1][field] = value
    export.write_text(json.dumps(document))
    result = _import(deployment, export)
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]


def test_a_query_this_node_would_not_have_answered_is_not_charged(
    deployment: dict[str, Any],
) -> None:
    """Review: only the signer was checked; a NOT PRIVATE query, or one for an analyst
    key this node does not pin, was charged (an infinite spend for the former)."""
    config: Path = deployment["owner_config"]
    text = config.read_text()
    config.write_text(text.replace(deployment["fingerprint"], "sha256:" + "cd" * 32))
    result = _import(deployment, _export(deployment))
    assert result.exit_code == 0, result.output
    assert f"not charged  {key('q2')}" in result.output
    assert "is not in policy.accepted_analyst_keys" in result.output
    assert [e.event.query_id for e in deployment["ledger"].events()] == [key("q1")]
