"""Fuzzing the proxy's servicers over real gRPC with mutual TLS (hypothesis, bounded).

One in-process proxy (TEST-ONLY 512-bit analyst keys; owner-1, owner-2 and owner-3
on its allow-list) holds three queries of the analyst alice, stored (and named by
owners) under their task ids ``alice/<query id>``:

* ``fuzz-target``: a stats-mode PCA query in COLLECTING (quorum 3) into which
  owner-1 has already uploaded;
* ``fuzz-finished``: a DONE query (quorum 1) with a stored result;
* ``fuzz-declinable``: a COLLECTING query (quorum 1) the fuzzed declines may hit.

Fuzzed calls:

* Upload streams from owner-1, owner-2, a third owner and an "intruder" whose
  certificate the CA signed but who is not on the allow-list: mutations of
  owner-1's accepted upload (a replay) and of a fresh, never sent upload —
  dropped, duplicated, reordered, resized or flipped chunks, wrong chunk indices
  and hashes, changed header fields (query, key fingerprint, upload id, blocks,
  chunk count, content hash, public record count), oversized declared counts,
  ciphertexts 0, >= n^2 or sharing a factor with n (with the hashes recomputed,
  so they reach the Z*_{n^2} check). Every mutation is invalid by construction,
  so the only acceptable outcomes are a refusal, or DUPLICATE for owner-1
  resending its very own, unmodified upload.
* SubmitQuery with near-valid specs (every field pushed to its edges, wrong or
  foreign keys, existing ids, an analyst with a small budget) and their
  signatures missing, over another query, flipped, oversized or by another key.
* GetQueryStatus, WatchQueryStatus, FetchResult, GetBudget, DeclineTask and Hello
  with random ids, deltas, reasons and details, callers of the wrong role and the
  intruder.

Properties: a refused call ends with a specific, non-INTERNAL status code and a
non-empty details message that the proxy also logged, and the stored state
(queries and their counters, SQLite aggregate blobs, uploads, declines, results,
budget ledgers, read through :class:`~fedpca.proxy.store.ProxyStore`) is exactly
what it was before the call. An accepted call changes only what it should. After
the fuzz run a valid upload still succeeds, and the decrypted result equals the
exact sums of the three owners' encrypted shares (no corruption).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from fedpca.codec import (
    CryptoPool,
    generate_keypair,
    key_fingerprint,
    unpack_slots,
)
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import FedpcaError
from fedpca.messages import (
    CiphertextPayload,
    QueryState,
    UploadStatus,
)
from fedpca.protocol import SHARES, ReleasePlan
from fedpca.proxy.config import (
    BudgetConfig,
    CryptoConfig,
    OwnersConfig,
    ProxyConfig,
    ProxySection,
    TlsConfig,
)
from fedpca.proxy.coordinator import task_id
from fedpca.proxy.limits import PeerLimits
from fedpca.proxy.server import ProxyServer
from fedpca.proxy.store import ProxyStore
from fedpca.query import QuerySpec
from fedpca.query_records import spec_to_dict
from fedpca.signing import generate_signing_key, sign_query, signer_id
from fedpca.transport import channels, serde
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial, init_certificates
from fedpca.transport.serde.query import MAX_QUERY_BYTES
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from fedpca.v1 import ciphertext_pb2 as ciphertext_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.v1 import query_pb2 as query_pb
from helpers import (
    TEST_SIGNER,
    TEST_SIGNING_KEY,
    encrypted_upload,
    fuzz_settings,
    query_builder,
    submit_request,
    unit_ball_rows,
)

TIMEOUT = 30.0
M = 6
TARGET = "fuzz-target"
FINISHED = "fuzz-finished"
DECLINABLE = "fuzz-declinable"
TARGET_KEY = task_id("alice", TARGET)
FINISHED_KEY = task_id("alice", FINISHED)
DECLINABLE_KEY = task_id("alice", DECLINABLE)
OWNERS = ("owner-1", "owner-2", "owner-3")
"""The proxy's allow-list."""
INTRUDER = "intruder"
"""An owner certificate the CA signed, for an owner the proxy does not accept."""
ANALYSTS = ("alice", "bob")
OTHER_SIGNING_KEY = generate_signing_key()
# One ciphertext per chunk: a 512-bit key has 128-byte ciphertexts.
SMALL_MESSAGES = 64 + 128

REFUSAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


# ------------------------------------------------------------------- fixtures
class _Refusals(logging.Handler):
    """Collects the servicers' refusal log lines (caplog is per function)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:
            self.lines.append(record.getMessage())

    def logged(self, details: str) -> bool:
        with self._guard:
            return any(details in line and "refused (" in line for line in self.lines)


@dataclass
class World:
    """The running proxy, its callers and what owner-1 uploaded."""

    server: ProxyServer
    store: ProxyStore
    public_key: Any
    private_key: Any
    other_key: Any
    spec: QuerySpec
    owners: dict[str, owner_grpc.OwnerServiceStub]
    """The allowed owners' stubs, and the intruder's."""
    analysts: dict[str, analyst_grpc.AnalystServiceStub]
    wrong_role: analyst_grpc.AnalystServiceStub
    wrong_owner: owner_grpc.OwnerServiceStub
    open_channel: Any
    replay: list[owner_pb.UploadMessage]
    fresh: dict[str, list[owner_pb.UploadMessage]]
    expected: dict[str, np.ndarray]
    refusals: _Refusals
    channels: list[grpc.Channel] = field(default_factory=list)


def _share(
    spec: QuerySpec, seed: int, public_key: Any, pool: CryptoPool
) -> tuple[CiphertextPayload, np.ndarray]:
    """An owner's encrypted upload for ``spec`` and the integers it encrypted."""
    payload, encoded = encrypted_upload(spec, unit_ball_rows(seed, 20, M), public_key, pool)
    return payload, encoded[SHARES]


_spec = query_builder(n_features=M, quorum=3, max_owners=8, deadline_seconds=3600.0)


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, test_only_keypair_512: tuple[Any, Any]
) -> Iterator[World]:
    public_key, private_key = test_only_keypair_512
    other_key, _ = generate_keypair(512, allow_insecure_test_key=True)
    tls = init_certificates(
        tmp_path_factory.mktemp("certs"),
        owner_ids=[*OWNERS, INTRUDER],
        analyst_ids=list(ANALYSTS),
    )
    proxy = tls[NodeIdentity(Role.PROXY, "proxy")]
    config = ProxyConfig(
        proxy=ProxySection(
            listen="127.0.0.1:0",
            database=tmp_path_factory.mktemp("proxy") / "proxy.sqlite3",
            heartbeat_seconds=0.2,
        ),
        tls=TlsConfig(ca=proxy.ca_certificate, cert=proxy.certificate, key=proxy.private_key),
        budget=BudgetConfig(PrivacyParams(math.inf, 1e-5), {"bob": PrivacyParams(1.0, 1e-5)}),
        crypto=CryptoConfig(processes=1, allow_insecure_test_keys=True),
        owners=OwnersConfig(frozenset(OWNERS)),
        # Every refusal is checked for its log line: no per-minute cap on those lines here;
        # and the tests of this module open far more task streams and uploads per owner
        # than an owner may in a minute (those bounds have their own tests in
        # test_hardening_streams.py).
        limits=PeerLimits(
            logged_refusals_per_minute=1_000_000,
            max_task_stream_opens_per_minute=1_000_000,
            max_upload_starts_per_minute=1_000_000,
        ),
    )
    refusals = _Refusals()
    servicer_log = logging.getLogger("fedpca.proxy.servicer")
    servicer_log.addHandler(refusals)
    with CryptoPool(processes=1) as pool:
        server = ProxyServer(config, noise_sampler=TestOnlySeededSampler(3), pool=pool)
        server.start()
        opened: list[grpc.Channel] = []

        def channel(role: Role, node_id: str, **options: Any) -> grpc.Channel:
            material = TlsMaterial.load(tls[NodeIdentity(role, node_id)])
            opened.append(channels.secure_channel(server.address, material, **options))
            return opened[-1]

        try:
            owners = {
                o: owner_grpc.OwnerServiceStub(channel(Role.OWNER, o)) for o in (*OWNERS, INTRUDER)
            }
            analysts = {
                a: analyst_grpc.AnalystServiceStub(channel(Role.ANALYST, a)) for a in ANALYSTS
            }
            # An owner certificate on the analyst service and the other way round.
            wrong_role = analyst_grpc.AnalystServiceStub(channel(Role.OWNER, "owner-3"))
            wrong_owner = owner_grpc.OwnerServiceStub(channel(Role.ANALYST, "alice"))
            spec = _spec(public_key, TARGET)
            finished = _spec(public_key, FINISHED, quorum=1)
            declinable = _spec(public_key, DECLINABLE, quorum=1)
            for submitted in (spec, finished, declinable):
                analysts["alice"].SubmitQuery(submit_request(submitted), timeout=TIMEOUT)
            expected: dict[str, np.ndarray] = {}
            fresh: dict[str, list[owner_pb.UploadMessage]] = {}
            for seed, owner in enumerate(OWNERS):
                payload, shares = _share(spec, seed, public_key, pool)
                expected[owner] = shares.astype(object)
                fresh[owner] = serde.encode_upload(
                    TARGET_KEY,
                    spec.analyst_key_fingerprint,
                    f"up-{owner}",
                    payload,
                    SMALL_MESSAGES,
                )
            replay = fresh.pop("owner-1")
            owners["owner-1"].Upload(iter(replay), timeout=TIMEOUT)
            done_payload, _ = _share(finished, 99, public_key, pool)
            owners["owner-2"].Upload(
                iter(
                    serde.encode_upload(
                        FINISHED_KEY, spec.analyst_key_fingerprint, "done", done_payload
                    )
                ),
                timeout=TIMEOUT,
            )
            store = server.coordinator.store
            _wait_for(lambda: store.query(FINISHED_KEY).state is QueryState.DONE)
            yield World(
                server=server,
                store=store,
                public_key=public_key,
                private_key=private_key,
                other_key=other_key,
                spec=spec,
                owners=owners,
                analysts=analysts,
                wrong_role=wrong_role,
                wrong_owner=wrong_owner,
                open_channel=channel,
                replay=replay,
                fresh=fresh,
                expected=expected,
                refusals=refusals,
                channels=opened,
            )
        finally:
            for opened_channel in opened:
                opened_channel.close()
            server.stop(grace=1.0)
            servicer_log.removeHandler(refusals)


def _wait_for(condition: Any, timeout: float = TIMEOUT) -> None:
    event = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        event.wait(0.05)
    raise AssertionError("condition not reached in time")


# ---------------------------------------------------------------- the oracle
def _spec_text(spec: Any) -> str:
    return json.dumps(spec, sort_keys=True)


def snapshot(store: ProxyStore) -> dict[str, Any]:
    """Everything durable a call could corrupt, read through the store."""
    queries = store.queries()
    ids = [record.query_id for record in queries]
    return {
        # A record holds its query as stored JSON text, which compares as text (a PCA
        # query may carry NaN class labels, and NaN never equals itself).
        "queries": {record.query_id: record for record in queries},
        "aggregates": {q: store.aggregate(q) for q in ids},
        "uploads_in_progress": {q: store.partial_uploads(q) for q in ids},
        "uploads": {q: store.uploads(q) for q in ids},
        "declines": {q: store.declines(q) for q in ids},
        "contributors": {
            q: [(c.owner_id, c.upload_id, c.covered, c.public_count) for c in store.contributors(q)]
            for q in ids
        },
        "results": {q: (store.result_pages(q), store.result_meta(q)) for q in ids},
        "releases": {a: store.releases(a) for a in ANALYSTS},
        # Not compared: the owners table (Hello and task streams record last_seen) and
        # the analysts table, a write-only mirror of the configured budget that every
        # submission refreshes before its checks run.
    }


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode | None
    details: str
    response: Any = None


def call(invoke: Any) -> Outcome:
    try:
        response = invoke()
    except grpc.RpcError as error:
        return Outcome(error.code(), error.details() or "")
    return Outcome(None, "", response)


def assert_refused_cleanly(
    world: World, outcome: Outcome, before: dict[str, Any], what: str
) -> None:
    """A refusal: specific code, a message the proxy logged, nothing stored changed."""
    # Coverage report with --hypothesis-show-statistics: which checks refused.
    event(f"{what.split()[0]} refused: {outcome.code}: {_shape(outcome.details)}")
    assert outcome.code in REFUSAL_CODES, f"{what}: {outcome.code} {outcome.details!r}"
    assert outcome.details.strip(), f"{what}: {outcome.code} without details"
    assert world.refusals.logged(outcome.details), f"{what}: refusal was not logged"
    assert snapshot(world.store) == before, f"{what}: refused, but the stored state changed"


def _shape(details: str) -> str:
    """The refusal message without its variable parts (ids, numbers, hashes)."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|[0-9a-f]{16}…|sha256:[0-9a-f]+|-?\d[\d.e+-]*", "_", details)
    return text[:90]


# -------------------------------------------------------------- upload fuzz
def _copy(messages: list[Any]) -> list[Any]:
    return [type(m).FromString(m.SerializeToString()) for m in messages]


def _rehash(stream: list[owner_pb.UploadMessage]) -> None:
    """Recompute every chunk's link of the hash chain (to get past the chain checks)."""
    link = hashlib.sha256(b"fedpca ciphertext chunk chain v1").digest()
    for message in stream:
        if message.WhichOneof("payload") == "chunk":
            chunk = message.chunk
            link = hashlib.sha256(
                link + chunk.index.to_bytes(4, "big") + chunk.ciphertexts
            ).digest()
            chunk.sha256 = link


def _different(value: Any, current: Any) -> Any:
    """``value``, nudged when it happens to equal ``current`` (every edit must bite)."""
    if value != current:
        return value
    if isinstance(value, bytes):
        return value + b"\x00"
    if isinstance(value, str):
        return value + "x"
    return value + 1 if value < 2**32 - 1 else value - 1


_BLOCK_FIELDS = {
    "name": st.text(max_size=10),
    "key_bits": st.sampled_from([0, 1, 511, 513, 1024, 2**32 - 1]),
    "slot_bits": st.sampled_from([0, 1, 61, 63, 512, 2**32 - 1]),
    "slots_per_ciphertext": st.sampled_from([0, 1, 7, 9, 2**32 - 1]),
    "value_count": st.sampled_from([0, 1, 27, 29, 2**63, 2**64 - 1]),
    "n_ciphertexts": st.sampled_from([0, 1, 3, 5, 2**32, 2**64 - 1]),
}
_UPLOAD_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _bad_value(public_key: Any, private_key: Any) -> st.SearchStrategy[int]:
    """Integers that fit the 128-byte field but are no element of Z*_{n^2}."""
    n = public_key.n
    n_square = n * n
    return st.one_of(
        st.sampled_from([0, n, n_square, n_square + 1, 2**1024 - 1]),
        st.integers(n_square, 2**1024 - 1),
        st.integers(1, 2**200).flatmap(
            lambda k: st.sampled_from([k * private_key.p, k * private_key.q, k * n])
        ),
    )


@st.composite
def upload_edits(draw: st.DrawFn, world: World) -> list[tuple[Any, ...]]:
    """1-3 edits, each of which alone makes any upload invalid."""
    position = st.integers(0, 64)
    edit = st.one_of(
        st.tuples(st.just("drop"), position),
        st.tuples(st.just("duplicate"), position),
        st.tuples(st.just("swap"), position, st.integers(1, 8)),
        st.tuples(st.just("flip"), position, st.integers(0, 127), st.integers(1, 255)),
        st.tuples(st.just("flip_keep_chunk_hash"), position, st.integers(0, 127)),
        st.tuples(st.just("chunk_index"), position, st.integers(0, 2**32 - 1)),
        st.tuples(st.just("chunk_sha"), position, st.binary(max_size=40)),
        st.tuples(st.just("resize"), position, st.integers(-200, 200).filter(bool)),
        st.tuples(st.just("truncate"), position),
        st.tuples(st.just("extra_chunk"), st.binary(min_size=1, max_size=256)),
        st.tuples(st.just("chunk_first")),
        st.tuples(st.just("empty")),
        st.tuples(
            st.just("query_id"),
            st.one_of(
                st.text(max_size=12),
                # Another task, the analyst's bare id, another analyst's key for it.
                st.sampled_from(
                    ["", FINISHED_KEY, DECLINABLE_KEY, TARGET, "bob/" + TARGET, "nope"]
                ),
            ),
        ),
        st.tuples(st.just("fingerprint"), st.one_of(st.text(max_size=12), st.just(""))),
        st.tuples(
            st.just("upload_id"),
            st.text(max_size=140).filter(lambda s: not _UPLOAD_ID_RE.fullmatch(s)),
        ),
        st.sampled_from(list(_BLOCK_FIELDS)).flatmap(
            lambda name: st.tuples(st.just("block"), st.just(name), _BLOCK_FIELDS[name])
        ),
        st.tuples(st.just("drop_block")),
        st.tuples(st.just("add_block"), st.text(max_size=6)),
        st.tuples(st.just("total_chunks"), st.sampled_from([0, 1, 3, 5, 2**32 - 1])),
        st.tuples(st.just("content_sha"), st.binary(max_size=40)),
        st.tuples(st.just("public_count"), st.sampled_from([0, 1, 20, 2**64 - 1])),
        st.tuples(
            st.just("ciphertext"),
            position,
            _bad_value(world.public_key, world.private_key),
        ),
    )
    return draw(st.lists(edit, min_size=1, max_size=3))


def mutate_upload(
    base: list[owner_pb.UploadMessage], edits: list[tuple[Any, ...]]
) -> list[owner_pb.UploadMessage]:
    stream = _copy(base)
    for edit in edits:
        kind = edit[0]
        chunks = [m.chunk for m in stream if m.WhichOneof("payload") == "chunk"]
        header = next((m.header for m in stream if m.WhichOneof("payload") == "header"), None)
        if kind == "empty":
            stream = []
        elif kind == "drop" and stream:
            del stream[edit[1] % len(stream)]
        elif kind == "duplicate" and stream:
            at = edit[1] % len(stream)
            stream.insert(at, _copy([stream[at]])[0])
        elif kind == "swap" and len(stream) >= 2:
            i = edit[1] % len(stream)
            j = (i + edit[2]) % len(stream)
            j = j if j != i else (i + 1) % len(stream)
            stream[i], stream[j] = stream[j], stream[i]
        elif kind in ("flip", "flip_keep_chunk_hash") and chunks:
            chunk = chunks[edit[1] % len(chunks)]
            data = bytearray(chunk.ciphertexts)
            if data:
                data[edit[2] % len(data)] ^= edit[3] if kind == "flip" else 0x01
                chunk.ciphertexts = bytes(data)
                if kind == "flip_keep_chunk_hash":
                    # A plain hash of the chunk checks out on its own; the chain does not.
                    chunk.sha256 = hashlib.sha256(chunk.ciphertexts).digest()
        elif kind == "chunk_index" and chunks:
            chunk = chunks[edit[1] % len(chunks)]
            chunk.index = _different(edit[2], chunk.index)
        elif kind == "chunk_sha" and chunks:
            chunk = chunks[edit[1] % len(chunks)]
            chunk.sha256 = _different(edit[2], chunk.sha256)
        elif kind == "resize" and chunks:
            chunk = chunks[edit[1] % len(chunks)]
            data, delta = chunk.ciphertexts, edit[2]
            chunk.ciphertexts = data[:delta] if delta < 0 else data + b"\x01" * delta
        elif kind == "truncate" and stream:
            del stream[edit[1] % len(stream) :]
        elif kind == "extra_chunk":
            index = len(chunks)
            stream.append(
                owner_pb.UploadMessage(
                    chunk=ciphertext_pb.CiphertextChunk(
                        index=index, ciphertexts=edit[1], sha256=hashlib.sha256(edit[1]).digest()
                    )
                )
            )
        elif kind == "chunk_first" and stream and header is not None:
            stream[0] = owner_pb.UploadMessage(chunk=_copy([stream[-1]])[0].chunk)
        elif kind == "ciphertext" and chunks:
            chunk = chunks[edit[1] % len(chunks)]
            if len(chunk.ciphertexts) >= 128:
                chunk.ciphertexts = edit[2].to_bytes(128, "big") + chunk.ciphertexts[128:]
                _rehash(stream)  # reach the Z*_{n^2} check, past every hash check
        elif header is not None:
            if kind == "query_id":
                value = _different(edit[1], header.query_id)
                # "sq-*" ids belong to SubmitQuery's fuzz; keep clear of them.
                header.query_id = "q" + value if "sq-" in value else value
            elif kind == "fingerprint":
                header.analyst_key_fingerprint = _different(edit[1], header.analyst_key_fingerprint)
            elif kind == "upload_id":
                header.upload_id = edit[1]
            elif kind == "block" and header.blocks:
                block = header.blocks[0]
                setattr(block, edit[1], _different(edit[2], getattr(block, edit[1])))
            elif kind == "drop_block" and header.blocks:
                del header.blocks[0]
            elif kind == "add_block":
                extra = header.blocks.add()
                if len(header.blocks) > 1:
                    extra.CopyFrom(header.blocks[0])
                extra.name = edit[1] + "-extra"
            elif kind == "total_chunks":
                header.total_chunks = _different(edit[1], header.total_chunks)
            elif kind == "content_sha":
                header.content_sha256 = _different(edit[1], header.content_sha256)
            elif kind == "public_count":
                header.public_record_count = edit[1]  # stats mode: must be absent
    return stream


def _wire(stream: list[Any]) -> list[bytes]:
    return [m.SerializeToString(deterministic=True) for m in stream]


def test_fuzzed_uploads_are_refused_without_touching_the_store(world: World) -> None:
    assert world.store.query(TARGET_KEY).state is QueryState.COLLECTING
    assert world.store.query(TARGET_KEY).n_contributed == 1

    @fuzz_settings(max_examples=250)
    @given(
        st.sampled_from(["replay", "owner-2", "owner-3"]),
        st.sampled_from([*OWNERS, INTRUDER]),
        upload_edits(world),
    )
    def run(base_name: str, caller: str, edits: list[tuple[Any, ...]]) -> None:
        base = world.replay if base_name == "replay" else world.fresh[base_name]
        stream = mutate_upload(base, edits)
        # Edits can cancel out (the same byte flipped twice, a swap undone); an
        # unmodified fresh upload is valid, so only a changed one is a fuzz input
        # (except from the intruder, for whom no upload is valid).
        assume(base_name == "replay" or caller == INTRUDER or _wire(stream) != _wire(base))
        before = snapshot(world.store)
        outcome = call(lambda: world.owners[caller].Upload(iter(stream), timeout=TIMEOUT))
        what = f"Upload by {caller} of {base_name} with {[e[0] for e in edits]}"
        if outcome.code is None:
            receipt = serde.upload_receipt_from_proto(outcome.response)
            # Only owner-1 resending its own accepted upload, byte for byte, may pass.
            assert receipt.status is UploadStatus.DUPLICATE, what
            assert caller == "owner-1" and _wire(stream) == _wire(world.replay), what
            assert snapshot(world.store) == before, what
        else:
            assert_refused_cleanly(world, outcome, before, what)

    run()


def test_unmodified_retry_is_a_harmless_duplicate(world: World) -> None:
    before = snapshot(world.store)
    receipt = world.owners["owner-1"].Upload(iter(world.replay), timeout=TIMEOUT)
    assert serde.upload_receipt_from_proto(receipt).status is UploadStatus.DUPLICATE
    assert snapshot(world.store) == before
    # The same bytes from an owner off the allow-list are refused, not a duplicate.
    outcome = call(lambda: world.owners[INTRUDER].Upload(iter(world.replay), timeout=TIMEOUT))
    assert outcome.code is grpc.StatusCode.PERMISSION_DENIED
    assert "allowed list" in outcome.details
    assert snapshot(world.store) == before


# --------------------------------------------------------- SubmitQuery fuzz
_EPSILONS = [math.inf, 0.1, 0.5, 1.0, 2.0, 10.0, 1e4, 1e10, 1e100, 1e300, 1.7e308]
_EPSILONS += [0.0, -1.0, -math.inf, math.nan]
_FLOATS = [0.0, -1.0, 1e-300, 5e-324, 0.5, 1.0, 2.0, 1e300, math.inf, -math.inf, math.nan]
_SPEC_EDITS: dict[str, st.SearchStrategy[Any]] = {
    "query_id": st.one_of(
        st.text(max_size=8).map(lambda s: "sq-" + s),
        st.sampled_from(["", TARGET, FINISHED, "sq-a", "sq-a", "sq-b"]),
    ),
    "kind": st.sampled_from([0, 1, 2, 99]),
    "mode": st.sampled_from([0, 1, 2, 99]),
    "calibration": st.sampled_from([0, 1, 2, 99]),
    "n_features": st.sampled_from([0, 1, 2, 4, 7, 50, 2**32 - 1]),
    "n_components": st.sampled_from([0, 1, 2, 4, 5, 2**32 - 1]),
    # Absurd epsilons too: the calibration once failed there with a bare RuntimeError
    # (fixed; the range had been left narrowed, found by a test audit).
    "epsilon": st.sampled_from(_EPSILONS),
    "delta": st.sampled_from([1e-5, 0.5, 1e-300, 5e-324, 0.0, 1.0, -1.0, math.inf, math.nan]),
    "clip_norm": st.sampled_from(_FLOATS),
    "bounds": st.tuples(
        st.lists(st.sampled_from([-1.0, 0.0, 1.0, math.nan, math.inf, -1e308]), max_size=5),
        st.lists(st.sampled_from([1.0, 2.0, 0.0, math.nan, 1e308]), max_size=5),
    ),
    "label_column": st.sampled_from([0, 3, 2**32 - 1]),
    "class_labels": st.lists(
        st.sampled_from([0.0, 1.0, 1.0, -1.0, math.nan, math.inf]), max_size=4
    ),
    "noise_weights": st.lists(
        st.sampled_from([1.0, 2.0, 0.0, -1.0, math.nan, math.inf]), max_size=4
    ),
    "quorum": st.sampled_from([0, 1, 2, 9, 2**32 - 1]),
    "max_owners": st.sampled_from([0, 1, 8, 2**32 - 1]),
    "max_records_per_owner": st.sampled_from([0, 1, 1000, 2**20, 2**63, 2**64 - 1]),
    "frac_bits": st.sampled_from([0, 7, 8, 32, 48, 49, 2**32 - 1]),
    # No short positive deadlines: an accepted query must not expire (and change
    # state on the proxy's timer) while the snapshots of other calls are compared.
    "deadline_seconds": st.sampled_from([3600.0, 4e7, 1e12, 1e300, 0.0, -1.0, math.inf, math.nan]),
    "key": st.sampled_from(["target", "other", "wrong-fingerprint", "even", "one", "padded"]),
}


def _spec_message(world: World, edits: list[tuple[str, Any]]) -> query_pb.QuerySpec:
    # A fresh id per input unless the edits name one, so that a valid spec is accepted
    # rather than refused as a different spec under an existing id.
    fresh_id = "sq-" + hashlib.sha256(repr(edits).encode()).hexdigest()[:16]
    spec = _spec(world.other_key, fresh_id, quorum=1, n_features=4, n_components=2)
    message = serde.query_spec_to_proto(spec)
    for name, value in edits:
        if name == "bounds":
            message.ClearField("feature_lower")
            message.ClearField("feature_upper")
            message.feature_lower.extend(value[0])
            message.feature_upper.extend(value[1])
        elif name in ("class_labels", "noise_weights"):
            message.ClearField(name)
            getattr(message, name).extend(value)
        elif name == "key":
            key = world.public_key if value == "target" else world.other_key
            n = key.n
            message.analyst_public_key_n = n.to_bytes((n.bit_length() + 7) // 8, "big")
            message.analyst_key_fingerprint = key_fingerprint(key)
            if value == "wrong-fingerprint":
                message.analyst_key_fingerprint = key_fingerprint(world.public_key)[:-1] + "0"
            elif value == "even":
                message.analyst_public_key_n = (n + 1).to_bytes(64, "big")
            elif value == "one":
                message.analyst_public_key_n = b"\x01"
            elif value == "padded":
                message.analyst_public_key_n = b"\x00" + message.analyst_public_key_n
        else:
            setattr(message, name, value)
    return message


_SIGNATURES = ["valid"] * 6 + ["foreign-key", "none", "other-query", "flipped", "bad-signer"]
_SIGNATURES += ["oversized"]
"""How a fuzzed submission is signed: validly (by the test key or another one: the proxy
verifies, owners pin), not at all, over the unedited query, with a flipped bit, under a
signer that is no signer id, or with a signature beyond the wire limit."""


def _signed_request(
    message: query_pb.QuerySpec, base: query_pb.QuerySpec, how: str
) -> analyst_pb.SubmitQueryRequest:
    """SubmitQuery carrying ``message`` and a signature made as ``how`` says.

    The signature is over the spec the proxy will parse from ``message``; a message that
    parses to no spec is signed over ``base`` (the proxy refuses it before any check of
    the signature).
    """
    request = analyst_pb.SubmitQueryRequest(query=message)
    if how == "none":
        return request
    try:
        spec = serde.query_spec_from_proto(message)
    except FedpcaError:
        spec = serde.query_spec_from_proto(base)
    if how == "other-query":
        spec = serde.query_spec_from_proto(base)
    key = OTHER_SIGNING_KEY if how == "foreign-key" else TEST_SIGNING_KEY
    signature = sign_query(spec, key)
    request.query_signature = signature
    request.query_signer = signer_id(key)
    if how == "flipped":
        request.query_signature = bytes([signature[0] ^ 0x01]) + signature[1:]
    elif how == "bad-signer":
        request.query_signer = "ed25519:" + "0" * 63 + "g"
    elif how == "oversized":
        request.query_signature = signature * 5
    return request


def test_fuzzed_query_submissions(world: World) -> None:
    @fuzz_settings(max_examples=150)
    @given(
        st.lists(
            st.sampled_from(sorted(_SPEC_EDITS)).flatmap(
                lambda name: st.tuples(st.just(name), _SPEC_EDITS[name])
            ),
            max_size=3,
        ),
        st.sampled_from(["alice", "alice", "alice", "bob"]),
        st.sampled_from([False] * 9 + [True]),
        st.sampled_from(_SIGNATURES),
    )
    def run(edits: list[tuple[str, Any]], analyst: str, wrong_role: bool, signing: str) -> None:
        message = _spec_message(world, edits)
        base = _spec_message(world, [])
        request = _signed_request(message, base, signing)
        stub = world.wrong_role if wrong_role else world.analysts[analyst]
        before = snapshot(world.store)
        outcome = call(lambda: stub.SubmitQuery(request, timeout=TIMEOUT))
        what = f"SubmitQuery by {'owner-3' if wrong_role else analyst} with {edits}, {signing}"
        event(f"SubmitQuery: {outcome.code}")
        if outcome.code is not None:
            assert_refused_cleanly(world, outcome, before, what)
            return
        assert not wrong_role, what
        spec = serde.query_spec_from_proto(message)
        # Only a signature over exactly this query passes (whoever signed it).
        assert signing in ("valid", "foreign-key") or (
            signing == "other-query" and spec == serde.query_spec_from_proto(base)
        ), what
        status = serde.query_status_from_proto(outcome.response)
        assert status.query_id == spec.query_id and status.state is QueryState.COLLECTING
        after = snapshot(world.store)
        key = task_id(analyst, spec.query_id)
        record = after["queries"][key]
        assert record.analyst_id == analyst, what
        assert _spec_text(world.store.query_spec(key)) == _spec_text(spec_to_dict(spec)), what
        new = key not in before["queries"]
        if new:
            assert record.signature == request.query_signature, what
            assert record.signer == request.query_signer, what
            del after["queries"][key]
            for part in (
                "aggregates",
                "uploads_in_progress",
                "uploads",
                "declines",
                "contributors",
            ):
                assert not after[part].pop(key), what
            assert after["results"].pop(key) == ([], None), what
            assert len(after["releases"][analyst]) == len(before["releases"][analyst]) + 1
            after["releases"][analyst] = before["releases"][analyst]
        assert after == before, f"{what}: accepted, but changed more than the new query"

    run()


# ------------------------------------------------- reads, budget, declines
_KNOWN_IDS = st.sampled_from(
    [
        *("", TARGET, FINISHED, FINISHED, DECLINABLE, "sq-a", "nope", "bob/" + FINISHED),
        # Owners name tasks by their task ids; declines may reach the declinable one.
        *(TARGET_KEY, FINISHED_KEY, DECLINABLE_KEY, DECLINABLE_KEY, DECLINABLE_KEY),
    ]
)
_IDS = st.one_of(st.text(max_size=10), _KNOWN_IDS, _KNOWN_IDS)


def test_fuzzed_reads_declines_and_hellos(world: World) -> None:
    @fuzz_settings(max_examples=400)
    @given(
        st.sampled_from(["status", "watch", "fetch", "budget", "decline", "hello"]),
        _IDS,
        st.sampled_from([*ANALYSTS, "wrong-role", INTRUDER]),
        st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
        st.one_of(st.integers(-5, 5), st.sampled_from(sorted(owner_pb.DeclineReason.values()))),
        st.text(max_size=20),
    )
    def run(
        method: str, query_id: str, caller: str, delta: float | None, reason: int, text: str
    ) -> None:
        # The intruder holds an owner certificate: on the analyst service it is of the
        # wrong role, on the owner service it is not on the allow-list.
        wrong = caller == "wrong-role"
        analyst = world.wrong_role if caller in ("wrong-role", INTRUDER) else world.analysts[caller]
        owner = (
            world.wrong_owner
            if wrong
            else world.owners[INTRUDER if caller == INTRUDER else "owner-3"]
        )
        ref = analyst_pb.QueryRef(query_id=query_id)
        before = snapshot(world.store)
        what = f"{method}({query_id!r}) by {caller}"
        if method == "status":
            outcome = call(lambda: analyst.GetQueryStatus(ref, timeout=TIMEOUT))
        elif method == "watch":
            # Read the first status (or the refusal), then hang up.
            def first() -> Any:
                stream = analyst.WatchQueryStatus(ref, timeout=TIMEOUT)
                try:
                    return next(stream)
                finally:
                    stream.cancel()

            outcome = call(first)
        elif method == "fetch":
            outcome = call(lambda: list(analyst.FetchResult(ref, timeout=TIMEOUT)))
        elif method == "budget":
            request = analyst_pb.BudgetRequest()
            if delta is not None:
                request.delta = delta
            outcome = call(lambda: analyst.GetBudget(request, timeout=TIMEOUT))
        elif method == "decline":
            # The target stays untouched: its final check counts owners (and owner-3's
            # decline would leave its quorum of 3 out of reach).
            if query_id == TARGET_KEY and caller in ANALYSTS:
                return
            decline = owner_pb.TaskDecline(query_id=query_id, reason=reason, detail=text)
            outcome = call(lambda: owner.DeclineTask(decline, timeout=TIMEOUT))
        else:
            hello = owner_pb.OwnerHello(node_id=text, software_version=text)
            outcome = call(lambda: owner.Hello(hello, timeout=TIMEOUT))
        if outcome.code is not None:
            assert_refused_cleanly(world, outcome, before, what)
            return
        event(f"{method}: accepted")
        after = snapshot(world.store)
        if method in ("decline", "hello"):
            # Only owner-3 (allowed) can decline or say hello; analysts use its channel.
            assert caller in ANALYSTS, what
        if method == "fetch":
            result = serde.decode_result(outcome.response)
            assert result.query.query_id == query_id and result.n_owners >= 1
            # Queries are the analyst's own: only alice has a result, of her query.
            assert caller == "alice" and query_id == FINISHED, what
        elif method == "decline":
            # Recorded under the task id, its reason and detail as one line.
            assert query_id == DECLINABLE_KEY, what
            code = serde.task_decline_from_proto(decline).reason.value
            line = " ".join(text.split())
            stored = after["declines"][query_id]["owner-3"]
            earlier = before["declines"].get(query_id, {}).get("owner-3")
            if earlier is not None:  # a decline repeated changes nothing (stop 42)
                assert stored == earlier, what
            elif line.isprintable():
                assert stored == (f"{code}: {line}" if line else code), what
            else:  # control characters are stored escaped, never as they came
                assert stored.startswith(f"{code}: ") and stored.isprintable(), what
            assert after["queries"][query_id].state is QueryState.COLLECTING, what
            after["declines"] = before["declines"]
        assert after == before, f"{what}: changed the stored state"

    run()


# ------------------------------------------------------- focused checks
def test_an_oversized_message_is_refused_by_size(world: World) -> None:
    """A chunk above the proxy's 2 MiB receive limit: RESOURCE_EXHAUSTED, nothing stored.

    The client may send up to 32 MiB, so it is the proxy that enforces its limit.
    """
    big = world.open_channel(Role.OWNER, "owner-3", max_message_bytes=32 * 1024 * 1024)
    stream = _copy(world.fresh["owner-3"])
    stream[1].chunk.ciphertexts = b"\x01" * (channels.PROXY_MAX_RECEIVE_BYTES + 1024)
    stream[1].chunk.sha256 = hashlib.sha256(stream[1].chunk.ciphertexts).digest()
    before = snapshot(world.store)
    stub = owner_grpc.OwnerServiceStub(big)
    outcome = call(lambda: stub.Upload(iter(stream), timeout=TIMEOUT))
    assert outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED and outcome.details.strip()
    assert snapshot(world.store) == before


def test_the_receive_limit_admits_the_largest_query_and_refuses_beyond(world: World) -> None:
    """The proxy reads at most 2 MiB a message (gRPC reads a message whole before any
    handler refuses it), yet a query up to its own 1 MiB cap still reaches the proxy's
    checks: below the limit a wide query is refused by those checks with
    INVALID_ARGUMENT and a reason; above it gRPC refuses it unread."""
    analyst = world.analysts["alice"]
    big = world.open_channel(Role.ANALYST, "alice", max_message_bytes=32 * 1024 * 1024)
    unbounded = analyst_grpc.AnalystServiceStub(big)
    base = submit_request(_spec(world.other_key, "wide", quorum=1))
    outcomes = {}
    for extra in (120_000, 140_000, 300_000):
        request = analyst_pb.SubmitQueryRequest()
        request.CopyFrom(base)
        request.query.feature_lower.extend([0.0] * extra)
        size = request.ByteSize()
        stub = unbounded if size > channels.PROXY_MAX_RECEIVE_BYTES else analyst
        outcomes[extra] = (size, call(lambda r=request, s=stub: s.SubmitQuery(r, timeout=TIMEOUT)))
    size, near_cap = outcomes[120_000]
    assert size < MAX_QUERY_BYTES
    assert near_cap.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than" not in near_cap.details  # decoded, refused for its shape
    size, over_cap = outcomes[140_000]
    assert MAX_QUERY_BYTES < size < channels.PROXY_MAX_RECEIVE_BYTES
    assert over_cap.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 1048576" in over_cap.details
    size, over_limit = outcomes[300_000]
    assert size > channels.PROXY_MAX_RECEIVE_BYTES
    assert over_limit.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_undecodable_request_bytes_are_invalid_argument(world: World) -> None:
    channel = world.channels[len(OWNERS)]  # alice's channel
    raw = channel.unary_unary("/fedpca.v1.AnalystService/GetQueryStatus")
    before = snapshot(world.store)
    outcome = call(lambda: raw(b"\x0a\xff\xff", timeout=TIMEOUT))
    assert snapshot(world.store) == before
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "QueryRef" in outcome.details


def test_undecodable_message_in_an_upload_stream_is_invalid_argument(world: World) -> None:
    channel = world.channels[0]  # an owner's channel
    raw = channel.stream_unary("/fedpca.v1.OwnerService/Upload")
    before = snapshot(world.store)
    outcome = call(lambda: raw(iter([b"\x0a\xff\xff"]), timeout=TIMEOUT))
    assert snapshot(world.store) == before
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "UploadMessage" in outcome.details


@pytest.mark.parametrize("analyst", ANALYSTS)
def test_an_absurd_epsilon_is_refused_precisely(world: World, analyst: str) -> None:
    message = _spec_message(world, [("query_id", f"sq-absurd-{analyst}")])
    message.epsilon = 1e300
    before = snapshot(world.store)
    outcome = call(
        lambda: world.analysts[analyst].SubmitQuery(
            _signed_request(message, message, "valid"), timeout=TIMEOUT
        )
    )
    assert snapshot(world.store) == before
    # Signed, so refused for the epsilon itself: no noise multiplier can be derived.
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "epsilon=1e+300" in outcome.details


def test_a_retry_with_a_changed_header_is_refused_not_duplicate(world: World) -> None:
    """Found by fuzzing: owner-1 resending its accepted upload with a stats-mode
    public_record_count (or another layout) under the same upload id and content
    hash skipped every header check and was answered DUPLICATE."""
    stream = mutate_upload(world.replay, [("public_count", 0)])
    before = snapshot(world.store)
    outcome = call(lambda: world.owners["owner-1"].Upload(iter(stream), timeout=TIMEOUT))
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "public_record_count" in outcome.details
    assert snapshot(world.store) == before


@pytest.mark.parametrize("deadline", [1e12, 1e300])
def test_a_deadline_beyond_any_timestamp_is_refused(world: World, deadline: float) -> None:
    """Found by fuzzing: deadline_seconds=1e12 was stored and charged, then its status
    (and every owner's task stream) failed with INTERNAL: year 33715 is out of range."""
    # (A valid query id: "+" is not in the query-id alphabet.)
    valid = _spec_message(world, [("query_id", f"sq-far-{deadline:.0e}".replace("+", ""))])
    message = query_pb.QuerySpec()
    message.CopyFrom(valid)
    message.deadline_seconds = deadline  # refused where the query is read (stop 34)
    before = snapshot(world.store)
    outcome = call(
        lambda: world.analysts["alice"].SubmitQuery(
            _signed_request(message, valid, "valid"), timeout=TIMEOUT
        )
    )
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT and "deadline" in outcome.details
    assert snapshot(world.store) == before


# ---------------------------------------------------------------- the end
def test_after_the_fuzz_valid_uploads_still_sum_exactly(world: World) -> None:
    """Run last: the two remaining owners upload; the decrypted sums are exact."""
    assert world.store.query(TARGET_KEY).n_contributed == 1
    assert world.store.query(TARGET_KEY).signer == TEST_SIGNER
    for owner in ("owner-2", "owner-3"):
        receipt = world.owners[owner].Upload(iter(world.fresh[owner]), timeout=TIMEOUT)
        assert serde.upload_receipt_from_proto(receipt).status is UploadStatus.ACCEPTED
    _wait_for(lambda: world.store.query(TARGET_KEY).state is QueryState.DONE)
    assert {u.owner_id for u in world.store.uploads(TARGET_KEY)} == set(OWNERS)
    result = serde.decode_result(
        world.analysts["alice"].FetchResult(analyst_pb.QueryRef(query_id=TARGET), timeout=TIMEOUT)
    )
    assert result.n_owners == 3
    block = ReleasePlan.for_query(world.spec, 512).result_block(SHARES)
    plaintexts = [world.private_key.raw_decrypt(c) for c in result.payload[SHARES]]
    expected = sum(world.expected.values())
    assert unpack_slots(plaintexts, block.layout, world.public_key.n) == list(expected)


def test_hostile_sizes_are_refused_at_once_and_quoted_short(world: World) -> None:
    """Sizes only a hostile peer sends (review): each refused before it costs the proxy
    time on its event loop, memory, rows or log, and quoted in at most a few KB.

    A header of 100,000 blocks once took minutes (a quadratic duplicate check on the
    event loop, freezing every peer); a 4 MiB key fingerprint grew the log by 4 MB a
    refusal; 7 MiB Hello fields were stored in the owners table. The sizes here stay
    under the proxy's 2 MiB receive limit, so the proxy's own checks refuse them."""
    big = world.open_channel(Role.OWNER, "owner-3", max_message_bytes=32 * 1024 * 1024)
    stub = owner_grpc.OwnerServiceStub(big)
    before = snapshot(world.store)
    many = _copy(world.fresh["owner-3"])
    block = many[0].header.blocks[0]
    for index in range(40_000):
        extra = many[0].header.blocks.add()
        extra.CopyFrom(block)
        extra.name = f"b{index}"
    started = time.monotonic()
    outcome = call(lambda: stub.Upload(iter(many), timeout=TIMEOUT))
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "blocks, more than any plan has" in outcome.details
    assert time.monotonic() - started < 5.0

    long_fingerprint = _copy(world.fresh["owner-3"])
    long_fingerprint[0].header.analyst_key_fingerprint = "sha256:" + "f" * (1 << 20)
    outcome = call(lambda: stub.Upload(iter(long_fingerprint), timeout=TIMEOUT))
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 256" in outcome.details and len(outcome.details) < 3000

    hello = owner_pb.OwnerHello(node_id="x" * (3 << 19), software_version="1.0")
    outcome = call(lambda: stub.Hello(hello, timeout=TIMEOUT))
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "OwnerHello.node_id" in outcome.details
    assert snapshot(world.store) == before
    assert max(len(line) for line in world.refusals.lines) < 3000


def test_a_submitted_query_is_decoded_off_the_event_loop(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query may be 1 MiB, about 0.3 s to decode: on the event loop that stalled
    every other peer's calls meanwhile (review). It is decoded on a worker thread."""
    decoded_on: list[str] = []
    decode = serde.submit_query_request_from_proto

    def recording(request: Any) -> Any:
        decoded_on.append(threading.current_thread().name)
        return decode(request)

    monkeypatch.setattr(serde, "submit_query_request_from_proto", recording)
    outcome = call(
        lambda: world.analysts["alice"].SubmitQuery(
            analyst_pb.SubmitQueryRequest(), timeout=TIMEOUT
        )
    )
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(decoded_on) == 1 and decoded_on[0].startswith("fedpca-proxy-work")


def test_opening_a_task_stream_takes_one_of_the_owners_call_slots(world: World) -> None:
    """Reopening task streams in a loop filled the proxy's shared work backlog (each
    open writes): opening is bounded per owner like every other call (review)."""
    slots = world.server.peer_slots
    limit = world.server.config.limits.max_calls_per_peer
    for _ in range(limit):
        slots.acquire("calls", "owner/owner-3", limit)
    try:
        stream = world.owners["owner-3"].StreamTasks(
            serde.task_stream_request_to_proto("owner-3"), timeout=TIMEOUT
        )
        outcome = call(lambda: next(stream))
        assert outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "calls in flight" in outcome.details
    finally:
        for _ in range(limit):
            slots.release("calls", "owner/owner-3")
    # With its slots back, the owner opens its stream as before.
    stream = world.owners["owner-3"].StreamTasks(
        serde.task_stream_request_to_proto("owner-3"), timeout=TIMEOUT
    )
    assert next(stream).WhichOneof("event") == "heartbeat"
    stream.cancel()


def test_a_cancelled_task_stream_is_not_reported_as_a_failure(world: World) -> None:
    """A client that cancels its task stream (Ctrl-C, a restart) closes the generator
    with GeneratorExit: that ended 541 of 2,000 streams in an ERROR traceback (review)."""
    before = len(world.refusals.lines)
    for _ in range(20):
        stream = world.owners["owner-3"].StreamTasks(
            serde.task_stream_request_to_proto("owner-3"), timeout=TIMEOUT
        )
        next(stream)
        stream.cancel()
    time.sleep(0.5)  # the proxy notices the cancellations
    assert not [line for line in world.refusals.lines[before:] if "unexpectedly" in line]


def test_a_refused_call_does_not_keep_its_request_alive(world: World) -> None:
    """Refusing with context.abort left the AbortError on the call, its traceback holding
    the handler's frames and so the request: a cycle that only the cyclic collector
    frees. One owner's refused 8 MiB Hellos took the proxy to 7 GiB (review). With the
    collector paused, nothing of five refused requests may stay alive."""
    gc.collect()
    gc.disable()
    try:
        stub = world.owners["owner-3"]
        for _ in range(5):
            request = owner_pb.OwnerHello(node_id="x" * (1 << 20), software_version="1")
            outcome = call(functools.partial(stub.Hello, request, timeout=TIMEOUT))
            assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT
            del request
        time.sleep(0.3)  # the server's side of the calls ends
        alive = [o for o in gc.get_objects() if type(o).__name__ == "OwnerHello"]
        assert alive == []
    finally:
        gc.enable()
