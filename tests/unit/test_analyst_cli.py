"""Analyst keys, the gRPC client and the ``fedpca analyst`` CLI.

The client and CLI talk real gRPC (loopback, insecure port) to a fake
AnalystService that answers like the proxy: it verifies each query's signature,
stores submitted queries and streams results built with serde.encode_result from
ciphertexts (the owners' exact fixed-point statistics) under the analyst's
TEST-ONLY 512-bit key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import re
import stat
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from click.testing import CliRunner

import fedpca.analyst.federated_estimator as estimators_module
import fedpca.analyst.keys as keys_module
from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.analyst.cli import (
    BUDGET_EXIT_CODE,
    BUSY_EXIT_CODE,
    OWNERS_CAP_NOTE,
    analyst_group,
)
from fedpca.analyst.client import (
    AnalystClient,
    ProxyUnavailableError,
)
from fedpca.analyst.config import load_config
from fedpca.analyst.decode import decrypt_result, result_from_packed
from fedpca.analyst.keys import (
    create_analyst_keys,
    load_analyst_private_key,
    load_analyst_public_key,
    load_analyst_signing_key,
)
from fedpca.codec import (
    CryptoPool,
    generate_keypair,
    key_fingerprint,
)
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import (
    BudgetExceededError,
    ConfigError,
    FedpcaError,
    KeyFileError,
    NotFoundError,
    ProtocolError,
    QueryStateError,
)
from fedpca.exact_statistics import fixed_point_statistics
from fedpca.masked_release import row_aligned_positions
from fedpca.messages import (
    CANCELLED_REASON,
    REFUSAL_METADATA,
    BudgetStatus,
    CancelReceipt,
    Charge,
    DeploymentInfo,
    OwnerDecline,
    QueryState,
    QueryStatus,
    QuerySummary,
    Refusal,
)
from fedpca.owner_terms import OwnerTerms
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SHARES,
    ReleasePlan,
)
from fedpca.query import AggregateKind, Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.signing import generate_signing_key, sign_query, signer_id, verify_query
from fedpca.table_schema import TableSchema
from fedpca.transport import serde
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from helpers import (
    TEST_SIGNER,
    TEST_SIGNING_KEY,
    example_owner_terms,
    fake_analyst_service,
    quantisation_step,
    query_builder,
)

ROWS = np.random.default_rng(1).uniform(-1.0, 1.0, size=(40, 3)) * [1.0, 0.5, 0.2]
LABELS = np.where(ROWS[:, 0] > 0, 1.0, -1.0)


# ------------------------------------------------------------------------ keys
def test_create_keys_writes_private_0600_and_refuses_overwrite(tmp_path: Path) -> None:
    files = create_analyst_keys(tmp_path / "keys", 512, allow_insecure_test_key=True)
    assert stat.S_IMODE(files.private_key.stat().st_mode) == 0o600
    public_key = load_analyst_public_key(files.directory, allow_insecure_test_key=True)
    assert files.fingerprint == key_fingerprint(public_key)
    private_key = load_analyst_private_key(files.private_key, allow_insecure_test_key=True)
    assert private_key.public_key == public_key
    # The query-signing key: secret (0600), next to the Paillier key, what owners pin.
    assert stat.S_IMODE(files.signing_key.stat().st_mode) == 0o600
    signing_key = load_analyst_signing_key(files.directory)
    assert files.signer == signer_id(signing_key) and files.signer.startswith("ed25519:")
    # Found from the key directory and from the Paillier key file next to it alike.
    assert signer_id(load_analyst_signing_key(files.private_key)) == files.signer
    assert signer_id(load_analyst_signing_key(files.signing_key)) == files.signer
    with pytest.raises(ConfigError, match="already exists"):
        create_analyst_keys(files.directory, 512, allow_insecure_test_key=True)
    replaced = create_analyst_keys(files.directory, 512, force=True, allow_insecure_test_key=True)
    assert replaced.fingerprint != files.fingerprint
    assert replaced.signer != files.signer
    assert signer_id(load_analyst_signing_key(files.directory)) == replaced.signer
    # A signing key left alone in a directory is not overwritten either.
    lone = tmp_path / "lone"
    lone.mkdir()
    files.signing_key.rename(lone / files.signing_key.name)
    with pytest.raises(ConfigError, match="already exists"):
        create_analyst_keys(lone, 512, allow_insecure_test_key=True)
    with pytest.raises(KeyFileError, match="no query-signing key"):
        load_analyst_signing_key(files.directory)


@pytest.mark.parametrize("bits", [512, 1024, 4096])
def test_only_2048_and_3072_bit_keys_are_generated(tmp_path: Path, bits: int) -> None:
    with pytest.raises(ConfigError, match="2048 or 3072"):
        create_analyst_keys(tmp_path, bits)
    assert not list(tmp_path.iterdir())


@pytest.fixture
def fast_keygen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the CLI's 2048/3072-bit generation produce a TEST-ONLY 512-bit key."""
    requested: list[int] = []

    def generate(bits: int, *, allow_insecure_test_key: bool = False) -> Any:
        requested.append(bits)
        return generate_keypair(512, allow_insecure_test_key=True)

    monkeypatch.setattr(keys_module, "generate_keypair", generate)
    return requested


def test_keygen_cli_prints_fingerprint_last(tmp_path: Path, fast_keygen: list[int]) -> None:
    runner = CliRunner()
    result = runner.invoke(analyst_group, ["keygen", "--out", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    assert fast_keygen == [3072]  # the default is the codec's 128-bit-security size
    private = tmp_path / "k" / "analyst.key.json"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    public_key = load_analyst_public_key(tmp_path / "k", allow_insecure_test_key=True)
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == key_fingerprint(public_key)
    # The query signer owners pin, printed on its own line before the fingerprint.
    signing_key = tmp_path / "k" / "analyst.signing.pem"
    assert stat.S_IMODE(signing_key.stat().st_mode) == 0o600
    assert lines[-3] == signer_id(load_analyst_signing_key(tmp_path / "k"))
    assert "accepted_query_signers" in lines[-4] and "accepted_analyst_keys" in lines[-2]

    again = runner.invoke(analyst_group, ["keygen", "--out", str(tmp_path / "k"), "--bits", "2048"])
    assert again.exit_code == 1 and "already exists" in again.output
    assert "Traceback" not in again.output and "generating" not in again.output
    assert fast_keygen == [3072]  # refused before generating anything
    forced = runner.invoke(
        analyst_group, ["keygen", "--out", str(tmp_path / "k"), "--bits", "2048", "--force"]
    )
    assert forced.exit_code == 0 and fast_keygen == [3072, 2048]
    bad = runner.invoke(analyst_group, ["keygen", "--out", str(tmp_path / "x"), "--bits", "1024"])
    assert bad.exit_code == 2


# -------------------------------------------------------------- a fake proxy
def _masked_blocks(
    spec: QuerySpec, pool: CryptoPool, public_key: Any
) -> tuple[dict[str, Any], int]:
    """Masked-mode result of ROWS without noise, computed in plaintext from the owners'
    exact fixed-point statistics."""
    plan = ReleasePlan.for_query(spec, 512)
    f = spec.frac_bits
    statistics = fixed_point_statistics(ROWS, None, spec)
    r = statistics.scatter.tolist()
    v = statistics.sums.tolist()
    n = statistics.count
    sums_block = plan.result_block(MASKED_SUM)
    rng = random.Random(3)
    # Below the mask width W (the block bound is |v|max + W), as the proxy draws it.
    b = [rng.randrange(sums_block.bound // 2) for _ in v]
    rows_block = plan.result_block(SCATTER_ROWS)
    k = rows_block.layout.slots_per_ciphertext
    t_values = [
        0
        if p is None
        else (n << f) * r[p[0]][p[1]] + v[p[0]] * b[p[1]] + b[p[0]] * v[p[1]] + b[p[0]] * b[p[1]]
        for p in row_aligned_positions(spec.n_features, k)
    ]
    masked = [vi + bi for vi, bi in zip(v, b, strict=True)]
    return {
        SCATTER_ROWS: pool.encrypt_packed(
            public_key, t_values, rows_block.layout, rows_block.bound
        ),
        MASKED_SUM: pool.encrypt_packed(public_key, masked, sums_block.layout, sums_block.bound),
    }, n


class FakeProxy(analyst_grpc.AnalystServiceServicer):
    def __init__(self, public_key: Any, pool: CryptoPool) -> None:
        self.public_key = public_key
        self.pool = pool
        self.specs: dict[str, QuerySpec] = {}
        self.refuse_budget = False
        self.foreign_key: Any = None
        """Serve results encrypted under this key instead (a malicious proxy)."""
        self.overload: tuple[tuple[str, str], ...] | None = None
        """Trailing metadata of a RESOURCE_EXHAUSTED for a per-peer bound (None: none)."""
        self.fail_reason: str | None = None
        self.unavailable_submits = 0
        self.submitted_ids: list[str] = []
        self.signatures: list[tuple[bytes, str]] = []
        self.signed: dict[str, tuple[bytes, str]] = {}
        """Query id -> the analyst's (signature, signer), echoed in result headers."""
        self.neighbouring = Neighbouring.ADD_REMOVE
        """The deployment's relation: a query stated for another is refused."""
        self.registered = 1
        """Owners the fake deployment accepts (results carry one owner's statistics)."""
        self.declines: tuple[OwnerDecline, ...] = ()
        self.cancelled: list[str] = []
        self.failed_before: dict[str, str] = {}
        self.fetch_breaks = 0
        """FetchResult streams to break (UNAVAILABLE) after their first two messages."""
        self.reencrypt_on_reopen = False
        """A re-opened FetchResult sends a fresh encryption instead of the same messages."""
        self.fetched: dict[str, list[Any]] = {}
        self.next_query: NextQuery | None = NextQuery(0.412345, 1e-6, AdmissionLimit.BUDGET)
        """What GetBudget reports for the next query (at the delta asked for, if any)."""
        self.listed: list[QuerySummary] = []
        """Queries ListQueries reports after the submitted ones."""
        self.status_charge = (QueryState.DONE, Charge.CHARGED)
        # False: a proxy older than ListQueriesRequest.query_id, which lists every query.
        self.honours_query_filter = True
        self.connected: int | None = None  # None: every registered owner
        self.absent: tuple[str, ...] = ()  # the owners not connected, as the proxy names them
        self.terms: tuple[tuple[str, OwnerTerms], ...] = ()  # stated by connected owners
        """The state and charge GetQueryStatus reports."""
        self.result_deleted_at: datetime | None = None
        self.slow_submits = 0
        """Submissions answered only after SLOW_SUBMIT_SECONDS (each still accepted)."""

    def DescribeDeployment(self, request: Any, context: Any) -> Any:
        info = DeploymentInfo(
            proxy_id="proxy",
            software_version="test",
            protocol_version=1,
            owners_registered=self.registered,
            owners_connected=self.registered if self.connected is None else self.connected,
            neighbouring=self.neighbouring,
            max_delta_per_query=1e-5,
            accountant="zcdp",
            analyst_id="alice",
            budget_epsilon=3.0,
            budget_delta=1e-5,
            server_time=datetime.now(UTC),
            owners_absent=self.absent,
            owner_terms=self.terms if request.with_owner_terms else (),
        )
        return serde.deployment_info_to_proto(info)

    def ListQueries(self, request: Any, context: Any) -> Any:
        limit = serde.list_queries_request_from_proto(request) or 50
        only = serde.listed_query_from_proto(request) if self.honours_query_filter else None
        if only is not None and only not in self.specs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown query {only!r}")
        summaries = [
            QuerySummary(
                status=QueryStatus(
                    query_id,
                    QueryState.DONE,
                    1,
                    spec.quorum,
                    owners_registered=self.registered,
                    charge=Charge.CHARGED,
                ),
                kind=spec.kind,
                mode=spec.mode,
                epsilon=spec.epsilon,
                delta=spec.delta,
                created_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
            )
            for query_id, spec in list(self.specs.items())[::-1][:limit]
            if only in (None, query_id)
        ]
        return serde.query_list_to_proto(summaries + ([] if only else self.listed))

    def CancelQuery(self, request: Any, context: Any) -> Any:
        query_id = serde.query_ref_from_proto(request)
        if query_id not in self.specs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown query {query_id!r}")
        self.cancelled.append(query_id)
        # A query that failed before (its reason) is cancelled again as the proxy does:
        # nothing changes and its charge stands.
        reason = self.failed_before.get(query_id, CANCELLED_REASON)
        status = QueryStatus(query_id, QueryState.FAILED, 0, 1, failure_reason=reason)
        refunded = query_id not in self.failed_before
        return serde.cancel_receipt_to_proto(CancelReceipt(status, refunded=refunded))

    def SubmitQuery(self, request: Any, context: Any) -> Any:
        signed = serde.submit_query_request_from_proto(request)
        spec = signed.spec
        # Like the proxy: only a query its analyst signed is accepted.
        try:
            verify_query(spec, signed.signature, signed.signer)
        except FedpcaError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid query signature: {exc}")
        self.submitted_ids.append(spec.query_id)
        self.signatures.append((signed.signature, signed.signer))
        self.signed[spec.query_id] = (signed.signature, signed.signer)
        if spec.neighbouring is not self.neighbouring:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the query is stated for {spec.neighbouring.value} adjacency; this "
                f"deployment accounts under {self.neighbouring.value}",
            )
        if self.unavailable_submits:
            self.unavailable_submits -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "proxy restarting")
        if self.slow_submits:
            self.slow_submits -= 1
            time.sleep(SLOW_SUBMIT_SECONDS)
        if self.refuse_budget:
            # Like the proxy: which RESOURCE_EXHAUSTED it is goes in trailing metadata.
            context.set_trailing_metadata(((REFUSAL_METADATA, Refusal.BUDGET.value),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"epsilon {spec.epsilon} would exceed the limit 3.0 (spent 2.9)",
            )
        if self.overload is not None:
            context.set_trailing_metadata(self.overload)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "analyst already has 4 queries open")
        self.specs[spec.query_id] = spec
        status = QueryStatus(spec.query_id, QueryState.COLLECTING, 0, spec.quorum)
        return serde.query_status_to_proto(status)

    def GetQueryStatus(self, request: Any, context: Any) -> Any:
        query_id = serde.query_ref_from_proto(request)
        if query_id not in self.specs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown query {query_id!r}")
        state, charge = self.status_charge
        status = QueryStatus(
            query_id,
            state,
            1,
            1,
            owners_declined=1,
            owners_registered=2,
            declines=(OwnerDecline("owner-2", "policy_refusal", "epsilon 9 > 1"),),
            charge=charge,
            result_deleted_at=self.result_deleted_at,
        )
        return serde.query_status_to_proto(status)

    def WatchQueryStatus(self, request: Any, context: Any) -> Iterator[Any]:
        query_id = serde.query_ref_from_proto(request)
        quorum = self.specs[query_id].quorum
        yield serde.query_status_to_proto(QueryStatus(query_id, QueryState.COLLECTING, 1, quorum))
        if self.declines:
            yield serde.query_status_to_proto(
                QueryStatus(
                    query_id,
                    QueryState.COLLECTING,
                    0,
                    quorum,
                    owners_declined=len(self.declines),
                    declines=self.declines,
                    owners_registered=self.registered,
                )
            )
        if self.fail_reason is not None:
            final = QueryStatus(
                query_id,
                QueryState.FAILED,
                1,
                quorum,
                failure_reason=self.fail_reason,
                declines=self.declines,
                owners_declined=len(self.declines),
                charge=Charge.REFUNDED,
            )
        else:
            final = QueryStatus(query_id, QueryState.DONE, quorum, quorum)
        yield serde.query_status_to_proto(final)

    def FetchResult(self, request: Any, context: Any) -> Iterator[Any]:
        query_id = serde.query_ref_from_proto(request)
        spec = self.specs.get(query_id)
        if spec is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no query {query_id!r}")
        assert spec is not None
        if self.foreign_key is not None:
            key = self.foreign_key
            spec = dataclasses.replace(
                spec, analyst_public_key_n=key.n, analyst_key_fingerprint=key_fingerprint(key)
            )
            plan = ReleasePlan.for_query(spec, 512)
            block = plan.owner_block(SHARES)
            values = plan.owner_integers(fixed_point_statistics(ROWS, None, spec))[SHARES]
            packed = self.pool.encrypt_packed(key, values, block.layout, block.bound)
            yield from serde.encode_result(result_from_packed(spec, 1, {SHARES: packed}))
            return
        if spec.mode is ProtocolMode.MASKED:
            blocks, n = _masked_blocks(spec, self.pool, self.public_key)
            result = result_from_packed(spec, 1, blocks, public_count=n)
        else:
            plan = ReleasePlan.for_query(spec, 512)
            block = plan.owner_block(SHARES)
            if spec.kind is QueryKind.DCA:  # the owner leaves out the other labels' rows
                kept = np.isin(LABELS, spec.class_labels)
                share = fixed_point_statistics(ROWS[kept], LABELS[kept], spec)
            else:
                share = fixed_point_statistics(ROWS, None, spec)
            values = plan.owner_integers(share)[SHARES]
            if plan.private:
                values = values + plan.noise_values(TestOnlySeededSampler(1))
            bound = block.bound + plan.bounds.noise_headroom
            packed = self.pool.encrypt_packed(self.public_key, values, block.layout, bound)
            result = result_from_packed(spec, 1, {SHARES: packed})
        signature, signer = self.signed.get(query_id, (b"", ""))
        messages = serde.encode_result(result, query_signature=signature, query_signer=signer)
        if query_id in self.fetched and not self.reencrypt_on_reopen:
            messages = self.fetched[query_id]
        self.fetched[query_id] = messages
        if self.fetch_breaks:
            self.fetch_breaks -= 1
            yield from messages[:2]
            context.abort(grpc.StatusCode.UNAVAILABLE, "proxy restarting")
        yield from messages

    def GetBudget(self, request: Any, context: Any) -> Any:
        delta, query_delta = serde.budget_request_from_proto(request)
        next_query = self.next_query
        if next_query is not None and query_delta is not None:
            next_query = dataclasses.replace(next_query, delta=query_delta)
        status = BudgetStatus(
            "alice", delta or 1e-5, 1.25, 1.75, 3.0, 2, limit_delta=1e-5, next_query=next_query
        )
        return serde.budget_status_to_proto(status)


@pytest.fixture
def proxy(test_only_keypair_512: Any, pool: CryptoPool) -> Iterator[tuple[FakeProxy, str]]:
    fake = FakeProxy(test_only_keypair_512[0], pool)
    with fake_analyst_service(fake) as address:
        yield fake, address


SLOW_SUBMIT_SECONDS = 0.5

_spec = query_builder(
    query_id="q-client", delta=1e-6, max_records_per_owner=64, max_owners=4, frac_bits=16
)


# ---------------------------------------------------------------------- client
def test_client_submits_watches_fetches_and_decrypts_masked_mode(
    proxy: tuple[FakeProxy, str], test_only_keypair_512: Any, pool: CryptoPool
) -> None:
    fake, address = proxy
    fake.neighbouring = Neighbouring.REPLACE_ONE  # masked mode: a replace-one deployment
    public_key, private_key = test_only_keypair_512
    spec = _spec(public_key, mode=ProtocolMode.MASKED, neighbouring=Neighbouring.REPLACE_ONE)
    with AnalystClient(address, None, insecure=True) as client:
        assert client.submit(spec, TEST_SIGNING_KEY).state is QueryState.COLLECTING
        states = [s.state for s in client.watch(spec.query_id)]
        assert states == [QueryState.COLLECTING, QueryState.DONE]
        fetched = client.fetch(spec.query_id, public_key=public_key, signer=TEST_SIGNER)
    # The client signed the query with the key it was given.
    assert [signer for _, signer in fake.signatures] == [TEST_SIGNER]
    # The public N travels in the result header (ResultHeader.public_record_count).
    assert fetched.result.public_record_count == len(ROWS)
    assert fetched.public_count == len(ROWS)
    release = decrypt_result(fetched.result, private_key, expected_query=spec, pool=pool)
    assert release.public_count == len(ROWS)
    assert release.centred_scatter is not None
    # Exactly the centred scatter of the owners' quantised rows ...
    exact = fixed_point_statistics(ROWS, None, spec)
    scatter = exact.scatter.astype(float) * 2.0**-spec.frac_bits
    sums = exact.sums.astype(float) * 2.0**-spec.frac_bits
    expected = scatter - np.outer(sums, sums) / exact.count
    np.testing.assert_allclose(release.centred_scatter, expected, rtol=1e-12, atol=1e-12)
    # ... which is the rows' centred scatter to within their quantisation.
    rows = preprocess_for_query(ROWS, spec)
    centred = (rows - rows.mean(axis=0)).T @ (rows - rows.mean(axis=0))
    tolerance = 4 * len(ROWS) * quantisation_step(spec.frac_bits)
    np.testing.assert_allclose(release.centred_scatter, centred, rtol=0, atol=tolerance)


def test_client_maps_grpc_errors(proxy: tuple[FakeProxy, str], test_only_keypair_512: Any) -> None:
    fake, address = proxy
    fake.refuse_budget = True
    with AnalystClient(address, None, insecure=True) as client:
        with pytest.raises(BudgetExceededError, match=r"would exceed the limit 3\.0"):
            client.submit(_spec(test_only_keypair_512[0]), TEST_SIGNING_KEY)
        with pytest.raises(NotFoundError, match="no query 'nope'"):
            client.fetch("nope", public_key=test_only_keypair_512[0], signer=TEST_SIGNER)
        fake.refuse_budget = False
        fake.fail_reason = "quorum of 3 not reached by the deadline"
        client.submit(_spec(test_only_keypair_512[0]), TEST_SIGNING_KEY)
        with pytest.raises(QueryStateError, match="quorum of 3 not reached"):
            client.wait("q-client")
        budget = client.budget(1e-5, query_delta=1e-7)
    assert budget.delta == 1e-5 and budget.epsilon_remaining == 1.75
    assert budget.next_query == NextQuery(0.412345, 1e-7, AdmissionLimit.BUDGET)


def test_submit_is_retried_with_the_same_query_id_while_the_proxy_is_unavailable(
    proxy: tuple[FakeProxy, str], test_only_keypair_512: Any
) -> None:
    fake, address = proxy
    fake.unavailable_submits = 2
    spec = _spec(test_only_keypair_512[0])
    with AnalystClient(address, None, insecure=True, retry_delays=(0.01, 0.01, 0.01)) as client:
        status = client.submit(spec, TEST_SIGNING_KEY)
    assert status.query_id == spec.query_id
    # Three attempts, all with the id chosen once by the client: the proxy treats an
    # identical resubmission as the same query, so the budget is charged once. The
    # signature (deterministic, over the same query) is the same every time.
    assert fake.submitted_ids[-3:] == [spec.query_id] * 3
    assert len(set(fake.signatures[-3:])) == 1


def test_a_broken_result_stream_is_reopened_and_must_repeat_itself(
    proxy: tuple[FakeProxy, str], test_only_keypair_512: Any, pool: CryptoPool
) -> None:
    # The client keeps a digest of every message it has yielded: a re-opened stream
    # continues after them if it repeats them exactly, and is refused if it does not.
    fake, address = proxy
    public_key, private_key = test_only_keypair_512
    spec = _spec(public_key)
    with AnalystClient(address, None, insecure=True, retry_delays=(0.01,) * 3) as client:
        client.submit(spec, TEST_SIGNING_KEY)
        mine = {"public_key": public_key, "signer": TEST_SIGNER}
        expected = client.fetch(spec.query_id, **mine).result  # what every fetch repeats
        fake.fetch_breaks = 1
        again = client.fetch(spec.query_id, **mine).result
        assert list(again.payload.in_wire_order()) == list(expected.payload.in_wire_order())
        fake.fetch_breaks, fake.reencrypt_on_reopen = 1, True
        with pytest.raises(ProtocolError, match="differs from the one received"):
            client.fetch(spec.query_id, **mine)
    release = decrypt_result(again, private_key, expected_query=spec, pool=pool)
    assert release.statistics is not None


def test_a_refusal_is_not_retried(proxy: tuple[FakeProxy, str], test_only_keypair_512: Any) -> None:
    fake, address = proxy
    fake.refuse_budget = True
    before = len(fake.submitted_ids)
    with (
        AnalystClient(address, None, insecure=True, retry_delays=(0.01,) * 5) as client,
        pytest.raises(BudgetExceededError),
    ):
        client.submit(_spec(test_only_keypair_512[0]), TEST_SIGNING_KEY)
    assert len(fake.submitted_ids) == before + 1


def test_unreachable_proxy_is_a_clear_error() -> None:
    with (
        AnalystClient("127.0.0.1:1", None, insecure=True, timeout=5.0, retry_delays=()) as client,
        pytest.raises(ProxyUnavailableError, match="proxy unavailable"),
    ):
        client.status("q")


def test_client_needs_tls_unless_insecure() -> None:
    with pytest.raises(ConfigError, match="TLS material"):
        AnalystClient("localhost:1", None)


# ------------------------------------------------------------------------- CLI
@pytest.fixture
def key_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    files = create_analyst_keys(tmp_path / "keys", 512, allow_insecure_test_key=True)

    def load(path: Any) -> Any:
        return load_analyst_private_key(path, allow_insecure_test_key=True)

    monkeypatch.setattr(estimators_module, "load_analyst_private_key", load)
    monkeypatch.setattr(keys_module, "load_analyst_private_key", load)
    return files.directory


@pytest.fixture
def analyst_key(key_dir: Path, proxy: tuple[FakeProxy, str]) -> Path:
    """Point the fake proxy at the CLI's key."""
    fake, _ = proxy
    fake.public_key = load_analyst_public_key(key_dir, allow_insecure_test_key=True)
    return key_dir


def _query_args(address: str, key_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--proxy",
        address,
        "--insecure",
        "--key-dir",
        str(key_dir),
        "--features",
        "3",
        "--components",
        "2",
        "--max-records-per-owner",
        "64",
        "--max-owners",
        "4",
        "--workers",
        "1",
        "--bounds",
        "none",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize("command", ["pca", "dca"])
def test_pca_and_dca_need_bounds_stated_none_included(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path, command: str
) -> None:
    """``--bounds`` defaulted to none: a forgotten flag submitted a query whose rows were
    clipped in raw units, charged, with only a note (a new analyst's walkthrough, stop
    43). Now it is required, as for stats and linreg; ``none`` is still accepted."""
    fake, address = proxy
    args = _query_args(address, analyst_key, tmp_path / "r.json", "--epsilon", "1")
    index = args.index("--bounds")
    del args[index : index + 2]
    classes = ["--classes", "-1,1"] if command == "dca" else []
    result = CliRunner().invoke(analyst_group, [command, *args, "--delta", "1e-6", *classes])
    assert result.exit_code == 2 and "Missing option '--bounds'" in result.output
    assert fake.submitted_ids == []


def test_cli_asks_for_bounded_owner_tables_only_when_told(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    for flag in ((), ("--bounded-owner-tables",)):
        out = tmp_path / f"result{len(flag)}.json"
        args = _query_args(address, analyst_key, out, "--epsilon", "1", "--delta", "1e-6", *flag)
        result = CliRunner().invoke(analyst_group, ["pca", *args])
        assert result.exit_code == 0, result.output
        spec = fake.specs[fake.submitted_ids[-1]]
        assert spec.bounded_owner_tables is bool(flag)
    assert "--bounded-owner-tables" in CliRunner().invoke(analyst_group, ["pca", "--help"]).output


def test_cli_pca_writes_result_and_plots(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    sample = tmp_path / "sample.csv"
    np.savetxt(sample, np.column_stack([LABELS, ROWS]), delimiter=",")
    out = tmp_path / "run" / "result.json"
    out.parent.mkdir()
    args = ["pca", *_query_args(address, analyst_key, out, "--epsilon", "1", "--delta", "1e-6")]
    result = CliRunner().invoke(analyst_group, [*args, "--sample", str(sample)])

    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(out)
    document = json.loads(out.read_text())
    assert document["epsilon"] == 1.0 and document["not_private"] is False
    assert document["n_samples_noisy"] is True and document["mode"] == "stats"
    # What the components and the mean are of (--bounds none here), said in the file.
    assert document["space"].startswith("raw units, each row clipped to L2 norm clip_norm")
    assert document["clip_norm"] == 1.0 and document["feature_bounds"] is None
    assert (out.parent / "result.scree.png").stat().st_size > 0
    assert (out.parent / "result.projection.png").stat().st_size > 0
    # Signed with the signing key of the key directory (owners pin its signer).
    assert [signer for _, signer in fake.signatures] == [
        signer_id(load_analyst_signing_key(analyst_key))
    ]


def test_cli_pca_prints_and_writes_the_components_noise_spread(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    """How far the noise alone moves each component and its explained variance: printed
    and written by `pca`, the same again by `fetch` (seeded by the query id), with as
    many redraws as asked, none with --noise-sd-draws 0, refused for an aggregate."""
    from fedpca.analyst.component_noise import default_draws

    fake, address = proxy
    runner = CliRunner()
    out = tmp_path / "r.json"
    args = _query_args(address, analyst_key, out, "--epsilon", "1", "--delta", "1e-6")
    result = runner.invoke(analyst_group, ["pca", *args])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["noise_sd_draws"] == default_draws(3) and not document["noise_sd_failure"]
    spread, angles = (
        document["explained_variance_noise_sd"],
        document["components_noise_angle_degrees"],
    )
    assert len(spread) == len(angles) == 2
    assert all(value > 0 for value in spread) and all(0 < angle <= 90 for angle in angles)
    assert document["timings"]["noise sd"] > 0
    lines = result.stdout.splitlines()
    # N's noise sd is the count section's sigma (it said only "noisy").
    n_sd = document["noise_sigma"]["count"]
    assert document["n_samples_noise_sd"] == n_sd > 0
    assert f"records N:   {document['n_samples']:.1f} (noisy, noise sd {n_sd:.3g})" in lines
    assert "  noise sd:  " + ", ".join(f"{v:.4g}" for v in spread) in lines
    assert "noise angle: " + ", ".join(f"{a:.1f}" for a in angles) + " degrees" in lines
    bound = document["explained_variance_noise_bound"]
    assert bound > 0
    assert any(line.startswith(f"noise bound: +/- {bound:.4g} on every") for line in lines)
    below = [rank for rank, v in enumerate(document["explained_variance"], 1) if v <= bound]
    if below:
        which = f"component {below[0]}" if len(below) == 1 else f"components {below[0]} to 2"
        assert f"{which}: explained variance within" in result.stdout
    else:
        assert "within the bound of 0" not in result.stdout

    connection = ["--proxy", address, "--insecure", "--key-dir", str(analyst_key)]
    query_id = fake.submitted_ids[-1]

    def fetch(*options: str) -> tuple[Any, dict[str, Any]]:
        again = tmp_path / "again.json"
        fetched = runner.invoke(
            analyst_group, ["fetch", query_id, *connection, "--out", str(again), *options]
        )
        assert fetched.exit_code == 0, fetched.output
        return fetched, json.loads(again.read_text())

    _, same = fetch()
    assert same["explained_variance_noise_sd"] == spread
    assert same["components_noise_angle_degrees"] == angles
    assert same["explained_variance_noise_bound"] == bound
    _, fewer = fetch("--noise-sd-draws", "7")
    assert fewer["noise_sd_draws"] == 7 and fewer["explained_variance_noise_sd"] != spread
    skipped, none = fetch("--noise-sd-draws", "0")
    assert none["noise_sd_draws"] == 0 and none["explained_variance_noise_sd"] is None
    assert none["components_noise_angle_degrees"] is None and "noise sd" not in none["timings"]
    assert none["explained_variance_noise_bound"] is None
    assert "noise angle" not in skipped.stdout and "  noise sd:" not in skipped.stdout
    # One draw has no spread: refused when the command line is read.
    one = runner.invoke(
        analyst_group,
        [
            "fetch",
            query_id,
            *connection,
            "--out",
            str(tmp_path / "one.json"),
            "--noise-sd-draws",
            "1",
        ],
    )
    assert one.exit_code == 2 and "0 (skip) or at least 2" in one.output, one.output
    assert not (tmp_path / "one.json").exists()

    # An aggregate's release has no components (the check runs before decryption).
    from types import SimpleNamespace

    import click

    from fedpca.analyst.query_commands import _check_fetch_options

    aggregate = SimpleNamespace(
        kind=QueryKind.AGGREGATE,
        aggregates=(SimpleNamespace(kind=AggregateKind.STATS),),
        query_id="q-stats",
        n_features=3,
    )
    with pytest.raises(click.UsageError, match="--noise-sd-draws applies to pca and dca; query"):
        _check_fetch_options(aggregate, None, ["--noise-sd-draws"])


def test_cli_not_private_warning_and_config_file(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    config = tmp_path / "analyst.toml"
    config.write_text(f'proxy = "{address}"\ninsecure = true\nkey_dir = "keys"\n')
    out = tmp_path / "r.json"
    args = _query_args("", analyst_key, out, "--epsilon", "inf")
    # Drop --proxy/--insecure/--key-dir: they come from the config file.
    args = args[5:]
    result = CliRunner().invoke(analyst_group, ["pca", "--config", str(config), *args])

    assert result.exit_code == 0, result.output
    assert "NOT PRIVATE" in result.output
    document = json.loads(out.read_text())
    assert document["epsilon"] is None and document["not_private"] is True
    # No noise: the exact count, and the mean to within the rows' quantisation.
    assert document["n_samples"] == len(ROWS) and document["n_samples_noisy"] is False
    spec = fake.specs[fake.submitted_ids[-1]]
    rows = preprocess_for_query(ROWS, spec)
    step = quantisation_step(spec.frac_bits)
    np.testing.assert_allclose(document["mean"], rows.mean(axis=0), rtol=0, atol=step)
    # The key directory named in the config file signed the query.
    assert fake.signatures[-1][1] == signer_id(load_analyst_signing_key(analyst_key))


def test_cli_masked_mode_against_a_replace_one_deployment(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    fake.neighbouring = Neighbouring.REPLACE_ONE
    out = tmp_path / "r.json"
    args = _query_args(address, analyst_key, out, "--epsilon", "inf", "--mode", "masked")
    result = CliRunner().invoke(analyst_group, ["pca", *args])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["mode"] == "masked" and document["not_private"] is True
    assert document["mean"] is None and document["n_samples"] == len(ROWS)


def test_cli_dca(proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path) -> None:
    fake, address = proxy
    out = tmp_path / "dca.json"
    args = _query_args(address, analyst_key, out, "--epsilon", "inf", "--classes", "-1,1")
    args[args.index("--components") + 1] = "1"
    result = CliRunner().invoke(analyst_group, ["dca", *args])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["classes"] == [-1.0, 1.0]
    # Usage errors, submitting nothing (a walkthrough's `--classes 1,1` exited 1).
    submitted = len(fake.submitted_ids)
    base = args[: args.index("--classes")]
    for classes, said in (
        ("1,1", "name at least two different classes"),
        ("1", "name at least two different classes"),
        ("0,-0", "name at least two different classes"),
        ("1,nan", "class labels must be finite numbers"),
        ("a,b", "is not a comma-separated list of numbers"),
    ):
        refused = CliRunner().invoke(analyst_group, ["dca", *base, "--classes", classes])
        assert refused.exit_code == 2 and said in refused.output, (classes, refused.output)
    assert len(fake.submitted_ids) == submitted


def test_a_dca_release_is_solved_again_with_other_ridges_or_read_as_a_pca(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    """A DCA whose within-class scatter was singular said "pass a positive rho", which
    only Python could; one with a single class found had nothing to offer, though its
    release holds the scatter of the classes' records (an analyst's walkthrough)."""
    fake, address = proxy
    runner = CliRunner()
    connection = ["--proxy", address, "--insecure", "--key-dir", str(analyst_key)]

    def fetch(query_id: str, name: str, *options: str) -> Any:
        out = tmp_path / name
        return out, runner.invoke(
            analyst_group, ["fetch", query_id, *connection, "--out", str(out), *options]
        )

    args = _query_args(address, analyst_key, tmp_path / "d.json", "--epsilon", "inf")
    args[args.index("--components") + 1] = "1"
    ridged = runner.invoke(analyst_group, ["dca", *args, "--classes", "-1,1", "--rho", "0.5"])
    assert ridged.exit_code == 0, ridged.output
    dca_id = fake.submitted_ids[-1]
    default = json.loads((tmp_path / "d.json").read_text())
    assert (default["rho"], default["rho_prime"]) == (0.5, 0.05)
    assert default["kind"] == default["query_kind"] == "dca"

    out, again = fetch(dca_id, "again.json", "--rho", "2", "--rho-prime", "0.3")
    assert again.exit_code == 0, again.output
    document = json.loads(out.read_text())
    assert (document["rho"], document["rho_prime"]) == (2.0, 0.3)
    assert not np.allclose(document["eigenvalues"], default["eigenvalues"])

    # The PCA of a DCA release of every record equals the PCA query of the same rows.
    pca_out = tmp_path / "p.json"
    asked = runner.invoke(
        analyst_group, ["pca", *_query_args(address, analyst_key, pca_out, "--epsilon", "inf")]
    )
    assert asked.exit_code == 0, asked.output
    pca_id = fake.submitted_ids[-1]
    out, as_pca = fetch(dca_id, "as-pca.json", "--as-pca", "--n-components", "2")
    assert as_pca.exit_code == 0, as_pca.output
    assert "pca of:      the records of classes -1, 1 (the dca release)" in as_pca.stdout
    document, expected = json.loads(out.read_text()), json.loads(pca_out.read_text())
    assert document["kind"] == "pca" and document["query_kind"] == "dca"
    assert document["query_id"] == dca_id and document["n_samples"] == len(ROWS)
    np.testing.assert_allclose(document["components"], expected["components"], atol=1e-9)
    np.testing.assert_allclose(
        document["explained_variance"], expected["explained_variance"], rtol=1e-9
    )

    # Only one class found: the DCA fails charged, and says what the release still gives.
    one_class = runner.invoke(analyst_group, ["dca", *args, "--classes", "-1,5"])
    assert one_class.exit_code == 1, one_class.output
    lonely_id = fake.submitted_ids[-1]
    hint = f"`fedpca analyst fetch {lonely_id} --as-pca --out result.json` with your --config gives"
    assert hint in " ".join(one_class.output.split())
    # A plain fetch of it later says so too (a walkthrough's said nothing of --as-pca).
    _, plain = fetch(lonely_id, "plain.json")
    assert plain.exit_code == 1 and hint in " ".join(plain.output.split()), plain.output
    out, rescued = fetch(lonely_id, "rescued.json", "--as-pca")
    assert rescued.exit_code == 0, rescued.output
    rescued_document = json.loads(out.read_text())
    assert rescued_document["n_samples"] == int((LABELS == -1).sum())
    # Which records the PCA is of, in the file too (the classes the query named).
    assert rescued_document["classes"] == [-1.0, 5.0]
    assert "pca of:      the records of classes -1, 5 (the dca release)" in rescued.stdout

    # What a release cannot take is refused before anything is decrypted.
    for query_id, options, said in (
        (pca_id, ["--rho", "1"], "--rho applies to dca; query"),
        (pca_id, ["--as-pca"], "--as-pca applies to dca; query"),
        (dca_id, ["--as-pca", "--rho-prime", "1"], "--as-pca takes none"),
        (dca_id, ["--rho", "nan"], "must be a finite number"),
        (dca_id, ["--rho", "-1"], "x>0"),
        # S_W is projected onto the PSD cone: without a ridge it is singular (a
        # walkthrough's --rho 0 was charged, then failed).
        (dca_id, ["--rho", "0"], "x>0"),
    ):
        _, refused = fetch(query_id, "refused.json", *options)
        assert refused.exit_code == 2 and said in refused.output, (options, refused.output)
        assert "decrypted" not in refused.output


def test_cli_refusals_exit_nonzero_without_traceback(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    runner = CliRunner()
    args = ["pca", *_query_args(address, analyst_key, tmp_path / "r.json", "--epsilon", "1")]

    missing_delta = runner.invoke(analyst_group, args)
    assert missing_delta.exit_code == 2 and "--delta is required" in missing_delta.output

    fake.refuse_budget = True
    refused = runner.invoke(analyst_group, [*args, "--delta", "1e-6"])
    assert refused.exit_code == BUDGET_EXIT_CODE
    assert "refused: epsilon 1.0 would exceed the limit 3.0" in refused.output
    # "Exhausted" only when the proxy says so: this query asked for more than is left.
    assert "exhausted" not in refused.output and "Traceback" not in refused.output

    fake.refuse_budget = False
    # A per-peer bound is no budget refusal: its own exit code, nothing charged. The
    # proxy says so in trailing metadata; gRPC's own bound on calls says nothing.
    for trailing in (((REFUSAL_METADATA, Refusal.OVERLOAD.value),), ()):
        fake.overload = trailing
        busy = runner.invoke(analyst_group, [*args, "--delta", "1e-6"])
        assert busy.exit_code == BUSY_EXIT_CODE, busy.output
        assert "privacy budget" not in busy.output and "nothing was charged" in busy.output
        assert "4 queries open" in busy.output and "Traceback" not in busy.output

    fake.overload = None
    fake.fail_reason = "quorum of 1 not reached by the deadline"
    failed = runner.invoke(analyst_group, [*args, "--delta", "1e-6"])
    assert failed.exit_code == 1 and "quorum of 1 not reached" in failed.output
    assert not (tmp_path / "r.json").exists()

    no_tls = runner.invoke(analyst_group, ["budget", "--proxy", address])
    assert no_tls.exit_code == 1 and "no TLS material" in no_tls.output


def test_cli_budget_names_the_delta_of_every_epsilon(proxy: tuple[FakeProxy, str]) -> None:
    _, address = proxy
    result = CliRunner().invoke(
        analyst_group, ["budget", "--proxy", address, "--insecure", "--delta", "1e-5"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert "alice" in lines[0]
    assert "budget:             epsilon 3 at delta 1e-05" in lines
    assert "epsilon spent:      1.25 at delta 1e-05" in lines
    # Asked at another delta: spent is reported there.
    other = CliRunner().invoke(
        analyst_group, ["budget", "--proxy", address, "--insecure", "--delta", "1e-6"]
    )
    assert other.exit_code == 0, other.output
    lines = other.stdout.strip().splitlines()
    assert "epsilon spent:      1.25 at delta 1e-06" in lines


def test_cli_budget_prints_what_the_next_query_may_ask_for(
    proxy: tuple[FakeProxy, str],
) -> None:
    fake, address = proxy
    runner = CliRunner()
    result = runner.invoke(analyst_group, ["budget", "--proxy", address, "--insecure"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    # The value on the same line as its label, with the query delta it assumes; not the
    # "remaining = limit - spent" line (composition is not additive).
    assert lines[-3] == "next query:         epsilon up to 0.412345 at delta 1e-06"
    assert "not additive" in lines[-2] and "admits now" in lines[-2]
    # Found by an analyst's walkthrough: an epsilon every owner would decline was shown
    # without a word about the owners' own caps.
    assert lines[-1] == f"                    ({OWNERS_CAP_NOTE})"
    assert "remaining" not in result.output and "1.75" not in result.output
    # The delta the next query would state is passed on, and named in the answer.
    asked = runner.invoke(
        analyst_group, ["budget", "--proxy", address, "--insecure", "--query-delta", "1e-7"]
    )
    assert asked.exit_code == 0, asked.output
    assert "next query:         epsilon up to 0.412345 at delta 1e-07" in asked.output
    bad = runner.invoke(
        analyst_group, ["budget", "--proxy", address, "--insecure", "--query-delta", "2"]
    )
    # A usage error, as `fedpca owner budget` gives (test_budget_options.py).
    assert bad.exit_code == 2
    assert "Invalid value for '--query-delta': must be in (0, 1), got 2" in bad.output
    # Every limit says what it is; "not additive" only where something (not
    # everything) is admitted.
    for next_query, expected, not_additive in [
        (NextQuery(0.0, 1e-6, AdmissionLimit.EXHAUSTED), "none: the budget is exhausted", False),
        (NextQuery(math.inf, 1e-6, AdmissionLimit.UNLIMITED), "any epsilon (the budget is", False),
        (
            NextQuery(100.721, 1e-6, AdmissionLimit.NOISE_FLOOR),
            "epsilon up to 100.721 at delta 1e-06 (capped by the least noise the PLD",
            True,
        ),
        (None, "not reported by this proxy (an older version)", False),
    ]:
        fake.next_query = next_query
        result = runner.invoke(analyst_group, ["budget", "--proxy", address, "--insecure"])
        assert result.exit_code == 0, result.output
        assert f"next query:         {expected}" in result.output
        assert ("not additive" in result.output) is not_additive, result.output
        exhausted = next_query is not None and next_query.epsilon == 0
        assert (OWNERS_CAP_NOTE in result.output) is (next_query is not None and not exhausted)


def test_cli_budget_says_why_the_next_query_may_ask_for_more_than_the_budget(
    proxy: tuple[FakeProxy, str],
) -> None:
    fake, address = proxy
    runner = CliRunner()
    args = ["budget", "--proxy", address, "--insecure"]
    # The fake's budget: epsilon 3 at delta 1e-05.
    fake.next_query = NextQuery(3.37, 1e-6, AdmissionLimit.BUDGET)
    lines = runner.invoke(analyst_group, args).stdout.strip().splitlines()
    assert lines[-4] == "next query:         epsilon up to 3.37 at delta 1e-06"
    assert lines[-3] == (
        "                    (more than the budget's epsilon 3: it is at the query's delta "
        "1e-06, the budget at delta 1e-05; the same noise costs more epsilon at a smaller "
        "delta)"
    )
    assert "not additive" in lines[-2]
    # Above it at the budget's own delta: only the PLD accountant counts less than the
    # query's zcdp calibration states.
    fake.next_query = NextQuery(3.2, 1e-5, AdmissionLimit.BUDGET)
    output = runner.invoke(analyst_group, [*args, "--query-delta", "1e-5"]).stdout
    assert "(more than the budget's epsilon 3: it is the query's epsilon by the zcdp" in output
    # Not above it: no such line.
    fake.next_query = NextQuery(2.5, 1e-6, AdmissionLimit.BUDGET)
    output = runner.invoke(analyst_group, args).stdout
    assert "more than the budget's epsilon" not in output and "not additive" in output


def test_cli_summary_states_owners_of_registered_and_warns_when_fewer(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    out = tmp_path / "r.json"
    args = ["pca", *_query_args(address, analyst_key, out, "--epsilon", "inf")]
    every = CliRunner().invoke(analyst_group, args)
    assert every.exit_code == 0, every.output
    # Exact for want of noise, not because it is public (it printed "exact, public").
    assert "(exact: NOT PRIVATE)" in every.stdout and "exact, public" not in every.stdout
    # No --quorum: the query waited for every owner the proxy accepts.
    assert fake.specs[fake.submitted_ids[-1]].quorum == 1
    assert "owners:      1 of 1 registered (quorum 1)" in every.stdout
    assert "WARNING" not in every.output
    fake.registered = 3
    partial = CliRunner().invoke(analyst_group, [*args, "--quorum", "1"])
    assert partial.exit_code == 0, partial.output
    assert "owners:      1 of 3 registered (quorum 1)" in partial.stdout
    assert "WARNING: query" in partial.stderr
    assert "only 1 of 3 registered owners contributed" in partial.stderr
    document = json.loads(out.read_text())
    assert document["owners"]["summary"] == "1 of 3 registered"
    assert document["owners"]["all_registered"] is False


def test_cli_list_status_cancel_and_fetch(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    runner = CliRunner()
    connection = ["--proxy", address, "--insecure"]
    assert runner.invoke(analyst_group, ["list", *connection]).stdout.strip() == "no queries"
    first = runner.invoke(
        analyst_group,
        ["pca", *_query_args(address, analyst_key, tmp_path / "a.json", "--epsilon", "inf")],
    )
    assert first.exit_code == 0, first.output
    query_id = fake.submitted_ids[-1]

    listing = runner.invoke(analyst_group, ["list", *connection])
    assert listing.exit_code == 0, listing.output
    header, row = listing.stdout.strip().splitlines()
    assert header.split()[:4] == ["QUERY", "CREATED", "(UTC)", "KIND/MODE"]
    assert row.split()[:7] == [query_id, "2030-01-02", "03:04:05", "pca/stats", "done", "1/1", "of"]

    status = runner.invoke(analyst_group, ["status", query_id, *connection])
    assert status.exit_code == 0, status.output
    assert f"query:       {query_id}" in status.stdout
    # What the query states, as `list` shows it (review: `status` left it out).
    assert "kind:        pca/stats\n" in status.stdout
    assert "privacy:     NOT PRIVATE (epsilon = inf)\n" in status.stdout
    assert "created:     2030-01-02 03:04:05 UTC\n" in status.stdout
    assert "quorum 1 of 2 registered" in status.stdout
    assert "declined:    owner-2: policy_refusal: epsilon 9 > 1" in status.stdout
    assert "charge:      charged\n" in status.stdout

    # Two queries cancelled alike, one after an owner began its upload: the listing
    # says which was charged and which refunded (they printed alike), and what a query
    # still open reserves.
    def listed(query: str, state: QueryState, charge: Charge, contributed: int) -> QuerySummary:
        reason = "cancelled by the analyst" if state is QueryState.FAILED else None
        return QuerySummary(
            status=QueryStatus(query, state, contributed, 3, failure_reason=reason, charge=charge),
            kind=QueryKind.PCA,
            mode=ProtocolMode.STATS,
            epsilon=0.5,
            delta=1e-6,
            created_at=datetime(2030, 1, 1, tzinfo=UTC),
        )

    aggregate = dataclasses.replace(
        listed("q-agg", QueryState.DONE, Charge.CHARGED, 3),
        kind=QueryKind.AGGREGATE,
        aggregates=(AggregateKind.STATS, AggregateKind.HISTOGRAM),
    )
    fake.listed = [
        listed("q-paid", QueryState.FAILED, Charge.CHARGED, 2),
        listed("q-free", QueryState.FAILED, Charge.REFUNDED, 0),
        listed("q-open", QueryState.COLLECTING, Charge.RESERVED, 0),
        listed("q-old", QueryState.FAILED, Charge.UNKNOWN, 0),
        aggregate,
    ]
    listing = runner.invoke(analyst_group, ["list", *connection])
    rows = {line.split()[0]: line.split() for line in listing.stdout.strip().splitlines()}
    assert rows["QUERY"][-2:] == ["CHARGE", "REASON"]
    assert rows[query_id][-1] == "charged"
    assert rows["q-paid"][-5:] == ["charged", "cancelled", "by", "the", "analyst"]
    assert rows["q-free"][-5:] == ["refunded", "cancelled", "by", "the", "analyst"]
    assert rows["q-open"][-1] == "reserved" and rows["q-old"][-5] == "?"
    # An aggregate query has one mode: it read "aggregate:stats+histogram/stats".
    assert rows["q-paid"][3] == "pca/stats"
    assert rows["q-agg"][3] == "aggregate:stats+histogram"
    # Every owner's decline makes a reason of hundreds of characters: cut in the list
    # (found by a new user: 700-character lines), whole in `status`.
    long_reason = "declined by every owner: " + "owner-x: policy_refusal: epsilon 9 > 1; " * 20
    fake.listed = [
        QuerySummary(
            status=QueryStatus(
                "q-long",
                QueryState.FAILED,
                0,
                3,
                failure_reason=long_reason,
                charge=Charge.REFUNDED,
            ),
            kind=QueryKind.PCA,
            mode=ProtocolMode.STATS,
            epsilon=0.5,
            delta=1e-6,
            created_at=datetime(2030, 1, 1, tzinfo=UTC),
        )
    ]
    long_listing = runner.invoke(analyst_group, ["list", *connection]).stdout
    line = next(row for row in long_listing.splitlines() if row.startswith("q-long"))
    assert line.endswith("…") and long_reason[:60] in line and len(line) < 250
    fake.listed = []

    cancelled = runner.invoke(analyst_group, ["cancel", query_id, *connection])
    assert cancelled.exit_code == 0, cancelled.output
    assert fake.cancelled == [query_id]
    assert "cancelled by the analyst" in cancelled.stdout and "refunded" in cancelled.stdout
    unknown = runner.invoke(analyst_group, ["cancel", "q-nope", *connection])
    assert unknown.exit_code == 1 and "unknown query 'q-nope'" in unknown.output
    # Cancelling a query that had failed for another reason says so, not "cancelled".
    fake.failed_before[query_id] = "deadline passed with 1 of 2 owners"
    again = runner.invoke(analyst_group, ["cancel", query_id, *connection])
    assert again.exit_code == 0, again.output
    assert f"query {query_id} had already failed, nothing to cancel: deadline passed" in (
        again.stdout
    )
    assert "cancelled by the analyst" not in again.stdout and "charge: stands" in again.stdout
    del fake.failed_before[query_id]

    out = tmp_path / "again" / "result.json"
    out.parent.mkdir()
    fetched = runner.invoke(
        analyst_group,
        ["fetch", query_id, *connection, "--key-dir", str(analyst_key), "--out", str(out)],
    )
    assert fetched.exit_code == 0, fetched.output
    # Said once, as the summary says it (Python's copy repeated it: an operator's
    # walkthrough, stop 42), of the owners registered when the query was asked.
    assert fetched.output.count("registered owners contributed") == 1, fetched.output
    # Decryption shows its progress, as `pca` does (5-10 s of silence before).
    assert re.search(r"decrypted (\d+)/\1 ciphertexts", fetched.output), fetched.output
    again = json.loads(out.read_text())
    assert again["query_id"] == query_id
    assert again["components"] == json.loads((tmp_path / "a.json").read_text())["components"]
    assert set(again["timings"]) == {"fetch", "decrypt", "solve"}
    # Fewer components from the same release: post-processing, nothing submitted.
    fewer = tmp_path / "again" / "fewer.json"
    submitted = list(fake.submitted_ids)
    one = runner.invoke(
        analyst_group,
        [
            "fetch",
            query_id,
            *connection,
            "--key-dir",
            str(analyst_key),
            "--out",
            str(fewer),
            "--n-components",
            "1",
        ],
    )
    assert one.exit_code == 0, one.output
    np.testing.assert_allclose(
        json.loads(fewer.read_text())["components"], again["components"][:1], atol=1e-12
    )
    assert fake.submitted_ids == submitted
    # Options the release cannot take are refused as usage errors before decrypting
    # (after it, or ignored: a new analyst's walkthrough, stop 43).
    never = str(tmp_path / "never.json")
    for flags, said in (
        (["--n-components", "4"], "--n-components 4: query q-"),
        (["--alpha", "1"], "--alpha applies to linreg; query q-"),
        (["--no-clip"], "--no-clip applies to stats; query q-"),
    ):
        refused = runner.invoke(
            analyst_group,
            ["fetch", query_id, *connection, "--key-dir", str(analyst_key), *flags, "--out", never],
        )
        assert refused.exit_code == 2 and said in refused.output, refused.output
        assert "decrypted" not in refused.output and not Path(never).exists()
    # A result under another key is refused at its header, before any page is kept
    # (fetch once held every page a proxy declared, then failed at decryption).
    fake.foreign_key, _ = generate_keypair(512, allow_insecure_test_key=True)
    stray = tmp_path / "stray" / "result.json"
    stray.parent.mkdir()
    foreign = runner.invoke(
        analyst_group,
        ["fetch", query_id, *connection, "--key-dir", str(analyst_key), "--out", str(stray)],
    )
    # (its query, altered to the other key, is no longer the one this analyst signed)
    assert foreign.exit_code == 1 and "not by you" in foreign.output, foreign.output
    assert "Traceback" not in foreign.output and not stray.exists()
    fake.foreign_key = None
    # The owners registered as the query's status records them (2 here), not the
    # deployment's count today (1): the allow-list may have changed since.
    assert "owners:      1 of 2 registered" in fetched.stdout
    missing = runner.invoke(
        analyst_group,
        ["fetch", "q-nope", *connection, "--key-dir", str(analyst_key), "--out", str(stray)],
    )
    assert missing.exit_code == 1, missing.output
    assert "fetch the result of query 'q-nope': unknown query" in missing.output


def test_config_file_is_validated(tmp_path: Path) -> None:
    config = tmp_path / "analyst.toml"
    config.write_text('proxy = "x:1"\n[tls]\nca = "ca.pem"\ncert = "c.pem"\nkey = "k.pem"\n')
    loaded = load_config(config)
    assert loaded.proxy == "x:1" and loaded.tls is not None
    assert loaded.tls.ca_certificate == tmp_path / "ca.pem"
    config.write_text('proxi = "x:1"\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(config)
    # A [tls] table names what it lacks and what it does not know (it said only
    # "needs exactly ca, cert and key").
    config.write_text('[tls]\nca = "ca.pem"\n')
    with pytest.raises(
        ConfigError, match=r"needs ca, cert and key together: tls\.cert, tls\.key missing"
    ):
        load_config(config)
    config.write_text('[tls]\ncA = "ca.pem"\ncert = "c.pem"\nkey = "k.pem"\n')
    with pytest.raises(ConfigError, match=r"unknown keys in section \[tls\]: tls\.cA \("):
        load_config(config)


def test_one_tls_flag_overrides_its_file_of_the_config(tmp_path: Path) -> None:
    """The help says flags override --config: --cert alone used to be refused."""
    from fedpca.analyst.cli_connection import connection_config as _connection

    config = tmp_path / "analyst.toml"
    config.write_text('proxy = "x:1"\n[tls]\nca = "ca.pem"\ncert = "c.pem"\nkey = "k.pem"\n')
    other = tmp_path / "renewed.pem"
    merged = _connection(config, None, None, other, None, False, None)
    assert merged.tls is not None
    assert merged.tls.certificate == other
    assert merged.tls.ca_certificate == tmp_path / "ca.pem"
    assert merged.tls.private_key == tmp_path / "k.pem"
    # Without a config's [tls] the three still go together.
    with pytest.raises(ConfigError, match="given together"):
        _connection(None, "x:1", None, other, None, False, None)


def test_cli_shows_each_decline_and_fails_with_the_proxys_reason(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    fake, address = proxy
    fake.registered = 3
    fake.declines = (
        OwnerDecline("owner-2", "policy_refusal", "epsilon 1 > max_epsilon_per_query 0.5"),
        OwnerDecline("owner-3", "key_not_pinned", "sha256:ab... is not pinned"),
    )
    fake.fail_reason = "the quorum of 3 can no longer be reached: 2 of 3 owners declined"
    out = tmp_path / "r.json"
    args = ["pca", *_query_args(address, analyst_key, out, "--epsilon", "1", "--delta", "1e-6")]
    result = CliRunner().invoke(analyst_group, args)
    assert result.exit_code == 1
    # One line per decline while waiting, each once, then the proxy's reason as the error.
    lines = result.stderr.splitlines()
    shown = [line for line in lines if line.startswith("owner declined: ")]
    assert shown == [
        "owner declined: owner-2: policy_refusal: epsilon 1 > max_epsilon_per_query 0.5",
        "owner declined: owner-3: key_not_pinned: sha256:ab... is not pinned",
    ]
    assert lines[-1].startswith("Error: query ") and fake.fail_reason in lines[-1]
    # ... and whether the query's epsilon stays charged.
    assert lines[-1].endswith("; its epsilon is refunded (no owner had begun an upload)")
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize(
    ("reasons", "exit_code"),
    [
        (("budget_exhausted", "budget_exhausted"), BUDGET_EXIT_CODE),
        (("budget_exhausted", "policy_refusal"), 1),
    ],
)
def test_a_query_every_owner_declined_for_its_budget_exits_as_a_budget_refusal(
    proxy: tuple[FakeProxy, str],
    analyst_key: Path,
    tmp_path: Path,
    reasons: tuple[str, str],
    exit_code: int,
) -> None:
    """An analyst's walkthrough: owners' budget declines exited 1, where the help says
    3 is a refusal by the privacy budget (a script checking for 3 missed it)."""
    fake, address = proxy
    fake.registered = 2
    fake.declines = tuple(
        OwnerDecline(f"owner-{i}", reason, "the query does not fit")
        for i, reason in enumerate(reasons, start=1)
    )
    fake.fail_reason = "the quorum of 2 can no longer be reached: 2 of 2 owners declined"
    out = tmp_path / "r.json"
    args = ["pca", *_query_args(address, analyst_key, out, "--epsilon", "1", "--delta", "1e-6")]
    result = CliRunner().invoke(analyst_group, args)
    assert result.exit_code == exit_code, result.output
    assert fake.fail_reason in result.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("state", "charge", "line"),
    [
        (QueryState.COLLECTING, Charge.RESERVED, "reserved (refunded if the query fails"),
        (QueryState.COLLECTING, Charge.CHARGED, "charged (an owner has begun an upload"),
        (QueryState.FAILED, Charge.CHARGED, "charged (an owner had begun an upload"),
        (QueryState.FAILED, Charge.REFUNDED, "refunded (no owner had begun an upload)"),
        (QueryState.DONE, Charge.CHARGED, "charged"),
        (QueryState.FAILED, Charge.UNKNOWN, "not reported by this proxy"),
    ],
)
def test_status_says_where_the_charge_stands(
    proxy: tuple[FakeProxy, str], state: QueryState, charge: Charge, line: str
) -> None:
    fake, address = proxy
    fake.specs["q-1"] = _spec(fake.public_key, "q-1")
    fake.status_charge = (state, charge)
    result = CliRunner().invoke(analyst_group, ["status", "q-1", "--proxy", address, "--insecure"])
    assert result.exit_code == 0, result.output
    assert f"state:       {state.value}\n" in result.stdout
    (shown,) = [text for text in result.stdout.splitlines() if text.startswith("charge:")]
    assert shown.removeprefix("charge:").strip().startswith(line), shown


def test_status_says_when_the_proxy_deleted_the_result(proxy: tuple[FakeProxy, str]) -> None:
    """Review: a result the proxy had deleted (keep_results_days) showed as a plain DONE
    query, and only ``fetch`` found out."""
    fake, address = proxy
    fake.specs["q-1"] = _spec(fake.public_key, "q-1")
    arguments = ["status", "q-1", "--proxy", address, "--insecure"]
    kept = CliRunner().invoke(analyst_group, arguments)
    assert kept.exit_code == 0, kept.output
    assert "result:" not in kept.stdout
    fake.result_deleted_at = datetime(2026, 11, 2, 3, 4, 5, tzinfo=UTC)
    deleted = CliRunner().invoke(analyst_group, arguments)
    assert deleted.exit_code == 0, deleted.output
    assert (
        "result:      deleted by the proxy on 2026-11-02T03:04:05+00:00, older than it keeps "
        "results: it can no longer be fetched\n" in deleted.stdout
    )


def test_a_submission_that_times_out_is_sent_again_and_then_explained(
    proxy: tuple[FakeProxy, str], test_only_keypair_512: Any
) -> None:
    """A submission the proxy committed after the client's timeout failed at once as
    "proxy unavailable", and the analyst's next fit() charged a second query (review).
    The same request is now sent again, and a final failure says the query may exist."""
    fake, address = proxy
    spec = _spec(test_only_keypair_512[0])
    fake.slow_submits = 1
    with AnalystClient(address, None, insecure=True, timeout=0.2, retry_delays=(0.01,)) as client:
        assert client.submit(spec, TEST_SIGNING_KEY).state is QueryState.COLLECTING
    assert fake.submitted_ids == [spec.query_id, spec.query_id]
    assert fake.signatures[0] == fake.signatures[1]  # the very same request
    fake.slow_submits = 2
    with (
        AnalystClient(address, None, insecure=True, timeout=0.2, retry_delays=(0.01,)) as client,
        pytest.raises(ProxyUnavailableError, match="DEADLINE_EXCEEDED") as failed,
    ):
        client.submit(_spec(test_only_keypair_512[0], query_id="q-2"), TEST_SIGNING_KEY)
    assert "`fedpca analyst status q-2` says whether it did" in str(failed.value)
    assert "`fedpca analyst cancel q-2`" in str(failed.value)


def test_fetch_checks_the_header_before_reading_any_page(
    pool: CryptoPool, test_only_keypair_512: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A malicious proxy declared a result of 10^9 ciphertexts under another key:
    ``fetch`` held 3.5 GB of its pages before anything refused it (review)."""
    from fedpca.analyst.client import AnalystClient, ResultStream
    from fedpca.errors import UntrustedKeyError
    from fedpca.messages import blocks_of

    public_key, _ = test_only_keypair_512
    other, _ = generate_keypair(512, allow_insecure_test_key=True)
    spec = _spec(other)
    plan = ReleasePlan.for_query(spec, 512)
    block = plan.owner_block(SHARES)
    values = plan.owner_integers(fixed_point_statistics(ROWS, None, spec))[SHARES]
    packed = pool.encrypt_packed(other, values, block.layout, block.bound)
    messages = serde.encode_result(result_from_packed(spec, 1, {SHARES: packed}))
    header = serde.result_header_from_message(messages[0])
    read: list[int] = []

    def pages() -> Iterator[Any]:
        read.append(1)
        raise AssertionError("a page was read")
        yield  # pragma: no cover

    client = AnalystClient("127.0.0.1:1", None, insecure=True)
    monkeypatch.setattr(client, "fetch_stream", lambda *a, **k: ResultStream(header, pages()))
    mine = signer_id(TEST_SIGNING_KEY)
    # Signed by the analyst, but under another Paillier key.
    signed_header = dataclasses.replace(
        header, query_signature=sign_query(spec, TEST_SIGNING_KEY), query_signer=mine
    )
    monkeypatch.setattr(
        client, "fetch_stream", lambda *a, **k: ResultStream(signed_header, pages())
    )
    with pytest.raises(UntrustedKeyError, match="not your key"):
        client.fetch(spec.query_id, public_key=public_key, signer=mine)
    with pytest.raises(ProtocolError, match="sent the result of"):
        client.fetch("another-query", public_key=public_key, signer=mine)
    # Under the analyst's own key but for a query it never signed (any size the proxy
    # likes, 20,000 features in the review): refused by the signature, before any page.
    big = _spec(public_key, n_features=2000)
    big_header = dataclasses.replace(
        header,
        query=big,
        blocks=blocks_of(ReleasePlan.for_query(big, 512).result_blocks),
        query_signature=sign_query(big, generate_signing_key()),
        query_signer=mine,
    )
    monkeypatch.setattr(client, "fetch_stream", lambda *a, **k: ResultStream(big_header, pages()))
    with pytest.raises(UntrustedKeyError, match="does not verify"):
        client.fetch(big.query_id, public_key=public_key, signer=mine)
    forged = dataclasses.replace(big_header, query_signer="ed25519:" + "ab" * 32)
    monkeypatch.setattr(client, "fetch_stream", lambda *a, **k: ResultStream(forged, pages()))
    with pytest.raises(UntrustedKeyError, match="not by you"):
        client.fetch(big.query_id, public_key=public_key, signer=mine)
    assert read == []
    client.close()


# ------------------------------------------------------------------ --out checks
def _command_args(command: str, address: str, key_dir: Path, out: Path) -> list[str]:
    """Arguments of every analyst command that writes a result, ``--out`` last."""
    connection = ["--proxy", address, "--insecure", "--key-dir", str(key_dir)]
    privacy = ["--epsilon", "1", "--delta", "1e-6"]
    query = {
        "pca": _query_args(address, key_dir, out, *privacy),
        "dca": _query_args(address, key_dir, out, *privacy, "--classes", "-1,1"),
        "stats": [*connection, *privacy, "--columns", "1", "--bounds", "0:1"],
        "histogram": [*connection, *privacy, "--columns", "1", "--bins", "0,1"],
        "linreg": [
            *(*connection, *privacy, "--columns", "1", "--bounds", "0:1"),
            *("--target", "2", "--target-bounds", "0:1"),
        ],
        "fetch": ["q-1", *connection],
    }[command]
    if "--out" in query:
        index = query.index("--out")
        del query[index : index + 2]
    return [command, *query, "--out", str(out)]


@pytest.mark.parametrize("command", ["pca", "dca", "stats", "histogram", "linreg", "fetch"])
def test_an_unwritable_out_is_refused_before_anything_is_sent(
    command: str,
    proxy: tuple[FakeProxy, str],
    analyst_key: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new operator's review: a mistyped --out folder was found only once the query
    had been charged, and a missing folder was created silently."""
    import os
    import tempfile

    fake, address = proxy
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    create = tempfile.mkstemp

    def mkstemp(*args: Any, dir: Any = None, **kwargs: Any) -> Any:
        if os.geteuid() == 0 and Path(dir) == locked:
            # Root writes through a mode of 0500: refuse as a read-only mount would.
            raise PermissionError(13, "Permission denied", str(dir))
        return create(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    cases = {
        tmp_path / "missing" / "r.json": "the folder",
        tmp_path / "a-file" / "r.json": "is not a folder",
        tmp_path / "a-folder": "is a directory",
        locked / "r.json": "cannot create files in",
    }
    for out, reason in cases.items():
        args = _command_args(command, address, analyst_key, out)
        result = CliRunner().invoke(analyst_group, args)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--out'" in result.output and reason in result.output
        assert "Traceback" not in result.output
    assert fake.submitted_ids == [] and fake.cancelled == []
    assert not (tmp_path / "missing").exists()
    assert not list(locked.iterdir()) and not list((tmp_path / "a-folder").iterdir())


def test_a_result_that_cannot_be_written_after_all_names_fetch(
    proxy: tuple[FakeProxy, str],
    analyst_key: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked before the query, the folder may still go away while it runs: the
    error then says the result is kept at the proxy and how to write it again."""
    import fedpca.analyst.report as report_module

    fake, address = proxy
    out = tmp_path / "r.json"

    def write_report(path: Path, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(report_module, "write_report", write_report)
    args = _command_args("pca", address, analyst_key, out)
    result = CliRunner().invoke(analyst_group, args)
    assert result.exit_code == 1, result.output
    query_id = fake.submitted_ids[-1]
    assert f"{out}: Permission denied" in result.output
    assert f"`fedpca analyst fetch {query_id} --out PATH`" in result.output


@pytest.mark.parametrize("command", ["pca", "dca", "stats", "histogram", "linreg"])
@pytest.mark.parametrize("delta", ["0", "1", "-1", "nan"])
def test_a_bad_delta_is_a_usage_error_as_a_bad_epsilon_is(
    command: str, delta: str, tmp_path: Path
) -> None:
    """Found by review: a bad --delta exited 1 ("Error: delta must be in (0, 1)") while
    a bad --epsilon is a usage error (exit 2), refused by the option itself."""
    (tmp_path / "keys").mkdir()
    args = _command_args(command, "127.0.0.1:1", tmp_path / "keys", tmp_path / "r.json")
    args[args.index("--delta") + 1] = delta
    result = CliRunner().invoke(analyst_group, args)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--delta'" in result.output


@pytest.mark.parametrize("honours_filter", [True, False], ids=["proxy", "older-proxy"])
def test_status_names_the_querys_kind_and_privacy_parameters(
    proxy: tuple[FakeProxy, str], honours_filter: bool
) -> None:
    """`status ID` says what the query asked for, also from a proxy that ignores the
    listing's query filter (it lists every query, and the client keeps the one)."""
    fake, address = proxy
    fake.honours_query_filter = honours_filter
    # q-1 first: the fake lists newest first, so "other" comes before it unfiltered.
    fake.specs["q-1"] = dataclasses.replace(_spec(fake.public_key, "q-1"), epsilon=0.25, delta=1e-7)
    fake.specs["other"] = _spec(fake.public_key, "other")
    result = CliRunner().invoke(analyst_group, ["status", "q-1", "--proxy", address, "--insecure"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "query:       q-1",
        "kind:        pca/stats",
        "privacy:     epsilon 0.25, delta 1e-07",
        "created:     2030-01-02 03:04:05 UTC",
    ]


def test_deployment_says_how_many_owners_are_connected(proxy: tuple[FakeProxy, str]) -> None:
    """Found by a new user's walkthrough: no command said how many owners were
    connected (a query of the default quorum waits for every registered one)."""
    fake, address = proxy
    fake.registered, fake.connected = 3, 1
    result = CliRunner().invoke(analyst_group, ["deployment", "--proxy", address, "--insecure"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("proxy:            proxy (fedpca test, protocol 1)")
    # A proxy older than the field's names says how many only.
    assert lines[1] == "owners:           1 of 3 registered connected now (2 not connected)"
    assert "neighbouring:     " in lines[2] and lines[3] == "accountant:       zcdp"
    assert lines[4] == "delta per query:  at most 1e-05"
    assert lines[5].startswith("budget:           epsilon 3 at delta 1e-05 (analyst alice;")

    # Which ones, as the proxy names them (the walkthrough of stop 45 had to ask the
    # proxy's operator), the first ten of many, a peer's text with its escapes shown.
    fake.absent = ("hospital-b", "hospital-\x1b[2Jc")
    named = CliRunner().invoke(analyst_group, ["deployment", "--proxy", address, "--insecure"])
    assert named.stdout.splitlines()[1] == (
        "owners:           1 of 3 registered connected now (not connected: hospital-b, "
        "hospital-\\x1b[2Jc)"
    )
    fake.registered, fake.connected = 20, 5
    fake.absent = tuple(f"owner-{i:02d}" for i in range(15))
    many = CliRunner().invoke(analyst_group, ["deployment", "--proxy", address, "--insecure"])
    assert many.stdout.splitlines()[1] == (
        "owners:           5 of 20 registered connected now (not connected: "
        + ", ".join(f"owner-{i:02d}" for i in range(10))
        + " and 5 more)"
    )


def test_deployment_shows_each_owners_terms_owners_of_equal_terms_together(
    proxy: tuple[FakeProxy, str],
) -> None:
    fake, address = proxy
    fake.registered, fake.connected = 4, 4
    common = example_owner_terms(
        schema=TableSchema(35, 0),
        allowed_kinds=(QueryKind.PCA, AggregateKind.STATS),
        allowed_columns=(1, 2, 3, 4, 9),
        max_delta_per_query=1e-6,
        max_epsilon_per_query=2.0,
        min_quorum=2,
        max_tasks_per_day=50,
    )
    other = dataclasses.replace(
        common, allowed_columns=None, allow_masked_mode=True, max_records=5000
    )
    fake.terms = (("hospital-a", common), ("hospital-b", other), ("hospital-c", common))
    result = CliRunner().invoke(analyst_group, ["deployment", "--proxy", address, "--insecure"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    start = lines.index(
        "owners' terms:    as each connected owner states them (the owner decides; a query "
        "they do not meet is declined)"
    )
    assert lines[start + 1 :] == [
        "  hospital-a, hospital-c:",
        "    answers:          pca, stats",
        "    file columns:     35 (0 to 34, labels in column 0); a query may read only 1-4, 9",
        "    epsilon:          at most 2 per query, measured at delta 1e-05 (zcdp)",
        "    delta:            at most 1e-06 per query",
        "    quorum:           at least 2",
        "    masked mode:      declined",
        "    epsilon = inf:    declined",
        "    tasks per day:    at most 50",
        "    neighbouring:     add-remove",
        "  hospital-b:",
        "    answers:          pca, stats",
        "    file columns:     35 (0 to 34, labels in column 0); a query may read any of them",
        "    epsilon:          at most 2 per query, measured at delta 1e-05 (zcdp)",
        "    delta:            at most 1e-06 per query",
        "    quorum:           at least 2",
        "    masked mode:      accepted",
        "    epsilon = inf:    declined",
        "    tasks per day:    at most 50",
        "    neighbouring:     add-remove",
        "    capacity:         5000 records (enforced)",
        "  1 connected owners state no terms this version can read (a fedpca older than "
        "terms, or newer)",
    ]
    fake.terms, fake.connected = (), 0
    none = CliRunner().invoke(analyst_group, ["deployment", "--proxy", address, "--insecure"])
    assert none.stdout.splitlines()[-1] == "owners' terms:    none stated (no owner connected)"


def test_ctrl_c_while_waiting_for_owners_exits_130_saying_nothing_was_submitted(
    proxy: tuple[FakeProxy, str],
    analyst_key: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator's walkthrough: Ctrl-C exited 1 with click's bare "Aborted!", and
    during the wait for owners nothing said whether a query had been sent."""
    from fedpca.analyst import owner_wait

    fake, address = proxy
    fake.registered, fake.connected = 3, 1

    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(owner_wait, "_pause", interrupt)
    args = _command_args("pca", address, analyst_key, tmp_path / "r.json")
    with caplog.at_level(logging.WARNING, logger="fedpca"):
        result = CliRunner().invoke(analyst_group, args)
    assert result.exit_code == 130, result.output
    assert "interrupted (Ctrl-C)" in result.output and "Aborted!" not in result.output
    assert "interrupted while waiting for owners: nothing was submitted" in caplog.text
    assert fake.submitted_ids == [] and fake.cancelled == []


@pytest.mark.parametrize(
    ("command", "why"),
    [
        (["stats", "--columns", "1,,6", "--bounds", "0:1"], "'1,,6' is not a comma-separated"),
        (["stats", "--columns", "1,6,", "--bounds", "0:1"], "is not a comma-separated"),
        (["histogram", "--columns", "1", "--bins", "5,1"], "at least two strictly increasing"),
        (["histogram", "--columns", "1", "--bins", "0,,1"], "is not a comma-separated list"),
        (["histogram", "--columns", "1", "--bins", "3"], "at least two strictly increasing"),
        # Two columns' edges in one --bins: the hint, and not the whole argument echoed.
        (
            ["histogram", "--columns", "1,2", "--bins", ",".join(["1"] * 400) + ";2,3"],
            "1,1'... is not a comma-separated list of numbers: '1;2' (give --bins once per column)",
        ),
    ],
)
def test_a_typo_in_a_list_is_a_usage_error_before_anything_is_sent(
    command: list[str], why: str, tmp_path: Path
) -> None:
    """An analyst's walkthrough: '--columns 1,,6' was read as columns 1 and 6, and bins
    out of order were refused by the query's check as 'bin_edges[0]', exit 1."""
    unreachable = ["--proxy", "127.0.0.1:9", "--insecure", "--key-dir", str(tmp_path)]
    unreachable += ["--out", str(tmp_path / "result.json")]
    result = CliRunner().invoke(
        analyst_group, [*command, *unreachable, "--epsilon", "1", "--delta", "1e-6"]
    )
    assert result.exit_code == 2, result.output
    assert why in result.output and "bin_edges" not in result.output


def test_cli_pca_of_named_columns_states_them_and_reads_the_sample_alike(
    proxy: tuple[FakeProxy, str], analyst_key: Path, tmp_path: Path
) -> None:
    """``--columns`` names the owners' file columns that are the features: M is their
    number (``--features`` may be left out or must agree), the signed query carries
    them, the summary and result.json say them, and a --sample in the owners' file
    layout is read at the same columns."""
    fake, address = proxy
    out = tmp_path / "result.json"
    args = _query_args(address, analyst_key, out, "--epsilon", "1", "--delta", "1e-6")
    index = args.index("--features")
    del args[index : index + 2]
    sample = tmp_path / "sample.csv"
    # The owners' layout: the label in column 0, then 6 columns of which 5, 2, 4 are read.
    wide = np.column_stack([LABELS, ROWS[:, :1], ROWS[:, 1:2], ROWS[:, :1], ROWS[:, 2:], ROWS])
    np.savetxt(sample, wide[:, :7], delimiter=",")
    result = CliRunner().invoke(
        analyst_group, ["pca", *args, "--columns", "5,2,4", "--sample", str(sample)]
    )
    assert result.exit_code == 0, result.output
    assert fake.specs[fake.submitted_ids[-1]].feature_columns == (5, 2, 4)
    assert "columns:     5, 2, 4 (the owners' file columns, 0-based)" in result.stdout
    document = json.loads(out.read_text())
    assert document["feature_columns"] == [5, 2, 4] and document["n_features"] == 3
    assert (tmp_path / "result.projection.png").stat().st_size > 0
    # Without either, or with both disagreeing: refused before anything is submitted.
    submitted = len(fake.submitted_ids)
    neither = CliRunner().invoke(analyst_group, ["pca", *args])
    assert neither.exit_code == 2 and "give --features M (or --columns" in neither.output
    both = CliRunner().invoke(analyst_group, ["pca", *args, "--columns", "5,2", "--features", "3"])
    assert both.exit_code != 0 and "n_features=3 but columns names 2: [5, 2]" in both.output
    beyond = CliRunner().invoke(
        analyst_group, ["pca", *args, "--columns", "5,2,9", "--sample", str(sample)]
    )
    assert beyond.exit_code != 0 and "has 7 columns; column 9 is read" in beyond.output
    assert len(fake.submitted_ids) == submitted
    # Without --columns, result.json says every column but the label.
    plain = tmp_path / "plain.json"
    every = _query_args(address, analyst_key, plain, "--epsilon", "1", "--delta", "1e-6")
    assert CliRunner().invoke(analyst_group, ["pca", *every]).exit_code == 0
    assert json.loads(plain.read_text())["feature_columns"] is None
