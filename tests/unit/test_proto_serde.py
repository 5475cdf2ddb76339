"""Round trips and every ProtocolError case of fedpca.transport.serde."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest

from fedpca.admission import AdmissionLimit, NextQuery
from fedpca.errors import CiphertextError, ConfigError, LayoutError, ProtocolError
from fedpca.messages import (
    DEFAULT_CHUNK_MESSAGE_BYTES,
    MAX_DECLINE_DETAIL,
    UPLOAD_CHUNK_BYTES,
    BudgetStatus,
    Charge,
    CiphertextBlock,
    CiphertextPayload,
    DeclineReason,
    Heartbeat,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    ObfuscationVariant,
    OwnerDecline,
    OwnerHello,
    ProxyInfo,
    QueryResult,
    QueryState,
    QueryStatus,
    SignedQuery,
    Task,
    TaskCancellation,
    TaskDecline,
    TaskEvent,
    UploadReceipt,
    UploadStatus,
    ciphertext_width,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
    new_upload_id,
)
from fedpca.query import Calibration, ProtocolMode, QueryKind, QuerySpec
from fedpca.signing import sign_query, verify_query
from fedpca.transport import serde
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import query_pb2 as query_pb
from helpers import TEST_SIGNER, TEST_SIGNING_KEY, signed

KEY_BITS = 512
WIDTH = 128  # 2 * ceil(512 / 8)
N = (1 << 511) + 187  # any 512-bit odd number: serde never does arithmetic with it


def pca_spec(**overrides: object) -> QuerySpec:
    values: dict[str, object] = {
        "query_id": "q-pca",
        "kind": QueryKind.PCA,
        "n_features": 3,
        "epsilon": 1.5,
        "delta": 1e-6,
        "n_components": 2,
        "analyst_public_key_n": N,
        "analyst_key_fingerprint": "sha256:abcd",
    }
    values.update(overrides)
    return QuerySpec(**values)  # type: ignore[arg-type]


def dca_spec() -> QuerySpec:
    # Every field away from its default, so a field dropped by serde shows up.
    return QuerySpec(
        query_id="q-dca",
        kind=QueryKind.DCA,
        n_features=3,
        epsilon=0.25,
        delta=1e-9,
        n_components=1,
        analyst_public_key_n=N,
        analyst_key_fingerprint="sha256:ffff",
        feature_lower=(-1.0, 0.0, -2.5),
        feature_upper=(1.0, 10.0, 2.5),
        clip_norm=2.0,
        calibration=Calibration.CLASSIC,
        mode=ProtocolMode.MASKED,
        label_column=0,
        class_labels=(0.0, 1.0, 2.0),
        feature_columns=(3, 1, 2),
        quorum=3,
        deadline_seconds=12.5,
        max_records_per_owner=5000,
        max_owners=7,
        frac_bits=20,
        noise_weights=(0.5, 0.25, 0.25),
        issued_at=1_795_000_000.125,
    )


# ------------------------------------------------------------------ QuerySpec


def test_wire_fields_equal_queryspec_fields() -> None:
    # Adding a QuerySpec field without a wire field (or vice versa) fails here.
    assert {f.name for f in dataclasses.fields(QuerySpec)} == serde.QUERY_SPEC_WIRE_FIELDS


@pytest.mark.parametrize(
    "spec",
    [
        pca_spec(),
        dca_spec(),
        pca_spec(epsilon=math.inf, delta=0.0),
        pca_spec(feature_lower=(), feature_upper=()),
        pca_spec(analyst_public_key_n=1),
    ],
    ids=["pca-defaults", "dca-everything", "inf-epsilon", "no-bounds", "tiny-n"],
)
def test_query_spec_round_trip_is_exact(spec: QuerySpec) -> None:
    wire = serde.query_spec_to_proto(spec).SerializeToString()
    back = serde.query_spec_from_proto(query_pb.QuerySpec.FromString(wire))
    assert back == spec
    assert type(back.kind) is QueryKind and type(back.calibration) is Calibration


def test_a_peer_spec_beyond_the_size_or_aggregate_cap_is_refused_before_it_is_built() -> None:
    # A 1-D histogram of 2^20 bins was 8.4 MB a query and 11 MB of JSON a row, stored,
    # cached and parsed again every half second (review).
    wide = serde.query_spec_to_proto(pca_spec())
    wide.feature_lower.extend([0.0] * 140_000)
    with pytest.raises(ProtocolError, match=r"bytes, more than 1048576"):
        serde.query_spec_from_proto(wide)
    many = serde.query_spec_to_proto(pca_spec())
    for _ in range(65):
        many.aggregates.add()  # empty: refused by count before any is decoded
    with pytest.raises(ProtocolError, match="at most 64 aggregates"):
        serde.query_spec_from_proto(many)
    long_key = serde.query_spec_to_proto(pca_spec())
    long_key.analyst_key_fingerprint = "sha256:" + "a" * 1000
    with pytest.raises(ProtocolError, match=r"analyst_key_fingerprint .* more than 256"):
        serde.query_spec_from_proto(long_key)


def test_every_non_default_field_is_present_on_the_wire() -> None:
    message = serde.query_spec_to_proto(dca_spec())
    for name in ("clip_norm", "label_column", "quorum", "deadline_seconds", "frac_bits"):
        assert message.HasField(name)
    assert message.label_column == 0  # presence, not the proto3 zero default
    assert message.analyst_public_key_n == N.to_bytes(64, "big")


def test_absent_optional_fields_take_queryspec_defaults() -> None:
    message = serde.query_spec_to_proto(pca_spec())
    for name in ("clip_norm", "quorum", "deadline_seconds", "max_records_per_owner"):
        message.ClearField(name)
    message.ClearField("calibration")
    message.ClearField("mode")
    assert serde.query_spec_from_proto(message) == pca_spec()


def test_pca_without_label_column_has_no_presence() -> None:
    message = serde.query_spec_to_proto(pca_spec())
    assert not message.HasField("label_column")
    assert serde.query_spec_from_proto(message).label_column is None


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda m: m.ClearField("kind"), r"kind: enum value 0"),
        (lambda m: setattr(m, "kind", 9), r"kind: enum value 9"),
        (lambda m: setattr(m, "mode", 7), r"mode: enum value 7"),
        (lambda m: m.ClearField("analyst_public_key_n"), r"analyst_public_key_n is empty"),
        (
            lambda m: setattr(m, "analyst_public_key_n", b"\x00" + m.analyst_public_key_n),
            r"leading zero byte",
        ),
        (
            lambda m: setattr(m, "analyst_public_key_n", b"\x01" + bytes(1024)),
            r"has 8,193 bits; at most 8,192",
        ),
        (lambda m: setattr(m, "epsilon", -1.0), r"invalid QuerySpec 'q-pca': epsilon must be"),
        # Owners add these to dates: beyond them a signed query ended their session.
        (lambda m: setattr(m, "deadline_seconds", 1e12), r"deadline_seconds must be > 0 and"),
        (lambda m: setattr(m, "issued_at", 1e15), r"issued_at must be a UNIX time before"),
        (lambda m: m.feature_lower.append(0.0), r"same length"),
    ],
)
def test_query_spec_from_proto_errors(
    mutate: Callable[[query_pb.QuerySpec], object], match: str
) -> None:
    message = serde.query_spec_to_proto(pca_spec())
    mutate(message)
    with pytest.raises(ProtocolError, match=match):
        serde.query_spec_from_proto(message)


def test_query_spec_to_proto_refuses_unrepresentable_values() -> None:
    with pytest.raises(ConfigError, match="label_column=-1"):
        serde.query_spec_to_proto(pca_spec(label_column=-1))
    with pytest.raises(ConfigError, match="must be positive"):
        serde.query_spec_to_proto(pca_spec(analyst_public_key_n=0))


# --------------------------------------------------------------------- layout


def block(name: str, n_ciphertexts: int, value_count: int | None = None) -> CiphertextBlock:
    return CiphertextBlock(
        name=name,
        key_bits=KEY_BITS,
        slot_bits=64,
        slots_per_ciphertext=7,
        value_count=7 * n_ciphertexts if value_count is None else value_count,
        n_ciphertexts=n_ciphertexts,
    )


def payload(*sizes: int, start: int = 1) -> CiphertextPayload:
    blocks = tuple(block(f"b{i}", n) for i, n in enumerate(sizes))
    counter = iter(range(start, start + sum(sizes)))
    # Values near both ends of the width catch truncation and sign mistakes.
    cts = {
        b.name: [(1 << (8 * WIDTH)) - next(counter) for _ in range(b.n_ciphertexts)] for b in blocks
    }
    return CiphertextPayload(blocks, cts)


def test_block_round_trip_and_width() -> None:
    blocks = (block("scatter", 3, value_count=20), block("sum", 1, value_count=3))
    assert serde.blocks_from_proto(serde.blocks_to_proto(blocks)) == blocks
    assert blocks[0].ciphertext_bytes == WIDTH
    assert ciphertext_width(2048) == 512 and ciphertext_width(3072) == 768
    assert ciphertext_width(1001) == 2 * 126


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "needs a name"),
        ({"n_ciphertexts": 0}, "n_ciphertexts must be >= 1"),
        ({"slot_bits": 80}, "do not fit below a 512-bit modulus"),
        ({"value_count": 100}, "100 values do not fit"),
    ],
)
def test_block_validation(kwargs: dict[str, object], match: str) -> None:
    values: dict[str, object] = dict(
        name="x",
        key_bits=512,
        slot_bits=64,
        slots_per_ciphertext=7,
        value_count=10,
        n_ciphertexts=2,
    )
    values.update(kwargs)
    with pytest.raises(LayoutError, match=match):
        CiphertextBlock(**values)  # type: ignore[arg-type]


def test_layout_errors_from_the_wire_are_protocol_errors() -> None:
    good = serde.blocks_to_proto([block("a", 1)])
    with pytest.raises(ProtocolError, match="duplicate block names"):
        serde.blocks_from_proto([good[0], good[0]])
    other_key = serde.blocks_to_proto([dataclasses.replace(block("b", 1), key_bits=1024)])
    with pytest.raises(ProtocolError, match="share key_bits"):
        serde.blocks_from_proto([good[0], other_key[0]])
    with pytest.raises(ProtocolError, match="at least one block"):
        serde.blocks_from_proto([])


# ------------------------------------------------------------ bytes and chunks


def test_ciphertext_bytes_round_trip_fixed_width() -> None:
    values = [0, 1, (1 << 1024) - 1, 12345678901234567890]
    data = ciphertexts_to_bytes(values, WIDTH)
    assert len(data) == 4 * WIDTH
    assert data[:WIDTH] == bytes(WIDTH)
    assert ciphertexts_from_bytes(data, WIDTH) == values


def test_ciphertext_out_of_range_is_refused() -> None:
    with pytest.raises(CiphertextError, match=r"ciphertext 1 .* 128 bytes"):
        ciphertexts_to_bytes([1, 1 << 1024], WIDTH)
    with pytest.raises(CiphertextError, match="ciphertext 0 is negative"):
        ciphertexts_to_bytes([-1], WIDTH)


def test_payload_must_match_layout() -> None:
    with pytest.raises(LayoutError, match="declares 2 ciphertexts, got 1"):
        CiphertextPayload((block("a", 2),), {"a": [5]})
    with pytest.raises(LayoutError, match="ciphertexts given for blocks"):
        CiphertextPayload((block("a", 1),), {"b": [5]})


@pytest.mark.parametrize(
    "max_bytes", [64 + WIDTH, 64 + 3 * WIDTH, 1000, DEFAULT_CHUNK_MESSAGE_BYTES]
)
def test_chunks_stay_under_max_message_size(max_bytes: int) -> None:
    data = payload(5, 4, 2)
    messages = serde.encode_upload("q1", "fp", "u1", data, max_message_bytes=max_bytes)
    assert all(m.ByteSize() <= max_bytes for m in messages[1:])
    header, back = serde.read_upload(messages)
    assert back == data
    per_chunk = (max_bytes - 64) // WIDTH
    assert header.total_chunks == math.ceil(11 / per_chunk) == len(messages) - 1


def test_default_chunk_size_with_production_keys() -> None:
    blocks = (dataclasses.replace(block("scatter", 9000), key_bits=3072),)
    data = CiphertextPayload(blocks, {"scatter": [7] * 9000})
    messages = serde.encode_upload("q1", "fp", "u1", data)
    sizes = [m.ByteSize() for m in messages[1:]]
    assert max(sizes) <= UPLOAD_CHUNK_BYTES  # as owners cut them, under the proxy's limit
    per_chunk = (UPLOAD_CHUNK_BYTES - 64) // 768  # 341 ciphertexts of a 3072-bit key
    assert len(sizes) == math.ceil(9000 / per_chunk) == 27  # 9000 * 768 B = 6.6 MiB


def test_too_small_max_message_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot hold one 128-byte ciphertext"):
        serde.encode_upload("q1", "fp", "u1", payload(1), max_message_bytes=100)


def test_upload_header_round_trip() -> None:
    data = payload(3, 1)
    messages = serde.encode_upload("q1", "sha256:key", "u-123", data, max_message_bytes=400)
    header = serde.upload_header_from_message(messages[0])
    assert header.query_id == "q1" and header.upload_id == "u-123"
    assert header.analyst_key_fingerprint == "sha256:key"
    assert header.blocks == data.blocks
    # Each chunk carries its link of the hash chain, from the defining equation.
    link = hashlib.sha256(b"fedpca ciphertext chunk chain v1").digest()
    for message in messages[1:]:
        chunk = message.chunk
        link = hashlib.sha256(link + chunk.index.to_bytes(4, "big") + chunk.ciphertexts).digest()
        assert chunk.sha256 == link
    assert not messages[0].header.content_sha256  # nothing is declared up front
    assert len(new_upload_id()) == 32 and new_upload_id() != new_upload_id()
    assert header.public_record_count is None  # stats mode: the count stays encrypted


@pytest.mark.parametrize("count", [0, 351, 1 << 40])
def test_upload_header_carries_the_public_record_count(count: int) -> None:
    # Masked mode sends N_l in the clear; 0 must survive (presence, not truthiness).
    messages = serde.encode_upload("q1", "fp", "u1", payload(1), public_record_count=count)
    assert messages[0].header.HasField("public_record_count")
    assert serde.upload_header_from_message(messages[0]).public_record_count == count
    header, _ = serde.read_upload(messages)
    assert header.public_record_count == count


def test_negative_public_record_count_cannot_be_encoded() -> None:
    with pytest.raises(ConfigError, match="public_record_count"):
        serde.encode_upload("q1", "fp", "u1", payload(1), public_record_count=-1)


# ---------------------------------------------------- every ProtocolError case


def _upload(max_bytes: int = 64 + 2 * WIDTH) -> list[owner_pb.UploadMessage]:
    # 5 ciphertexts, 2 per chunk -> chunks of 2, 2, 1.
    return serde.encode_upload("q1", "fp", "u1", payload(3, 2), max_message_bytes=max_bytes)


def _rechain(messages: list[owner_pb.UploadMessage]) -> None:
    """Recompute every chunk's link (a sender that changed a chunk and fixed the chain)."""
    link = hashlib.sha256(b"fedpca ciphertext chunk chain v1").digest()
    for message in messages:
        if message.WhichOneof("payload") == "chunk":
            chunk = message.chunk
            link = hashlib.sha256(
                link + chunk.index.to_bytes(4, "big") + chunk.ciphertexts
            ).digest()
            chunk.sha256 = link


def _drop_last_byte(messages: list[owner_pb.UploadMessage]) -> None:
    messages[1].chunk.ciphertexts = messages[1].chunk.ciphertexts[:-1]
    _rechain(messages)


def _swap_chunks(messages: list[owner_pb.UploadMessage]) -> None:
    messages[1], messages[2] = messages[2], messages[1]


def _repeat_chunk(messages: list[owner_pb.UploadMessage]) -> None:
    messages.insert(2, messages[1])


def _corrupt_chunk(messages: list[owner_pb.UploadMessage]) -> None:
    data = bytearray(messages[2].chunk.ciphertexts)
    data[5] ^= 1
    messages[2].chunk.ciphertexts = bytes(data)


def _corrupt_chunk_and_its_link(messages: list[owner_pb.UploadMessage]) -> None:
    _corrupt_chunk(messages)
    # Chunk 1's own link made consistent again: chunk 2's link, which commits to it,
    # no longer continues the chain.
    previous = messages[1].chunk.sha256
    chunk = messages[2].chunk
    chunk.sha256 = hashlib.sha256(
        previous + chunk.index.to_bytes(4, "big") + chunk.ciphertexts
    ).digest()


def _extra_ciphertext(messages: list[owner_pb.UploadMessage]) -> None:
    messages[3].chunk.ciphertexts += bytes(WIDTH)
    _rechain(messages)


def _missing_ciphertext(messages: list[owner_pb.UploadMessage]) -> None:
    messages[2].chunk.ciphertexts = messages[2].chunk.ciphertexts[:WIDTH]
    _rechain(messages)


def _missing_chunk(messages: list[owner_pb.UploadMessage]) -> None:
    del messages[3]


def _extra_chunk(messages: list[owner_pb.UploadMessage]) -> None:
    extra = owner_pb.UploadMessage()
    extra.chunk.index = 3
    extra.chunk.ciphertexts = bytes(WIDTH)
    messages.append(extra)
    _rechain(messages)


def _fewer_declared_chunks(messages: list[owner_pb.UploadMessage]) -> None:
    messages[0].header.total_chunks = 2


def _empty_chunk(messages: list[owner_pb.UploadMessage]) -> None:
    messages[1].chunk.ciphertexts = b""
    _rechain(messages)


def _short_chunk_hash(messages: list[owner_pb.UploadMessage]) -> None:
    messages[1].chunk.sha256 = b"\x01" * 31


def _links_of_another_chunking(messages: list[owner_pb.UploadMessage]) -> None:
    # The same bytes cut differently: the first chunk's link names other boundaries.
    other = serde.encode_upload("q1", "fp", "u1", payload(3, 2), max_message_bytes=64 + WIDTH)
    messages[1].chunk.sha256 = other[1].chunk.sha256


def _more_chunks_than_ciphertexts(messages: list[owner_pb.UploadMessage]) -> None:
    messages[0].header.total_chunks = 6


def _chunk_first(messages: list[owner_pb.UploadMessage]) -> None:
    del messages[0]


def _second_header(messages: list[owner_pb.UploadMessage]) -> None:
    messages.insert(2, messages[0])


def _bad_upload_id(messages: list[owner_pb.UploadMessage]) -> None:
    messages[0].header.upload_id = "../etc/passwd"


def _no_fingerprint(messages: list[owner_pb.UploadMessage]) -> None:
    messages[0].header.analyst_key_fingerprint = ""


def _bad_layout(messages: list[owner_pb.UploadMessage]) -> None:
    messages[0].header.blocks[1].name = "b0"


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (_drop_last_byte, r"chunk 0 has 255 bytes, not a multiple of the ciphertext width 128"),
        (_swap_chunks, r"chunk index 1 arrived, expected 0"),
        (_repeat_chunk, r"chunk index 0 arrived, expected 1"),
        (_corrupt_chunk, r"chunk 1 does not continue the hash chain"),
        (_corrupt_chunk_and_its_link, r"chunk 2 does not continue the hash chain"),
        (_extra_ciphertext, r"chunk 2 brings the ciphertext count to 6, layout declares 5"),
        (_missing_ciphertext, r"received 4 ciphertexts, layout declares 5"),
        (_missing_chunk, r"stream ended after 2 of 3 declared chunks"),
        (_extra_chunk, r"chunk 3 exceeds the declared total_chunks=3"),
        (_fewer_declared_chunks, r"chunk 2 exceeds the declared total_chunks=2"),
        (_empty_chunk, r"chunk 0 is empty"),
        (_short_chunk_hash, r"chunk 0 sha256 must be 32 bytes"),
        (_links_of_another_chunking, r"chunk 0 does not continue the hash chain"),
        (_more_chunks_than_ciphertexts, r"total_chunks=6 must be in \[1, 5\]"),
        (_chunk_first, r"must start with an UploadHeader"),
        (_second_header, r"expected a ciphertext chunk after the upload header, got header"),
        (_bad_upload_id, r"upload_id '../etc/passwd' must match"),
        (_no_fingerprint, r"analyst_key_fingerprint is empty"),
        (_bad_layout, r"duplicate block names"),
    ],
)
def test_upload_protocol_errors(
    corrupt: Callable[[list[owner_pb.UploadMessage]], None], match: str
) -> None:
    messages = _upload()
    assert [m.chunk.index for m in messages[1:]] == [0, 1, 2]
    serde.read_upload(messages)  # sanity: intact stream is accepted
    messages = [owner_pb.UploadMessage.FromString(m.SerializeToString()) for m in messages]
    corrupt(messages)
    with pytest.raises(ProtocolError, match=match):
        serde.read_upload(messages)


def test_empty_upload_stream() -> None:
    with pytest.raises(ProtocolError, match="upload stream is empty"):
        serde.read_upload([])


def test_error_messages_name_the_upload() -> None:
    messages = _upload()
    del messages[3]
    with pytest.raises(ProtocolError, match=r"^upload 'u1' for query 'q1': stream ended"):
        serde.read_upload(messages)


def test_assembler_streams_chunks_with_offsets_and_refuses_late_chunks() -> None:
    messages = _upload()
    header = serde.upload_header_from_message(messages[0])
    assembler = header.assembler()
    decoded = [assembler.add(serde.upload_chunk_from_message(m)) for m in messages[1:]]
    assert [d.offset for d in decoded] == [0, 2, 4]
    assert (assembler.chunks_received, assembler.ciphertexts_received) == (3, 5)
    assert assembler.bytes_received == 5 * WIDTH
    assembler.finish()
    with pytest.raises(ProtocolError, match="after the stream ended"):
        assembler.add(messages[1].chunk)


def test_upload_receipt_round_trip() -> None:
    receipt = UploadReceipt("q1", "u1", UploadStatus.DUPLICATE, 3, 5)
    assert serde.upload_receipt_from_proto(serde.upload_receipt_to_proto(receipt)) == receipt
    with pytest.raises(ProtocolError, match=r"UploadReceipt.status"):
        serde.upload_receipt_from_proto(owner_pb.UploadReceipt(query_id="q1"))


# ------------------------------------------------------------ owner session


NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def test_hello_and_proxy_info_round_trip() -> None:
    hello = OwnerHello("owner-1", "0.1.0", (ObfuscationVariant.DJN,))
    assert serde.owner_hello_from_proto(serde.owner_hello_to_proto(hello)) == hello
    info = ProxyInfo("proxy", "0.1.0", "owner-1", 15.0, 8 << 20, NOW)
    assert serde.proxy_info_from_proto(serde.proxy_info_to_proto(info)) == info


def test_task_ids_and_withdrawal_reasons_from_the_proxy_are_checked() -> None:
    """Found by review: a proxy could put line breaks into an owner's log lines (and its
    ledger keys) through the task id or a cancellation."""
    forged = owner_pb.TaskEvent(cancellation=owner_pb.TaskCancellation(query_id="a/q\nFAKE"))
    with pytest.raises(ProtocolError):
        serde.task_event_from_proto(forged)
    wordy = owner_pb.TaskEvent(
        cancellation=owner_pb.TaskCancellation(query_id="alice/q1", reason="x\ny" * 500)
    )
    event = serde.task_event_from_proto(wordy)
    assert "\n" not in event.reason and len(event.reason) <= MAX_DECLINE_DETAIL


def test_task_stream_request() -> None:
    message = serde.task_stream_request_to_proto("owner-1")
    assert serde.task_stream_request_from_proto(message) == ("owner-1", ())
    keys = ("alice/q1", "bob/q-2")
    message = serde.task_stream_request_to_proto("owner-1", keys)
    assert serde.task_stream_request_from_proto(message) == ("owner-1", keys)
    # The sender cuts a long list; the receiver refuses one that was not cut, and keys
    # that are not task keys.
    many = [f"alice/q{i}" for i in range(serde.MAX_IN_FLIGHT_TASKS + 5)]
    sent = serde.task_stream_request_to_proto("owner-1", many)
    assert len(sent.in_flight_tasks) == serde.MAX_IN_FLIGHT_TASKS
    for bad in (
        owner_pb.TaskStreamRequest(in_flight_tasks=many),
        owner_pb.TaskStreamRequest(in_flight_tasks=["../etc"]),
    ):
        with pytest.raises(ProtocolError):
            serde.task_stream_request_from_proto(bad)


def test_unknown_capabilities_are_ignored() -> None:
    message = owner_pb.OwnerHello(node_id="o", obfuscation_variants=[1, 42])
    assert serde.owner_hello_from_proto(message).obfuscation_variants == (ObfuscationVariant.FULL,)


@pytest.mark.parametrize(
    "event",
    [
        Heartbeat(sent_at=NOW),
        Task(query=dca_spec(), upload_deadline=NOW + timedelta(minutes=5)),
        Task(
            query=pca_spec(),
            upload_deadline=NOW,
            accepted_obfuscation_variants=(ObfuscationVariant.FULL,),
        ),
        # As the proxy forwards it: the analyst's signature and the task id.
        Task(
            query=pca_spec(),
            upload_deadline=NOW,
            query_signature=sign_query(pca_spec(), TEST_SIGNING_KEY),
            query_signer=TEST_SIGNER,
            task_id="alice/" + pca_spec().query_id,
        ),
        TaskCancellation(query_id="alice/q1", reason="deadline passed"),
    ],
)
def test_task_event_round_trip(event: TaskEvent) -> None:
    wire = serde.task_event_to_proto(event).SerializeToString()
    assert serde.task_event_from_proto(owner_pb.TaskEvent.FromString(wire)) == event


def test_task_event_errors() -> None:
    with pytest.raises(ProtocolError, match="carries no event"):
        serde.task_event_from_proto(owner_pb.TaskEvent())
    message = serde.task_event_to_proto(Task(query=pca_spec(), upload_deadline=NOW))
    message.task.ClearField("upload_deadline")
    with pytest.raises(ProtocolError, match="upload_deadline missing"):
        serde.task_event_from_proto(message)
    # A proxy's 4 MiB query id is quoted cut: the owner logs this error (a review wrote
    # 84 MB of log in 0.3 s with 20 such events).
    message.task.query.query_id = "q" * (4 << 20)
    with pytest.raises(ProtocolError, match="upload_deadline missing") as info:
        serde.task_event_from_proto(message)
    assert len(str(info.value)) < 200


def test_timestamps_must_be_timezone_aware() -> None:
    with pytest.raises(ConfigError, match="timezone-aware"):
        serde.task_event_to_proto(Heartbeat(sent_at=datetime(2026, 1, 1)))
    # Other offsets are fine and compare equal after the round trip.
    plus_two = NOW.astimezone(timezone(timedelta(hours=2)))
    back = serde.task_event_from_proto(serde.task_event_to_proto(Heartbeat(plus_two)))
    assert back == Heartbeat(NOW)


@pytest.mark.parametrize("reason", list(DeclineReason))
def test_task_decline_round_trip(reason: DeclineReason) -> None:
    decline = TaskDecline("q1", reason, "epsilon above local cap")
    assert serde.task_decline_from_proto(serde.task_decline_to_proto(decline)) == decline


def test_task_decline_needs_a_reason() -> None:
    with pytest.raises(ProtocolError, match=r"TaskDecline.reason"):
        serde.task_decline_from_proto(owner_pb.TaskDecline(query_id="q1"))
    assert serde.decline_receipt_from_proto(serde.decline_receipt_to_proto("q1")) == "q1"


def test_query_ids_from_peers_follow_the_upload_id_rule() -> None:
    """1 MiB ids and ids with line breaks are refused wherever a peer names a query,
    with a message that quotes at most 40 characters of them (issue 15)."""
    header = serde.encode_upload("alice/q1", "fp", "u1", payload(1))[0]
    for good in ("q1", "alice/q1", "a.b_c-D9/" + "x" * 128):
        assert serde.query_ref_from_proto(analyst_pb.QueryRef(query_id=good.split("/")[-1]))
        decline = owner_pb.TaskDecline(query_id=good, reason=owner_pb.DECLINE_REASON_POLICY_REFUSAL)
        assert serde.task_decline_from_proto(decline).query_id == good
        header.header.query_id = good
        assert serde.upload_header_from_message(header).query_id == good
    for bad in ("A" * (1 << 20), "q1\nforged", "x" * 129, "alice/", "/q1", "-bad/q1", "a/b/c"):
        parsers: list[Callable[[], object]] = [
            lambda bad=bad: serde.task_decline_from_proto(
                owner_pb.TaskDecline(query_id=bad, reason=owner_pb.DECLINE_REASON_POLICY_REFUSAL)
            ),
        ]
        if "/" not in bad:
            parsers.append(
                lambda bad=bad: serde.query_ref_from_proto(analyst_pb.QueryRef(query_id=bad))
            )
        bad_header = owner_pb.UploadMessage()
        bad_header.CopyFrom(header)
        bad_header.header.query_id = bad
        parsers.append(lambda m=bad_header: serde.upload_header_from_message(m))
        for parse in parsers:
            with pytest.raises(ProtocolError) as info:
                parse()
            assert len(str(info.value)) < 200 and "\n" not in str(info.value), bad[:20]
    bad_header = owner_pb.UploadMessage()
    bad_header.CopyFrom(header)
    bad_header.header.upload_id = "u" * (1 << 20)
    with pytest.raises(ProtocolError, match="upload_id") as info:
        serde.upload_header_from_message(bad_header)
    assert len(str(info.value)) < 200


# ------------------------------------------------------------ analyst side


def test_submit_and_query_ref() -> None:
    spec = dca_spec()
    query = signed(spec)
    back = serde.submit_query_request_from_proto(serde.submit_query_request_to_proto(query))
    assert back == query and back.spec == spec
    verify_query(back.spec, back.signature, back.signer)  # the signature survives the wire
    # An unsigned request reads as unsigned (the proxy refuses it, not the parser).
    unsigned = serde.submit_query_request_to_proto(SignedQuery(spec))
    assert serde.submit_query_request_from_proto(unsigned) == SignedQuery(spec, b"", "")
    with pytest.raises(ProtocolError, match="query is missing"):
        serde.submit_query_request_from_proto(analyst_pb.SubmitQueryRequest())
    for oversized in (
        dataclasses.replace(query, signature=b"\x01" * 257),
        dataclasses.replace(query, signer="ed25519:" + "0" * 100),
    ):
        with pytest.raises(ProtocolError, match="signature or signer is too long"):
            serde.submit_query_request_from_proto(serde.submit_query_request_to_proto(oversized))
    assert serde.query_ref_from_proto(serde.query_ref_to_proto("q9")) == "q9"
    with pytest.raises(ProtocolError, match=r"QueryRef.query_id is empty"):
        serde.query_ref_from_proto(analyst_pb.QueryRef())


@pytest.mark.parametrize(
    "status",
    [
        QueryStatus("q1", QueryState.NOISING, 2, 2),
        QueryStatus("q1", QueryState.COLLECTING, 1, 2, 1, NOW),
        QueryStatus("q1", QueryState.FAILED, 1, 2, 0, NOW, "quorum not reached"),
        QueryStatus("q1", QueryState.DONE, 2, 2, failure_reason=""),
        QueryStatus("q1", QueryState.COLLECTING, 1, 4, owners_uploading=3),
        QueryStatus(
            "q1", QueryState.AGGREGATING, 0, 2, owners_uploading=2, pages_final=3, pages_total=8
        ),
        # Public declines and the allow-list's size reach the analyst.
        QueryStatus(
            "q1",
            QueryState.FAILED,
            0,
            3,
            2,
            NOW,
            "the quorum of 3 can no longer be reached",
            declines=(
                OwnerDecline("owner-1", "policy_refusal", "epsilon above the cap"),
                OwnerDecline("owner-2", "unsigned_query"),
            ),
            owners_registered=3,
        ),
        # Where the query's epsilon stands on the analyst's ledger.
        *(QueryStatus("q1", QueryState.FAILED, 1, 2, charge=charge) for charge in Charge),
        # A result the proxy has deleted.
        QueryStatus("q1", QueryState.DONE, 2, 2, result_deleted_at=NOW),
    ],
)
def test_query_status_round_trip(status: QueryStatus) -> None:
    assert serde.query_status_from_proto(serde.query_status_to_proto(status)) == status


def test_a_status_without_a_charge_is_read_as_unknown() -> None:
    """An older proxy sends no charge (and an older analyst ignores it): the status is
    still read, its charge UNKNOWN; so is a value a later version may add."""
    message = analyst_pb.QueryStatus(query_id="q", state=analyst_pb.QUERY_STATE_FAILED)
    assert serde.query_status_from_proto(message).charge is Charge.UNKNOWN
    message.charge = 99  # type: ignore[assignment]
    assert serde.query_status_from_proto(message).charge is Charge.UNKNOWN
    sent = serde.query_status_to_proto(
        QueryStatus("q", QueryState.FAILED, 0, 2, charge=Charge.REFUNDED)
    )
    assert sent.charge == analyst_pb.QUERY_CHARGE_REFUNDED


@pytest.mark.parametrize("state", [analyst_pb.QUERY_STATE_PENDING])
def test_query_states_no_proxy_reports_are_refused(state: int) -> None:
    # The wire numbers PENDING, but the lifecycle has no such state.
    message = serde.query_status_to_proto(QueryStatus("q1", QueryState.COLLECTING, 0, 2))
    message.state = state
    with pytest.raises(ProtocolError, match="state: enum value"):
        serde.query_status_from_proto(message)


def test_query_state_terminal() -> None:
    assert {s for s in QueryState if s.terminal} == {
        QueryState.DONE,
        QueryState.FAILED,
    }


def test_budget_round_trip() -> None:
    status = BudgetStatus("analyst-1", 1e-6, 1.25, 8.75, 10.0, 3)
    assert serde.budget_status_from_proto(serde.budget_status_to_proto(status)) == status
    for next_query in (
        NextQuery(0.412345, 1e-6, AdmissionLimit.BUDGET),
        NextQuery(0.0, 1e-7, AdmissionLimit.EXHAUSTED),
        NextQuery(math.inf, 1e-6, AdmissionLimit.UNLIMITED),
        NextQuery(100.721, 1e-6, AdmissionLimit.NOISE_FLOOR),
    ):
        status = BudgetStatus("analyst-1", 1e-6, 1.25, 8.75, 10.0, 3, 1e-5, next_query)
        assert serde.budget_status_from_proto(serde.budget_status_to_proto(status)) == status
    assert serde.budget_request_from_proto(serde.budget_request_to_proto()) == (None, None)
    assert serde.budget_request_from_proto(serde.budget_request_to_proto(1e-5)) == (1e-5, None)
    both = serde.budget_request_to_proto(1e-5, query_delta=1e-7)
    assert serde.budget_request_from_proto(both) == (1e-5, 1e-7)
    with pytest.raises(ProtocolError, match="delta must be in"):
        serde.budget_request_from_proto(serde.budget_request_to_proto(0.0))
    with pytest.raises(ProtocolError, match="query_delta must be in"):
        serde.budget_request_from_proto(serde.budget_request_to_proto(query_delta=1.0))


def test_a_next_query_a_peer_sends_is_checked() -> None:
    status = BudgetStatus(
        "a", 1e-6, 1.25, 8.75, 10.0, 3, 1e-5, NextQuery(0.5, 1e-6, AdmissionLimit.BUDGET)
    )
    message = serde.budget_status_to_proto(status)
    message.next_query.limit = analyst_pb.ADMISSION_LIMIT_UNSPECIFIED
    with pytest.raises(ProtocolError, match=r"NextQuery\.limit"):
        serde.budget_status_from_proto(message)
    message = serde.budget_status_to_proto(status)
    message.next_query.epsilon = 0.0  # 0 only goes with EXHAUSTED
    with pytest.raises(ProtocolError, match="does not go with limit budget"):
        serde.budget_status_from_proto(message)
    message.next_query.delta = 0.0
    with pytest.raises(ProtocolError, match="delta must be in"):
        serde.budget_status_from_proto(message)


NOISE = NoiseDescription(
    mechanism=NoiseMechanism.GAUSSIAN,
    calibration=Calibration.ANALYTIC,
    epsilon=1.0,
    delta=1e-6,
    sections=(NoiseSection("scatter", 3.5), NoiseSection("sum", 1.25)),
)


def _result(mode: ProtocolMode) -> QueryResult:
    spec = dca_spec() if mode is ProtocolMode.MASKED else pca_spec()
    return QueryResult(
        query=spec,
        n_owners=3,
        noise=NOISE,
        payload=payload(4, 2),
        masked_mean_block="b1" if mode is ProtocolMode.MASKED else None,
        # Masked mode: the public N, beyond 32 bits to show the field is a uint64.
        public_record_count=5_000_000_000 if mode is ProtocolMode.MASKED else None,
    )


@pytest.mark.parametrize("mode", list(ProtocolMode))
def test_result_round_trip(mode: ProtocolMode) -> None:
    result = _result(mode)
    messages = serde.encode_result(result, max_message_bytes=64 + 4 * WIDTH)
    assert len(messages) == 3
    wire = [analyst_pb.ResultMessage.FromString(m.SerializeToString()) for m in messages]
    assert serde.decode_result(wire) == result
    masked = mode is ProtocolMode.MASKED
    # N is in the header in masked mode only (stats mode: absent, not 0).
    assert wire[0].header.HasField("public_record_count") is masked
    assert serde.decode_result(wire).public_record_count == (5_000_000_000 if masked else None)


def test_result_with_infinite_epsilon() -> None:
    noise = NoiseDescription(NoiseMechanism.NONE, Calibration.ANALYTIC, math.inf, 0.0)
    result = dataclasses.replace(
        _result(ProtocolMode.STATS), query=pca_spec(epsilon=math.inf), noise=noise
    )
    assert serde.decode_result(serde.encode_result(result)) == result


def test_result_errors() -> None:
    with pytest.raises(LayoutError, match="masked mode needs masked_mean_block"):
        dataclasses.replace(_result(ProtocolMode.MASKED), masked_mean_block=None)
    with pytest.raises(LayoutError, match="masked mode needs public_record_count"):
        dataclasses.replace(_result(ProtocolMode.MASKED), public_record_count=None)
    with pytest.raises(LayoutError, match="only valid in masked mode"):
        dataclasses.replace(_result(ProtocolMode.STATS), public_record_count=3)
    with pytest.raises(LayoutError, match="must be an int >= 1"):
        dataclasses.replace(_result(ProtocolMode.MASKED), public_record_count=True)
    with pytest.raises(LayoutError, match="not a block of the result"):
        dataclasses.replace(_result(ProtocolMode.MASKED), masked_mean_block="nope")
    messages = serde.encode_result(_result(ProtocolMode.MASKED))
    with pytest.raises(ProtocolError, match="must start with a ResultHeader"):
        serde.decode_result(messages[1:])
    messages[0].header.ClearField("masked_mean_block")
    with pytest.raises(ProtocolError, match="masked mode needs masked_mean_block"):
        serde.decode_result(messages)
    messages = serde.encode_result(_result(ProtocolMode.MASKED))
    messages[0].header.ClearField("public_record_count")
    with pytest.raises(ProtocolError, match="masked mode needs public_record_count"):
        serde.decode_result(messages)
    messages[0].header.public_record_count = 0
    with pytest.raises(ProtocolError, match="public_record_count must be an int >= 1, got 0"):
        serde.decode_result(messages)
    messages = serde.encode_result(_result(ProtocolMode.STATS))
    messages[0].header.public_record_count = 7
    with pytest.raises(ProtocolError, match="public_record_count is only valid in masked mode"):
        serde.decode_result(messages)
    messages = serde.encode_result(_result(ProtocolMode.STATS))
    messages[1].chunk.ciphertexts = messages[1].chunk.ciphertexts[::-1]
    with pytest.raises(ProtocolError, match=r"^result of query 'q-pca': chunk 0 does not continue"):
        serde.decode_result(messages)
    messages = serde.encode_result(_result(ProtocolMode.STATS))
    messages[0].header.ClearField("noise")
    with pytest.raises(ProtocolError, match=r"ResultHeader.noise is missing"):
        serde.decode_result(messages)


@pytest.mark.parametrize("delta", [math.nan, -1e-9, 1.0, math.inf])
def test_a_spec_needs_a_real_delta_even_without_noise(delta: float) -> None:
    # epsilon = inf ignores delta, but a NaN there was accepted and stored (found by
    # the servicer fuzz tests).
    with pytest.raises(ConfigError, match="delta must be in"):
        pca_spec(epsilon=math.inf, delta=delta)
    assert pca_spec(epsilon=math.inf, delta=0.0).delta == 0.0


def test_query_summaries_round_trip_with_their_aggregate_kinds() -> None:
    from datetime import UTC, datetime

    from fedpca.messages import QuerySummary
    from fedpca.query import AggregateKind, ProtocolMode, QueryKind

    status = QueryStatus("q1", QueryState.DONE, 2, 2)
    made = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    summaries = [
        QuerySummary(
            status,
            QueryKind.AGGREGATE,
            ProtocolMode.STATS,
            1.0,
            1e-6,
            made,
            (AggregateKind.HISTOGRAM, AggregateKind.LINREG),
        ),
        QuerySummary(status, QueryKind.PCA, ProtocolMode.MASKED, 0.5, 1e-7, made),
    ]
    back = serde.query_list_from_proto(serde.query_list_to_proto(summaries))
    assert back == summaries
    assert [item.what for item in back] == ["aggregate:histogram+linreg", "pca"]


def test_what_a_peer_answers_is_bounded_before_it_is_kept_or_logged() -> None:
    """A malicious proxy's text reached the owner's and the analyst's logs in full, and
    a peer's capability list was decoded entry by entry (review)."""
    now = datetime.now(UTC)
    info = serde.proxy_info_to_proto(ProxyInfo("proxy", "1", "owner-1", 1.0, 1 << 20, now))
    info.authenticated_node_id = "x" * 5_000_000
    with pytest.raises(ProtocolError, match=r"ProxyInfo\.authenticated_node_id"):
        serde.proxy_info_from_proto(info)
    hello = owner_pb.OwnerHello(node_id="owner-1", software_version="1")
    hello.obfuscation_variants.extend([1] * 17)
    with pytest.raises(ProtocolError, match="more than 16 obfuscation variants"):
        serde.owner_hello_from_proto(hello)
    status = analyst_pb.QueryStatus(query_id="q", state=analyst_pb.QUERY_STATE_COLLECTING)
    status.declines.add(owner_id="owner-1", reason="policy_refusal", detail="d" * 5000)
    with pytest.raises(ProtocolError, match=r"declines.detail .* more than 4000"):
        serde.query_status_from_proto(status)
    many = analyst_pb.QueryStatus(query_id="q", state=analyst_pb.QUERY_STATE_COLLECTING)
    for index in range(4097):
        many.declines.add(owner_id=f"o{index}", reason="policy_refusal")
    with pytest.raises(ProtocolError, match="more than 4096 declines"):
        serde.query_status_from_proto(many)
    noise = analyst_pb.NoiseDescription()
    for _ in range(1025):
        noise.sections.add(name="s", sigma=1.0)
    with pytest.raises(ProtocolError, match="more than 1024 sections"):
        serde.noise_description_from_proto(noise)
