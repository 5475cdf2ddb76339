"""Hostile peers against a real proxy process (issue 15, points 1, 2 and 6).

The proxy is the real ``fedpca proxy serve`` in its own OS process
(:class:`fedpca.app.cluster.LocalCluster`: certificates from a fresh CA, the config
file it reads, mutual TLS on loopback); owners, where a point needs them, are real
``fedpca owner serve`` processes. The test process plays the attacker: a gRPC client
holding the certificate the attack needs, sending what a hostile peer would (raw
stubs, no client-side validation). The Paillier key is a TEST-ONLY 512-bit key.

Each test's docstring names the behaviour of fedpca before the hardening (the red-team
run of issue 15) that it fails on. The owner-side points (3, 4, 5 and the timing of
6) are in ``test_hardening_owner_processes.py``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedpca.app.cluster import LocalCluster, write_toml
from fedpca.codec import CryptoPool
from fedpca.messages import (
    UPLOAD_ACCEPTED_METADATA,
    DeclineReason,
    OwnerHello,
    QueryState,
    TaskDecline,
)
from fedpca.proxy.coordinator import task_id
from fedpca.proxy.limits import PeerLimits
from fedpca.transport import serde
from fedpca.transport.certs import read_certificate
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from helpers import (
    SECOND_TEST_SIGNER,
    SECOND_TEST_SIGNING_KEY,
    cluster_analyst,
    cluster_keys,
    cluster_stub,
    encrypted_upload,
    query_builder,
    rpc_refusal,
    submit_request,
    timed,
    wait_until,
)
from inprocess import labelled

pytestmark = pytest.mark.slow

M = 3
ROWS = 20
PROMPT = 1.0
"""Seconds within which a peer that is not the attacker must be answered."""
_spec = query_builder(
    n_features=M,
    n_components=1,
    epsilon=1.0,
    delta=1e-6,
    deadline_seconds=120.0,
    feature_lower=(-1.0,) * M,
    feature_upper=(1.0,) * M,
)


def _cluster(tmp_path: Path, n_owners: int, **kwargs: Any) -> LocalCluster:
    rng = np.random.default_rng(0)
    tables = [labelled(rng.uniform(-0.5, 0.5, (ROWS, M))) for _ in range(n_owners)]
    cluster = LocalCluster(
        workdir=tmp_path / "work",
        owner_tables=tables,
        key_bits=512,  # TEST-ONLY
        processes_per_node=1,
        **kwargs,
    )
    cluster.prepare()
    return cluster


def _upload_messages(cluster: LocalCluster, spec: Any, key: str, upload_id: str) -> list[Any]:
    """A valid encrypted upload (header and chunks) of ``spec`` for the task ``key``."""
    public_key, _ = cluster_keys(cluster)
    rows = np.random.default_rng(1).uniform(-0.5, 0.5, (5, M))
    with CryptoPool(1) as pool:
        payload, _ = encrypted_upload(spec, rows, public_key, pool)
    return serde.encode_upload(key, spec.analyst_key_fingerprint, upload_id, payload)


# ---------------------------------------------------------------- 1. starvation
STREAMS = 61
UPLOADS = 62


def test_one_owner_certificate_cannot_starve_the_proxy_process(tmp_path: Path) -> None:
    """Before: the proxy served on a synchronous gRPC server with 64 threads; 61 open
    ``StreamTasks`` or 62 uploads that sent a header and stalled, all with one owner
    certificate, held every thread, and the analyst's ``GetBudget`` and another owner's
    ``Hello`` hit DEADLINE_EXCEEDED until the attacker let go."""
    idle = 3.0
    cluster = _cluster(
        tmp_path,
        2,
        proxy_settings={"limits": {"max_uploads_per_owner": 2, "upload_idle_seconds": idle}},
    )
    attacker_id, other_id = cluster.owner_ids
    public_key, signing_key = cluster_keys(cluster)
    spec = _spec(public_key, "target", quorum=2)
    key = task_id(cluster.analyst_ids[0], "target")
    header = _upload_messages(cluster, spec, key, "stall-0")[0]
    release = threading.Event()
    with cluster:
        cluster.start_proxy()
        with cluster_analyst(cluster) as analyst:
            analyst.submit(spec, signing_key)
        channel, attacker = cluster_stub(cluster, "owner", attacker_id)
        with channel:
            # Each stream admitted supersedes the previous one; beyond the openings
            # allowed per minute (20 by default), the others are refused at once.
            streams, refused = [], []
            for _ in range(STREAMS):
                stream = attacker.StreamTasks(
                    serde.task_stream_request_to_proto(attacker_id), timeout=60
                )
                try:
                    next(stream)  # the first heartbeat: the stream is open at the proxy
                    streams.append(stream)
                except grpc.RpcError as err:
                    refused.append(err.code())
            assert len(streams) == PeerLimits().max_task_stream_opens_per_minute
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (STREAMS - len(streams))

            def stalled(index: int) -> Iterator[Any]:
                first = owner_pb.UploadMessage()
                first.CopyFrom(header)
                first.header.upload_id = f"stall-{index}"
                yield first
                release.wait(60.0)

            started = time.monotonic()
            uploads = [attacker.Upload.future(stalled(i)) for i in range(UPLOADS)]
            refused_at: dict[int, float] = {}
            while time.monotonic() - started < 5.0 and len(refused_at) < UPLOADS - 2:
                for index, upload in enumerate(uploads):
                    if index not in refused_at and upload.done():
                        refused_at[index] = time.monotonic() - started
                time.sleep(0.01)
            exhausted = [
                i for i in refused_at if uploads[i].code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            ]
            # Beyond the per-owner bound of 2, every upload is refused at once (the clock
            # started before the 62 calls were made).
            assert len(exhausted) == UPLOADS - 2, sorted(refused_at)
            assert max(refused_at[i] for i in exhausted) < PROMPT

            # Meanwhile the other peers are served within a second.
            other_channel, other = cluster_stub(cluster, "owner", other_id)
            with other_channel, cluster_analyst(cluster) as analyst:
                hello = serde.owner_hello_to_proto(OwnerHello(other_id, "t"))
                reply, seconds = timed(lambda: other.Hello(hello, timeout=10))
                assert isinstance(reply, owner_pb.ProxyInfo) and seconds < PROMPT, seconds
                budget, seconds = timed(analyst.budget)
                assert budget.n_releases == 1 and seconds < PROMPT, seconds
                status, seconds = timed(lambda: analyst.status("target"))
                assert status.owners_uploading <= 2 and seconds < PROMPT, seconds

            # One task stream per owner: the proxy ended the 19 older ones (long before
            # their own 60 s deadline, saying a newer one replaced them), the newest one
            # is still open.
            for stream in streams[:-1]:
                with contextlib.suppress(grpc.RpcError):
                    for _ in stream:
                        pass
                assert stream.code() is grpc.StatusCode.ABORTED
                assert "replaced this one" in (stream.details() or "")
            assert streams[-1].is_active()
            streams[-1].cancel()

            # The two stalled uploads end after the idle time, with DEADLINE_EXCEEDED.
            for index in set(range(UPLOADS)) - set(exhausted):
                assert uploads[index].exception(timeout=idle + 10) is not None
                assert uploads[index].code() is grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
        assert cluster.proxy is not None
        log = cluster.proxy.log_text()
        assert log.count(f"task stream of owner {attacker_id} replaced by a newer one") == (
            len(streams) - 1
        )


# ------------------------------------------------------------- 2. allow-list
def _stall() -> Iterator[Any]:
    """A request stream that sends nothing for 30 s."""
    time.sleep(30.0)
    yield from ()


def _owner_calls(stub: Any, owner_id: str, key: str, upload: list[Any]) -> dict[str, Any]:
    """Every OwnerService call, as the holder of ``owner_id``'s certificate makes it."""
    hello = serde.owner_hello_to_proto(OwnerHello(owner_id, "t"))
    stream = serde.task_stream_request_to_proto(owner_id)
    decline = serde.task_decline_to_proto(TaskDecline(key, DeclineReason.POLICY_REFUSAL, "x"))
    return {
        "Hello": lambda: stub.Hello(hello, timeout=10),
        "StreamTasks": lambda: next(stub.StreamTasks(stream, timeout=10)),
        "Upload": lambda: stub.Upload(iter(upload), timeout=10),
        "DeclineTask": lambda: stub.DeclineTask(decline, timeout=10),
    }


def test_unlisted_and_revoked_owner_certificates_are_refused_by_the_proxy_process(
    tmp_path: Path,
) -> None:
    """Before: any certificate the CA signed was an owner; an owner id in no
    configuration enrolled, took a quorum slot and poisoned the count (180 -> 50,183),
    and there was no way to revoke a certificate."""
    # owner-3 holds a certificate from the CA but is not on the allow-list; owner-4 is
    # on it, but its certificate's serial is listed as revoked.
    cluster = _cluster(
        tmp_path,
        4,
        allowed_owners=["owner-1", "owner-2", "owner-4"],
        revoked_owners=["owner-4"],
    )
    honest, hostile = ["owner-1", "owner-2"], ["owner-3", "owner-4"]
    public_key, signing_key = cluster_keys(cluster)
    spec = _spec(public_key, "allowed-only", quorum=2)
    key = task_id(cluster.analyst_ids[0], spec.query_id)
    upload = _upload_messages(cluster, spec, key, "intruder-upload")
    with cluster:
        cluster.start_proxy()
        cluster.start_owners(owner_ids=honest)
        # Real owner nodes with the refused certificates: they never get connected.
        refused_nodes = cluster.start_owners(owner_ids=hostile, wait=False)
        for node in refused_nodes:
            wait_until(
                lambda node=node: (
                    "PERMISSION_DENIED" in node.log_text() or "connected to" in node.log_text()
                ),
                f"{node.name} to be refused",
            )
            assert "connected to" not in node.log_text()
        with cluster_analyst(cluster) as analyst:
            analyst.submit(spec, signing_key)
            status = analyst.wait(spec.query_id, timeout=60.0)
            assert status.state is QueryState.DONE
            assert status.owners_contributed == 2
            deployment = analyst.describe()
            assert (deployment.owners_registered, deployment.owners_connected) == (3, 2)
        for owner_id in hostile:
            channel, stub = cluster_stub(cluster, "owner", owner_id)
            with channel:
                calls = _owner_calls(stub, owner_id, key, upload)
                # An upload that sends nothing is refused too, at once: it holds no slot.
                calls["Upload (stalled)"] = lambda stub=stub: stub.Upload(_stall(), timeout=10)
                for name, call in calls.items():
                    error, seconds = timed(call)
                    assert isinstance(error, grpc.RpcError), (owner_id, name, error)
                    assert error.code() is grpc.StatusCode.PERMISSION_DENIED, (owner_id, name)
                    assert seconds < PROMPT, (owner_id, name, seconds)
        with cluster_analyst(cluster) as analyst:
            # Nothing of theirs reached the query: the two allowed owners' count stands.
            status = analyst.status(spec.query_id)
            assert (status.owners_contributed, status.owners_declined) == (2, 0)
        for node in refused_nodes:
            assert "connected to" not in node.log_text()


def test_sighup_reloads_the_allow_list_and_revocations_of_the_serving_proxy(
    tmp_path: Path,
) -> None:
    """Before: revoking a certificate or taking an owner off the allow-list took a
    restart of the proxy (every upload in flight broken), and an owner's open task
    stream was never checked again. Now ``kill -HUP`` (``systemctl reload``) takes the
    file's allow-lists and revocations; a file that changes anything else is refused
    whole, and the proxy serves on as before."""
    cluster = _cluster(tmp_path, 3)
    with cluster:
        proxy = cluster.start_proxy()
        nodes = dict(zip(cluster.owner_ids, cluster.start_owners(), strict=True))
        document = tomllib.loads(cluster.proxy_config.read_text())
        serial = read_certificate(cluster.node_tls("owner", "owner-3").certificate).serial_number
        document["owners"]["allowed"] = ["owner-1", "owner-3"]
        document["tls"]["revoked_serials"] = [format(serial, "x")]
        write_toml(cluster.proxy_config, document)
        proxy.process.send_signal(signal.SIGHUP)
        proxy.wait_for("reloaded", 30.0)
        assert (
            f"owners.allowed removed: owner-2; tls.revoked_serials added: {serial:x}"
            in proxy.log_text()
        )
        # The two nodes' open task streams end, refused; owner-1's stays.
        for owner_id in ("owner-2", "owner-3"):
            node = nodes[owner_id]
            wait_until(lambda node=node: "PERMISSION_DENIED" in node.log_text(), owner_id)
        with cluster_analyst(cluster) as analyst:
            wait_until(lambda: analyst.describe().owners_connected == 1, "one owner left")
            assert analyst.describe().owners_registered == 2
        # A file that also changes a setting read only at start: nothing is applied.
        document["owners"]["allowed"] = ["owner-1"]
        document["limits"] = {"max_calls_per_peer": 3}
        write_toml(cluster.proxy_config, document)
        proxy.process.send_signal(signal.SIGHUP)
        proxy.wait_for("reload refused", 30.0)
        assert "limits.max_calls_per_peer changed" in proxy.log_text()
        # A file that cannot be read (an invalid id, a line of TOML cut short) is refused
        # too, and the proxy serves on: a review's malformed id stopped it.
        document["owners"]["allowed"] = ["owner-1", "bad id!"]
        del document["limits"]
        write_toml(cluster.proxy_config, document)
        proxy.process.send_signal(signal.SIGHUP)
        wait_until(lambda: proxy.log_text().count("reload refused") == 2, "a second refusal")
        assert "owners.allowed[1]" in proxy.log_text()
        cluster.proxy_config.write_text(cluster.proxy_config.read_text() + "\n[owners\n")
        proxy.process.send_signal(signal.SIGHUP)
        wait_until(lambda: proxy.log_text().count("reload refused") == 3, "a third refusal")
        with cluster_analyst(cluster) as analyst:
            info = analyst.describe()
            assert (info.owners_registered, info.owners_connected) == (2, 1)
        assert proxy.process.poll() is None
        assert "connected to" in nodes["owner-1"].log_text()


# ------------------------------------------------------------ 6. query ids
BIG_ID = "A" * (1 << 20)
FORGED_LINE = "2030-01-01 00:00:00,000 INFO fedpca.proxy.coordinator: forged"
NEWLINE_ID = "q1\n" + FORGED_LINE


def test_query_ids_are_validated_at_every_entry_point(tmp_path: Path) -> None:
    """Before: ``query_id`` was not validated; 1 MiB ids were accepted and newlines
    forged log lines. The rule of upload ids applies: an id outside ``[A-Za-z0-9._-]``
    or longer than 128 characters is refused with INVALID_ARGUMENT and a bounded
    message, at once, wherever a peer can send one, and the proxy's log stays small."""
    cluster = _cluster(tmp_path, 1)
    owner_id = cluster.owner_ids[0]
    public_key, signing_key = cluster_keys(cluster)
    spec = _spec(public_key, "valid", quorum=1)
    key = task_id(cluster.analyst_ids[0], spec.query_id)
    header = _upload_messages(cluster, spec, key, "u-1")[0]
    with cluster:
        proxy = cluster.start_proxy()
        with cluster_analyst(cluster) as analyst:
            analyst.submit(spec, signing_key)
        log_before = len(proxy.log_text())
        analyst_channel, analyst_stub = cluster_stub(cluster, "analyst", cluster.analyst_ids[0])
        owner_channel, owner_stub = cluster_stub(cluster, "owner", owner_id)
        with analyst_channel, owner_channel:

            def calls(bad: str) -> dict[str, Any]:
                submit = submit_request(spec, signing_key)
                submit.query.query_id = bad
                ref = analyst_pb.QueryRef(query_id=bad)
                decline = serde.task_decline_to_proto(
                    TaskDecline(bad, DeclineReason.POLICY_REFUSAL, "x")
                )
                bad_header = owner_pb.UploadMessage()
                bad_header.CopyFrom(header)
                bad_header.header.query_id = bad
                return {
                    "SubmitQuery": lambda: analyst_stub.SubmitQuery(submit, timeout=10),
                    "GetQueryStatus": lambda: analyst_stub.GetQueryStatus(ref, timeout=10),
                    "WatchQueryStatus": lambda: next(
                        analyst_stub.WatchQueryStatus(ref, timeout=10)
                    ),
                    "FetchResult": lambda: next(analyst_stub.FetchResult(ref, timeout=10)),
                    "CancelQuery": lambda: analyst_stub.CancelQuery(ref, timeout=10),
                    "DeclineTask": lambda: owner_stub.DeclineTask(decline, timeout=10),
                    "Upload": lambda: owner_stub.Upload(iter([bad_header]), timeout=10),
                }

            long_upload_id = owner_pb.UploadMessage()
            long_upload_id.CopyFrom(header)
            long_upload_id.header.upload_id = BIG_ID
            attempts = {
                f"{name}({label})": call
                for label, bad in (("1 MiB", BIG_ID), ("newline", NEWLINE_ID))
                for name, call in calls(bad).items()
            }
            attempts["Upload(1 MiB upload_id)"] = lambda: owner_stub.Upload(
                iter([long_upload_id]), timeout=10
            )
            answers = {name: timed(call) for name, call in attempts.items()}
        wrong = {
            name: f"{error.code().name if isinstance(error, grpc.RpcError) else error} "
            f"after {seconds:.2f} s"
            for name, (error, seconds) in answers.items()
            if not isinstance(error, grpc.RpcError)
            or error.code() is not grpc.StatusCode.INVALID_ARGUMENT
            or seconds >= PROMPT
        }
        assert not wrong, wrong
        for name, (error, _) in answers.items():
            assert len(error.details()) < 1000, (name, len(error.details()))
        grown = len(proxy.log_text()) - log_before
        assert grown < 300 * len(answers), grown  # a line or two per refusal, not 1 MiB
        lines = proxy.log_text().splitlines()
        assert not [line for line in lines if line.startswith(FORGED_LINE)]
        # The valid query is untouched.
        with cluster_analyst(cluster) as analyst:
            assert analyst.status(spec.query_id).state is QueryState.COLLECTING


def test_query_ids_are_scoped_by_analyst(tmp_path: Path) -> None:
    """Before: query ids were global across analysts, an existence oracle: a second
    analyst learnt whether an id was in use (its status or its submission of the same
    id answered differently) and could not use an id another analyst had taken."""
    cluster = _cluster(
        tmp_path, 1, analyst_ids=("alice", "bob"), extra_query_signers=(SECOND_TEST_SIGNER,)
    )
    public_key, signing_key = cluster_keys(cluster)
    with cluster:
        cluster.start_proxy()  # no owner process: the queries stay collecting
        with cluster_analyst(cluster, "alice") as alice:
            alice.submit(_spec(public_key, "shared", quorum=1), signing_key)
        channel, bob_stub = cluster_stub(cluster, "analyst", "bob")
        with channel:

            def answers(query_id: str) -> list[tuple[grpc.StatusCode, str]]:
                ref = analyst_pb.QueryRef(query_id=query_id)
                seen = []
                for call in (
                    lambda: bob_stub.GetQueryStatus(ref, timeout=10),
                    lambda: next(bob_stub.WatchQueryStatus(ref, timeout=10)),
                    lambda: next(bob_stub.FetchResult(ref, timeout=10)),
                    lambda: bob_stub.CancelQuery(ref, timeout=10),
                ):
                    error = rpc_refusal(call)
                    seen.append((error.code(), error.details().replace(query_id, "<id>")))
                return seen

            # Alice's id and an id nobody used look exactly the same to Bob.
            taken, unused = answers("shared"), answers("never-used")
            assert taken == unused
            assert {code for code, _ in taken} == {grpc.StatusCode.NOT_FOUND}
        with cluster_analyst(cluster, "bob") as bob:
            assert bob.list_queries() == []
            # Bob may use the same id for a query of his own.
            status = bob.submit(
                _spec(public_key, "shared", quorum=1, epsilon=0.5), SECOND_TEST_SIGNING_KEY
            )
            assert status.state is QueryState.COLLECTING
            (mine,) = bob.list_queries()
            assert (mine.status.query_id, mine.epsilon) == ("shared", 0.5)
        with cluster_analyst(cluster, "alice") as alice:
            (hers,) = alice.list_queries()
            assert (hers.status.query_id, hers.epsilon) == ("shared", 1.0)
            assert alice.cancel("shared").status.state is QueryState.FAILED
        with cluster_analyst(cluster, "bob") as bob:
            assert bob.status("shared").state is QueryState.COLLECTING


# ------------------------------------------------------------- 6. declines
def test_declines_only_while_collecting_before_an_upload_with_a_bounded_detail(
    tmp_path: Path,
) -> None:
    """Before: ``DeclineTask`` was accepted after the owner had uploaded and on finished
    queries, with a 100 KB detail stored and shown to the analyst."""
    cluster = _cluster(tmp_path, 2)
    uploader, decliner = cluster.owner_ids
    analyst_id = cluster.analyst_ids[0]
    public_key, signing_key = cluster_keys(cluster)
    collecting = _spec(public_key, "collecting", quorum=2)
    finished = _spec(public_key, "finished", quorum=1)
    uploads = {
        spec.query_id: _upload_messages(cluster, spec, task_id(analyst_id, spec.query_id), "u-1")
        for spec in (collecting, finished)
    }
    huge_detail = "the owner's policy\nsays no " * 4_000  # about 100 KB, with line breaks

    def decline(stub: Any, query_id: str, detail: str = "late") -> Any:
        message = serde.task_decline_to_proto(
            TaskDecline(task_id(analyst_id, query_id), DeclineReason.POLICY_REFUSAL, detail)
        )
        return timed(lambda: stub.DeclineTask(message, timeout=10))

    with cluster:
        proxy = cluster.start_proxy()  # both owners are driven by hand
        up_channel, up_stub = cluster_stub(cluster, "owner", uploader)
        down_channel, down_stub = cluster_stub(cluster, "owner", decliner)
        with cluster_analyst(cluster) as analyst, up_channel, down_channel:
            analyst.submit(collecting, signing_key)
            # The proxy acknowledges the header (initial metadata) before any chunk:
            # owners send chunks only after it (protocol version 3).
            call = up_stub.Upload.future(iter(uploads["collecting"]), timeout=30)
            assert dict(call.initial_metadata()).get(UPLOAD_ACCEPTED_METADATA) == "yes"
            receipt = call.result()
            assert receipt.upload_id == "u-1"
            # An owner that uploaded cannot decline afterwards.
            refused, seconds = decline(up_stub, "collecting")
            assert isinstance(refused, grpc.RpcError), refused
            assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION and seconds < PROMPT
            # While collecting, an owner that has not uploaded may decline; its detail
            # is cut to one line of at most 300 characters, and the proxy's log does
            # not take it either.
            log_before = len(proxy.log_text())
            accepted, _ = decline(down_stub, "collecting", huge_detail)
            assert not isinstance(accepted, grpc.RpcError), accepted
            assert len(proxy.log_text()) - log_before < 2_000
            status = analyst.status("collecting")
            ((owner, reason, detail),) = [(d.owner_id, d.reason, d.detail) for d in status.declines]
            assert (owner, reason) == (decliner, "policy_refusal")
            assert "\n" not in detail and 0 < len(detail) <= 300
            # One of two owners declined: quorum 2 is out of reach, the query failed.
            assert status.state is QueryState.FAILED
            # ... and nothing more is accepted on a failed query.
            refused, seconds = decline(down_stub, "collecting", "again")
            assert isinstance(refused, grpc.RpcError), refused
            assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION and seconds < PROMPT
            # A header the proxy refuses (the decliner on the failed query) is never
            # acknowledged.
            late = down_stub.Upload.future(iter(uploads["collecting"]), timeout=30)
            assert UPLOAD_ACCEPTED_METADATA not in dict(late.initial_metadata() or ())
            with pytest.raises(grpc.RpcError) as refusal:
                late.result()
            assert refusal.value.code() is grpc.StatusCode.FAILED_PRECONDITION

            analyst.submit(finished, signing_key)
            up_stub.Upload(iter(uploads["finished"]), timeout=30)
            assert analyst.wait("finished", timeout=60.0).state is QueryState.DONE
            refused, seconds = decline(down_stub, "finished")
            assert isinstance(refused, grpc.RpcError), refused
            assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION and seconds < PROMPT
            assert analyst.status("finished").declines == ()


# -------------------------------------------------------- 6. budget checks
def test_a_long_budget_check_does_not_hold_up_another_analyst(tmp_path: Path) -> None:
    """Before: a submission composed the analyst's ledger inside the store's global
    transaction, which every other call waits for: another analyst's status call was
    blocked 12.9 s. Now the ledger is composed outside, re-checked and inserted.

    Under the ``pld-continuous`` accountant one check of a large composed epsilon
    takes a second or two (a PLD on a fine grid). Alice submits three such queries
    while Bob asks for his query's status every 20 ms; each of Bob's answers must come
    well within the time of Alice's longest check (and within a second)."""
    cluster = _cluster(
        tmp_path,
        1,
        analyst_ids=("alice", "bob"),
        epsilon_budget=10_000.0,
        proxy_settings={"privacy": {"accountant": "pld-continuous"}},
    )
    public_key, signing_key = cluster_keys(cluster)
    latencies: list[float] = []
    stop = threading.Event()
    with cluster:
        cluster.start_proxy()  # no owner process: every query stays collecting
        with cluster_analyst(cluster, "bob") as bob, cluster_analyst(cluster, "alice") as alice:
            bob.submit(_spec(public_key, "bobs", quorum=1), SECOND_TEST_SIGNING_KEY)

            def poll() -> None:
                while not stop.is_set():
                    _, seconds = timed(lambda: bob.status("bobs"))
                    latencies.append(seconds)
                    time.sleep(0.02)

            poller = threading.Thread(target=poll, name="bob")
            poller.start()
            try:
                checks = []
                # Composed, the three stay just above the PLD accountant's floor z = 0.1.
                for index, epsilon in enumerate((20.0, 30.0, 40.0)):
                    spec = _spec(public_key, f"large-{index}", quorum=1, epsilon=epsilon)
                    status, seconds = timed(lambda spec=spec: alice.submit(spec, signing_key))
                    assert status.state is QueryState.COLLECTING, status
                    checks.append(seconds)
            finally:
                stop.set()
                poller.join()
            assert alice.budget().n_releases == 3
    longest = max(checks)
    assert longest > 0.5, checks  # the checks did take long enough to be seen
    assert len(latencies) > 20 and max(latencies) < min(PROMPT, longest / 2), (
        f"Bob waited up to {max(latencies):.2f} s; Alice's checks took {checks}"
    )


def test_a_proxy_stopped_with_uploads_in_flight_stops_cleanly(tmp_path: Path) -> None:
    """An operator's walkthrough (stop 42): SIGTERM (`systemctl stop`) with uploads in
    flight logged "Task was destroyed but it is pending!" and tracebacks after "proxy
    stopped": the event loop was closed with the upload handlers still pending."""
    cluster = _cluster(tmp_path, 2)
    owner_id = cluster.owner_ids[0]
    public_key, signing_key = cluster_keys(cluster)
    spec = _spec(public_key, "cut", quorum=2)
    key = task_id(cluster.analyst_ids[0], "cut")
    messages = _upload_messages(cluster, spec, key, "cut-0")
    release = threading.Event()
    with cluster:
        cluster.start_proxy()
        with cluster_analyst(cluster) as analyst:
            analyst.submit(spec, signing_key)
        channel, owner = cluster_stub(cluster, "owner", owner_id)
        with channel:

            def header_only() -> Iterator[Any]:
                yield messages[0]
                release.wait(60.0)

            upload = owner.Upload.future(header_only())
            with cluster_analyst(cluster) as analyst:
                wait_until(lambda: analyst.status("cut").owners_uploading == 1, "the upload")
            assert cluster.proxy is not None
            cluster.proxy.stop()
            release.set()
            assert upload.exception(timeout=30) is not None
        log = cluster.proxy.log_path.read_text(errors="replace")  # stopped: the log closed
    assert "proxy stopped" in log
    assert "Traceback" not in log and "was destroyed but it is pending" not in log, log
