"""Per-analyst shares of an owner's budget (fedpca.dp.shares, ``[budget] analyst_shares``).

What they must do: a decline for lack of budget depends on the asking analyst's own
releases only, and the owner-wide budget (the rule that protects the rows) still holds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fedpca.codec import CryptoPool
from fedpca.dp.accounting import BUDGET_ROUNDING_SLACK, Accountant, compose_epsilon
from fedpca.dp.calibration import calibrate_noise_multiplier, zcdp_epsilon
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.dp.shares import EXTRA_DELTA_FRACTION, BudgetShares
from fedpca.errors import BudgetExceededError, ConfigError, PolicyError
from fedpca.owner import ledger as ledger_module
from fedpca.owner.cli import owner_group
from fedpca.owner.config import OwnerConfig, load_config
from fedpca.owner.ledger import BudgetLedger, owner_ledger
from fedpca.owner.ledger_rows import OWN_RELEASES_SQL
from fedpca.owner.node import OwnerNode
from fedpca.query import Neighbouring
from helpers import signed_task
from inprocess import FAST_RETRY, deployment, labelled, unit_box_queries

DELTA = 1e-5
BUDGET = PrivacyParams(2.0, DELTA)
A, B, C = ("sha256:" + c * 64 for c in "abc")
SIGNER = "ed25519:" + "ef" * 32
M = 5


def _event(query_id: str, analyst: str, epsilon: float, *, extra: float = 0.0) -> PrivacyEvent:
    z = calibrate_noise_multiplier(epsilon, 1e-6)
    return PrivacyEvent(query_id, analyst, z, epsilon, 1e-6, delta_extra=extra)


@pytest.mark.parametrize("accountant", list(Accountant))
def test_rho_max_is_the_largest_rho_whose_conversion_fits(accountant: Accountant) -> None:
    shares = BudgetShares.for_budget({A: 1.0}, BUDGET, accountant)
    gaussian_delta = DELTA * (1 - EXTRA_DELTA_FRACTION)
    assert shares.extra_delta_cap == pytest.approx(DELTA * EXTRA_DELTA_FRACTION)
    z = 1 / math.sqrt(2 * shares.rho_max)
    assert compose_epsilon([z], gaussian_delta, accountant) <= BUDGET.epsilon
    # A little more rho (a smaller z) no longer fits: rho_max is not set needlessly low.
    assert compose_epsilon([z * (1 - 1e-3)], gaussian_delta, accountant) > BUDGET.epsilon
    if accountant is Accountant.ZCDP:
        assert zcdp_epsilon(z, gaussian_delta) == pytest.approx(BUDGET.epsilon, rel=1e-9)


def test_the_pld_floor_caps_rho_max() -> None:
    # epsilon 100 at delta 1e-5 would need z below the PLD accountant's floor of 0.1.
    shares = BudgetShares.for_budget({A: 1.0}, PrivacyParams(100.0, DELTA), "pld-continuous")
    assert shares.rho_max == pytest.approx(1 / (2 * 0.1**2), rel=1e-12)
    zcdp = BudgetShares.for_budget({A: 1.0}, PrivacyParams(100.0, DELTA), "zcdp")
    assert zcdp.rho_max > 50


@pytest.mark.parametrize(
    ("accountant", "budget", "fractions"),
    [
        (Accountant.ZCDP, BUDGET, (0.5, 0.3, 0.2)),
        (Accountant.ZCDP, PrivacyParams(0.05, 1e-9), (1 / 3, 1 / 3, 1 / 3)),
        (Accountant.PLD_CONTINUOUS, BUDGET, (0.5, 0.3, 0.2)),
        (Accountant.PLD_CONTINUOUS, PrivacyParams(60.0, 1e-5), (0.6, 0.2, 0.2)),
    ],
)
def test_within_their_shares_the_whole_ledger_fits_the_budget(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    accountant: Accountant,
    budget: PrivacyParams,
    fractions: tuple[float, float, float],
) -> None:
    """The owner-wide check is implied by the shares and not made: random interleavings
    of releases (some with masked-mode-sized additive deltas) filled to every share,
    then the whole ledger composed apart, by the accountant itself."""
    shares = BudgetShares.for_budget(
        dict(zip((A, B, C), fractions, strict=True)), budget, accountant
    )
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3", accountant=accountant, shares=shares)
    assert ledger.within_shares

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the owner-wide composition was computed within the shares")

    monkeypatch.setattr("fedpca.owner.ledger.check_budget", never)
    monkeypatch.setattr("fedpca.owner.ledger.compose_epsilon", never)
    rng = random.Random(7)
    refused = {A: 0, B: 0, C: 0}
    n = 0
    while min(refused.values()) < 3:
        analyst = rng.choice([A, B, C])
        extra = budget.delta * 1e-5 if rng.random() < 0.2 else 0.0
        epsilon = budget.epsilon * rng.uniform(0.03, 0.3)
        z = calibrate_noise_multiplier(epsilon, budget.delta)
        event = PrivacyEvent(f"q{n}", analyst, z, epsilon, budget.delta, delta_extra=extra)
        n += 1
        try:
            decision = ledger.reserve(event, budget, spec_digest=event.query_id)
        except BudgetExceededError as exc:
            assert "use of its share" in str(exc), str(exc)
            refused[analyst] += 1
        else:
            assert decision.share_used is not None
            assert decision.share_used[0] < decision.share_used[1] <= 1.0
    monkeypatch.undo()
    events = [entry.event for entry in ledger.events()]
    assert len(events) > 6 and shares.over_share(events) == []
    assert compose_epsilon(events, budget.delta, accountant) <= budget.epsilon * (
        1 + BUDGET_ROUNDING_SLACK
    )
    # Each analyst got close to its share: the shares do not waste the budget.
    for analyst in (A, B, C):
        assert 0.6 < shares.used(events, analyst) <= 1.0


def test_over_its_shares_the_ledger_checks_the_whole_budget_as_well(tmp_path: Path) -> None:
    # A's releases were recorded before the shares: more than A's share of 0.2.
    path = tmp_path / "ledger.sqlite3"
    plain = BudgetLedger(path)
    filled = _decisions(plain, A, [0.6] * 30)
    assert filled[0] and not filled[-1]  # until the budget refuses
    shares = BudgetShares.for_budget({A: 0.2, B: 0.8}, BUDGET)
    ledger = BudgetLedger(path, shares=shares)
    assert not ledger.within_shares
    probe = _event("b0", B, 0.6)  # refused to A at the end above
    assert shares.check([e.event for e in ledger.events()], probe).fits
    # It fits B's share, but not the whole budget A has used.
    with pytest.raises(BudgetExceededError, match="over the budget epsilon=2"):
        ledger.reserve(probe, BUDGET, spec_digest="b0")
    assert [e.event.analyst for e in ledger.events()].count(B) == 0


def test_the_additive_delta_has_its_own_share(tmp_path: Path) -> None:
    shares = BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET)
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3", shares=shares)
    room = 0.5 * shares.extra_delta_cap
    # Almost no noise budget used (epsilon 0.01), but more than half A's additive delta.
    ledger.reserve(_event("a0", A, 0.01, extra=0.6 * room), BUDGET, spec_digest="a0")
    with pytest.raises(BudgetExceededError, match="use of its share"):
        ledger.reserve(_event("a1", A, 0.01, extra=0.6 * room), BUDGET, spec_digest="a1")
    ledger.reserve(_event("b0", B, 0.01, extra=0.6 * room), BUDGET, spec_digest="b0")


def _decisions(ledger: BudgetLedger, analyst: str, epsilons: list[float]) -> list[bool]:
    return [told is None for told in _told(ledger, analyst, epsilons)]


def _told(ledger: BudgetLedger, analyst: str, epsilons: list[float]) -> list[str | None]:
    """Each query's refusal message (None: admitted)."""
    told: list[str | None] = []
    for n, epsilon in enumerate(epsilons):
        event = _event(f"{analyst[-4:]}-{n}", analyst, epsilon)
        try:
            ledger.reserve(event, BUDGET, spec_digest=event.query_id)
            told.append(None)
        except BudgetExceededError as exc:
            told.append(str(exc))
    return told


@pytest.mark.parametrize("with_shares", [True, False])
def test_what_one_analyst_is_told_does_not_depend_on_another_analysts_spend(
    tmp_path: Path, with_shares: bool
) -> None:
    probes = [0.9, 0.9, 0.5, 0.5, 0.3, 0.2, 0.2, 0.1]
    told = []
    for a_spends in (0, 12):
        shares = BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET) if with_shares else None
        ledger = BudgetLedger(tmp_path / f"{with_shares}-{a_spends}.sqlite3", shares=shares)
        _decisions(ledger, A, [0.4] * a_spends)
        told.append(_told(ledger, B, probes))
    assert None in told[0]
    if with_shares:
        assert any(told[0])  # the probes reach B's share
        assert told[0] == told[1]  # the same answers and the same words
    else:
        # The leak the shares close: without them, A's spending changes B's answers.
        assert told[0] != told[1]


def test_a_key_without_a_share_and_verification_releases_are_refused(tmp_path: Path) -> None:
    shares = BudgetShares.for_budget({A: 1.0}, BUDGET)
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3", shares=shares)
    with pytest.raises(BudgetExceededError, match="use of its share"):
        ledger.reserve(_event("q", B, 0.1), BUDGET, spec_digest="q")
    with pytest.raises(PolicyError, match="NOT PRIVATE"):
        ledger.reserve(PrivacyEvent("v", A, 0.0, math.inf, 0.0), BUDGET, allow_not_private=True)
    assert ledger.events() == []


def test_the_daily_count_can_be_one_analysts(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    for n, analyst in enumerate([A, A, B]):
        ledger.reserve(_event(f"q{n}", analyst, 0.1), BUDGET, spec_digest=f"q{n}")
    assert ledger.tasks_started_since(0, asking=A) == 3
    assert ledger.tasks_started_since(0, asking=A, own_only=True) == 2
    assert ledger.tasks_started_since(0, asking=B, excluding="q2", own_only=True) == 0


SIGNER_B = "ed25519:" + "cd" * 32
PAIRS = f'analyst_key_signers = {{ "{A}" = ["{SIGNER}"], "{B}" = ["{SIGNER_B}"] }}'


def _config(tmp_path: Path, shares: str, *, extra_policy: str = PAIRS, budget: str = "2.0") -> Path:
    (tmp_path / "data.csv").write_text("1,2\n3,4\n")
    path = tmp_path / "owner.toml"
    path.write_text(
        f"""
[owner]
id = "owner-1"
proxy = "127.0.0.1:9"
state_dir = "state"
[tls]
insecure = true
[data]
path = "data.csv"
max_records = 100
n_columns = 2
[policy]
accepted_analyst_keys = ["{A}", "{B}"]
accepted_query_signers = ["{SIGNER}", "{SIGNER_B}"]
max_epsilon_per_query = 1.0
{extra_policy}
[budget]
epsilon = {budget}
delta = 1e-5
{shares}
"""
    )
    return path


@pytest.mark.parametrize(
    ("shares", "extra_policy", "budget", "message"),
    [
        (f'analyst_shares = {{ "{A}" = 0.5 }}', PAIRS, "2.0", "no share for the pinned"),
        (f'analyst_shares = {{ "{A}" = 0.6, "{B}" = 0.5 }}', PAIRS, "2.0", "add up to 1.1"),
        (f'analyst_shares = {{ "{A}" = 0.5, "{B}" = 0 }}', PAIRS, "2.0", r"must be in \(0, 1\]"),
        (f'analyst_shares = {{ "{A}" = 0.5, "{B}" = "x" }}', PAIRS, "2.0", "must be a number"),
        (
            f'analyst_shares = {{ "{A}" = 0.4, "{B}" = 0.4, "{C}" = 0.3 }}',
            PAIRS,
            "2.0",
            "add up to 1.1",  # a retired key's share counts
        ),
        ("analyst_shares = 0.5", PAIRS, "2.0", "must be a table of fractions"),
        (
            f'analyst_shares = {{ "{A}" = 0.5, "{B}" = 0.5 }}',
            PAIRS + "\nallow_not_private = true",
            "2.0",
            "cannot be combined with policy.allow_not_private",
        ),
        (f'analyst_shares = {{ "{A}" = 0.5, "{B}" = 0.5 }}', PAIRS, "inf", "finite budget"),
        (
            f'analyst_shares = {{ "{A}" = 0.5, "{B}" = 0.5 }}',
            "",
            "2.0",
            "needs policy.analyst_key_signers",
        ),
        (
            f'analyst_shares = {{ "{A}" = 0.5, "{B}" = 0.5 }}',
            f'analyst_key_signers = {{ "{A}" = ["{SIGNER}"] }}',
            "2.0",
            f"no signers for the pinned key '{B}'",
        ),
        (
            "",
            f'analyst_key_signers = {{ "{A}" = ["{SIGNER}"], "{C}" = ["{SIGNER}"] }}',
            "2.0",
            "not a key in policy.accepted_analyst_keys",
        ),
        (
            "",
            f'analyst_key_signers = {{ "{A}" = ["{SIGNER}"], "{B}" = ["ed25519:{"0" * 64}"] }}',
            "2.0",
            "is not in policy.accepted_query_signers",
        ),
        (
            "",
            f'analyst_key_signers = {{ "{A}" = ["{SIGNER}"], "{B}" = [] }}',
            "2.0",
            "must be a non-empty list of signers",
        ),
    ],
)
def test_shares_are_checked_when_the_config_is_read(
    tmp_path: Path, shares: str, extra_policy: str, budget: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, shares, extra_policy=extra_policy, budget=budget))


def test_a_retired_key_keeps_its_share_and_the_ledger_stays_within(tmp_path: Path) -> None:
    """Found by review: a share had to name a pinned key, so the releases of a key
    retired from accepted_analyst_keys counted as beyond every share, and the ledger
    composed every analyst's releases for good. A retired key keeps its share."""
    path = _config(tmp_path, "")
    plain = owner_ledger(load_config(path))
    plain.reserve(_event("c0", C, 0.5), BUDGET, spec_digest="c0")  # C's, before it retired
    config = load_config(
        _config(tmp_path, f'analyst_shares = {{ "{A}" = 0.4, "{B}" = 0.4, "{C}" = 0.2 }}')
    )
    assert C not in config.policy.accepted_analyst_keys
    ledger = owner_ledger(config)
    assert ledger.within_shares
    assert _decisions(ledger, A, [0.3]) == [True]
    assert ledger.within_shares


def test_thirds_add_up_and_the_ledger_of_the_config_uses_them(tmp_path: Path) -> None:
    third = 1 / 3
    path = _config(tmp_path, f'analyst_shares = {{ "{A}" = {third!r}, "{B}" = {2 * third!r} }}')
    config = load_config(path)
    assert config.analyst_shares == {A: third, B: 2 * third}
    assert load_config(_config(tmp_path, "")).analyst_shares == {}
    ledger = owner_ledger(config)
    assert ledger.shares is not None and ledger.shares.share_of(B) == 2 * third


def test_releases_beyond_a_share_are_named_when_the_ledger_opens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Releases recorded before the shares were set: A has used more than its new share.
    path = _config(tmp_path, "")
    plain = owner_ledger(load_config(path))
    for n in range(3):
        plain.reserve(_event(f"q{n}", A, 0.8), BUDGET, spec_digest=f"q{n}")
    path = _config(tmp_path, f'analyst_shares = {{ "{A}" = 0.2, "{B}" = 0.8 }}')
    with caplog.at_level(logging.WARNING, logger="fedpca.owner.ledger"):
        owner_ledger(load_config(path))
    assert f"exceed the budget share of {A}" in caplog.text


def test_owner_budget_prints_each_analysts_share_and_next_query(tmp_path: Path) -> None:
    path = _config(tmp_path, f'analyst_shares = {{ "{A}" = 0.25, "{B}" = 0.75 }}')
    config = load_config(path)
    ledger = owner_ledger(config)
    ledger.reserve(_event("a1", A, 0.5), config.budget, spec_digest="a1")
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(f"analyst      {A}"))
    assert "share 0.25 of the budget" in lines[header]
    assert f"analyst      {B}: share 0.75 of the budget, 0.00% of it used" in result.output
    # A's next query: what is printed fits A's share, a little more does not.
    epsilon = float(lines[header + 1].split("epsilon up to ")[1].split()[0])
    assert 0 < epsilon < 1.0
    shares = ledger.shares
    assert shares is not None
    events = [entry.event for entry in ledger.events()]
    assert shares.admits(events, A, calibrate_noise_multiplier(epsilon, 1e-6))
    assert not shares.admits(events, A, calibrate_noise_multiplier(epsilon * 1.001, 1e-6))
    ledger.reserve(_event("a2", A, epsilon), config.budget, spec_digest="a2")


class _RecordingStub:
    """Stands in for the proxy's stub: records the declines sent."""

    def __init__(self) -> None:
        self.declined: list[Any] = []

    def DeclineTask(self, message: Any, timeout: float) -> None:
        self.declined.append(message)


@contextlib.contextmanager
def _owner_of_one_task_a_day(
    tmp_path: Path, pool: CryptoPool, public_key: Any
) -> Iterator[OwnerConfig]:
    """The configuration of an owner under ``max_tasks_per_day = 1`` that is not
    serving: the test hands it tasks itself (:func:`_offer`)."""
    tables = {"owner-1": labelled(np.random.default_rng(3).uniform(-0.3, 0.3, size=(20, M)))}
    with deployment(
        workdir=tmp_path,
        tables=tables,
        pool=pool,
        public_key=public_key,
        running=(),
        policy={"max_tasks_per_day": 1},
    ) as running:
        yield running.write_owner_config("owner-1")


def _offer(node: OwnerNode, stub: _RecordingStub, spec: Any) -> Any:
    """What ``node._accept`` returns for ``spec`` delivered as alice's task."""
    due = datetime.now(UTC) + timedelta(seconds=120)
    return node._accept(stub, signed_task(spec, due, "alice"))  # type: ignore[arg-type]


def _accept_once(
    tmp_path: Path, pool: CryptoPool, public_key: Any, share: float | None
) -> tuple[Any, list[Any]]:
    """One task of a pinned analyst at an owner whose ledger holds another analyst's
    release of today, under ``max_tasks_per_day = 1``: what ``_accept`` returns, and
    the declines it sent."""
    spec = unit_box_queries(M)(public_key, "today", quorum=1, deadline_seconds=120.0)
    with _owner_of_one_task_a_day(tmp_path, pool, public_key) as config:
        # Another analyst's release today, from before the shares (a key pinned then).
        owner_ledger(config).reserve(_event("other/q", "sha256:" + "0" * 64, 0.1), config.budget)
        if share is not None:
            shares = {spec.analyst_key_fingerprint: share, "sha256:" + "0" * 64: 0.5}
            config = replace(config, analyst_shares=shares)
        node = OwnerNode(config, pool=pool, retry=FAST_RETRY)
        # The other analyst's release fits its share: the node works within the shares.
        assert node.ledger.within_shares == (share is not None)
        stub = _RecordingStub()
        accepted = _offer(node, stub, spec)
    return accepted, stub.declined


@pytest.mark.parametrize("with_shares", [True, False])
def test_with_shares_the_daily_cap_counts_the_asking_analysts_releases(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any], with_shares: bool
) -> None:
    accepted, declined = _accept_once(
        tmp_path, pool, test_only_keypair_512[0], 0.5 if with_shares else None
    )
    if with_shares:
        assert isinstance(accepted, tuple) and declined == []
    else:
        assert [m.detail for m in declined] == [
            "this owner has reached its limit of tasks begun in 24 hours "
            "(policy.max_tasks_per_day = 1, this analyst's refunded tasks included)"
        ]


def test_a_refunded_task_still_counts_toward_the_daily_cap(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Found by review (stop 42): a refund removed the release the cap counted, so queries
    cancelled before any upload (charged nothing) kept an owner computing without bound."""
    public_key = test_only_keypair_512[0]
    queries = unit_box_queries(M)
    first = queries(public_key, "first", quorum=1, deadline_seconds=120.0)
    second = queries(public_key, "second", quorum=1, deadline_seconds=120.0)
    with _owner_of_one_task_a_day(tmp_path, pool, public_key) as config:
        node = OwnerNode(config, pool=pool, retry=FAST_RETRY)
        stub = _RecordingStub()
        assert isinstance(_offer(node, stub, first), tuple)
        assert node.ledger.cancel_reservation("alice/first")  # withdrawn before any upload
        assert node.ledger.events() == []
        again = _offer(node, stub, second)
    assert not isinstance(again, tuple)
    assert [m.detail for m in stub.declined] == [
        "this owner has reached its limit of tasks begun in 24 hours "
        "(policy.max_tasks_per_day = 1, this analyst's refunded tasks included)"
    ]


def test_a_share_decline_tells_the_analyst_its_own_figures(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    accepted, declined = _accept_once(tmp_path, pool, test_only_keypair_512[0], 1e-6)
    assert not isinstance(accepted, tuple)
    (decline,) = declined
    assert "use of its share (1e-06 of the budget) from 0.0000% to" in decline.detail


def test_a_ledger_of_two_relations_is_not_within_its_shares(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    BudgetLedger(path).reserve(_event("a0", A, 0.5), BUDGET, spec_digest="a0")
    shares = BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET)
    other = BudgetLedger(path, neighbouring=Neighbouring.REPLACE_ONE, shares=shares)
    assert not other.within_shares
    replace_one = replace(_event("b0", B, 0.1), neighbouring=Neighbouring.REPLACE_ONE)
    with pytest.raises(ConfigError, match="never composed"):
        other.reserve(replace_one, BUDGET, spec_digest="b0")


def test_releases_another_writer_adds_are_looked_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ledger.sqlite3"
    shares = BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET)
    node = BudgetLedger(path, shares=shares)
    assert node.within_shares
    # Another writer without shares (an older node, another host) lets A past its share.
    assert _decisions(BudgetLedger(path), A, [0.6] * 8) == [True] * 8
    events = [entry.event for entry in node.events()]
    assert 1 < shares.used(events, A) < 2  # past its share, within the whole budget
    filled = _told(node, B, [0.6] * 8)
    assert not node.within_shares
    assert any(told and "over the budget" in told for told in filled)
    events = [entry.event for entry in node.events()]
    assert compose_epsilon(events, DELTA) <= BUDGET.epsilon * (1 + BUDGET_ROUNDING_SLACK)


def test_a_release_written_in_place_of_the_latest_is_looked_at(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    node = BudgetLedger(path, shares=BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET))
    node.reserve(_event("a0", A, 0.3), BUDGET, spec_digest="a0")
    with sqlite3.connect(path) as raw:
        (rowid,) = raw.execute("SELECT rowid FROM releases WHERE query_id = 'a0'").fetchone()
    # Another writer refunds A's latest release and records one past A's share in its
    # place: SQLite gives the new row the same rowid, so the largest rowid is unchanged.
    other = BudgetLedger(path)
    assert other.cancel_reservation("a0")
    other.reserve(_event("a-big", A, 1.9), BUDGET, spec_digest="a-big")
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT MAX(rowid) FROM releases").fetchone() == (rowid,)
    assert node.within_shares
    node.reserve(_event("b0", B, 0.1), BUDGET, spec_digest="b0")
    assert not node.within_shares  # noticed: the owner-wide check is made again


def test_a_reservation_whose_commit_failed_does_not_move_the_cached_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the count of writes was cached inside the transaction, so a
    commit that failed (a full disk) left it one ahead of the file, and the next write by
    another writer brought the file to the cached value unnoticed."""
    path = tmp_path / "ledger.sqlite3"
    node = BudgetLedger(path, shares=BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET))
    real = ledger_module._immediate

    @contextlib.contextmanager
    def failing_commit(connection: sqlite3.Connection) -> Any:
        connection.execute("BEGIN IMMEDIATE")
        yield
        connection.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ledger_module, "_immediate", failing_commit)
    with pytest.raises(sqlite3.OperationalError):
        node.reserve(_event("a0", A, 0.3), BUDGET, spec_digest="a0")
    monkeypatch.setattr(ledger_module, "_immediate", real)
    assert node.events() == []
    # Another writer's one release past A's share brings the file's count to 1.
    BudgetLedger(path).reserve(_event("a-big", A, 1.9), BUDGET, spec_digest="a-big")
    node.reserve(_event("b0", B, 0.1), BUDGET, spec_digest="b0")
    assert not node.within_shares  # noticed


def test_every_write_to_the_releases_is_counted_by_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    BudgetLedger(path)
    counts = []
    with sqlite3.connect(path) as raw:  # a writer that is not fedpca at all
        for statement in (
            "INSERT INTO releases (query_id, analyst, noise_multiplier, epsilon, delta, "
            "recorded_at, not_private, spec_digest) VALUES ('q', 'a', 1, 1, 1e-6, 0, 0, 'd')",
            "UPDATE releases SET epsilon = 2",
            "DELETE FROM releases",
        ):
            raw.execute(statement)
            counts.append(ledger_module.release_changes(raw))
    assert counts == [1, 2, 3]


def test_within_its_shares_refunds_and_repeats_read_only_the_analysts_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shares = BudgetShares.for_budget({A: 0.5, B: 0.5}, BUDGET)
    path = tmp_path / "ledger.sqlite3"
    ledger = BudgetLedger(path, shares=shares)
    read: list[str | None] = []
    real = ledger_module.read_events

    def reading(connection: Any, analyst: str | None = None) -> Any:
        read.append(analyst)
        return real(connection, analyst)

    monkeypatch.setattr(ledger_module, "read_events", reading)
    first = ledger.reserve(_event("a0", A, 0.3), BUDGET, spec_digest="a0")
    assert first.share_used is not None
    used = first.share_used[1]
    again = ledger.reserve(_event("a0", A, 0.3), BUDGET, spec_digest="a0")
    assert again.already_reserved and again.share_used == (used, used)
    assert ledger.cancel_reservation("a0")
    ledger.reserve(_event("b0", B, 0.3), BUDGET, spec_digest="b0")
    assert read == [A, A, B]  # never every analyst's
    # A release another writer adds is looked at once, from every release; then the
    # ledger, still within its shares, reads the asking analyst's only again.
    BudgetLedger(path).reserve(_event("a1", A, 0.3), BUDGET, spec_digest="a1")
    ledger.reserve(_event("b1", B, 0.1), BUDGET, spec_digest="b1")
    assert read[-2:] == [None, B] and ledger.within_shares
    ledger.reserve(_event("b2", B, 0.1), BUDGET, spec_digest="b2")
    assert read[-1] == B


def test_one_analysts_releases_and_a_tasks_digest_are_found_by_index(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "ledger.sqlite3")
    with sqlite3.connect(ledger.path) as connection:
        own = connection.execute(f"EXPLAIN QUERY PLAN {OWN_RELEASES_SQL}", (A,)).fetchall()
        digest = connection.execute(
            "EXPLAIN QUERY PLAN SELECT query_id FROM tasks WHERE spec_digest = ?", ("d",)
        ).fetchall()
    assert "USING INDEX releases_by_analyst" in " ".join(str(row) for row in own)
    assert "USING INDEX tasks_by_digest" in " ".join(str(row) for row in digest)


def test_within_shares_a_ledger_refuses_another_budget(tmp_path: Path) -> None:
    ledger = BudgetLedger(
        tmp_path / "ledger.sqlite3", shares=BudgetShares.for_budget({A: 1.0}, BUDGET)
    )
    with pytest.raises(ConfigError, match="shares were made for the budget"):
        ledger.reserve(_event("a0", A, 0.1), PrivacyParams(0.5, DELTA), spec_digest="a0")
    assert ledger.events() == []


def test_the_over_share_warning_is_given_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.sqlite3"
    _decisions(BudgetLedger(path), A, [0.6] * 3)
    with caplog.at_level(logging.WARNING, logger="fedpca.owner.ledger"):
        ledger = BudgetLedger(path, shares=BudgetShares.for_budget({A: 0.1, B: 0.9}, BUDGET))
        assert _decisions(ledger, B, [0.05] * 3) == [True] * 3
    assert caplog.text.count("exceed the budget share") == 1
