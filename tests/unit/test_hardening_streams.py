"""One owner certificate must not be able to starve the proxy.

On fedpca 0.1, 61 open ``StreamTasks`` or 62 uploads that sent a header and stalled held
all 64 threads of the synchronous gRPC server: the analyst's ``GetBudget`` and other
owners' ``Hello`` hit DEADLINE_EXCEEDED. The proxy now serves on the asynchronous server
with per-peer bounds (:mod:`fedpca.proxy.limits`); this test opens the attack's streams
and checks that the other peers are still answered within a second, that the extra
uploads are refused at once with RESOURCE_EXHAUSTED, that stalled uploads end after the
idle time, and that an owner keeps exactly one task stream.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedpca.codec import CryptoPool
from fedpca.errors import OverloadError
from fedpca.messages import OwnerHello, Task, TaskCancellation
from fedpca.protocol import ReleasePlan
from fedpca.proxy.limits import PeerLimits, TaskStreams
from fedpca.table_schema import TableSchema
from fedpca.transport import serde
from fedpca.transport.certs import Role, TlsMaterial
from fedpca.transport.channels import secure_channel
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import (
    TEST_SIGNING_KEY,
    encrypted_upload,
    example_owner_terms,
    query_builder,
    wait_until,
)
from inprocess import deployment, labelled

M = 3
STREAMS = 61
UPLOADS = 62
_spec = query_builder(
    n_features=M, n_components=1, epsilon=1.0, delta=1e-6, quorum=2, deadline_seconds=120.0
)


def _stub(running: Any, owner_id: str) -> tuple[grpc.Channel, Any]:
    channel = secure_channel(
        running.proxy.address, TlsMaterial.load(running.tls(Role.OWNER, owner_id))
    )
    return channel, owner_grpc.OwnerServiceStub(channel)


def _driven_by_hand(
    tmp_path: Path, pool: CryptoPool, public_key: Any, limits: PeerLimits, rng: Any
) -> Any:
    """A deployment whose two owners, "attacker" and "owner-2", run no node: the tests
    drive their calls by hand."""
    tables = {o: labelled(rng.uniform(-0.5, 0.5, (10, M))) for o in ("attacker", "owner-2")}
    return deployment(
        workdir=tmp_path,
        tables=tables,
        pool=pool,
        public_key=public_key,
        running=(),
        limits=limits,
    )


def test_one_owner_certificate_cannot_starve_the_proxy(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(0)
    limits = PeerLimits(max_uploads_per_owner=2, upload_idle_seconds=3.0)
    with _driven_by_hand(tmp_path, pool, public_key, limits, rng) as running:
        spec = _spec(public_key, "target")
        with running.analyst() as analyst:
            analyst.submit(spec, TEST_SIGNING_KEY)
        plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
        payload, _ = encrypted_upload(spec, rng.uniform(-0.5, 0.5, (5, M)), public_key, pool)
        release = threading.Event()
        channel, attacker = _stub(running, "attacker")
        with channel:
            # 61 task streams: each one admitted supersedes the previous one; beyond
            # the openings allowed per minute, the others are refused at once.
            streams, refused = [], []
            for _ in range(STREAMS):
                stream = attacker.StreamTasks(serde.task_stream_request_to_proto("attacker"))
                try:
                    next(stream)  # the first heartbeat: the stream is open
                    streams.append(stream)
                except grpc.RpcError as err:
                    refused.append(err.code())
            assert len(streams) == limits.max_task_stream_opens_per_minute
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (STREAMS - len(streams))

            # 62 uploads that send a valid header and then stall.
            def stalled(index: int) -> Iterator[Any]:
                messages = serde.encode_upload(
                    "alice/target", spec.analyst_key_fingerprint, f"stall-{index}", payload
                )
                yield messages[0]
                release.wait(30.0)

            started = time.monotonic()
            uploads = [attacker.Upload.future(stalled(i)) for i in range(UPLOADS)]
            time.sleep(0.5)
            exhausted = [
                u for u in uploads if u.done() and u.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            ]
            # Beyond the per-owner bound, uploads are refused at once.
            assert len(exhausted) >= UPLOADS - limits.max_uploads_per_owner
            assert time.monotonic() - started < 5.0

            # Other peers are served within a second meanwhile.
            other_channel, owner_2 = _stub(running, "owner-2")
            with other_channel, running.analyst() as analyst:
                t = time.monotonic()
                owner_2.Hello(serde.owner_hello_to_proto(OwnerHello("owner-2", "t")), timeout=5)
                assert time.monotonic() - t < 1.0
                t = time.monotonic()
                analyst.budget()
                assert time.monotonic() - t < 1.0
                t = time.monotonic()
                assert analyst.status("target").owners_uploading <= limits.max_uploads_per_owner
                assert time.monotonic() - t < 1.0

            # Only the newest task stream is alive: the 60 older ones ended.
            ended = 0
            for stream in streams[:-1]:
                try:
                    for _ in stream:
                        pass
                except grpc.RpcError:
                    pass
                ended += 1
            assert ended == len(streams) - 1
            streams[-1].cancel()

            # The stalled uploads end after the idle time, with DEADLINE_EXCEEDED.
            stalled_ones = [u for u in uploads if u not in exhausted]
            for upload in stalled_ones:
                assert upload.exception(timeout=limits.upload_idle_seconds + 10) is not None
                assert upload.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
        assert plan.owner_blocks  # the header really was the plan's


def test_an_upload_that_trickles_is_ended_after_the_total_time(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """No gap reaches ``upload_idle_seconds``, yet the upload ends at ``upload_total_seconds``.

    An owner sending one message just inside the idle time would otherwise hold its
    upload slot for as long as it likes; the refused upload leaves nothing behind.
    """
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(1)
    limits = PeerLimits(upload_idle_seconds=2.0, upload_total_seconds=2.5)
    with _driven_by_hand(tmp_path, pool, public_key, limits, rng) as running:
        spec = _spec(public_key, "trickle")
        with running.analyst() as analyst:
            analyst.submit(spec, TEST_SIGNING_KEY)
        payload, _ = encrypted_upload(spec, rng.uniform(-0.5, 0.5, (5, M)), public_key, pool)
        messages = serde.encode_upload(
            "alice/trickle", spec.analyst_key_fingerprint, "trickle-1", payload
        )

        gap = 1.5  # under the 2 s idle time; the stream ends after len(messages) gaps

        def trickled() -> Iterator[Any]:
            for message in messages:
                yield message
                time.sleep(gap)

        channel, attacker = _stub(running, "attacker")
        with channel:
            started = time.monotonic()
            upload = attacker.Upload.future(trickled())
            assert upload.exception(timeout=30) is not None
            took = time.monotonic() - started
            assert upload.code() is grpc.StatusCode.DEADLINE_EXCEEDED, upload.details()
            assert "upload_total_seconds = 2.5" in upload.details()
            assert limits.upload_total_seconds - 0.1 <= took < gap * len(messages)
        with running.analyst() as analyst:
            status = analyst.status("trickle")
        assert status.owners_contributed == 0 and status.owners_uploading == 0


def test_calls_whose_request_never_arrives_are_bounded_per_peer(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """gRPC starts a single-request handler only once the whole request arrived, so no
    per-peer bound saw calls whose request never finishes: one certificate held 2.3 GiB
    of a proxy with 1,000 such calls, and every other peer was refused once it held
    gRPC's 20,000 call places (review). The proxy now reads the request itself: beyond
    ``max_calls_per_peer`` such calls of a peer are refused at once, each waits at most
    ``request_read_seconds``, and other peers are served meanwhile."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(2)
    limits = PeerLimits(max_calls_per_peer=4, request_read_seconds=2.0)
    with _driven_by_hand(tmp_path, pool, public_key, limits, rng) as running:
        release = threading.Event()

        def never() -> Iterator[bytes]:
            release.wait(30.0)
            return
            yield b""  # a generator that sends nothing before it is released

        channel, _ = _stub(running, "attacker")
        with channel:
            hello = channel.stream_unary("/fedpca.v1.OwnerService/Hello")
            started = time.monotonic()
            calls = [hello.future(never()) for _ in range(limits.max_calls_per_peer + 3)]
            time.sleep(0.5)
            refused = [c for c in calls if c.done()]
            assert len(refused) == 3
            for call in refused:
                assert call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "requests being read" in call.details()
            # Another owner is served meanwhile.
            other_channel, owner_2 = _stub(running, "owner-2")
            with other_channel:
                t = time.monotonic()
                owner_2.Hello(serde.owner_hello_to_proto(OwnerHello("owner-2", "t")), timeout=5)
                assert time.monotonic() - t < 1.0
            # The waiting ones end after the read time, without their request.
            waiting = [c for c in calls if c not in refused]
            for call in waiting:
                assert call.exception(timeout=10) is not None
                assert call.code() is grpc.StatusCode.DEADLINE_EXCEEDED, call.details()
                assert "request_read_seconds" in call.details()
            took = time.monotonic() - started
            assert limits.request_read_seconds - 0.1 <= took < limits.request_read_seconds + 5
            # Their slots are free again: a complete call of the same peer is answered.
            again, attacker = _stub(running, "attacker")
            with again:
                attacker.Hello(serde.owner_hello_to_proto(OwnerHello("attacker", "t")), timeout=5)
            release.set()


def test_health_watches_are_bounded_per_peer(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """The health service's Watch streams last as long as a peer likes and had no
    per-peer bound (review): each now holds one of its peer's call slots."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(3)
    limits = PeerLimits(max_calls_per_peer=3)
    with _driven_by_hand(tmp_path, pool, public_key, limits, rng) as running:
        channel, _ = _stub(running, "attacker")
        with channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [
                health.Watch(health_pb2.HealthCheckRequest(service=""))
                for _ in range(limits.max_calls_per_peer)
            ]
            for watch in watches:
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                next(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5))
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "health calls" in refused.value.details()
            # Another peer's check is answered meanwhile.
            other_channel, _ = _stub(running, "owner-2")
            with other_channel:
                answer = health_pb2_grpc.HealthStub(other_channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5
                )
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            for watch in watches:
                watch.cancel()


def test_task_stream_openings_are_bounded_per_owner_and_minute() -> None:
    now = [0.0]
    streams = TaskStreams(opens_per_minute=3, clock=lambda: now[0])
    for _ in range(3):
        streams.admit("attacker")
        now[0] += 1.0
    with pytest.raises(OverloadError, match="3 times in the last 60 s"):
        streams.admit("attacker")
    streams.admit("owner-2")  # another owner's openings are counted apart
    now[0] = 60.0  # the first opening (at 0 s) has left the window, the others not
    streams.admit("attacker")
    with pytest.raises(OverloadError):
        streams.admit("attacker")
    now[0] = 62.0  # so have the openings at 1 s and 2 s
    streams.admit("attacker")
    streams.admit("attacker")


def test_hellos_and_upload_starts_are_bounded_per_owner_and_minute(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Review, stop 42: one owner calling Hello in a loop (each a database write, 707 a
    second) or beginning uploads and breaking them off (each written, folded in and taken
    out again, 355 a second) kept a proxy core busy and filled its log."""
    public_key, _ = test_only_keypair_512
    limits = PeerLimits(max_task_stream_opens_per_minute=3, max_upload_starts_per_minute=2)
    rng = np.random.default_rng(1)
    with _driven_by_hand(tmp_path, pool, public_key, limits, rng) as running:
        channel, attacker = _stub(running, "attacker")
        other_channel, owner_2 = _stub(running, "owner-2")
        with channel, other_channel:
            hello = serde.owner_hello_to_proto(OwnerHello("attacker", "t"))
            for _ in range(3):
                attacker.Hello(hello, timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                attacker.Hello(hello, timeout=5)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "attacker said hello 3 times in the last 60 s" in refused.value.details()
            owner_2.Hello(serde.owner_hello_to_proto(OwnerHello("owner-2", "t")), timeout=5)
            for _ in range(2):  # refused for their content (no header), but counted
                with pytest.raises(grpc.RpcError) as empty:
                    attacker.Upload(iter(()), timeout=5)
                assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:
                attacker.Upload(iter(()), timeout=5)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "attacker began an upload 2 times" in refused.value.details()
            with pytest.raises(grpc.RpcError) as empty:
                owner_2.Upload(iter(()), timeout=5)
            assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_an_owner_leaving_is_logged(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator's walkthrough (stop 42): an owner that stopped or was killed cancels
    its task stream, which skipped the proxy's "closed" line: the log showed owners
    connecting, never leaving."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(2)
    with (
        caplog.at_level(logging.INFO, logger="fedpca.proxy"),
        _driven_by_hand(tmp_path, pool, public_key, PeerLimits(), rng) as running,
    ):
        channel, owner_2 = _stub(running, "owner-2")
        with channel:
            stream = owner_2.StreamTasks(serde.task_stream_request_to_proto("owner-2"))
            next(stream)
            assert "task stream opened by owner owner-2" in caplog.text
            stream.cancel()
            wait_until(
                lambda: "task stream of owner owner-2 closed" in caplog.text,
                "the proxy's line for the stream's end",
            )


def test_an_owner_uploading_is_told_at_once_when_the_query_fails(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """An operator's walkthrough (stop 42): a contributor kept its task whatever befell
    the query, so an owner uploading to a query that was cancelled or ran past its
    deadline encrypted on until its next chunk was refused (18 to 60 s there)."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(3)
    with _driven_by_hand(tmp_path, pool, public_key, PeerLimits(), rng) as running:
        spec = _spec(public_key, "doomed")
        payload, _ = encrypted_upload(spec, rng.uniform(-0.5, 0.5, (5, M)), public_key, pool)
        release = threading.Event()

        def header_then_stall() -> Iterator[Any]:
            yield serde.encode_upload(
                "alice/doomed", spec.analyst_key_fingerprint, "u-doomed", payload
            )[0]
            release.wait(30.0)

        channel, owner_2 = _stub(running, "owner-2")
        with channel, running.analyst() as analyst:
            analyst.submit(spec, TEST_SIGNING_KEY)
            stream = owner_2.StreamTasks(
                serde.task_stream_request_to_proto("owner-2"), timeout=20.0
            )
            events = (serde.task_event_from_proto(message) for message in stream)
            assert any(isinstance(event, Task) for event in events)  # the task, delivered
            upload = owner_2.Upload.future(header_then_stall())
            wait_until(lambda: analyst.status("doomed").owners_uploading == 1, "the upload")
            analyst.cancel("doomed")
            started = time.monotonic()
            withdrawal = next(e for e in events if isinstance(e, TaskCancellation))
            assert time.monotonic() - started < 5.0
            assert withdrawal.query_id == "alice/doomed"
            assert withdrawal.reason == "query failed: cancelled by the analyst"
            stream.cancel()
            release.set()
            assert upload.exception(timeout=30) is not None


def test_a_new_stream_ends_only_the_one_it_replaces() -> None:
    streams = TaskStreams()
    ended: list[str] = []
    first = streams.open("attacker", lambda: ended.append("attacker, first"))
    streams.open("owner-2", lambda: ended.append("owner-2"))
    second = streams.open("attacker", lambda: ended.append("attacker, second"))
    assert ended == ["attacker, first"] and second != first
    streams.close("attacker", first)  # the replaced stream's close changes nothing
    assert streams.connected() == 2
    streams.close("attacker", second)
    assert streams.connected() == 1


def test_the_terms_stated_are_those_of_each_owners_current_stream() -> None:
    streams = TaskStreams()
    old, new = (example_owner_terms(schema=TableSchema(n)) for n in (3, 4))
    first = streams.open("owner-1", lambda: None, old)
    streams.open("owner-2", lambda: None)  # an older owner states none
    assert streams.stated_terms() == {"owner-1": old}
    second = streams.open("owner-1", lambda: None, new)
    streams.close("owner-1", first)  # the replaced stream's close leaves the newer terms
    assert streams.stated_terms() == {"owner-1": new}
    streams.close("owner-1", second)
    assert streams.stated_terms() == {}


def test_reopening_a_task_stream_does_not_wake_the_other_owners_streams(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each opening used to wake every owner's task stream, each of which then read its
    pending tasks from the database: one owner reopening in a loop cost the proxy a
    database read per connected owner and opening."""
    public_key, _ = test_only_keypair_512
    limits = PeerLimits()
    with _driven_by_hand(tmp_path, pool, public_key, limits, np.random.default_rng(0)) as running:
        coordinator = running.proxy.coordinator
        reads: Counter[str] = Counter()
        read_pending = coordinator.pending_tasks

        def counted(owner_id: str) -> Any:
            reads[owner_id] += 1
            return read_pending(owner_id)

        monkeypatch.setattr(coordinator, "pending_tasks", counted)
        request = serde.task_stream_request_to_proto
        bystander_channel, bystander = _stub(running, "owner-2")
        attacker_channel, attacker = _stub(running, "attacker")
        with bystander_channel, attacker_channel:
            held = bystander.StreamTasks(request("owner-2"))
            next(held)
            before, started = reads["owner-2"], time.monotonic()
            streams = []
            for _ in range(limits.max_task_stream_opens_per_minute):
                stream = attacker.StreamTasks(request("attacker"))
                next(stream)
                streams.append(stream)
            for stream in streams[:-1]:  # each replaced stream ended, saying why
                with contextlib.suppress(grpc.RpcError):
                    for _ in stream:
                        pass
                assert stream.code() is grpc.StatusCode.ABORTED
            elapsed = time.monotonic() - started
            # Only its heartbeats (one a second here) woke the bystander's stream.
            assert reads["owner-2"] - before <= elapsed / 1.0 + 1, (reads, elapsed)
            assert held.is_active()
            held.cancel()
            streams[-1].cancel()
