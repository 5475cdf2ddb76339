"""The proxy coordinator without gRPC: lifecycle, budget, validation, noise and mask.

Keys are TEST-ONLY 512-bit moduli; owners' shares are real ionosphere rows split
across owners, encrypted exactly as an owner does (exact fixed-point statistics,
packed encryption), so the checks below compare decrypted results with the
integer sums the owners actually encrypted. Queries are signed by the analyst
(helpers.TEST_SIGNING_KEY) and stored under their task id ``analyst/query``; only
the owners on the allow-list (owner-0, owner-1, owner-2) take part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import re
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.codec import CryptoPool, pack_slots, unpack_slots
from fedpca.dp.accounting import Accountant
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    CalibrationError,
    CiphertextError,
    ConfigError,
    LayoutError,
    NotFoundError,
    OverloadError,
    ProtocolError,
    QueryStateError,
)
from fedpca.exact_statistics import fixed_point_statistics
from fedpca.masked_release import row_aligned_positions
from fedpca.messages import (
    MAX_DECLINE_DETAIL,
    DecodedChunk,
    NoiseMechanism,
    OwnerDecline,
    QueryState,
    SignedQuery,
    Task,
    TaskCancellation,
    UploadHeader,
    ciphertexts_to_bytes,
)
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SHARES,
    SUM_SINGLE,
    ReleasePlan,
)
from fedpca.proxy import catalog, coordinator_core, prepared_noise
from fedpca.proxy.config import (
    BudgetConfig,
    OwnersConfig,
    PrivacySection,
    ProxyConfig,
    ProxySection,
)
from fedpca.proxy.coordinator import PROXY_WORK_LIMIT_SECONDS, Coordinator, task_id
from fedpca.proxy.coordinator_core import ContextCache, total_ciphertexts
from fedpca.proxy.limits import PeerLimits
from fedpca.proxy.queries import wire_blocks
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_records import NotContributingError, UploadCompletion
from fedpca.proxy.uploads import UploadStream
from fedpca.query import DEFAULT_QUERY_DELTA, Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.query_records import spec_from_dict, spec_to_dict
from fedpca.signing import (
    CLOCK_ALLOWANCE_SECONDS,
    generate_signing_key,
    sign_query,
    verify_query,
)
from fedpca.stats import sum_statistics
from helpers import (
    QUANTISATION_STEP,
    SECOND_TEST_SIGNING_KEY,
    TEST_SIGNER,
    TEST_SIGNING_KEY,
    dataset_table,
    query_builder,
    record_exact_draws,
    reference_statistics,
    signed,
    sqlite_error,
    wait_until,
)

IntVector = list[int]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def owner_rows() -> list[np.ndarray]:
    """Ionosphere features split across three owners (raw; owners preprocess)."""
    table = dataset_table("ionosphere")
    features = table[:, 1:]
    return [features[0:120], features[120:240], features[240:]]


OWNER_IDS = ("owner-0", "owner-1", "owner-2")
"""The proxy's allow-list (``[owners] allowed``)."""
ANALYST = "alice"
REPLACE_ONE = Neighbouring.REPLACE_ONE


def key(query_id: str = "q1", analyst: str = ANALYST) -> str:
    """The proxy's task id of an analyst's query (what owners and the store use)."""
    return task_id(analyst, query_id)


Q1 = key("q1")


def make_config(
    epsilon: float = math.inf,
    *,
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
    accountant: Accountant = Accountant.ZCDP,
    max_delta_per_query: float | None = None,
    **analysts: PrivacyParams,
) -> ProxyConfig:
    return ProxyConfig(
        budget=BudgetConfig(PrivacyParams(epsilon, 1e-5), dict(analysts)),
        owners=OwnersConfig(frozenset(OWNER_IDS)),
        privacy=PrivacySection(neighbouring, accountant, max_delta_per_query),
    )


make_spec = query_builder(
    n_features=34,
    n_components=3,
    feature_lower=(-1.0,) * 34,
    feature_upper=(1.0,) * 34,
    quorum=3,
    deadline_seconds=60.0,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make_coordinator(
    tmp_path: Path, pool: CryptoPool, config: ProxyConfig | None = None, **kwargs: Any
) -> Coordinator:
    clock = kwargs.setdefault("clock", Clock())
    store = ProxyStore(tmp_path / "proxy.sqlite3", clock=clock)
    kwargs.setdefault("noise_sampler", TestOnlySeededSampler(7))
    return Coordinator(
        store,
        config or make_config(),
        pool,
        allow_insecure_test_keys=True,
        background=False,
        **kwargs,
    )


class Owner:
    """What an owner node does for one query, minus the network."""

    def __init__(self, owner_id: str, rows: np.ndarray) -> None:
        self.owner_id = owner_id
        self.rows = rows

    def encode(self, plan: ReleasePlan) -> tuple[dict[str, np.ndarray], int]:
        """The exact fixed-point integers of every block and the record count.

        Exact integer statistics: the same integers on every call, and in masked mode
        every copy of v (unpacked and as windows) is the same integer, as the mask
        terms need.
        """
        statistics = fixed_point_statistics(self.rows, None, plan.spec)
        return plan.owner_integers(statistics), statistics.count

    def upload(
        self, plan: ReleasePlan, public_key: Any, pool: CryptoPool, task: str = Q1
    ) -> tuple[UploadHeader, dict[str, list[int]], dict[str, np.ndarray]]:
        """The upload header (naming the task id ``task``), ciphertexts and integers."""
        encoded, count = self.encode(plan)
        blocks = {
            block.name: list(
                pool.encrypt_packed(
                    public_key, encoded[block.name], block.layout, block.bound
                ).ciphertexts
            )
            for block in plan.owner_blocks
        }
        header = UploadHeader(
            query_id=task,
            analyst_key_fingerprint=plan.spec.analyst_key_fingerprint,
            upload_id=f"{self.owner_id}-{plan.spec.query_id}",
            blocks=wire_blocks(plan),
            total_chunks=len(plan.owner_blocks),
            public_record_count=count if plan.spec.mode is ProtocolMode.MASKED else None,
        )
        return header, blocks, encoded


def accept_upload(
    coordinator: Coordinator,
    owner_id: str,
    header: UploadHeader,
    blocks: Mapping[str, Sequence[int]],
) -> UploadCompletion:
    """Stream an upload through the coordinator, one chunk per block in the plan's
    order, as the servicer does with wire chunks (taking it out again if it fails).

    Blocks are passed on as given (a short or missing one included): the production
    checks must refuse them, not this helper.
    """
    upload = coordinator.begin_upload(owner_id, header)
    try:
        position, index = 0, 0
        content = hashlib.sha256()
        width = header.blocks[0].ciphertext_bytes
        for block in upload.context.plan.owner_blocks:
            ciphertexts = list(blocks.get(block.name, []))
            if ciphertexts:
                data = ciphertexts_to_bytes(ciphertexts, width)
                upload.add(DecodedChunk(index, position, ciphertexts, data))
                content.update(data)
                index += 1
            position += block.layout.n_ciphertexts
        return upload.complete(content.digest())
    except BaseException:
        upload.abandon()
        raise


def chunk_of(ciphertexts: Sequence[int], index: int = 0, offset: int = 0) -> DecodedChunk:
    """The checked chunk a servicer hands on for these ciphertexts (512-bit test keys)."""
    return DecodedChunk(index, offset, list(ciphertexts), ciphertexts_to_bytes(ciphertexts, 128))


def owners_for(rows: list[np.ndarray]) -> list[Owner]:
    return [Owner(f"owner-{i}", r) for i, r in enumerate(rows)]


def decrypt_block(
    pool: CryptoPool,
    private_key: Any,
    coordinator: Coordinator,
    query_id: str,
    name: str,
    analyst: str = ANALYST,
) -> IntVector:
    result = coordinator.result(analyst, query_id)
    plan = coordinator.plan(key(query_id, analyst))
    block = next(b for b in plan.result_blocks if b.name == name)
    plaintexts = pool.decrypt(private_key, list(result.payload[name]))
    return unpack_slots(plaintexts, block.layout, private_key.public_key.n)


def run_stats_query(
    coordinator: Coordinator,
    pool: CryptoPool,
    public_key: Any,
    owners: list[Owner],
    spec: QuerySpec,
    analyst: str = "alice",
) -> np.ndarray:
    """Submit, upload every owner, finish; return Σ of the owners' encoded values."""
    coordinator.submit(analyst, signed(spec))
    task = key(spec.query_id, analyst)
    plan = coordinator.plan(task)
    total = np.zeros(plan.owner_block(SHARES).layout.value_count, dtype=object)
    for owner in owners:
        header, blocks, encoded = owner.upload(plan, public_key, pool, task)
        accept_upload(coordinator, owner.owner_id, header, blocks)
        total = total + encoded[SHARES].astype(object)
    return total


# ------------------------------------------------------------------ stats mode
def test_spec_json_round_trip_keeps_every_field(test_only_keypair_512: Any) -> None:
    public_key, _ = test_only_keypair_512
    spec = make_spec(public_key, mode=ProtocolMode.MASKED, noise_weights=())
    assert spec_from_dict(spec_to_dict(spec)) == spec
    dca = make_spec(
        public_key, kind=QueryKind.DCA, label_column=0, class_labels=(-1.0, 1.0), epsilon=0.5
    )
    assert spec_from_dict(spec_to_dict(dca)) == dca
    assert spec_to_dict(spec)["epsilon"] == "inf"  # strict JSON


def test_stats_mode_without_noise_equals_the_owners_integer_sums(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    caplog: pytest.LogCaptureFixture,
) -> None:
    public_key, private_key = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    owners = owners_for(owner_rows)
    spec = make_spec(public_key)
    expected = run_stats_query(coordinator, pool, public_key, owners, spec)

    record = coordinator.store.query(Q1)
    assert record.state is QueryState.DONE and record.n_contributed == 3
    assert record.analyst_id == ANALYST and record.signer == TEST_SIGNER
    # The result's header carries the analyst's signature, so a fetch by id checks the
    # query is one the analyst signed before reading a page.
    header = coordinator.result_header(ANALYST, "q1")
    assert header.query_signer == TEST_SIGNER
    verify_query(header.query, header.query_signature, header.query_signer)
    decrypted = decrypt_block(pool, private_key, coordinator, "q1", SHARES)
    assert decrypted == list(expected)  # exact: no noise, homomorphic sums only

    # A later pass (a late fold callback, a restart) finds the query done and does not
    # report it done again (its log line, metrics and result timings).
    caplog.set_level(logging.INFO, logger="fedpca.proxy.coordinator")
    caplog.clear()
    meta = coordinator.store.result_meta(Q1)
    coordinator.advance(Q1)
    assert not [r for r in caplog.records if " done: " in r.getMessage()]
    assert coordinator.store.result_meta(Q1) == meta

    # And the decoded statistics are the pooled statistics of all rows, to within the
    # owners' quantisation of every coordinate (2^-16 per coordinate and row).
    plan = coordinator.plan(Q1)
    pooled = sum_statistics(
        reference_statistics(preprocess_for_query(o.rows, spec), None, spec) for o in owners
    )
    got = plan.statistics_from_integers(decrypted)
    tolerance = 351 * 2 * QUANTISATION_STEP
    np.testing.assert_allclose(got.scatter, pooled.scatter, rtol=0, atol=tolerance)
    np.testing.assert_allclose(got.sums, pooled.sums, rtol=0, atol=tolerance)
    assert got.count == 351.0  # counts are exact

    meta = coordinator.result_meta(ANALYST, "q1")
    assert meta["not_private"] is True and meta["n_owners"] == 3
    assert all(s["sigma"] == 0 for s in meta["sections"])
    result = coordinator.result(ANALYST, "q1")
    assert result.noise.mechanism is NoiseMechanism.NONE
    assert result.query == spec  # the analyst's own query id, not the task id


def test_a_finished_querys_result_is_deleted_after_the_days_it_is_kept(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
) -> None:
    """Found by review: the proxy kept every result for good. After [proxy]
    keep_results_days a finished query's pages are deleted; a fetch then says so (not
    "no result"), and the query and its charge stay."""
    public_key, _ = test_only_keypair_512
    config = replace(make_config(), proxy=ProxySection(keep_results_days=2.0))
    coordinator = make_coordinator(tmp_path, pool, config)
    clock = coordinator.clock
    assert isinstance(clock, Clock)
    run_stats_query(coordinator, pool, public_key, owners_for(owner_rows), make_spec(public_key))
    assert coordinator.purge_results() == []  # finished just now
    clock.now += 2 * 86_400 - 60
    assert coordinator.purge_results() == []
    clock.now += 120
    assert coordinator.status(ANALYST, "q1").result_deleted_at is None
    assert coordinator.purge_results() == [Q1]
    deleted_at = coordinator.status(ANALYST, "q1").result_deleted_at
    assert deleted_at == datetime.fromtimestamp(clock.now, UTC)
    for fetch in (
        lambda: coordinator.result_header(ANALYST, "q1"),
        lambda: coordinator.result_pages(ANALYST, "q1", 0),
        lambda: coordinator.result(ANALYST, "q1"),
    ):
        with pytest.raises(QueryStateError, match="keep_results_days"):
            fetch()
    assert coordinator.store.query(Q1).state is QueryState.DONE
    assert coordinator.store.has_release(Q1)  # its charge stands
    assert coordinator.purge_results() == []  # once
    # 0 keeps results for good.
    forever = replace(make_config(), proxy=ProxySection(keep_results_days=0.0))
    kept = make_coordinator(tmp_path / "forever", pool, forever)
    run_stats_query(kept, pool, public_key, owners_for(owner_rows), make_spec(public_key))
    later = kept.clock
    assert isinstance(later, Clock)
    later.now += 10_000 * 86_400
    assert kept.purge_results() == [] and kept.store.result_pages(Q1)


def test_stats_mode_noise_has_the_planned_sigma_per_section(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(epsilon=100.0))
    spec = make_spec(public_key, epsilon=1.0)
    expected = run_stats_query(coordinator, pool, public_key, owners_for(owner_rows), spec)
    decrypted = decrypt_block(pool, private_key, coordinator, "q1", SHARES)
    noise = np.array([int(a - b) for a, b in zip(decrypted, expected, strict=True)], dtype=float)

    plan = coordinator.plan(Q1)
    slices = plan.statistics.section_slices()
    for section in plan.sections:
        part = noise[slices[section.name]]
        assert section.sigma_int > 0
        # The noise covers a capped owner's swap of a record under add/remove: at clip
        # norm 1 every section of the default split gets z * sqrt(4.5).
        assert section.sigma == pytest.approx(plan.noise_multiplier * math.sqrt(4.5))
        if section.length >= 30:
            # Sample sd of n Gaussian draws has relative standard error ~1/sqrt(2n):
            # 3% for the 595 scatter values, 12% for the 34 sums; allow 5 of them.
            tolerance = 5 / math.sqrt(2 * section.length)
            assert np.std(part) == pytest.approx(section.sigma_int, rel=tolerance)
            assert abs(np.mean(part)) < 5 * section.sigma_int / math.sqrt(section.length)
        else:
            assert np.all(np.abs(part) < 6 * section.sigma_int)
    meta = coordinator.result_meta(ANALYST, "q1")
    assert meta["not_private"] is False
    assert [s["sigma"] for s in meta["sections"]] == [s.sigma for s in plan.sections]
    assert coordinator.result(ANALYST, "q1").noise.mechanism is NoiseMechanism.GAUSSIAN


def test_a_coordinator_without_a_sampler_draws_every_section_with_the_exact_sampler(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy's default is the exact sampler, at each section's own scale (a test
    audit found no test that would notice a default switched to the seeded one)."""
    calls = record_exact_draws(monkeypatch)
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(epsilon=100.0), noise_sampler=None)
    spec = make_spec(public_key, epsilon=1.0)
    run_stats_query(coordinator, pool, public_key, owners_for(owner_rows), spec)
    plan = coordinator.plan(Q1)
    drawn: dict[float, int] = {}
    for sigma_int, size in calls:
        drawn[sigma_int] = drawn.get(sigma_int, 0) + size
    expected: dict[float, int] = {}
    for section in plan.sections:
        expected[section.sigma_int] = expected.get(section.sigma_int, 0) + section.length
    assert drawn == expected


# ------------------------------------------------------------------ budget
def test_budget_refusal_happens_at_submit_and_records_nothing(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    config = make_config(epsilon=100.0, bob=PrivacyParams(1.2, 1e-5))
    coordinator = make_coordinator(tmp_path, pool, config)
    coordinator.submit(
        "bob", signed(make_spec(public_key, "b1", epsilon=1.0), SECOND_TEST_SIGNING_KEY)
    )
    with pytest.raises(BudgetExceededError):
        coordinator.submit(
            "bob", signed(make_spec(public_key, "b2", epsilon=1.0), SECOND_TEST_SIGNING_KEY)
        )
    assert [q.query_id for q in coordinator.store.queries()] == ["bob/b1"]
    assert len(coordinator.store.releases("bob")) == 1
    assert coordinator.store.releases("bob")[0]["query_id"] == "bob/b1"
    assert coordinator.tasks_for("owner-0") == [make_spec(public_key, "b1", epsilon=1.0)]
    # Resubmitting the accepted query is idempotent and not charged twice.
    coordinator.submit(
        "bob", signed(make_spec(public_key, "b1", epsilon=1.0), SECOND_TEST_SIGNING_KEY)
    )
    assert len(coordinator.store.releases("bob")) == 1
    # epsilon = inf costs an infinite budget: refused under any finite one.
    with pytest.raises(BudgetExceededError):
        coordinator.submit("alice", signed(make_spec(public_key, "inf")))
    budget = coordinator.budget("bob")
    assert budget.n_releases == 1 and budget.epsilon_limit == 1.2
    assert 0 < budget.epsilon_spent <= 1.0 + 1e-6
    assert budget.epsilon_remaining == pytest.approx(1.2 - budget.epsilon_spent)


@pytest.mark.parametrize("accountant", [Accountant.ZCDP, Accountant.PLD_CONTINUOUS])
def test_budget_reports_the_largest_epsilon_the_next_submission_is_admitted_with(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, accountant: Accountant
) -> None:
    public_key, _ = test_only_keypair_512
    config = make_config(accountant=accountant, bob=PrivacyParams(2.0, 1e-5))
    coordinator = make_coordinator(tmp_path, pool, config)

    def submit(query_id: str, epsilon: float, delta: float) -> None:
        spec = make_spec(public_key, query_id, epsilon=epsilon, delta=delta)
        coordinator.submit("bob", signed(spec, SECOND_TEST_SIGNING_KEY))

    submit("b1", 0.5, 1e-6)
    submit("b2", 0.8, 1e-7)
    budget = coordinator.budget("bob")
    next_query = budget.next_query
    assert next_query is not None and next_query.limit is AdmissionLimit.BUDGET
    # The default query delta: the estimators' 1e-6, under the per-query cap (1e-5).
    assert next_query.delta == DEFAULT_QUERY_DELTA
    # Far more than "limit - spent" (composition is not additive), kept on the wire.
    assert budget.epsilon_remaining == pytest.approx(2.0 - budget.epsilon_spent)
    assert next_query.epsilon > budget.epsilon_remaining + 0.3
    # A query asking for a little more is refused at submission, charging nothing; one
    # asking for exactly the answer is admitted through the whole submission path.
    with pytest.raises(BudgetExceededError):
        submit("more", next_query.epsilon * (1 + 1e-3), next_query.delta)
    assert len(coordinator.store.releases("bob")) == 2
    submit("exact", next_query.epsilon, next_query.delta)
    assert coordinator.store.releases("bob")[-1]["query_id"] == "bob/exact"


def test_budget_next_query_at_other_deltas_and_of_exhausted_and_unlimited_budgets(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(bob=PrivacyParams(2.0, 1e-5)))
    unlimited = coordinator.budget("alice").next_query
    assert unlimited == NextQuery(math.inf, DEFAULT_QUERY_DELTA, AdmissionLimit.UNLIMITED)
    spec = make_spec(public_key, "b1", epsilon=1.0, delta=1e-6)
    coordinator.submit("bob", signed(spec, SECOND_TEST_SIGNING_KEY))
    # At another query delta (less delta: more epsilon for the same noise), never above
    # the per-query delta cap.
    at_default = coordinator.budget("bob").next_query
    other = coordinator.budget("bob", query_delta=1e-8).next_query
    assert at_default is not None and other is not None and other.delta == 1e-8
    assert other.epsilon > at_default.epsilon and other.limit is AdmissionLimit.BUDGET
    with pytest.raises(ConfigError, match="above this proxy's per-query cap 1e-05"):
        coordinator.budget("bob", query_delta=1e-4)
    # Metrics ask for the spent epsilon only: no search.
    assert coordinator.budget("bob", next_query=False).next_query is None
    coordinator.store.close()
    # The operator lowers bob's budget below what he has spent.
    lowered = make_config(bob=PrivacyParams(0.5, 1e-5), max_delta_per_query=1e-7)
    restarted = make_coordinator(tmp_path, pool, lowered)
    status = restarted.budget("bob")
    # A per-query delta cap below 1e-6 is the default query delta.
    assert status.next_query == NextQuery(0.0, 1e-7, AdmissionLimit.EXHAUSTED)
    tiny = make_spec(public_key, "b2", epsilon=1e-3, delta=1e-7)
    with pytest.raises(BudgetExceededError):
        restarted.submit("bob", signed(tiny, SECOND_TEST_SIGNING_KEY))


def test_a_budget_refusal_says_what_still_fits_and_exhausted_only_when_nothing_does(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(bob=PrivacyParams(1.2, 1e-5)))

    def submit(coordinator: Coordinator, query_id: str, epsilon: float) -> None:
        spec = make_spec(public_key, query_id, epsilon=epsilon, delta=1e-6)
        coordinator.submit("bob", signed(spec, SECOND_TEST_SIGNING_KEY))

    submit(coordinator, "b1", 1.0)
    with pytest.raises(BudgetExceededError) as refused:
        submit(coordinator, "b2", 1.0)
    message = str(refused.value)
    # Room is left, only not for this query: no "exhausted", and how much fits, found
    # by the admission rule (zcdp: closed form, cheap) and readable.
    assert "exhausted" not in message
    assert message.startswith("not enough privacy budget left for this query (it would bring")
    fits = coordinator.budget("bob", query_delta=1e-6).next_query
    assert fits is not None and 0 < fits.epsilon < 1.0
    assert message.endswith(
        f"; it asks for epsilon 1 at delta 1e-06, and a query at that delta may ask for "
        f"epsilon up to {fits.epsilon:.6g} now (fedpca analyst budget --query-delta 1e-06)"
    )
    spent = re.search(
        r"from (\S+) to (\S+) at delta 1e-05, over the budget (\S+); zcdp accountant\)", message
    )
    assert spent is not None, message
    assert len(spent[1]) <= 8 and float(spent[2]) > float(spent[3]) == 1.2 > float(spent[1])
    submit(coordinator, "b3", fits.epsilon)  # what the refusal named is admitted
    coordinator.store.close()
    # Lowered below what was spent: nothing fits any more, and only now "exhausted".
    lowered = make_coordinator(tmp_path, pool, make_config(bob=PrivacyParams(0.5, 1e-5)))
    with pytest.raises(BudgetExceededError, match=r"^the privacy budget is exhausted \("):
        submit(lowered, "b4", 1e-3)


def test_a_budget_refusal_under_pld_points_to_the_budget_command_without_a_search(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, monkeypatch: Any
) -> None:
    # Under pld-continuous the search takes up to seconds: the refusal path runs none.
    import fedpca.dp.next_query as next_query_module

    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the refusal searched for the largest epsilon that fits")

    monkeypatch.setattr(next_query_module, "largest_admissible_epsilon", no_search)
    public_key, _ = test_only_keypair_512
    config = make_config(accountant=Accountant.PLD_CONTINUOUS, bob=PrivacyParams(1.0, 1e-5))
    coordinator = make_coordinator(tmp_path, pool, config)
    for query_id in ("p1", "p2"):
        spec = make_spec(public_key, query_id, epsilon=1.0, delta=1e-6)
        if query_id == "p1":
            coordinator.submit("bob", signed(spec, SECOND_TEST_SIGNING_KEY))
            continue
        with pytest.raises(BudgetExceededError) as refused:
            coordinator.submit("bob", signed(spec, SECOND_TEST_SIGNING_KEY))
    message = str(refused.value)
    assert "exhausted" not in message and "not enough privacy budget left" in message
    assert message.endswith(
        "; `fedpca analyst budget --query-delta 1e-06` shows the largest epsilon that still fits"
    )


@pytest.mark.parametrize("budget", [math.inf, 5.0])
def test_huge_epsilon_is_refused_at_submit_with_the_accountants_limit(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, budget: float
) -> None:
    # epsilon = 1e6 made dp_accounting's PLD accountant fail (MemoryError): INTERNAL.
    # The floor is the PLD accountant's (the option); zcdp has none (next test).
    public_key, _ = test_only_keypair_512
    config = make_config(epsilon=budget, accountant=Accountant.PLD_CONTINUOUS)
    coordinator = make_coordinator(tmp_path, pool, config)
    with pytest.raises(CalibrationError, match=r"epsilon=1e\+06.*minimum 0\.1") as info:
        coordinator.submit("alice", signed(make_spec(public_key, "huge", epsilon=1e6)))
    assert "at most epsilon=91.8173 per release" in str(info.value)
    assert coordinator.store.queries() == []
    assert coordinator.store.releases("alice") == []
    assert coordinator.tasks_for("owner-0") == []
    # The analyst may still ask for a usable epsilon.
    coordinator.submit("alice", signed(make_spec(public_key, "fine", epsilon=1.0)))
    assert [q.query_id for q in coordinator.store.queries()] == [key("fine")]


def test_huge_epsilon_under_the_default_zcdp_accountant_is_a_budget_question(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    # The zcdp accountant is closed form: no floor, nothing to exhaust. epsilon = 1e6
    # is charged like any other release: over a finite budget it is refused (and
    # nothing recorded), under an unlimited one accepted.
    public_key, _ = test_only_keypair_512
    limited = make_coordinator(tmp_path / "limited", pool, make_config(epsilon=5.0))
    with pytest.raises(BudgetExceededError, match="zcdp accountant"):
        limited.submit("alice", signed(make_spec(public_key, "huge", epsilon=1e6)))
    assert limited.store.queries() == [] and limited.store.releases("alice") == []
    unlimited = make_coordinator(tmp_path / "unlimited", pool, make_config())
    unlimited.submit("alice", signed(make_spec(public_key, "huge", epsilon=1e6)))
    assert unlimited.budget("alice").n_releases == 1
    assert unlimited.budget("alice").epsilon_spent == pytest.approx(1e6, rel=1e-3)


def test_two_concurrent_submits_where_only_one_fits(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(1.2))
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def submit(query_id: str) -> None:
        barrier.wait()
        try:
            coordinator.submit("carol", signed(make_spec(public_key, query_id, epsilon=1.0)))
            outcomes.append("accepted")
        except BudgetExceededError:
            outcomes.append("refused")

    threads = [threading.Thread(target=submit, args=(f"c{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["accepted", "refused"]
    assert len(coordinator.store.queries()) == 1
    assert len(coordinator.store.releases("carol")) == 1


def test_an_analyst_has_at_most_its_bound_of_queries_open_and_a_refused_one_costs_nothing(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    # Each query costs the proxy its noise draw and a row, cancelled or not: a tiny
    # epsilon must not buy an unbounded number of them (review: 10 queries at M = 4,000
    # took 611 MiB for epsilon 0.029 in all).
    public_key, _ = test_only_keypair_512
    config = replace(make_config(100.0), limits=PeerLimits(max_open_queries_per_analyst=2))
    coordinator = make_coordinator(tmp_path, pool, config)
    for query_id in ("a1", "a2"):
        coordinator.submit(ANALYST, signed(make_spec(public_key, query_id, epsilon=0.01)))
    spent = coordinator.budget(ANALYST).epsilon_spent
    with pytest.raises(OverloadError, match=r"2 queries open.*max_open_queries_per_analyst"):
        coordinator.submit(ANALYST, signed(make_spec(public_key, "a3", epsilon=0.01)))
    assert [q.query_id for q in coordinator.store.queries()] == [key("a1"), key("a2")]
    assert coordinator.budget(ANALYST).epsilon_spent == spent  # nothing charged
    assert coordinator.budget(ANALYST).n_releases == 2
    # Resubmitting an open query is the same query, not a new one; another analyst
    # has bounds of its own.
    coordinator.submit(ANALYST, signed(make_spec(public_key, "a2", epsilon=0.01)))
    coordinator.submit(
        "bob", signed(make_spec(public_key, "b1", epsilon=0.01), SECOND_TEST_SIGNING_KEY)
    )
    # A query that ended (here: cancelled) frees its place.
    coordinator.cancel(ANALYST, "a1")
    coordinator.submit(ANALYST, signed(make_spec(public_key, "a3", epsilon=0.01)))
    assert coordinator.store.query(key("a3")).state is QueryState.COLLECTING


def test_a_submission_beyond_a_bound_is_refused_before_any_work(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a refused submission first composed the analyst's ledger (seconds under
    the PLD accountant, on a shared worker thread), so a flood of them froze the proxy."""
    public_key, _ = test_only_keypair_512
    config = replace(make_config(100.0), limits=PeerLimits(max_open_queries_per_analyst=1))
    coordinator = make_coordinator(tmp_path, pool, config)
    coordinator.submit(ANALYST, signed(make_spec(public_key, "first", epsilon=0.01)))
    composed: list[str] = []
    monkeypatch.setattr(coordinator, "_check_budget", lambda *a: composed.append("!"))
    with pytest.raises(OverloadError):
        coordinator.submit(ANALYST, signed(make_spec(public_key, "second", epsilon=0.01)))
    assert composed == []


def test_an_analyst_submits_at_most_its_daily_bound_in_any_24_hours(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    # Submitting and cancelling at once keeps nothing open and is refunded: without a
    # rate bound a zero budget could grow the proxy's database without end.
    public_key, _ = test_only_keypair_512
    limits = PeerLimits(max_queries_per_analyst_per_day=3)
    clock = Clock()
    coordinator = make_coordinator(
        tmp_path, pool, replace(make_config(100.0), limits=limits), clock=clock
    )
    for index in range(3):
        coordinator.submit(ANALYST, signed(make_spec(public_key, f"d{index}", epsilon=0.01)))
        assert coordinator.cancel(ANALYST, f"d{index}").refunded
        clock.now += 3600.0
    with pytest.raises(OverloadError, match="3 queries in the last 24 hours"):
        coordinator.submit(ANALYST, signed(make_spec(public_key, "d3", epsilon=0.01)))
    assert len(coordinator.store.queries()) == 3
    # 24 hours after the first, one place is free again (and only one).
    clock.now += 24 * 3600.0 - 3 * 3600.0 + 1.0
    coordinator.submit(ANALYST, signed(make_spec(public_key, "d3", epsilon=0.01)))
    with pytest.raises(OverloadError):
        coordinator.submit(ANALYST, signed(make_spec(public_key, "d4", epsilon=0.01)))


def test_a_stalled_contributor_cannot_hold_the_analysts_place_past_a_cancel(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
) -> None:
    """An owner that begins an upload and stalls keeps the query AGGREGATING until its
    deadline; the analyst may cancel it then (charged: an upload began), which frees
    its place under max_open_queries_per_analyst (review)."""
    public_key, _ = test_only_keypair_512
    config = replace(make_config(100.0), limits=PeerLimits(max_open_queries_per_analyst=1))
    coordinator = make_coordinator(tmp_path, pool, config)
    coordinator.submit(ANALYST, signed(make_spec(public_key, quorum=1, epsilon=1.0)))
    plan = coordinator.plan(Q1)
    header, _, _ = owners_for(owner_rows)[0].upload(plan, public_key, pool)
    stalled = coordinator.begin_upload("owner-0", header)  # a header, then nothing
    assert coordinator.store.query(Q1).state is QueryState.AGGREGATING
    with pytest.raises(OverloadError):
        coordinator.submit(ANALYST, signed(make_spec(public_key, "next", epsilon=1.0)))
    receipt = coordinator.cancel(ANALYST, "q1")
    assert receipt.status.state is QueryState.FAILED and not receipt.refunded
    stalled.abandon()
    coordinator.submit(ANALYST, signed(make_spec(public_key, "next", epsilon=1.0)))
    assert coordinator.store.query(key("next")).state is QueryState.COLLECTING


def test_a_signing_key_belongs_to_the_analyst_that_first_submitted_with_it(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """Owners see every signed query; another analyst who submitted a copy of one first
    had owners decline the original as a replay (review)."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(100.0))
    hers = signed(make_spec(public_key, "q1", epsilon=1.0))
    coordinator.submit("alice", hers)
    with pytest.raises(AuthenticationError, match="signing key of another analyst"):
        coordinator.submit("bob", hers)  # her very signature, under his name
    with pytest.raises(AuthenticationError):
        coordinator.submit("bob", signed(make_spec(public_key, "q2", epsilon=1.0)))
    assert [q.query_id for q in coordinator.store.queries()] == ["alice/q1"]
    assert coordinator.store.releases("bob") == []
    coordinator.submit(
        "bob", signed(make_spec(public_key, "q2", epsilon=1.0), SECOND_TEST_SIGNING_KEY)
    )
    coordinator.submit("alice", signed(make_spec(public_key, "q3", epsilon=1.0)))


def test_query_contexts_in_memory_are_bounded_and_rebuilt_from_the_store(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator._contexts = ContextCache(size=2)
    specs = [make_spec(public_key, f"c{index}", epsilon=1.0) for index in range(4)]
    for spec in specs:
        coordinator.submit(ANALYST, signed(spec))
        assert len(coordinator._contexts) <= 2
    assert coordinator._contexts.get(key("c0")) is None  # the oldest went first
    # A query whose context was dropped is served as before: rebuilt from its row.
    assert coordinator.plan(key("c0")).spec == specs[0]
    assert coordinator._contexts.get(key("c0")) is not None
    assert len(coordinator._contexts) == 2


def test_submit_refuses_short_keys_and_wrong_fingerprints(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    strict = Coordinator(
        ProxyStore(tmp_path / "strict.sqlite3"), make_config(), pool, background=False
    )
    with pytest.raises(ConfigError, match="512 bits; at least 2048"):
        strict.submit("alice", signed(make_spec(public_key)))
    coordinator = make_coordinator(tmp_path, pool)
    with pytest.raises(ConfigError, match="fingerprint does not match"):
        coordinator.submit(
            "alice", signed(make_spec(public_key, analyst_key_fingerprint="sha256:00"))
        )
    with pytest.raises(ConfigError, match="masked mode is the published PCA protocol"):
        coordinator.submit(
            "alice",
            signed(
                make_spec(
                    public_key,
                    kind=QueryKind.DCA,
                    label_column=0,
                    class_labels=(-1.0, 1.0),
                    mode=ProtocolMode.MASKED,
                )
            ),
        )
    assert coordinator.store.queries() == [] and strict.store.queries() == []
    assert coordinator.store.releases("alice") == []


def test_submit_refuses_a_query_no_owner_would_answer_by_its_signing_time(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """Owners answer a query only from its signing time (less 5 minutes for clocks)
    until its signed deadline: the proxy refuses at once what none would answer, so
    an analyst whose clock is wrong learns it at submission, not from every owner
    ending its task as too late (before, the proxy took it and charged the analyst).
    A resubmission of a query it already holds is not checked again."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(epsilon=100.0))
    now = time.time()

    def signed_at(query_id: str, issued_at: float | None) -> SignedQuery:
        spec = make_spec(public_key, query_id=query_id, issued_at=issued_at, epsilon=1.0)
        return SignedQuery(spec, sign_query(spec, TEST_SIGNING_KEY), TEST_SIGNER)

    with pytest.raises(ConfigError, match="carries no signing time"):
        coordinator.submit("alice", signed_at("none", None))
    with pytest.raises(ConfigError, match="in the future of this node's clock"):
        coordinator.submit("alice", signed_at("future", now + CLOCK_ALLOWANCE_SECONDS + 60))
    deadline = make_spec(public_key).deadline_seconds
    late = now - deadline - CLOCK_ALLOWANCE_SECONDS - 1
    with pytest.raises(ConfigError, match="passed before it reached this proxy"):
        coordinator.submit("alice", signed_at("late", late))
    assert coordinator.store.queries() == [] and coordinator.store.releases("alice") == []
    # Within the allowance either way: taken.
    coordinator.submit("alice", signed_at("ahead", now + CLOCK_ALLOWANCE_SECONDS - 60))
    behind = signed_at("behind", now - deadline - CLOCK_ALLOWANCE_SECONDS + 60)
    coordinator.submit("alice", behind)
    assert {r.query_id for r in coordinator.store.queries()} == {"alice/ahead", "alice/behind"}


def test_submit_refuses_what_the_deployment_cannot_serve(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(epsilon=100.0))
    spec = make_spec(public_key, epsilon=1.0)
    # Unsigned, signed over another query, or by something that is no signer id.
    with pytest.raises(ConfigError, match="not signed"):
        coordinator.submit("alice", SignedQuery(spec))
    other = make_spec(public_key, epsilon=2.0)
    with pytest.raises(ConfigError, match="invalid query signature"):
        coordinator.submit("alice", replace(signed(spec), signature=signed(other).signature))
    with pytest.raises(ConfigError, match="not a query-signing key"):
        coordinator.submit("alice", replace(signed(spec), signer="ed25519:nothex"))
    # A relation other than the deployment's (the owners' ledgers could not compose it).
    with pytest.raises(ConfigError, match="stated for replace-one adjacency;") as raised:
        coordinator.submit("alice", signed(make_spec(public_key, neighbouring=REPLACE_ONE)))
    assert "masked" not in str(raised.value)
    # Masked mode as the analyst's tools state it (replace-one): the refusal says why.
    masked = make_spec(public_key, neighbouring=REPLACE_ONE, mode=ProtocolMode.MASKED)
    with pytest.raises(ConfigError, match=r"a masked-mode query always is.*ask in stats mode"):
        coordinator.submit("alice", signed(masked))
    # Masked mode publishes N: refused under add/remove by the plan.
    with pytest.raises(ConfigError, match="no finite epsilon under add-remove"):
        coordinator.submit("alice", signed(make_spec(public_key, mode=ProtocolMode.MASKED)))
    # delta above the cap: by default the budget's delta, at most 1e-5.
    with pytest.raises(ConfigError, match=r"above this proxy's per-query cap 1e-05"):
        coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0, delta=2e-5)))
    # More owners than the allow-list holds can never meet the quorum.
    with pytest.raises(ConfigError, match="quorum 4 is more than the 3 owners"):
        coordinator.submit("alice", signed(make_spec(public_key, quorum=4)))
    assert coordinator.store.queries() == [] and coordinator.store.releases("alice") == []
    assert coordinator.tasks_for("owner-0") == []

    # The same signed query is accepted; any valid signature is (owners pin signers).
    assert coordinator.submit("alice", signed(spec)).query_id == Q1
    someone = generate_signing_key()
    second = make_spec(public_key, "q2", epsilon=1.0)
    accepted = coordinator.submit("alice", signed(second, someone))
    assert accepted.signature == sign_query(second, someone)
    # A configured cap replaces the default; NOT PRIVATE queries state no delta to cap.
    capped = make_coordinator(
        tmp_path / "capped", pool, make_config(epsilon=100.0, max_delta_per_query=1e-4)
    )
    capped.submit("alice", signed(make_spec(public_key, epsilon=1.0, delta=1e-4)))
    with pytest.raises(ConfigError, match=r"cap 0\.0001"):
        capped.submit("alice", signed(make_spec(public_key, "q2", epsilon=1.0, delta=2e-4)))
    unlimited = make_coordinator(tmp_path / "unlimited", pool)
    unlimited.submit("alice", signed(make_spec(public_key, epsilon=math.inf, delta=0.5)))


def test_owners_off_the_allow_list_get_no_task_and_cannot_act(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    spec = make_spec(public_key, quorum=1)
    coordinator.submit("alice", signed(spec))
    # Allowed owners get the task with its task id and the analyst's signature.
    (task,) = coordinator.pending_tasks("owner-0")
    assert task.task_id == task.key == Q1 and task.query == spec
    assert task.query_signer == TEST_SIGNER
    verify_query(task.query, task.query_signature, task.query_signer)  # forwarded unchanged
    coordinator.enroll("owner-0")

    assert coordinator.tasks_for("mallory") == [] and coordinator.pending_tasks("mallory") == []
    with pytest.raises(AuthenticationError, match="not in this proxy's"):
        coordinator.enroll("mallory")
    header, blocks, _ = Owner("mallory", owner_rows[0]).upload(
        coordinator.plan(Q1), public_key, pool
    )
    with pytest.raises(AuthenticationError):
        accept_upload(coordinator, "mallory", header, blocks)
    with pytest.raises(AuthenticationError):
        coordinator.decline("mallory", Q1, "policy_refusal")
    record = coordinator.store.query(Q1)
    assert record.state is QueryState.COLLECTING and record.n_contributed == 0
    assert not record.uploads_begun  # a refused stranger does not cost the refund
    assert coordinator.store.declines(Q1) == {} and coordinator.store.owners() == ["owner-0"]
    assert coordinator.status(ANALYST, "q1").owners_registered == len(OWNER_IDS)


def test_another_analysts_query_does_not_exist_for_you(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key)))
    # Bob asking for alice's query id is told exactly what an unknown id gets.
    for read in (coordinator.status, coordinator.result, coordinator.result_meta):
        with pytest.raises(NotFoundError) as hers:
            read("bob", "q1")
        with pytest.raises(NotFoundError) as unknown:
            read("bob", "qx")
        assert str(hers.value).replace("q1", "qx") == str(unknown.value)
    # The same query id is his own, separate query (and his own budget charge).
    coordinator.submit(
        "bob", signed(make_spec(public_key, epsilon=math.inf, quorum=2), SECOND_TEST_SIGNING_KEY)
    )
    assert sorted(q.query_id for q in coordinator.store.queries()) == ["alice/q1", "bob/q1"]
    assert coordinator.status("bob", "q1").quorum == 2
    assert coordinator.status("alice", "q1").quorum == 3
    assert coordinator.status("alice", "q1").query_id == "q1"
    assert len(coordinator.store.releases("bob")) == len(coordinator.store.releases("alice")) == 1


# ------------------------------------------------------------------ uploads
def test_late_upload_is_refused(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, quorum=1)))
    plan = coordinator.plan(Q1)
    first, first_blocks, _ = owners_for(owner_rows)[0].upload(plan, public_key, pool)
    assert not accept_upload(coordinator, "owner-0", first, first_blocks).duplicate
    assert coordinator.store.query(Q1).state is QueryState.DONE
    aggregate = coordinator.store.aggregate(Q1)

    late = owners_for(owner_rows)[1]  # an allowed owner that had not answered yet
    header, blocks, _ = late.upload(plan, public_key, pool)
    assert coordinator.tasks_for(late.owner_id) == []
    with pytest.raises(QueryStateError, match="no longer accepted"):
        accept_upload(coordinator, late.owner_id, header, blocks)
    # ... nor may it decline a query that no longer collects.
    with pytest.raises(QueryStateError, match="no longer recorded"):
        coordinator.decline(late.owner_id, Q1, "policy_refusal")
    # A retry of the accepted upload (lost acknowledgement) is still "duplicate".
    assert accept_upload(coordinator, "owner-0", first, first_blocks).duplicate
    # The same owner with another upload is refused, not counted twice.
    with pytest.raises(ProtocolError, match="already contributed a different upload"):
        accept_upload(coordinator, "owner-0", replace(first, upload_id="other"), first_blocks)
    assert coordinator.store.query(Q1).n_contributed == 1
    assert coordinator.store.aggregate(Q1) == aggregate
    assert coordinator.store.declines(Q1) == {}


def test_bad_uploads_are_refused_with_state_untouched(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key)))
    plan = coordinator.plan(Q1)
    owner = owners_for(owner_rows)[0]
    header, blocks, _ = owner.upload(plan, public_key, pool)
    # Owners name the task by its task id: the analyst's own id is no task of theirs.
    with pytest.raises(NotFoundError):
        accept_upload(coordinator, "owner-0", replace(header, query_id="q1"), blocks)

    wrong_block = replace(header.blocks[0], slot_bits=header.blocks[0].slot_bits - 1)
    with pytest.raises(LayoutError, match="the query's plan requires"):
        accept_upload(coordinator, "owner-0", replace(header, blocks=(wrong_block,)), blocks)
    with pytest.raises(CiphertextError, match="encrypted under key"):
        accept_upload(
            coordinator, "owner-0", replace(header, analyst_key_fingerprint="sha256:beef"), blocks
        )
    n = public_key.n
    for bad in (0, n * n, n * 3):  # outside [1, n^2), or sharing the factor n
        tampered = {SHARES: [bad, *blocks[SHARES][1:]]}
        with pytest.raises(CiphertextError):
            accept_upload(coordinator, "owner-0", header, tampered)
    with pytest.raises(ProtocolError, match="cover"):
        accept_upload(coordinator, "owner-0", header, {SHARES: blocks[SHARES][:-1]})
    with pytest.raises(ProtocolError, match="absent in stats mode"):
        accept_upload(coordinator, "owner-0", replace(header, public_record_count=5), blocks)

    record = coordinator.store.query(Q1)
    assert record.state is QueryState.COLLECTING and record.n_contributed == 0
    assert coordinator.store.aggregate(Q1) == b"" and coordinator.store.uploads(Q1) == []
    # The intact upload is still accepted afterwards.
    assert accept_upload(coordinator, "owner-0", header, blocks).n_contributed == 1


def test_no_more_owners_than_the_quorum_contribute(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    # The quorum is checked against the slots' owner bound at submission...
    with pytest.raises(ConfigError, match="quorum must be in"):
        make_spec(public_key, quorum=2, max_owners=1)
    # ...and the contributors are the first quorum owners to begin, so the aggregate
    # never holds more owners than the slots were sized for.
    coordinator.submit("alice", signed(make_spec(public_key, quorum=1, max_owners=1)))
    owners = owners_for(owner_rows)
    plan = coordinator.plan(Q1)
    header, blocks, _ = owners[0].upload(plan, public_key, pool)
    coordinator.begin_upload("owner-0", header)  # begins: the set of one is fixed
    assert coordinator.store.query(Q1).state is QueryState.AGGREGATING
    header, blocks, _ = owners[1].upload(plan, public_key, pool)
    with pytest.raises(NotContributingError, match="contributors are fixed"):
        accept_upload(coordinator, "owner-1", header, blocks)
    assert [c.owner_id for c in coordinator.store.contributors(Q1)] == ["owner-0"]
    # The task stays with the contributor, whose upload is still streaming in; the
    # other owners see it withdrawn.
    assert coordinator.withdrawn_tasks("owner-0", [Q1]) == []
    (withdrawn,) = coordinator.withdrawn_tasks("owner-1", [Q1])
    assert withdrawn.query_id == Q1 and "uploads are closed" in withdrawn.reason
    # Once the query failed, the contributor is told at once (before, it encrypted on
    # until its next chunk was refused: an operator's walkthrough, stop 42).
    coordinator.store.set_state(Q1, QueryState.FAILED, failure_reason="deadline passed")
    (stopped,) = coordinator.withdrawn_tasks("owner-0", [Q1])
    assert stopped.reason == "query failed: deadline passed"


def test_what_one_owner_asks_reads_that_owners_rows_not_every_owners(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An owner joining, its pending tasks, withdrawals and uploads in flight are
    answered from its own rows, a count or the answered owners' ids, never by listing
    the query's contributors, declines or uploads: with N owners, per-owner answers
    that listed them made the proxy's work grow as N^2 (benchmarks/scale_owners.py at
    1,000 owners: 6.1 -> 2.4 ms of proxy CPU per owner)."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, quorum=2)))
    coordinator.decline("owner-2", Q1, "policy", "not today")
    plan = coordinator.plan(Q1)
    owners = owners_for(owner_rows)

    def listing(*args: Any) -> Any:
        raise AssertionError("a per-owner answer listed every owner of the query")

    for name in ("contributors", "declines", "uploads"):
        monkeypatch.setattr(coordinator.store, name, listing)
    header, blocks, _ = owners[0].upload(plan, public_key, pool)
    accept_upload(coordinator, "owner-0", header, blocks)
    assert coordinator.store.contributor_count(Q1) == 1
    assert coordinator.store.query(Q1).state is QueryState.COLLECTING
    # Collecting: the task is offered to the one owner that has not answered yet, and
    # nobody's task is withdrawn; the contributor's upload is confirmed.
    assert coordinator.store.answered_owners(Q1) == {"owner-0", "owner-2"}
    assert [task.task_id for task in coordinator.pending_tasks("owner-1")] == [Q1]
    assert coordinator.pending_tasks("owner-0") == coordinator.pending_tasks("owner-2") == []
    for owner_id in OWNER_IDS:
        assert coordinator.withdrawn_tasks(owner_id, [Q1]) == []
    (confirmed,) = coordinator.in_flight_answers("owner-0", [Q1])
    assert isinstance(confirmed, Task) and confirmed.task_id == Q1
    assert coordinator.in_flight_answers("owner-1", [Q1]) == []
    # The second owner fixes the set: the query aggregates.
    header, blocks, _ = owners[1].upload(plan, public_key, pool)
    upload = coordinator.begin_upload("owner-1", header)
    assert coordinator.store.query(Q1).state is QueryState.AGGREGATING
    assert coordinator.store.contributor_count(Q1) == 2
    assert coordinator.store.contributor(Q1, "owner-1") is not None
    assert coordinator.store.contributor(Q1, "owner-2") is None
    assert coordinator.store.has_upload(Q1, "owner-0")
    assert not coordinator.store.has_upload(Q1, "owner-1")
    assert coordinator.store.has_declined(Q1, "owner-2")
    assert not coordinator.store.has_declined(Q1, "owner-0")
    # A contributor keeps its task (its upload streams in), and so does the owner that
    # declined; the query no longer has a place for anyone else.
    assert coordinator.withdrawn_tasks("owner-1", [Q1]) == []
    assert coordinator.withdrawn_tasks("owner-2", [Q1]) == []
    (resumed,) = coordinator.in_flight_answers("owner-1", [Q1])
    assert isinstance(resumed, Task)
    (ended,) = coordinator.in_flight_answers("owner-2", [Q1])
    assert isinstance(ended, TaskCancellation)
    upload.abandon()


# ------------------------------------------------------------ quorum/deadline
def test_deadline_below_quorum_fails_the_query(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    clock = Clock()
    coordinator = make_coordinator(tmp_path, pool, clock=clock)
    coordinator.submit("alice", signed(make_spec(public_key, quorum=2, deadline_seconds=60)))
    assert coordinator.budget("alice").n_releases == 1  # charged at submission
    owner = owners_for(owner_rows)[0]
    header, blocks, _ = owner.upload(coordinator.plan(Q1), public_key, pool)
    accept_upload(coordinator, "owner-0", header, blocks)
    # One decline leaves two allowed owners for a quorum of two: still collecting.
    coordinator.decline("owner-1", Q1, "policy_refusal", "epsilon above this owner's cap")
    assert coordinator.store.query(Q1).state is QueryState.COLLECTING
    assert coordinator.tasks_for("owner-1") == [] and len(coordinator.tasks_for("owner-2")) == 1
    clock.now += 59
    assert coordinator.check_deadlines() == []
    clock.now += 2
    assert coordinator.tasks_for("owner-2") == []  # past the deadline: no longer offered
    late, late_blocks, _ = owners_for(owner_rows)[2].upload(coordinator.plan(Q1), public_key, pool)
    with pytest.raises(NotContributingError, match="deadline has passed"):
        accept_upload(coordinator, "owner-2", late, late_blocks)
    assert coordinator.check_deadlines() == [Q1]
    record = coordinator.store.query(Q1)
    assert record.state is QueryState.FAILED
    assert record.failure_reason == "deadline passed with 1 of 2 required owners uploading"
    status = coordinator.status(ANALYST, "q1")
    assert status.state is QueryState.FAILED and status.owners_declined == 1
    # The decline's public reason reaches the analyst.
    assert status.declines == (
        OwnerDecline("owner-1", "policy_refusal", "epsilon above this owner's cap"),
    )
    assert status.owners_registered == 3 and status.owners_contributed == 1
    with pytest.raises(QueryStateError):
        coordinator.result(ANALYST, "q1")
    # owner-0 uploaded, so it may have spent budget on the query: nothing was released,
    # but the analyst's charge is not refunded.
    assert record.uploads_begun
    assert coordinator.budget("alice").n_releases == 1
    assert [r["query_id"] for r in coordinator.store.releases("alice")] == [Q1]


def test_a_failed_query_is_refunded_only_if_no_upload_ever_began(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    clock = Clock()
    coordinator = make_coordinator(tmp_path, pool, clock=clock)
    coordinator.submit("alice", signed(make_spec(public_key, "silent", deadline_seconds=60)))
    coordinator.submit("alice", signed(make_spec(public_key, "broken", deadline_seconds=60)))
    assert coordinator.budget("alice").n_releases == 2
    # An upload that began and broke off is taken out of the aggregate, but the owner
    # may have spent its budget by then: the query counts as uploaded to.
    header, blocks, _ = owners_for(owner_rows)[0].upload(
        coordinator.plan(key("broken")), public_key, pool, key("broken")
    )
    stream = coordinator.begin_upload("owner-0", header)
    stream.add(chunk_of(blocks[SHARES][:1]))
    stream.abandon()  # the set of contributors was open: taken out, place freed
    assert coordinator.store.aggregate(key("broken")) == b""
    assert coordinator.store.contributors(key("broken")) == []
    assert coordinator.store.query(key("broken")).uploads_begun
    assert not coordinator.store.query(key("silent")).uploads_begun

    clock.now += 61
    assert sorted(coordinator.check_deadlines()) == [key("broken"), key("silent")]
    assert coordinator.status(ANALYST, "silent").state is QueryState.FAILED
    assert coordinator.status(ANALYST, "broken").state is QueryState.FAILED
    # The silent query released nothing and no owner spent anything: refunded.
    assert [r["query_id"] for r in coordinator.store.releases("alice")] == [key("broken")]
    assert coordinator.budget("alice").n_releases == 1


def test_declines_are_public_one_line_and_fail_a_query_whose_quorum_is_out_of_reach(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, quorum=2)))
    # Unknown tasks, and the analyst's bare query id, are no task of an owner's.
    for unknown in ("q1", key("q1", "bob"), "alice/nope"):
        with pytest.raises(NotFoundError):
            coordinator.decline("owner-0", unknown, "policy_refusal")
    # An owner that uploaded cannot decline afterwards (its share is in the aggregate).
    header, blocks, _ = owners_for(owner_rows)[0].upload(coordinator.plan(Q1), public_key, pool)
    accept_upload(coordinator, "owner-0", header, blocks)
    with pytest.raises(QueryStateError, match="already uploaded"):
        coordinator.decline("owner-0", Q1, "policy_refusal")
    # A detail is cut to one line of at most MAX_DECLINE_DETAIL characters.
    forged = "fine\nowner-2: budget_exhausted: forged line\r\t" + "x" * 500
    coordinator.decline("owner-1", Q1, "policy_refusal", forged)
    (decline,) = coordinator.status(ANALYST, "q1").declines
    assert decline.owner_id == "owner-1" and decline.reason == "policy_refusal"
    assert "\n" not in decline.detail and "\r" not in decline.detail
    assert len(decline.detail) == MAX_DECLINE_DETAIL and decline.detail.endswith("...")
    assert decline.detail.startswith("fine owner-2: budget_exhausted: forged line x")
    # The same decline again is acknowledged and does nothing: no write, no log line,
    # no wake-up of every stream (review, stop 42: 882 a second from one owner).
    wakeups: list[None] = []
    monkeypatch.setattr(coordinator, "_notify", lambda: wakeups.append(None))
    with caplog.at_level(logging.INFO, logger="fedpca.proxy"):
        coordinator.decline("owner-1", Q1, "budget_exhausted", "another reason")
    assert "declined" not in caplog.text and wakeups == []
    assert coordinator.status(ANALYST, "q1").declines == (decline,)
    # owner-0 uploaded, owner-2 may still: the quorum of 2 is in reach.
    assert coordinator.store.query(Q1).state is QueryState.COLLECTING

    # Quorum 3 of 3 allowed owners: one decline puts it out of reach, and the query
    # fails at once (the declines are public), listing them. Nobody uploaded: refunded.
    coordinator.submit("alice", signed(make_spec(public_key, "q3", quorum=3)))
    before = coordinator.budget("alice").n_releases
    coordinator.decline("owner-2", key("q3"), "key_not_pinned", "not my analyst")
    status = coordinator.status(ANALYST, "q3")
    assert status.state is QueryState.FAILED
    assert status.failure_reason == (
        "the quorum of 3 can no longer be reached: 1 of 3 owners declined "
        "(owner-2: key_not_pinned: not my analyst)"
    )
    assert status.declines == (OwnerDecline("owner-2", "key_not_pinned", "not my analyst"),)
    assert coordinator.budget("alice").n_releases == before - 1
    assert coordinator.tasks_for("owner-2") == [make_spec(public_key, quorum=2)]
    with pytest.raises(QueryStateError, match="no longer recorded"):
        coordinator.decline("owner-1", key("q3"), "policy_refusal")
    # So is a repeat of the decline that failed it: only a collecting query's repeat is
    # acknowledged without a word.
    with pytest.raises(QueryStateError, match="no longer recorded"):
        coordinator.decline("owner-2", key("q3"), "key_not_pinned", "again")


def test_a_quorum_put_out_of_reach_before_a_restart_fails_the_query_at_start(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """A process stopped between a decline's commit and the quorum check left the query
    collecting to its deadline; an owner's upload meanwhile made it fail charged, where
    it should have failed at once, refunded (review). The same holds for an allow-list
    that shrank below the quorum across a restart."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, "q1", quorum=3)))
    coordinator.submit("alice", signed(make_spec(public_key, "q2", quorum=2)))
    charged = coordinator.budget("alice").n_releases
    # The decline committed; the process stopped before its check.
    coordinator.store.record_decline(Q1, "owner-0", "policy_refusal")
    coordinator.store.close()
    restarted = make_coordinator(tmp_path, pool)
    assert restarted.recover() == [Q1]
    record = restarted.store.query(Q1)
    assert record.state is QueryState.FAILED
    assert record.failure_reason is not None
    assert "1 of 3 owners declined (owner-0: policy_refusal)" in record.failure_reason
    assert restarted.budget("alice").n_releases == charged - 1  # refunded
    assert restarted.store.query(key("q2")).state is QueryState.COLLECTING
    restarted.store.close()
    fewer = replace(make_config(), owners=OwnersConfig(frozenset({"owner-1"})))
    shrunk = make_coordinator(tmp_path, pool, fewer)
    assert shrunk.recover() == [key("q2")]
    assert shrunk.store.query(key("q2")).failure_reason == (
        "the quorum of 2 can no longer be reached: the proxy now accepts 1 owner(s)"
    )


def test_a_query_this_version_cannot_plan_fails_at_start_instead_of_stopping_it(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """A stored in-flight query a later version could not plan stopped the proxy at
    every start, naming no query, with no way to fail it by hand (review)."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, "q1", quorum=2)))
    coordinator.submit("alice", signed(make_spec(public_key, "q2", quorum=2)))
    charged = coordinator.budget("alice").n_releases
    coordinator.store.close()
    with sqlite3.connect(tmp_path / "proxy.sqlite3") as raw:  # as if its format changed
        raw.execute(
            "UPDATE queries SET spec = '{\"quorum\": 2}', summary = '{\"quorum\": 2}' "
            "WHERE query_id = ?",
            (Q1,),
        )
    raw.close()
    restarted = make_coordinator(tmp_path, pool)
    assert restarted.recover() == [Q1]
    record = restarted.store.query(Q1)
    assert record.state is QueryState.FAILED and record.failure_reason is not None
    assert record.failure_reason.startswith("this proxy's version cannot plan the query")
    assert restarted.budget("alice").n_releases == charged - 1  # no upload began: refunded
    assert restarted.store.query(key("q2")).state is QueryState.COLLECTING
    # Its analyst still reads its status, and lists its other queries.
    assert restarted.status(ANALYST, "q1").state is QueryState.FAILED
    listed = catalog.list_queries(restarted, ANALYST, 10)
    assert [q.status.query_id for q in listed] == ["q2"]  # the other queries still list


def test_pages_left_unreleased_by_a_crash_are_released_at_restart(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    # e.g. the process died after the last fold, before the pages were made final
    coordinator.advance = lambda query_id: None  # type: ignore[method-assign]
    spec = make_spec(public_key, quorum=2)
    expected = run_stats_query(coordinator, pool, public_key, owners_for(owner_rows)[:2], spec)
    record = coordinator.store.query(Q1)
    assert record.state is QueryState.AGGREGATING and record.n_contributed == 2
    assert coordinator.store.pages_final(Q1) == 0
    coordinator.store.close()
    restarted = make_coordinator(tmp_path, pool)
    assert restarted.recover() == []
    assert restarted.store.query(Q1).state is QueryState.DONE
    assert decrypt_block(pool, private_key, restarted, "q1", SHARES) == list(expected)


def test_a_contributor_that_never_finishes_fails_the_query_at_its_deadline(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    clock = Clock()
    coordinator = make_coordinator(tmp_path, pool, clock=clock)
    coordinator.submit("alice", signed(make_spec(public_key, quorum=2, deadline_seconds=60)))
    owners = owners_for(owner_rows)
    plan = coordinator.plan(Q1)
    header, blocks, _ = owners[0].upload(plan, public_key, pool)
    accept_upload(coordinator, "owner-0", header, blocks)
    header, blocks, _ = owners[1].upload(plan, public_key, pool)
    stream = coordinator.begin_upload("owner-1", header)  # fixed: kept for resumption
    stream.add(chunk_of(blocks[SHARES][:2]))
    stream.abandon()
    assert coordinator.store.partial_uploads(Q1) == {"owner-1": 2}
    clock.now += 61
    assert coordinator.check_deadlines() == [Q1]
    record = coordinator.store.query(Q1)
    assert record.state is QueryState.FAILED
    assert record.failure_reason == (
        "deadline passed before contributors owner-1 delivered all their chunks"
    )
    with pytest.raises(QueryStateError, match="failed: deadline passed before"):
        coordinator.result_pages(ANALYST, "q1", 0)
    assert coordinator.budget("alice").n_releases == 1  # charged in full


class SimulatedCrash(BaseException):
    """Stands in for the process dying (not an Exception: nothing may catch it)."""


def _masked_query_interrupted_in_noising(
    tmp_path: Path, pool: CryptoPool, public_key: Any, owner_rows: list[np.ndarray]
) -> tuple[Coordinator, ProxyConfig]:
    """A masked query whose owners all uploaded, whose process died adding noise."""

    def crash(*args: Any) -> Any:
        raise SimulatedCrash

    config = make_config(neighbouring=REPLACE_ONE)
    coordinator = make_coordinator(tmp_path, pool, config)
    coordinator._masked_result = crash  # type: ignore[method-assign]
    spec = make_spec(public_key, quorum=2, mode=ProtocolMode.MASKED, neighbouring=REPLACE_ONE)
    coordinator.submit("alice", signed(spec))
    with pytest.raises(SimulatedCrash):
        finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows)[:2], "q1")
    assert coordinator.store.query(Q1).state is QueryState.NOISING
    return coordinator, config


def test_recover_finishes_a_query_interrupted_in_noising_exactly_once(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    coordinator, config = _masked_query_interrupted_in_noising(
        tmp_path, pool, public_key, owner_rows
    )
    store = coordinator.store
    aggregate_before = store.aggregate(Q1)
    store.close()

    # A new process: new store connection, new coordinator, recover() at startup.
    restarted = make_coordinator(tmp_path, pool, config)
    assert restarted.store.aggregate(Q1) == aggregate_before
    assert restarted.recover() == [Q1]
    assert restarted.store.query(Q1).state is QueryState.DONE
    assert restarted.recover() == []
    assert restarted.finish(Q1).state is QueryState.DONE  # a no-op now
    with pytest.raises(QueryStateError):
        restarted.store.store_result(Q1, b"", {})
    assert len(restarted.store.releases("alice")) == 1
    # Exact arithmetic: no noise, and the mask cancels exactly.
    noise, _, _ = _unmask(pool, private_key, restarted, owners_for(owner_rows)[:2])
    assert not noise.any()


# ------------------------------------------------- stats noise prepared early
class RecordingSampler:
    """TEST ONLY: a seeded sampler that records which thread drew how many values.

    ``hold`` (optional) keeps the first draw waiting until it is set; ``fail`` makes
    every draw raise.
    """

    def __init__(self, seed: int, hold: threading.Event | None = None, fail: bool = False) -> None:
        self.inner = TestOnlySeededSampler(seed)
        self.hold = hold
        self.fail = fail
        self.draws: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def sample(self, sigma_int: float, size: int) -> np.ndarray:
        with self.lock:
            first = not self.draws
            self.draws.append((threading.current_thread().name, size))
        if first and self.hold is not None:
            assert self.hold.wait(30.0)
        if self.fail:
            raise ConfigError("sampler failure (test)")
        with self.lock:
            return self.inner.sample(sigma_int, size)

    def threads(self) -> list[str]:
        with self.lock:
            return [name.split("_")[0] for name, _ in self.draws]


def finish_with_owners(
    coordinator: Coordinator, pool: CryptoPool, public_key: Any, owners: list[Owner], query_id: str
) -> None:
    task = key(query_id)
    plan = coordinator.plan(task)
    for owner in owners:
        header, blocks, _ = owner.upload(plan, public_key, pool, task)
        accept_upload(coordinator, owner.owner_id, header, blocks)


def test_stats_noise_is_prepared_at_submit_and_used_once(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    sections = 3  # scatter, sum, count: one draw each
    sampler = RecordingSampler(7)
    early = make_coordinator(tmp_path / "early", pool, noise_sampler=sampler, precompute_noise=True)
    try:
        spec = make_spec(public_key, epsilon=1.0)
        early.submit("alice", signed(spec))
        prepared = early.prepared_noise(Q1)
        assert prepared is not None
        prepared.result(timeout=60)
        # Drawn (and encrypted) on the preparation thread before any owner uploaded.
        assert sampler.threads() == ["fedpca-noise-prep"] * sections
        early.submit("alice", signed(spec))  # an idempotent resubmission prepares nothing more
        assert early.prepared_noise(Q1) is prepared
        finish_with_owners(early, pool, public_key, owners_for(owner_rows), "q1")
        assert early.store.query(Q1).state is QueryState.DONE
        assert len(sampler.draws) == sections  # used, not drawn again
        assert early.prepared_noise(Q1) is None  # taken: can never serve another result
        assert early.result_meta(ANALYST, "q1")["timings"]["noise_precomputed"] == 1.0
        got = decrypt_block(pool, private_key, early, "q1", SHARES)
    finally:
        early.shutdown()

    # The same seeded sampler drawing at finish time yields the very same release:
    # the prepared noise is what was added, drawn by the injected sampler.
    late = make_coordinator(tmp_path / "late", pool, noise_sampler=TestOnlySeededSampler(7))
    run_stats_query(
        late, pool, public_key, owners_for(owner_rows), make_spec(public_key, epsilon=1.0)
    )
    assert "noise_precomputed" not in late.result_meta(ANALYST, "q1")["timings"]
    reference = decrypt_block(pool, private_key, late, "q1", SHARES)
    assert got == reference


def plan_drawn_in_pieces_of_seven(public_key: Any, monkeypatch: pytest.MonkeyPatch) -> ReleasePlan:
    """A private stats query's plan, its noise drawn 7 values at a time (pieces straddle
    sections and ciphertexts)."""
    monkeypatch.setattr(prepared_noise, "NOISE_PIECE_VALUES", 7)
    return ReleasePlan.for_query(make_spec(public_key, epsilon=1.0), public_key.n.bit_length())


def test_noise_drawn_in_pieces_packs_to_the_plans_whole_draw(
    test_only_keypair_512: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Drawn a few values at a time (pieces straddle sections and ciphertexts) and kept
    # as fixed-width bytes, the noise is still the plan's draw, value for value, and
    # each page takes the ciphertext (1 + P n) mod n^2 of its packed value P.
    public_key, _ = test_only_keypair_512
    n = public_key.n
    plan = plan_drawn_in_pieces_of_seven(public_key, monkeypatch)
    sampler = RecordingSampler(7)
    noise = prepared_noise.draw_page_noise(plan, n, sampler)
    assert max(size for _, size in sampler.draws) == 7 and len(sampler.draws) > 3
    block = plan.owner_block(SHARES)
    whole = plan.noise_values(TestOnlySeededSampler(7))
    packed = [p % n for p in pack_slots(whole, block.layout, plan.bounds.noise_headroom)]
    assert [noise.plaintext(i) for i in range(block.layout.n_ciphertexts)] == packed
    width = 2 * ((n.bit_length() + 7) // 8)
    assert noise.encoded(2, 3) == b"".join(
        ((1 + p * n) % (n * n)).to_bytes(width, "big") for p in packed[2:5]
    )
    assert noise.sample_cpu_seconds > 0.0


class PieceTaggingSampler:
    """TEST ONLY: a parallel-safe sampler whose k-th call returns k in every value,
    finishing out of order (calls sleep 0-2 ms by k)."""

    parallel_safe = True

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sizes: dict[int, int] = {}
        self.threads: set[str] = set()

    def sample(self, sigma_int: float, size: int) -> np.ndarray:
        with self.lock:
            tag = len(self.sizes) + 1
            self.sizes[tag] = size
            self.threads.add(threading.current_thread().name)
        time.sleep(0.001 * (tag % 3))
        return np.full(size, tag, dtype=np.int64)


def test_noise_drawn_on_several_threads_is_packed_in_piece_order(
    test_only_keypair_512: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pieces drawn concurrently finish out of order; each is still packed whole, in the
    # order of the plan's draws (which section, which positions), exactly once.
    public_key, _ = test_only_keypair_512
    n = public_key.n
    plan = plan_drawn_in_pieces_of_seven(public_key, monkeypatch)
    sampler = PieceTaggingSampler()
    noise = prepared_noise.draw_page_noise(plan, n, sampler, threads=3)
    block = plan.owner_block(SHARES)
    values = unpack_slots(
        [noise.plaintext(i) for i in range(block.layout.n_ciphertexts)], block.layout, n
    )
    values = np.asarray(values, dtype=np.int64)[: sum(s.length for s in plan.sections)]
    # Runs of equal tags, in order: their lengths are the plan's piece sizes.
    edges = np.flatnonzero(np.diff(values)) + 1
    runs = np.split(values, edges)
    expected_sizes = [
        min(7, section.length - start)
        for section in plan.sections
        for start in range(0, section.length, 7)
    ]
    assert [len(run) for run in runs] == expected_sizes
    tags = [int(run[0]) for run in runs]
    assert sorted(tags) == list(range(1, len(expected_sizes) + 1))
    assert all(sampler.sizes[tag] == len(run) for tag, run in zip(tags, runs, strict=True))
    assert len(sampler.threads) > 1 and all(
        name.startswith("fedpca-noise-draw") for name in sampler.threads
    )
    assert prepared_noise.noise_threads(sampler) == prepared_noise.NOISE_THREADS
    assert prepared_noise.noise_threads(TestOnlySeededSampler(1)) == 1
    assert prepared_noise.noise_threads(None) == prepared_noise.NOISE_THREADS


class GatedSampler(RecordingSampler):
    """TEST ONLY: a seeded sampler whose draws after the first ``free`` wait for ``gate``."""

    def __init__(self, seed: int, free: int, gate: threading.Event) -> None:
        super().__init__(seed)
        self.free = free
        self.gate = gate
        self.waiting = threading.Event()

    def sample(self, sigma_int: float, size: int) -> np.ndarray:
        with self.lock:
            held = len(self.draws) >= self.free
        if held:
            self.waiting.set()
            assert self.gate.wait(30.0)
        return super().sample(sigma_int, size)


def test_a_slow_progress_report_does_not_hold_up_the_draw(
    test_only_keypair_512: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reporting progress (making pages final: store writes) runs on its own thread: the
    # noise is drawn to the end while the first report is blocked, and the reports
    # queued meanwhile collapse into one that sees the noise complete.
    public_key, _ = test_only_keypair_512
    plan = plan_drawn_in_pieces_of_seven(public_key, monkeypatch)
    total = plan.owner_block(SHARES).layout.n_ciphertexts
    reporting, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def report(key: str) -> None:
        # A report follows a drawn piece, so the draw is running: get() returns it.
        seen.append(prepared.get(key, plan, public_key.n).drawn())
        reporting.set()
        assert release.wait(30.0)

    # The pieces after those that fill the first ciphertext (the first report) wait
    # until that report has begun.
    first = -(-plan.owner_block(SHARES).layout.slots_per_ciphertext // 7)
    sampler = GatedSampler(7, free=first, gate=reporting)
    prepared = prepared_noise.PreparedNoise(sampler, enabled=True, on_progress=report, threads=1)
    try:
        prepared.prepare("q", plan, public_key.n)
        future = prepared.pending("q")
        assert future is not None
        assert future.result(timeout=30.0).drawn() == total  # while the report blocks
        assert len(seen) == 1 and seen[0] < total
        release.set()
        wait_until(lambda: len(seen) == 2, "the queued report")
        assert seen[1] == total
        time.sleep(0.1)
        assert len(seen) == 2  # pieces drawn during one report: one more report, not one each
    finally:
        release.set()
        prepared.shutdown()


def test_an_analyst_holds_a_bounded_amount_of_noise_drawn_in_advance(
    test_only_keypair_512: Any,
) -> None:
    """Found by review: each open query held its whole packed noise from submission until
    it ended. Beyond a per-analyst bound a query's noise is drawn when its pages need it;
    other analysts' queries are not held back, and a discarded query frees its part."""
    public_key, _ = test_only_keypair_512
    plan = ReleasePlan.for_query(make_spec(public_key, epsilon=1.0), public_key.n.bit_length())
    size = plan.owner_block(SHARES).layout.n_ciphertexts * ((public_key.n.bit_length() + 7) // 8)
    prepared = prepared_noise.PreparedNoise(
        RecordingSampler(3), enabled=True, threads=1, max_prepared_bytes_per_analyst=2 * size
    )
    try:
        for key in ("alice/q1", "alice/q2", "alice/q3", "bob/q1"):
            prepared.prepare(key, plan, public_key.n)
        assert [prepared.pending(k) is not None for k in ("alice/q1", "alice/q2")] == [True] * 2
        assert prepared.pending("alice/q3") is None  # beyond alice's bound
        assert prepared.pending("bob/q1") is not None  # bob's own bound
        # Once its contributors are fixed its noise is needed: drawn in the background
        # whatever the bound (not whole on an owner's upload call).
        prepared.prepare("alice/q3", plan, public_key.n, bounded=False)
        future = prepared.pending("alice/q3")
        assert future is not None
        total = plan.owner_block(SHARES).layout.n_ciphertexts
        assert future.result(timeout=30.0).drawn() == total
        prepared.discard("alice/q3")
        # Never prepared, it is drawn when its pages need it, in the background too:
        # the caller gets it as far as drawn and it completes.
        noise = prepared.get("alice/q5", plan, public_key.n)
        urgent = prepared.pending("alice/q5")
        assert urgent is not None and urgent.result(timeout=30.0) is noise
        assert noise.drawn() == total
        prepared.discard("alice/q5")
        prepared.discard("alice/q1")
        prepared.prepare("alice/q4", plan, public_key.n)
        assert prepared.pending("alice/q4") is not None
    finally:
        prepared.shutdown()


def test_noise_drawn_at_once_is_drawn_once_and_a_failure_is_reported(
    test_only_keypair_512: Any,
) -> None:
    """Found by review: a query whose urgent draw was still queued had it cancelled and
    queued again, with a new vector in memory, at every fold; and an urgent draw that
    failed after the last fold was never looked at again (the query waited for its
    deadline). Queued or running, an urgent draw is the query's one draw; a failure is
    reported as progress is, and the noise raises it."""
    public_key, _ = test_only_keypair_512
    plan = ReleasePlan.for_query(make_spec(public_key, epsilon=1.0), public_key.n.bit_length())
    gate = threading.Event()
    reported: list[str] = []
    prepared = prepared_noise.PreparedNoise(
        GatedSampler(3, free=0, gate=gate),
        enabled=True,
        on_progress=reported.append,
        threads=1,
    )
    try:
        keys = [f"alice/q{i}" for i in range(prepared_noise.URGENT_DRAWS + 1)]
        first = {k: prepared.get(k, plan, public_key.n) for k in keys}
        # Every urgent worker is busy: the last query's draw is queued. Asked again and
        # again (every fold asks), it is the same draw and the same noise.
        for _ in range(3):
            assert all(prepared.get(k, plan, public_key.n) is first[k] for k in keys)
        gate.set()
        total = plan.owner_block(SHARES).layout.n_ciphertexts
        for k in keys:
            future = prepared.pending(k)
            assert future is not None and future.result(timeout=30.0) is first[k]
            assert first[k].drawn() == total
    finally:
        gate.set()
        prepared.shutdown()
    failing = prepared_noise.PreparedNoise(
        RecordingSampler(3, fail=True), enabled=True, on_progress=reported.append, threads=1
    )
    try:
        reported.clear()
        noise = failing.get("alice/bad", plan, public_key.n)
        wait_until(lambda: "alice/bad" in reported, "the failed draw's report")
        with pytest.raises(ConfigError, match="sampler failure"):
            noise.drawn()
    finally:
        failing.shutdown()


def gated_coordinator(
    tmp_path: Path, pool: CryptoPool, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> tuple[Coordinator, GatedSampler, threading.Event]:
    """A coordinator with one-ciphertext pages whose noise, drawn 64 values a piece in
    advance, stops after its first piece until the returned gate is set."""
    monkeypatch.setattr(prepared_noise, "NOISE_PIECE_VALUES", 64)
    gate = threading.Event()
    sampler = GatedSampler(7, free=1, gate=gate)
    store = ProxyStore(tmp_path / "proxy.sqlite3", clock=clock, page_ciphertexts=1)
    coordinator = Coordinator(
        store,
        make_config(),
        pool,
        noise_sampler=sampler,
        clock=clock,
        allow_insecure_test_keys=True,
        background=False,
        precompute_noise=True,
    )
    return coordinator, sampler, gate


def test_pages_become_final_as_their_noise_is_drawn(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every contribution is in while the noise is still being drawn: the pages whose
    # noise is drawn are final at once, the others as soon as their noise is, and the
    # release is the same as with the noise drawn whole before any page.
    public_key, private_key = test_only_keypair_512
    coordinator, sampler, gate = gated_coordinator(tmp_path, pool, Clock(), monkeypatch)
    store = coordinator.store
    try:
        coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0)))
        assert sampler.waiting.wait(30.0)  # the first piece is drawn and packed
        finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows), "q1")
        pages = coordinator.plan(Q1).owner_block(SHARES).layout.n_ciphertexts
        early = store.pages_final(Q1)
        assert 0 < early < pages
        assert store.query(Q1).state is QueryState.AGGREGATING
        prepared = coordinator.prepared_noise(Q1)
        assert prepared is not None
        gate.set()
        prepared.result(timeout=60)
        # Pages are made final on the reporting thread, after the last piece is drawn;
        # the query's timings are recorded last.
        wait_until(
            lambda: "timings" in coordinator.result_meta(ANALYST, "q1"), "the query to be done"
        )
        assert store.pages_final(Q1) == pages
        assert store.query(Q1).state is QueryState.DONE
        # A late report or fold finds the query done: its discarded noise is not drawn
        # again (it used to be, whole, for nothing).
        draws = len(sampler.draws)
        coordinator.advance(Q1)
        time.sleep(0.2)  # or a report of the last pieces, on the reporting thread
        assert len(sampler.draws) == draws
        assert coordinator.result_meta(ANALYST, "q1")["timings"]["noise_precomputed"] == 1.0
        got = decrypt_block(pool, private_key, coordinator, "q1", SHARES)
    finally:
        gate.set()
        coordinator.shutdown()
    whole = make_coordinator(tmp_path / "whole", pool, noise_sampler=TestOnlySeededSampler(7))
    run_stats_query(
        whole, pool, public_key, owners_for(owner_rows), make_spec(public_key, epsilon=1.0)
    )
    assert got == decrypt_block(pool, private_key, whole, "q1", SHARES)


def test_a_failed_query_stops_drawing_its_noise(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    public_key, _ = test_only_keypair_512
    monkeypatch.setattr(prepared_noise, "NOISE_PIECE_VALUES", 64)
    gate = threading.Event()
    clock = Clock()
    sampler = GatedSampler(7, free=1, gate=gate)
    coordinator = make_coordinator(
        tmp_path, pool, clock=clock, noise_sampler=sampler, precompute_noise=True
    )
    try:
        coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0, deadline_seconds=60)))
        prepared = coordinator.prepared_noise(Q1)
        assert prepared is not None and sampler.waiting.wait(30.0)
        clock.now += 61
        assert coordinator.check_deadlines() == [Q1]
        gate.set()
        prepared.result(timeout=60)
        # The piece being drawn when the query failed is the last one drawn.
        assert len(sampler.draws) == 2
    finally:
        gate.set()
        coordinator.shutdown()


def test_prepared_noise_is_discarded_when_the_query_fails(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    clock = Clock()
    sampler = RecordingSampler(7)
    coordinator = make_coordinator(
        tmp_path, pool, clock=clock, noise_sampler=sampler, precompute_noise=True
    )
    masked = make_coordinator(
        tmp_path / "replace-one",
        pool,
        make_config(neighbouring=REPLACE_ONE),
        noise_sampler=sampler,
        precompute_noise=True,
    )
    try:
        coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0, deadline_seconds=60)))
        prepared = coordinator.prepared_noise(Q1)
        assert prepared is not None
        prepared.result(timeout=60)
        clock.now += 61
        assert coordinator.check_deadlines() == [Q1]
        assert coordinator.store.query(Q1).state is QueryState.FAILED
        assert coordinator.prepared_noise(Q1) is None
        # Not private or masked (a replace-one deployment): nothing to prepare.
        coordinator.submit("alice", signed(make_spec(public_key, "q-inf", epsilon=math.inf)))
        masked.submit(
            "alice",
            signed(
                make_spec(
                    public_key,
                    "q-masked",
                    epsilon=1.0,
                    mode=ProtocolMode.MASKED,
                    neighbouring=REPLACE_ONE,
                )
            ),
        )
        assert coordinator.prepared_noise(key("q-inf")) is None
        assert masked.prepared_noise(key("q-masked")) is None
        assert len(sampler.draws) == 3  # q1's three sections only
    finally:
        coordinator.shutdown()
        masked.shutdown()


def test_noise_not_prepared_in_time_is_drawn_at_finish_for_that_query_only(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    hold = threading.Event()
    sampler = RecordingSampler(7, hold=hold)
    coordinator = make_coordinator(tmp_path, pool, noise_sampler=sampler, precompute_noise=True)
    try:
        coordinator.submit("alice", signed(make_spec(public_key, "q1", epsilon=1.0)))
        coordinator.submit("alice", signed(make_spec(public_key, "q2", epsilon=1.0)))
        first, second = coordinator.prepared_noise(Q1), coordinator.prepared_noise(key("q2"))
        assert first is not None and second is not None
        assert not second.running()  # queued behind q1's preparation, held by the sampler
        # q2 reaches its quorum first: its preparation has not started, so it is
        # cancelled and q2's noise is drawn at once on a thread of its own, not by the
        # caller (in the server: an owner's upload call; found by review).
        finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows), "q2")
        # The timings are written just after the state turns DONE (flaky: 2 runs in 37
        # read them too early, found by a test audit).
        wait_until(lambda: "timings" in coordinator.result_meta(ANALYST, "q2"), "q2 done, timed")
        assert coordinator.store.query(key("q2")).state is QueryState.DONE
        assert second.cancelled()
        assert "noise_precomputed" not in coordinator.result_meta(ANALYST, "q2")["timings"]
        assert sampler.threads()[1:] == ["fedpca-noise-now"] * 3
        hold.set()
        first.result(timeout=60)
        finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows), "q1")
        assert coordinator.result_meta(ANALYST, "q1")["timings"]["noise_precomputed"] == 1.0
        # Six draws in all, three per query: no vector served two results.
        threads = sampler.threads()
        assert sorted(threads) == ["fedpca-noise-now"] * 3 + ["fedpca-noise-prep"] * 3
        noise = [
            np.array(decrypt_block(pool, private_key, coordinator, q, SHARES), dtype=object)
            for q in ("q1", "q2")
        ]
        assert not np.array_equal(noise[0], noise[1])
    finally:
        hold.set()
        coordinator.shutdown()


class _BrokenSampler(RecordingSampler):
    """TEST ONLY: a sampler whose every draw raises an error that is not fedpca's own."""

    def sample(self, sigma_int: float, size: int) -> np.ndarray:
        with self.lock:
            self.draws.append((threading.current_thread().name, size))
        raise RuntimeError("sampler crashed (test)")


@pytest.mark.parametrize("error", ["ConfigError", "RuntimeError"])
def test_a_failed_noise_preparation_fails_the_query_without_a_second_draw(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    error: str,
) -> None:
    public_key, _ = test_only_keypair_512
    sampler = RecordingSampler(7, fail=True) if error == "ConfigError" else _BrokenSampler(7)
    coordinator = make_coordinator(tmp_path, pool, noise_sampler=sampler, precompute_noise=True)
    try:
        coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0)))
        prepared = coordinator.prepared_noise(Q1)
        assert prepared is not None
        assert type(prepared.exception(timeout=60)).__name__ == error
        owners = owners_for(owner_rows)
        finish_with_owners(coordinator, pool, public_key, owners[:2], "q1")
        # The third upload completes the first page: its noise is needed, and missing.
        with pytest.raises(QueryStateError, match=rf"failed: adding noise failed \({error}\)"):
            finish_with_owners(coordinator, pool, public_key, owners[2:], "q1")
        record = coordinator.store.query(Q1)
        assert record.state is QueryState.FAILED
        assert record.failure_reason is not None and error in record.failure_reason
        # A redraw after a failed draw would condition the noise on the failure.
        assert len(sampler.draws) == 1
        # Nothing was released, but the owners uploaded (and spent their budgets on
        # it): the analyst's charge stands.
        assert record.uploads_begun and coordinator.budget("alice").n_releases == 1
    finally:
        coordinator.shutdown()


def test_a_restarted_proxy_prepares_fresh_noise_for_collecting_queries(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    first_sampler = RecordingSampler(7)
    first = make_coordinator(tmp_path, pool, noise_sampler=first_sampler, precompute_noise=True)
    first.submit("alice", signed(make_spec(public_key, epsilon=1.0)))
    prepared = first.prepared_noise(Q1)
    assert prepared is not None
    prepared.result(timeout=60)
    first.shutdown()
    first.store.close()
    assert first.prepared_noise(Q1) is None  # memory only: gone with the process

    second_sampler = RecordingSampler(8)
    restarted = make_coordinator(
        tmp_path, pool, noise_sampler=second_sampler, precompute_noise=True
    )
    try:
        restarted.recover()
        again = restarted.prepared_noise(Q1)
        assert again is not None
        again.result(timeout=60)
        assert second_sampler.threads() == ["fedpca-noise-prep"] * 3
        finish_with_owners(restarted, pool, public_key, owners_for(owner_rows), "q1")
        assert restarted.store.query(Q1).state is QueryState.DONE
        assert len(second_sampler.draws) == 3
        assert restarted.result_meta(ANALYST, "q1")["timings"]["noise_precomputed"] == 1.0
    finally:
        restarted.shutdown()


# ------------------------------------------------------------------ masked mode
def _unmask(
    pool: CryptoPool,
    private_key: Any,
    coordinator: Coordinator,
    owners: list[Owner],
) -> tuple[np.ndarray, np.ndarray, int]:
    """(T − v′v′ᵀ − (N 2^f R − v vᵀ))/(N 2^f), rounded: the noise E as exact integers.

    Also returns S = (N 2^f R_int − v_int v_intᵀ)/(N 2^(2f)) from the owners' own
    integers and N.
    """
    plan = coordinator.plan(Q1)
    spec = plan.spec
    m, f = spec.n_features, spec.frac_bits
    k = plan.result_block(SCATTER_ROWS).layout.slots_per_ciphertext
    t_slots = decrypt_block(pool, private_key, coordinator, "q1", SCATTER_ROWS)
    v_prime = decrypt_block(pool, private_key, coordinator, "q1", MASKED_SUM)
    r_int = [0] * len(t_slots)
    v_int = [0] * m
    n_records = 0
    for owner in owners:
        encoded, count = owner.encode(plan)
        r_int = [a + int(b) for a, b in zip(r_int, encoded[SCATTER_ROWS], strict=True)]
        v_int = [a + int(b) for a, b in zip(v_int, encoded[SUM_SINGLE], strict=True)]
        n_records += count
    assert coordinator.result_meta(ANALYST, "q1")["public_n"] == n_records
    scale = n_records << f
    noise = np.zeros((m, m))
    scatter = np.zeros((m, m))
    residues: list[int] = []
    for slot, position in enumerate(row_aligned_positions(m, k)):
        if position is None:
            assert t_slots[slot] == 0
            continue
        i, j = position
        centred = t_slots[slot] - v_prime[i] * v_prime[j]
        truth = scale * r_int[slot] - v_int[i] * v_int[j]
        difference = centred - truth  # the mask cancels exactly: N 2^f E + F
        # F, the uniform residue that hides v vᵀ mod N 2^f, lies in [−⌊scale/2⌋, scale
        # − ⌊scale/2⌋): rounding to the nearest multiple of scale takes it off.
        noise[i, j] = (difference + scale // 2) // scale
        residues.append(difference - scale * int(noise[i, j]))
        scatter[i, j] = truth / (scale * 2.0**f)
    if noise.any():  # with noise, the residues are uniform draws, not all zero
        assert all(-(scale // 2) <= r < scale - scale // 2 for r in residues)
        assert len(set(residues)) > 1
    else:  # epsilon = inf: nothing to hide, nothing added
        assert not any(residues)
    return noise, scatter, n_records


def test_a_replaced_upload_breaking_last_does_not_keep_the_newer_ones_place(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    """Stream A (upload u1) stalls, stream B (upload u2) replaces it and breaks, then A
    breaks: nothing streams, so u2 must be taken out. Streams were counted per owner,
    so B's break saw A open and A's saw another id: the place was kept (review)."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, "q", deadline_seconds=60)))
    plan = coordinator.plan(key("q"))
    owner = owners_for(owner_rows)[0]
    header, blocks, _ = owner.upload(plan, public_key, pool, key("q"))
    first = coordinator.begin_upload("owner-0", replace(header, upload_id="u1"))
    first.add(chunk_of(blocks[SHARES][:1]))
    second = coordinator.begin_upload("owner-0", replace(header, upload_id="u2"))
    second.add(chunk_of(blocks[SHARES][:1]))
    assert [c.upload_id for c in coordinator.store.contributors(key("q"))] == ["u2"]
    second.abandon()
    first.abandon()
    assert coordinator.store.contributors(key("q")) == []
    assert coordinator.store.aggregate(key("q")) == b""


@pytest.mark.parametrize("clip_norm", [1.0, 2.5])
def test_masked_mode_without_noise_unmasks_to_the_centred_scatter(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    clip_norm: float,
) -> None:
    """At a clip norm other than 1 the proxy sized its mean mask in data units, the plan
    in clip units, and failed every such query after its owners had uploaded (review)."""
    public_key, private_key = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(neighbouring=REPLACE_ONE))
    spec = make_spec(
        public_key, mode=ProtocolMode.MASKED, neighbouring=REPLACE_ONE, clip_norm=clip_norm
    )
    coordinator.submit("alice", signed(spec))
    plan = coordinator.plan(Q1)
    assert plan.owner_block(SCATTER_ROWS).layout.slots_per_ciphertext == 2  # 512-bit key
    owners = owners_for(owner_rows)
    for owner in owners:
        header, blocks, _ = owner.upload(plan, public_key, pool)
        assert header.public_record_count == len(owner.rows)
        accept_upload(coordinator, owner.owner_id, header, blocks)
    assert coordinator.store.query(Q1).state is QueryState.DONE

    noise, scatter, n_records = _unmask(pool, private_key, coordinator, owners)
    assert not noise.any()  # epsilon = inf: exact
    # The unmasked value is the centred scatter of all rows, to within the owners'
    # quantisation (< 2^-16 per coordinate; the scatter and the mean's outer product
    # each move by at most 2 * N * 2^-16).
    x = np.vstack([preprocess_for_query(o.rows, spec) for o in owners])
    centred = x.T @ x - np.outer(x.sum(axis=0), x.sum(axis=0)) / len(x)
    upper = np.triu_indices(34)
    tolerance = 4 * len(x) * QUANTISATION_STEP
    # Owners send the scatter in units of c^2 and the sum in units of c.
    np.testing.assert_allclose(
        scatter[upper] * clip_norm**2, centred[upper], rtol=0, atol=tolerance * clip_norm**2
    )
    result = coordinator.result(ANALYST, "q1")
    assert result.masked_mean_block == MASKED_SUM and n_records == 351
    # The masked sum is v + b: far from v (the mask is 2^40 times wider than |v|).
    v_prime = decrypt_block(pool, private_key, coordinator, "q1", MASKED_SUM)
    v_true = x.sum(axis=0) * 2.0**spec.frac_bits / clip_norm
    assert min(abs(a - b) for a, b in zip(v_prime, v_true, strict=True)) > 2**40


def test_masked_mode_noise_has_the_expected_sigma(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    config = make_config(epsilon=100.0, neighbouring=REPLACE_ONE)
    coordinator = make_coordinator(tmp_path, pool, config)
    spec = make_spec(public_key, mode=ProtocolMode.MASKED, epsilon=1.0, neighbouring=REPLACE_ONE)
    coordinator.submit("alice", signed(spec))
    plan = coordinator.plan(Q1)
    owners = owners_for(owner_rows)
    for owner in owners:
        header, blocks, _ = owner.upload(plan, public_key, pool)
        accept_upload(coordinator, owner.owner_id, header, blocks)
    noise, _, _ = _unmask(pool, private_key, coordinator, owners)
    upper = noise[np.triu_indices(34)]
    sigma_int = coordinator.result_meta(ANALYST, "q1")["sections"][0]["sigma_int"]
    # The defining value, written out (a test audit halved masked_sigma and this test,
    # which read the expected sigma from the code that draws the noise, still passed):
    # sigma = z (4√2 c² + 4c²/N + √(M(M+1)/2) 2^-f c²), drawn in units of 2^-f c².
    c2, n, m, f = spec.clip_norm**2, sum(len(rows) for rows in owner_rows), 34, spec.frac_bits
    sensitivity = 4 * math.sqrt(2) * c2 + 4 * c2 / n + math.sqrt(m * (m + 1) / 2) * 2.0**-f * c2
    assert plan.noise_multiplier > 0
    assert sigma_int == pytest.approx(
        math.ldexp(plan.noise_multiplier * sensitivity / c2, f), rel=1e-12
    )
    # 595 draws: sample sd within 5 relative standard errors (1/sqrt(2 * 595) ≈ 3%).
    assert np.std(upper) == pytest.approx(sigma_int, rel=5 / math.sqrt(2 * upper.size))
    assert abs(np.mean(upper)) < 5 * sigma_int / math.sqrt(upper.size)
    assert not np.tril(noise, -1).any()  # only the upper triangle is released


def test_masked_upload_needs_a_public_count_within_bounds(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(neighbouring=REPLACE_ONE))
    spec = make_spec(public_key, mode=ProtocolMode.MASKED, quorum=1, neighbouring=REPLACE_ONE)
    coordinator.submit("alice", signed(spec))
    header, blocks, _ = owners_for(owner_rows)[0].upload(coordinator.plan(Q1), public_key, pool)
    with pytest.raises(ProtocolError, match="needs the owner's public_record_count"):
        accept_upload(coordinator, "owner-0", replace(header, public_record_count=None), blocks)
    with pytest.raises(ProtocolError, match="exceeds the query's max_records_per_owner"):
        accept_upload(coordinator, "owner-0", replace(header, public_record_count=1 << 21), blocks)
    assert coordinator.store.query(Q1).n_contributed == 0


def test_a_query_needing_oversized_uploads_is_refused_before_anything_is_stored(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    config = dataclasses.replace(
        make_config(), proxy=dataclasses.replace(ProxyConfig().proxy, max_upload_mib=0.001)
    )
    coordinator = make_coordinator(tmp_path, pool, config)
    # 34 features at 512 bits: 79 ciphertexts of 128 bytes (~10 KiB) against ~1 KiB;
    # 2 features fit in one ciphertext.
    with pytest.raises(ConfigError, match=r"proxy\.max_upload_mib"):
        coordinator.submit("alice", signed(make_spec(public_key)))
    assert coordinator.store.queries() == []
    assert coordinator.store.releases("alice") == []
    small = make_spec(
        public_key,
        query_id="q-small",
        n_features=2,
        n_components=1,
        feature_lower=(-1.0, -1.0),
        feature_upper=(1.0, 1.0),
    )
    assert coordinator.submit("alice", signed(small)).query_id == key("q-small")


def test_uploads_in_progress_are_taken_out_at_restart_while_open_and_resumed_once_fixed(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key, quorum=3)))
    plan = coordinator.plan(Q1)
    owners = owners_for(owner_rows)
    uploads = [owner.upload(plan, public_key, pool) for owner in owners]
    header, blocks, _ = uploads[0]
    accept_upload(coordinator, owners[0].owner_id, header, blocks)
    accepted = coordinator.store.aggregate(Q1)
    # Owner 1's stream dies with the process after its first chunk was folded.
    stream = coordinator.begin_upload(owners[1].owner_id, uploads[1][0])
    stream.add(chunk_of(uploads[1][1][SHARES][:2]))
    assert coordinator.store.aggregate(Q1) != accepted
    status = coordinator.status(ANALYST, "q1")
    assert (status.owners_contributed, status.owners_uploading) == (1, 1)
    coordinator.store.close()

    # The set of contributors was still open: the restart takes the chunk out and
    # frees the place.
    restarted = make_coordinator(tmp_path, pool)
    assert restarted.store.partial_uploads(Q1) == {owners[1].owner_id: 2}
    restarted.recover()
    assert restarted.store.partial_uploads(Q1) == {}
    assert restarted.store.aggregate(Q1) == accepted
    assert restarted.status(ANALYST, "q1").owners_uploading == 0
    # Owner 2 begins, then owner 1 resends and completes the set: from now on nothing
    # is taken out. Owner 2's stream breaks; it resumes after its two folded chunks.
    late = restarted.begin_upload(owners[2].owner_id, uploads[2][0])
    ciphertexts = uploads[2][1][SHARES]
    late.add(chunk_of(ciphertexts[:1]))
    accept_upload(restarted, owners[1].owner_id, uploads[1][0], uploads[1][1])
    assert restarted.store.query(Q1).state is QueryState.AGGREGATING
    late.add(chunk_of(ciphertexts[1:3], 1, 1))
    late.abandon()
    assert restarted.store.partial_uploads(Q1) == {owners[2].owner_id: 3}
    resumed = restarted.begin_upload(owners[2].owner_id, uploads[2][0])
    content = hashlib.sha256()
    for chunk in (
        chunk_of(ciphertexts[:1]),
        chunk_of(ciphertexts[1:3], 1, 1),
        chunk_of(ciphertexts[3:], 2, 3),
    ):
        resumed.add(chunk)  # the first two are below the mark: skipped
        content.update(chunk.data)
    resumed.complete(content.digest())
    assert restarted.store.query(Q1).state is QueryState.DONE
    expected = sum(upload[2][SHARES].astype(object) for upload in uploads)
    assert decrypt_block(pool, private_key, restarted, "q1", SHARES) == list(expected)


def test_budget_searches_once_per_ledger_and_again_after_a_release(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, monkeypatch: Any
) -> None:
    # The search composes the ledger a few times (seconds under pld-continuous): asked
    # again with the same ledger, the proxy answers from what it found.
    import fedpca.dp.next_query as next_query_module
    from fedpca.proxy.analyst_requests import _NEXT_QUERIES

    searches: list[int] = []
    real = next_query_module.largest_admissible_epsilon

    def counted(ledger: Any, *args: Any, **kwargs: Any) -> Any:
        searches.append(len(ledger))
        return real(ledger, *args, **kwargs)

    monkeypatch.setattr(next_query_module, "largest_admissible_epsilon", counted)
    _NEXT_QUERIES.clear()  # an earlier test may have asked about the same ledger
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(bob=PrivacyParams(2.0, 1e-5)))
    first = coordinator.budget("bob").next_query
    assert coordinator.budget("bob").next_query == first
    assert searches == [0]
    coordinator.submit(
        "bob", signed(make_spec(public_key, "c1", epsilon=1.0, delta=1e-6), SECOND_TEST_SIGNING_KEY)
    )
    after = coordinator.budget("bob").next_query
    assert searches == [0, 1]
    assert first is not None and after is not None and after.epsilon < first.epsilon


def test_one_budget_search_at_a_time_per_analyst(
    tmp_path: Path, pool: CryptoPool, monkeypatch: Any
) -> None:
    """A search costs up to seconds of CPU under pld-continuous, a new one for every
    query delta: an analyst asking about many deltas at once gets one search, and each
    of the others a retryable refusal, instead of holding a worker thread each."""
    import fedpca.dp.next_query as next_query_module
    from fedpca.proxy.analyst_requests import _NEXT_QUERIES

    started, release = threading.Event(), threading.Event()
    real = next_query_module.largest_admissible_epsilon

    def slow(ledger: Any, limit: Any, query_delta: float, *args: Any, **kwargs: Any) -> Any:
        if query_delta == 1e-7:  # bob's first search: held until released
            started.set()
            assert release.wait(30)
        return real(ledger, limit, query_delta, *args, **kwargs)

    monkeypatch.setattr(next_query_module, "largest_admissible_epsilon", slow)
    _NEXT_QUERIES.clear()
    coordinator = make_coordinator(
        tmp_path, pool, make_config(bob=PrivacyParams(2.0, 1e-5), carol=PrivacyParams(2.0, 1e-5))
    )
    kept = coordinator.budget("bob", None, 1e-8).next_query  # found once, then kept
    answers: list[Any] = []
    first = threading.Thread(target=lambda: answers.append(coordinator.budget("bob", None, 1e-7)))
    first.start()
    assert started.wait(30)
    with pytest.raises(OverloadError, match="still being computed"):
        coordinator.budget("bob", None, 1e-9)
    # An answer already kept needs no search: given meanwhile.
    assert coordinator.budget("bob", None, 1e-8).next_query == kept
    # Another analyst is not held up, and the spent epsilon needs no search.
    assert coordinator.budget("carol", None, 1e-8).next_query is not None
    assert coordinator.budget("bob", next_query=False).epsilon_spent == 0.0
    release.set()
    first.join(30)
    assert len(answers) == 1 and answers[0].next_query is not None
    assert coordinator.budget("bob", None, 1e-9).next_query is not None  # free again


def test_one_budget_composition_at_a_time_per_analyst_each_kept(
    tmp_path: Path, pool: CryptoPool, monkeypatch: Any
) -> None:
    """Review, stop 42: only the next-query search was one at a time. A composition at a
    delta asked for the first time (up to a second under pld-continuous) was not, so an
    analyst asking at fresh deltas from 16 threads held 16 of the proxy's workers."""
    import fedpca.dp.accounting as accounting_module
    from fedpca.proxy.analyst_requests import _COMPOSED

    started, release = threading.Event(), threading.Event()
    composed_at: list[float] = []
    real = accounting_module.compose_epsilon

    def slow(ledger: Any, delta: float, *args: Any, **kwargs: Any) -> Any:
        composed_at.append(delta)
        if delta == 3e-6:  # bob's first composition: held until released
            started.set()
            assert release.wait(30)
        return real(ledger, delta, *args, **kwargs)

    monkeypatch.setattr(accounting_module, "compose_epsilon", slow)
    _COMPOSED.clear()
    coordinator = make_coordinator(
        tmp_path, pool, make_config(bob=PrivacyParams(2.0, 1e-5), carol=PrivacyParams(2.0, 1e-5))
    )
    coordinator.budget("bob", 2e-6)  # composed once, then kept
    answers: list[Any] = []
    first = threading.Thread(target=lambda: answers.append(coordinator.budget("bob", 3e-6)))
    first.start()
    assert started.wait(30)
    with pytest.raises(OverloadError, match="still being computed"):
        coordinator.budget("bob", 4e-6)
    before = len(composed_at)
    assert coordinator.budget("bob", 2e-6).delta == 2e-6  # kept: answered meanwhile
    assert coordinator.budget("carol", 4e-6).delta == 4e-6  # another analyst: not held
    assert coordinator.budget("bob", 4e-6, next_query=False).delta == 4e-6  # the metrics'
    release.set()
    first.join(30)
    assert len(answers) == 1 and answers[0].delta == 3e-6
    assert composed_at[before:].count(2e-6) == 0  # the kept value was not composed again
    assert coordinator.budget("bob", 5e-6).delta == 5e-6  # free again


def test_resubmitting_a_query_whose_charge_was_re_entered_is_refused_clearly(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    """After a restore, `proxy import-releases` charges queries the database does not
    hold; an analyst retrying such a query id got INTERNAL (a duplicate key)."""
    public_key, _ = test_only_keypair_512
    # A budget the re-entered release nearly fills: the reason is still the restore.
    coordinator = make_coordinator(tmp_path, pool, make_config(bob=PrivacyParams(1.2, 1e-5)))
    spec = make_spec(public_key, "c1", epsilon=1.0, delta=1e-6)
    event = PrivacyEvent("bob/c1", "bob", 2.0, 1.0, 1e-6).to_dict()
    with coordinator.store.transaction() as conn:
        coordinator.store.record_release(conn, "bob", "bob/c1", event)
    with pytest.raises(QueryStateError, match=r"restored from a backup.*new query id"):
        coordinator.submit("bob", signed(spec, SECOND_TEST_SIGNING_KEY))
    assert not coordinator.store.has_query("bob/c1")
    assert [r["query_id"] for r in coordinator.store.releases("bob")] == ["bob/c1"]


# ------------------------------------------------ steps a crash or a locked store stalls
def test_a_masked_result_that_meets_a_locked_store_is_stored_later(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: a "database is locked" while storing a masked-mode result failed
    # the query for good, every owner and the analyst charged. Nothing was stored (the
    # transaction rolled back), so the timer tries again and the query completes.
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(neighbouring=REPLACE_ONE))
    store = coordinator.store
    real_store_result = store.store_result
    error = sqlite_error(tmp_path, "locked")
    attempts = [0]

    def locked_once(*args: Any, **kwargs: Any) -> Any:
        attempts[0] += 1
        if attempts[0] == 1:
            raise error
        return real_store_result(*args, **kwargs)

    store.store_result = locked_once  # type: ignore[method-assign]
    spec = make_spec(public_key, quorum=2, mode=ProtocolMode.MASKED, neighbouring=REPLACE_ONE)
    coordinator.submit("alice", signed(spec))
    finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows)[:2], "q1")
    assert attempts[0] == 1
    assert store.query(Q1).state is QueryState.NOISING  # was: FAILED, charged
    # Not tried again at once: the wait doubles from half a second (a disk full for
    # hours must not cost a recomputed result every half second).
    assert coordinator.retry_stalled() == []
    monkeypatch.setattr(coordinator_core, "STALL_BACKOFF_FIRST", 0.0)
    coordinator._stall(Q1)  # its second failure, due at once
    assert coordinator.retry_stalled() == [Q1]
    assert store.query(Q1).state is QueryState.DONE
    assert coordinator.retry_stalled() == []  # nothing left to retry
    assert store.has_release(Q1)


def test_a_masked_result_that_can_never_be_stored_fails_a_day_past_the_deadline(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    """A NOISING query whose result could not be stored was retried for ever, holding
    one of its analyst's open-query places (review); an aggregating query's pages were
    already bounded by PROXY_WORK_LIMIT_SECONDS."""
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool, make_config(neighbouring=REPLACE_ONE))
    store = coordinator.store
    error = sqlite_error(tmp_path, "locked")

    def always_locked(*args: Any, **kwargs: Any) -> Any:
        raise error

    store.store_result = always_locked  # type: ignore[method-assign]
    spec = make_spec(public_key, quorum=2, mode=ProtocolMode.MASKED, neighbouring=REPLACE_ONE)
    coordinator.submit("alice", signed(spec))
    finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows)[:2], "q1")
    assert store.query(Q1).state is QueryState.NOISING
    # Its failed step stays due for a retry (review: the pass that scheduled it cleared
    # it, so it was never tried again).
    assert Q1 in coordinator._stalled
    clock = coordinator.clock
    assert isinstance(clock, Clock)
    clock.now = store.query(Q1).deadline_at + PROXY_WORK_LIMIT_SECONDS - 1
    assert coordinator.check_deadlines() == []
    assert store.query(Q1).state is QueryState.NOISING
    clock.now += 2
    assert coordinator.check_deadlines() == [Q1]
    record = store.query(Q1)
    assert record.state is QueryState.FAILED
    assert record.failure_reason is not None and "could not finish" in record.failure_reason
    assert store.has_release(Q1)  # every owner uploaded: charged


def test_a_noising_query_a_restart_finds_long_past_its_deadline_is_finished(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any, owner_rows: list[np.ndarray]
) -> None:
    """The bound on a NOISING query's retries failed, charged, a query that a proxy
    restarted a day after its deadline had queued to finish (review of that fix)."""
    coordinator, config = _masked_query_interrupted_in_noising(
        tmp_path, pool, test_only_keypair_512[0], owner_rows
    )
    deadline = coordinator.store.query(Q1).deadline_at
    coordinator.store.close()
    later = Clock()
    later.now = deadline + PROXY_WORK_LIMIT_SECONDS + 60
    restarted = make_coordinator(tmp_path, pool, config, clock=later)
    queued: list[str] = []
    restarted._schedule = queued.append  # type: ignore[method-assign]  # as the executor
    restarted.recover()
    assert queued == [Q1]
    assert restarted.store.query(Q1).state is QueryState.NOISING  # not failed meanwhile
    assert restarted.finish(Q1).state is QueryState.DONE


def test_pages_a_locked_store_kept_from_being_final_are_made_final_later(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: pages are made final after a fold or a noise piece; when that
    # step met a locked database after the last fold, nothing tried again, and the query
    # with every chunk folded failed at its deadline, charged.
    public_key, _ = test_only_keypair_512
    coordinator = make_coordinator(tmp_path, pool)
    store = coordinator.store
    real_finalize = store.finalize_pages
    error = sqlite_error(tmp_path, "locked")
    failed = [0]

    def locked_when_finishing(query_id: str, total: int, *args: Any, **kwargs: Any) -> Any:
        if not failed[0] and store.aggregated_through(query_id) >= total:
            failed[0] += 1
            raise error
        return real_finalize(query_id, total, *args, **kwargs)

    store.finalize_pages = locked_when_finishing  # type: ignore[method-assign]
    coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0)))
    with pytest.raises(sqlite3.OperationalError):
        # The last fold is durable; the step after it fails (the owner is answered
        # UNAVAILABLE and its retry finds every chunk folded).
        finish_with_owners(coordinator, pool, public_key, owners_for(owner_rows), "q1")
    assert failed[0] == 1
    assert store.query(Q1).state is QueryState.AGGREGATING
    assert store.aggregated_through(Q1) == total_ciphertexts(coordinator._context(Q1))
    monkeypatch.setattr(coordinator_core, "STALL_BACKOFF_FIRST", 0.0)
    coordinator._stall(Q1)  # due at once
    assert coordinator.retry_stalled() == [Q1]
    assert store.query(Q1).state is QueryState.DONE


def test_a_query_whose_chunks_are_all_in_is_not_failed_at_its_deadline(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: every upload accepted, part of the result released, the rest
    # waiting for its noise (as after a restart, which draws it afresh): the deadline
    # failed the query. What is left is the proxy's own work; an owner that has not
    # delivered its chunks still fails it (the control below).
    public_key, _ = test_only_keypair_512
    clock = Clock()
    coordinator, sampler, gate = gated_coordinator(tmp_path, pool, clock, monkeypatch)
    store = coordinator.store
    try:
        coordinator.submit("alice", signed(make_spec(public_key, epsilon=1.0)))
        assert sampler.waiting.wait(30.0)
        owners = owners_for(owner_rows)
        finish_with_owners(coordinator, pool, public_key, owners, "q1")
        pages = coordinator.plan(Q1).owner_block(SHARES).layout.n_ciphertexts
        assert 0 < store.pages_final(Q1) < pages  # released in part, the rest waits
        clock.now += 3600.0
        assert coordinator.check_deadlines() == []
        assert store.query(Q1).state is QueryState.AGGREGATING
        # ... but not for ever: a day after the deadline the query fails (found by
        # review: a step failing other than on the store would have held it for good).
        clock.now += PROXY_WORK_LIMIT_SECONDS
        assert coordinator.check_deadlines() == [Q1]
        failed = store.query(Q1)
        assert failed.state is QueryState.FAILED
        assert "could not finish the result" in failed.failure_reason
        gate.set()
        # Control: a contributor that has not delivered every chunk fails the query.
        coordinator.submit("alice", signed(make_spec(public_key, "q2", epsilon=1.0)))
        plan = coordinator.plan(key("q2"))
        for owner in owners[:2]:
            header, blocks, _ = owner.upload(plan, public_key, pool, key("q2"))
            accept_upload(coordinator, owner.owner_id, header, blocks)
        header, blocks, _ = owners[2].upload(plan, public_key, pool, key("q2"))
        partial = coordinator.begin_upload(owners[2].owner_id, header)
        partial.add(chunk_of(blocks[plan.owner_blocks[0].name][:10]))  # 10 ciphertexts only
        clock.now += 3600.0
        assert coordinator.check_deadlines() == [key("q2")]
        failed = store.query(key("q2"))
        assert failed.state is QueryState.FAILED and "owner-2" in failed.failure_reason
    finally:
        gate.set()
        coordinator.shutdown()


def _upload_with_one_chunk_folded(
    tmp_path: Path, pool: CryptoPool, keypair: Any, owner_rows: list[np.ndarray]
) -> tuple[Coordinator, Owner, UploadHeader, dict[str, list[int]], UploadStream]:
    """A COLLECTING query (quorum 3) whose first owner's stream folded its first chunk:
    the coordinator, the owner, its header and ciphertexts, and the open stream."""
    public_key, _ = keypair
    coordinator = make_coordinator(tmp_path, pool)
    coordinator.submit("alice", signed(make_spec(public_key)))
    plan = coordinator.plan(Q1)
    owner = owners_for(owner_rows)[0]
    header, blocks, _ = owner.upload(plan, public_key, pool)
    stream = coordinator.begin_upload(owner.owner_id, header)
    stream.add(chunk_of(blocks[plan.owner_blocks[0].name]))
    return coordinator, owner, header, blocks, stream


def test_a_broken_stream_cannot_take_out_the_upload_a_new_stream_just_joined(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
) -> None:
    # Found by review (by reading): the retry of an upload joined (resuming from its
    # mark) before it was counted as open; the broken stream's take-out in between
    # removed the contributor, and the new stream failed at its mark, the owner's
    # contribution lost. Now the join holds the upload's turn, and the take-out waits.
    coordinator, owner, header, blocks, broken = _upload_with_one_chunk_folded(
        tmp_path, pool, test_only_keypair_512, owner_rows
    )
    store, plan = coordinator.store, coordinator.plan(Q1)
    first = plan.owner_blocks[0]
    real_join = store.join
    taking_out: list[threading.Thread] = []

    def join_then_break_the_old_stream(*args: Any, **kwargs: Any) -> Any:
        joined = real_join(*args, **kwargs)
        # The old stream breaks right after the new one's join: its take-out must not
        # run until the new stream is counted.
        thread = threading.Thread(target=broken.abandon)
        thread.start()
        thread.join(0.5)
        taking_out.append(thread)
        return joined

    store.join = join_then_break_the_old_stream  # type: ignore[method-assign]
    resumed = coordinator.begin_upload(owner.owner_id, header)
    store.join = real_join  # type: ignore[method-assign]
    taking_out[0].join(30.0)
    assert not taking_out[0].is_alive()
    assert resumed.covered == first.layout.n_ciphertexts
    contributor = store.contributor(Q1, owner.owner_id)
    assert contributor is not None and contributor.covered == first.layout.n_ciphertexts
    position = 0
    content = hashlib.sha256()
    for index, block in enumerate(plan.owner_blocks):
        data = ciphertexts_to_bytes(blocks[block.name], header.blocks[0].ciphertext_bytes)
        resumed.add(DecodedChunk(index, position, list(blocks[block.name]), data))
        content.update(data)
        position += block.layout.n_ciphertexts
    assert not resumed.complete(content.digest()).duplicate


def test_a_new_stream_of_an_upload_being_taken_out_joins_after_the_take_out(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: Any,
    owner_rows: list[np.ndarray],
) -> None:
    # The other order than the test above (review of stop 34): the broken stream has
    # seen itself alone and is taking its upload out when a new stream of it arrives.
    # The new stream's join waits for the take-out, then starts over from 0; without
    # the upload's turn it joined first, resumed from the mark, and the take-out then
    # removed the row it resumed.
    coordinator, owner, header, _, broken = _upload_with_one_chunk_folded(
        tmp_path, pool, test_only_keypair_512, owner_rows
    )
    store = coordinator.store
    real_abandon = store.abandon
    resumed: list[Any] = []

    def new_stream_arrives_then_take_out(*args: Any, **kwargs: Any) -> Any:
        thread = threading.Thread(
            target=lambda: resumed.append(coordinator.begin_upload(owner.owner_id, header))
        )
        thread.start()
        thread.join(0.5)  # the new stream's join, if nothing holds it back
        return real_abandon(*args, **kwargs)

    store.abandon = new_stream_arrives_then_take_out  # type: ignore[method-assign]
    broken.abandon()
    store.abandon = real_abandon  # type: ignore[method-assign]
    wait_until(lambda: len(resumed) == 1, "the new stream's join")
    contributor = store.contributor(Q1, owner.owner_id)
    assert contributor is not None
    assert resumed[0].covered == contributor.covered == 0  # starts over, consistently
