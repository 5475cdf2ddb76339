"""Re-entering the releases a restored proxy database forgot.

A new operator's walkthrough restored a proxy database from a backup as
docs/operations.md says: the analyst's spent epsilon fell back to what it was at the
backup (4 releases to 3) while the owners' ledgers still listed the lost query, and no
command could re-enter it. `fedpca owner budget --json` now exports an owner's releases
and `fedpca proxy import-releases` charges those of queries the database does not know.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_proxy_cli import write_config

from fedpca.dp.accounting import Accountant, compose_epsilon
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import ConfigError, NotFoundError
from fedpca.files import ExclusiveUse
from fedpca.messages import QueryState
from fedpca.owner.cli import owner_group
from fedpca.owner.ledger import BudgetLedger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.proxy.cli import proxy_group
from fedpca.proxy.release_import import import_releases
from fedpca.proxy.store import ProxyStore
from fedpca.query import Neighbouring
from fedpca.release_exports import OwnerRelease, owner_releases_document, read_owner_releases

BUDGET = PrivacyParams(10.0, 1e-5)


FINGERPRINT = "sha256:" + "ab" * 32


def _event(query_id: str, z: float, *, analyst: str = "alice") -> PrivacyEvent:
    """A release as an owner records it: under the task id (analyst/query) and the
    analyst's key fingerprint (task_processing), not the analyst's id."""
    return PrivacyEvent(f"{analyst}/{query_id}", FINGERPRINT, z, 0.5, 1e-6)


def _owner_export(
    tmp_path: Path,
    name: str,
    events: list[PrivacyEvent],
    outcomes: dict[str, TaskOutcome] | None = None,
) -> Path:
    """An owner's ledger holding ``events``, exported with `fedpca owner budget --json`.

    Each task ends as ``outcomes`` says (by query id), else UPLOADED.
    """
    folder = tmp_path / name
    folder.mkdir()
    config = folder / "owner.toml"
    config.write_text(
        f'[owner]\nid = "{name}"\nproxy = "127.0.0.1:9"\nstate_dir = "state"\n'
        '[tls]\ninsecure = true\n[data]\npath = "data.csv"\nmax_records = 10\nn_columns = 3\n'
        "[policy]\naccepted_analyst_keys = []\nmax_epsilon_per_query = 1.0\n"
        "[budget]\nepsilon = 10.0\ndelta = 1e-5\n"
    )
    ledger = BudgetLedger(folder / "state" / "ledger.sqlite3")
    for event in events:
        ledger.reserve(event, BUDGET)  # raises if it does not fit
        outcome = (outcomes or {}).get(event.query_id, TaskOutcome.UPLOADED)
        ledger.record_task(event.query_id, outcome)
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    export = folder / "releases.json"
    export.write_text(result.output)
    return export


def _spent(store: ProxyStore, analyst: str = "alice") -> float:
    events = [PrivacyEvent.from_dict(r) for r in store.releases(analyst)]
    return compose_epsilon(events, 1e-5, Accountant.ZCDP)


def test_an_owner_export_reads_back_as_its_ledger(tmp_path: Path) -> None:
    events = [_event("q1", 2.0), _event("q2", 3.0, analyst="bob")]
    export = _owner_export(tmp_path, "hospital-a", events)
    document = json.loads(export.read_text())
    assert document["owner"] == "hospital-a"
    assert [r["outcome"] for r in document["releases"]] == ["uploaded", "uploaded"]
    read = read_owner_releases(document, str(export))
    assert [(r.event.query_id, r.event.analyst, r.event.noise_multiplier) for r in read] == [
        (e.query_id, e.analyst, e.noise_multiplier) for e in events
    ]
    assert all(r.upload_began for r in read)
    with pytest.raises(ConfigError, match="not an export"):
        read_owner_releases({"releases": []}, "x.json")


def test_an_export_states_release_times_to_the_second_only() -> None:
    event = PrivacyEvent("alice/t", "alice", 1.0, 0.5, 1e-6, timestamp=1_700_000_000.987654)
    document = owner_releases_document("o", [(event, "uploaded")])
    assert document["releases"][0]["event"]["timestamp"] == 1_700_000_000.0
    (read,) = read_owner_releases(json.loads(json.dumps(document)), "o.json")
    assert read.event.timestamp == 1_700_000_000.0


def test_a_not_private_release_survives_the_round_trip() -> None:
    event = PrivacyEvent("alice/v", "alice", 0.0, float("inf"), 0.0)
    document = json.loads(json.dumps(owner_releases_document("o", [(event, "uploaded")])))
    (read,) = read_owner_releases(document, "o.json")
    assert read.event.noise_multiplier == 0.0 and read.event.epsilon == float("inf")
    assert read.upload_began


def test_import_charges_what_owners_released_and_the_database_forgot(tmp_path: Path) -> None:
    config, _ = write_config(tmp_path)
    database = tmp_path / "state" / "proxy.sqlite3"
    store = ProxyStore(database)
    # In the restored database: q1 charged and done; q2 and q5 refunded (q5 by a proxy
    # started before the import: its owners had answered after the backup); q4 and q6
    # charged and still collecting, no upload begun at the backup.
    for query_id in ("q1", "q2", "q4", "q5", "q6"):
        store.create_query(f"alice/{query_id}", "alice", {"quorum": 2}, {}, time.time() + 60)
    with store.transaction() as conn:
        for query_id in ("q1", "q4", "q6"):
            record = {**_event(query_id, 2.0).to_dict(), "analyst": "alice"}
            store.record_release(conn, "alice", f"alice/{query_id}", record)
    store.set_state("alice/q1", QueryState.DONE)
    for query_id in ("q2", "q5"):
        store.set_state(f"alice/{query_id}", QueryState.FAILED, failure_reason="deadline passed")
    before = _spent(store)
    store.close()
    # An earlier proxy left q1's aggregate without noise: opening the database drops it.
    with sqlite3.connect(database) as conn:
        conn.execute("INSERT INTO aggregate_pages VALUES ('alice/q1', 0, 2, x'00')")
    files = sorted(database.parent.glob(database.name + "*"))
    contents = {path.name: path.read_bytes() for path in files}
    # q3 came after the backup; the two owners that took part list it (one with a
    # larger noise multiplier: the costlier record is charged). hospital-a began
    # uploads of q4 and q5; of q2 and q6 it holds only reservations.
    reserved = {"alice/q2": TaskOutcome.RESERVED, "alice/q6": TaskOutcome.RESERVED}
    exports = [
        _owner_export(
            tmp_path,
            "hospital-a",
            [_event(q, 2.5 if q == "q3" else 2.0) for q in ("q1", "q2", "q3", "q4", "q5", "q6")],
            reserved,
        ),
        _owner_export(tmp_path, "hospital-b", [_event("q1", 2.0), _event("q3", 3.0)]),
    ]
    runner = CliRunner()
    command = ["import-releases", "--config", str(config), *map(str, exports)]

    dry = runner.invoke(proxy_group, [*command[:3], "--dry-run", *command[3:]])
    assert dry.exit_code == 0, dry.output
    assert "would charge alice/q3  epsilon=0.5 delta=1e-06 z=2.5" in dry.output
    assert "would make final alice/q4" in dry.output
    assert "would charge again alice/q5" in dry.output
    # A dry run changes nothing, not even what opening the database would (it opened a
    # copy: before, it dropped q1's aggregate in the restored database).
    assert {path.name: path.read_bytes() for path in files} == contents
    store = ProxyStore(database)
    assert _spent(store) == before
    store.close()

    done = runner.invoke(proxy_group, command)
    assert done.exit_code == 0, done.output
    assert "owners differ alice/q3" in done.output
    assert done.output.splitlines()[-1] == (
        "1 release(s) charged; 1 charge(s) made final; 1 refund(s) undone; 2 already "
        "recorded; 1 not charged (refunded here, no upload begun)"
    )
    store = ProxyStore(database)
    # Charged to the analyst the query id names, not to the owners' key fingerprint.
    charged = {
        r["query_id"]: (r["analyst"], r["noise_multiplier"]) for r in store.releases("alice")
    }
    assert charged == {
        "alice/q1": ("alice", 2.0),
        "alice/q3": ("alice", 2.5),
        "alice/q4": ("alice", 2.0),
        "alice/q5": ("alice", 2.0),
        "alice/q6": ("alice", 2.0),
    }
    after = _spent(store)
    expected = compose_epsilon(
        [_event(q, 2.5 if q == "q3" else 2.0) for q in ("q1", "q3", "q4", "q5", "q6")],
        1e-5,
        Accountant.ZCDP,
    )
    assert after == pytest.approx(expected) and after > before
    assert "alice" in store.analyst_ids()
    # q3's record is gone with the restore; asked for it, the proxy says so, not
    # "unknown" (review: a charged query read as one never made).
    with pytest.raises(NotFoundError, match=r"lost with a restore.*charge.*stands"):
        store.query("alice/q3")
    with pytest.raises(NotFoundError, match="unknown query 'alice/q9'"):
        store.query("alice/q9")
    # q4 fails here (its owners' uploads went to the proxy before the restore and are
    # not sent again): its charge stands. q6, of which no upload began, is refunded as
    # any query failing before an upload.
    store.set_state("alice/q4", QueryState.FAILED, failure_reason="deadline passed")
    store.set_state("alice/q6", QueryState.FAILED, failure_reason="deadline passed")
    assert store.has_release("alice/q4") and not store.has_release("alice/q6")
    store.close()

    again = runner.invoke(proxy_group, command)  # idempotent
    assert again.exit_code == 0, again.output
    assert (
        "0 release(s) charged; 0 charge(s) made final; 0 refund(s) undone; 4 already recorded"
        in again.output
    )


def test_import_refuses_while_the_proxy_holds_the_database(tmp_path: Path) -> None:
    config, _ = write_config(tmp_path)
    database = tmp_path / "state" / "proxy.sqlite3"
    ProxyStore(database).close()
    export = _owner_export(tmp_path, "hospital-a", [_event("q9", 2.0)])
    with ExclusiveUse(database.with_name("proxy.sqlite3.lock"), f"the proxy database {database}"):
        result = CliRunner().invoke(
            proxy_group, ["import-releases", "--config", str(config), str(export)]
        )
    assert result.exit_code == 1 and "is in use by process" in result.output
    store = ProxyStore(database)
    assert store.releases("alice") == []
    store.close()


def test_a_file_that_is_no_export_is_named_as_such(tmp_path: Path) -> None:
    """An operator's walkthrough gave a log file: "cannot read serve.log: Extra data:
    line 1 column 5", which did not say the file was the wrong one."""
    config, _ = write_config(tmp_path)
    ProxyStore(tmp_path / "state" / "proxy.sqlite3").close()
    log = tmp_path / "serve.log"
    log.write_text("2026 proxy serving\n")
    result = CliRunner().invoke(proxy_group, ["import-releases", "--config", str(config), str(log)])
    assert result.exit_code == 1
    assert f"{log} is not an owner's export (the JSON of `fedpca owner budget --json`)" in (
        result.output.replace("\n", " ")
    )


def test_an_export_of_another_relation_imports_nothing(tmp_path: Path) -> None:
    store = ProxyStore(tmp_path / "proxy.sqlite3")
    other = PrivacyEvent("alice/q1", FINGERPRINT, 2.0, 0.5, 1e-6, Neighbouring.REPLACE_ONE)
    mine = _event("q2", 2.0)
    with pytest.raises(ConfigError, match="another deployment"):
        import_releases(
            store, [OwnerRelease(e, "uploaded") for e in (mine, other)], Neighbouring.ADD_REMOVE
        )
    assert store.releases("alice") == []
    with pytest.raises(ConfigError, match="does not name its analyst"):
        import_releases(
            store,
            [OwnerRelease(PrivacyEvent("q", FINGERPRINT, 2.0, 0.5, 1e-6), "uploaded")],
            Neighbouring.ADD_REMOVE,
        )
    store.close()
