"""Reloading a serving proxy's allow-lists and revoked certificates (SIGHUP).

Before, revoking a certificate or taking an owner off ``[owners] allowed`` took a
restart of the proxy, which broke every owner's upload in flight; and a call already
open (a task stream, an upload, an analyst's watch) was never checked again. Here one
in-process proxy with mutual TLS (TEST-ONLY 512-bit analyst key) serves three owners
and two analysts; :meth:`ProxyServer.reload` takes a new configuration and the
calls of peers it no longer accepts end, while the others go on.
"""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import ConfigError
from fedpca.proxy.config import (
    AnalystsConfig,
    BudgetConfig,
    CryptoConfig,
    OwnersConfig,
    ProxyConfig,
    ProxySection,
    TlsConfig,
    reload_changes,
)
from fedpca.proxy.coordinator import task_id
from fedpca.proxy.limits import PeerLimits
from fedpca.proxy.server import ProxyServer
from fedpca.transport import channels, serde
from fedpca.transport.certs import (
    NodeIdentity,
    Role,
    TlsMaterial,
    init_certificates,
    read_certificate,
)
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import (
    SECOND_TEST_SIGNING_KEY,
    encrypted_upload,
    query_builder,
    submit_request,
    unit_ball_rows,
    wait_until,
)

TIMEOUT = 30.0
M = 4
OWNERS = ("owner-1", "owner-2", "owner-3")
ANALYSTS = ("alice", "bob")
_spec = query_builder(n_features=M, quorum=3, max_owners=8, deadline_seconds=3600.0)


def _config(tmp_path: Path, tls: dict[NodeIdentity, Any]) -> ProxyConfig:
    proxy = tls[NodeIdentity(Role.PROXY, "proxy")]
    return ProxyConfig(
        proxy=ProxySection(
            listen="127.0.0.1:0", database=tmp_path / "proxy.sqlite3", heartbeat_seconds=0.2
        ),
        tls=TlsConfig(ca=proxy.ca_certificate, cert=proxy.certificate, key=proxy.private_key),
        budget=BudgetConfig(PrivacyParams(math.inf, 1e-5)),
        crypto=CryptoConfig(processes=1, allow_insecure_test_keys=True),
        owners=OwnersConfig(frozenset(OWNERS)),
        analysts=AnalystsConfig(frozenset(ANALYSTS)),
    )


def test_reload_changes_names_each_change_and_refuses_any_other_setting() -> None:
    current = ProxyConfig(
        owners=OwnersConfig(frozenset({"a", "b"})),
        tls=TlsConfig(insecure=True, revoked_serials=frozenset({0x1F})),
    )
    assert reload_changes(current, current) == []
    new = replace(
        current,
        owners=OwnersConfig(frozenset({"b", "c"})),
        analysts=AnalystsConfig(frozenset({"alice"})),
        tls=replace(current.tls, revoked_serials=frozenset({0x1F, 0xAB})),
    )
    assert reload_changes(current, new) == [
        "owners.allowed added: c",
        "owners.allowed removed: a",
        "analysts.allowed set: only alice served",
        "tls.revoked_serials added: ab",
    ]
    assert reload_changes(new, current)[-2:] == [
        "analysts.allowed removed: any analyst the CA certified is served",
        "tls.revoked_serials removed: ab",
    ]
    # A file that also changes what is read only at start is refused whole, naming it:
    # applying its allow-list alone could serve an analyst it adds before its budget.
    for changed, name in (
        (replace(new, limits=PeerLimits(max_calls_per_peer=3)), "limits.max_calls_per_peer"),
        (
            replace(new, budget=BudgetConfig(analysts={"alice": PrivacyParams(1.0, 1e-6)})),
            "budget.analysts",
        ),
        (replace(new, tls=replace(new.tls, insecure=False)), "tls.insecure"),
    ):
        with pytest.raises(ConfigError) as refused:
            reload_changes(current, changed)
        assert str(refused.value).startswith(f"{name} changed, which take effect only")
        assert "nothing was applied" in str(refused.value)


def _absent(owners: str, allowed: int) -> str:
    return (
        f"allowed owners not connected now: {owners} (an analyst's query asks for all "
        f"{allowed} allowed owners unless given a smaller --quorum, and waits for them)"
    )


def _ended_with(call: Any) -> grpc.StatusCode:
    """Read a server stream to its end; the status it ended with."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


class _HeldUpload:
    """An upload whose chunks are sent only when :meth:`release` is called."""

    def __init__(self, messages: list[Any]) -> None:
        self._messages = messages
        self._released: queue.Queue[bool] = queue.Queue()

    def __iter__(self) -> Iterator[Any]:
        yield self._messages[0]  # the header: the proxy records the upload as begun
        self._released.get(timeout=TIMEOUT)
        yield from self._messages[1:]

    def release(self) -> None:
        self._released.put(True)


def test_a_reload_ends_the_open_calls_of_peers_it_no_longer_accepts(
    tmp_path: Path, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    tls = init_certificates(tmp_path / "certs", owner_ids=OWNERS, analyst_ids=ANALYSTS)
    config = _config(tmp_path, tls)
    opened: list[grpc.Channel] = []

    def stub(role: Role, node_id: str) -> Any:
        material = TlsMaterial.load(tls[NodeIdentity(role, node_id)])
        opened.append(channels.secure_channel(server.address, material))
        if role is Role.OWNER:
            return owner_grpc.OwnerServiceStub(opened[-1])
        return analyst_grpc.AnalystServiceStub(opened[-1])

    with CryptoPool(processes=1) as pool:
        server = ProxyServer(config, noise_sampler=TestOnlySeededSampler(3), pool=pool)
        server.start()
        try:
            owners = {owner: stub(Role.OWNER, owner) for owner in OWNERS}
            analysts = {analyst: stub(Role.ANALYST, analyst) for analyst in ANALYSTS}
            spec = _spec(public_key, "reloaded")
            analysts["alice"].SubmitQuery(submit_request(spec), timeout=TIMEOUT)
            # bob's query needs one owner: owner-1's upload below fixes its contributors.
            bobs = _spec(public_key, "reloaded-b", quorum=1)
            request = submit_request(bobs, SECOND_TEST_SIGNING_KEY)
            analysts["bob"].SubmitQuery(request, timeout=TIMEOUT)
            streams = {
                owner: owners[owner].StreamTasks(
                    serde.task_stream_request_to_proto(owner), timeout=TIMEOUT
                )
                for owner in OWNERS
            }
            for stream in streams.values():
                assert next(stream).WhichOneof("event") == "heartbeat"
            watches = {
                analyst: analysts[analyst].WatchQueryStatus(
                    analyst_pb.QueryRef(query_id=query.query_id), timeout=TIMEOUT
                )
                for analyst, query in (("alice", spec), ("bob", bobs))
            }
            for watch in watches.values():
                next(watch)  # the current status
            # owner-3 has begun its upload to alice's query, owner-1 to bob's (the proxy
            # accepted their headers); their chunks wait.
            uploads, held = {}, {}
            store = server.coordinator.store
            for owner, analyst, query in (("owner-3", "alice", spec), ("owner-1", "bob", bobs)):
                rows = unit_ball_rows(int(owner[-1]), 10, M)
                payload, _ = encrypted_upload(query, rows, public_key, pool)
                key = task_id(analyst, query.query_id)
                held[owner] = _HeldUpload(
                    serde.encode_upload(key, query.analyst_key_fingerprint, f"up-{owner}", payload)
                )
                uploads[owner] = owners[owner].Upload.future(iter(held[owner]), timeout=TIMEOUT)
                wait_until(
                    lambda key=key: store.query(key).uploads_begun, f"{owner}'s header", TIMEOUT
                )
            # bob fetches: the header (contributors fixed), then waits for the pages.
            fetch = analysts["bob"].FetchResult(
                analyst_pb.QueryRef(query_id=bobs.query_id), timeout=TIMEOUT
            )
            assert next(fetch).WhichOneof("payload") == "header"

            # Reload: owner-2 off the allow-list, owner-3's certificate revoked, bob off
            # the analysts' list.
            serial = read_certificate(tls[NodeIdentity(Role.OWNER, "owner-3")].certificate)
            new = replace(
                config,
                owners=OwnersConfig(frozenset({"owner-1", "owner-3"})),
                analysts=AnalystsConfig(frozenset({"alice"})),
                tls=replace(config.tls, revoked_serials=frozenset({serial.serial_number})),
            )
            changes = server.reload(new)
            assert changes[:3] == [
                "owners.allowed removed: owner-2",
                "analysts.allowed removed: bob",
                f"tls.revoked_serials added: {serial.serial_number:x}",
            ]
            # owner-3's stream ends as the reload's effect: it may still count as connected.
            assert changes[3:] in ([], [_absent("owner-3", 2)])
            assert _ended_with(streams["owner-2"]) is grpc.StatusCode.PERMISSION_DENIED
            assert _ended_with(streams["owner-3"]) is grpc.StatusCode.PERMISSION_DENIED
            assert _ended_with(watches["bob"]) is grpc.StatusCode.PERMISSION_DENIED
            assert _ended_with(fetch) is grpc.StatusCode.PERMISSION_DENIED
            held["owner-3"].release()  # owner-3's next chunk is refused
            with pytest.raises(grpc.RpcError) as refused:
                uploads["owner-3"].result(timeout=TIMEOUT)
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "revoked" in refused.value.details()
            # owner-1, still accepted, finishes its upload (into the query bob asked,
            # begun before: it is kept, not lost).
            held["owner-1"].release()
            receipt = uploads["owner-1"].result(timeout=TIMEOUT)
            assert receipt.status == owner_pb.UploadReceipt.STATUS_ACCEPTED
            # New calls are refused as at their start.
            hello = owner_pb.OwnerHello(node_id="owner-2", software_version="1")
            with pytest.raises(grpc.RpcError) as unlisted:
                owners["owner-2"].Hello(hello, timeout=TIMEOUT)
            assert unlisted.value.code() is grpc.StatusCode.PERMISSION_DENIED
            # The peers still accepted go on: owner-1's stream beats, and alice's watch
            # tells her that her query failed at once: with two owners left, its quorum
            # of 3 cannot be reached (left collecting, owner-1's upload would have begun
            # and the deadline failed it: found by review).
            _beats(streams["owner-1"], 2)
            statuses = list(watches["alice"])  # ends, not refused
            assert statuses[-1].state == analyst_pb.QUERY_STATE_FAILED
            assert "the proxy now accepts 2 owner(s)" in statuses[-1].failure_reason
            info = analysts["alice"].DescribeDeployment(
                analyst_pb.DescribeDeploymentRequest(), timeout=TIMEOUT
            )
            assert info.owners_registered == 2

            # A reload that also changes a setting read at start applies nothing.
            with pytest.raises(ConfigError, match=r"limits\.worker_threads changed"):
                server.reload(replace(config, limits=PeerLimits(worker_threads=2)))
            assert server.config == new and server.coordinator.config == new
            _beats(streams["owner-1"], 2)
            # An owner added before it runs is named: analysts' default quorum counts it.
            added = replace(new, owners=OwnersConfig(frozenset({"owner-1", "owner-3", "new"})))
            assert server.reload(added) == [
                "owners.allowed added: new",
                _absent("new, owner-3", 3),
            ]
            assert server.reload(new)[-1] == _absent("owner-3", 2)
            streams["owner-1"].cancel()
        finally:
            for channel in opened:
                channel.close()
            server.stop(grace=1.0)


def _beats(stream: Any, count: int) -> None:
    """Read a task stream until ``count`` heartbeats came (tasks may come between)."""
    beats = 0
    while beats < count:
        beats += next(stream).WhichOneof("event") == "heartbeat"
