"""Fuzzing every parser of untrusted input with hypothesis (bounded, reproducible).

Each parser gets random bytes and structured-but-wrong inputs:

* protobuf messages: random and mutated bytes through ``ParseFromString``, and
  messages generated field by field from their descriptors (every scalar over its
  whole wire range, unknown enum values, out-of-range timestamps), then the
  matching ``serde.*_from_proto``;
* the upload and result stream readers (``serde.read_upload``,
  ``serde.decode_result``) on mutated streams: dropped, duplicated, reordered,
  resized or flipped chunks, wrong indices and hashes, changed header fields and
  block layouts, huge declared counts;
* ciphertext byte decoding (serde framing and the codec's Z*_{n^2} validation):
  wrong lengths and counts, 0, n^2 and above, multiples of p, q and n;
* owner tables: CSV text with NaN/inf/huge/non-numeric/empty cells, ragged rows,
  a BOM, every header mode; random and mutated ``.npy`` bytes and arrays of every
  dtype; random and wrongly typed Parquet files;
* the owner, proxy and analyst TOML configs: valid documents with keys removed,
  retyped or added, whole random TOML documents, random bytes;
* Paillier key files: random JSON, near-valid documents with wrong fields or
  composite factors, random bytes.

The property is always the same: the parse either succeeds and its result
satisfies the documented invariants, or raises a :class:`~fedpca.errors.FedpcaError`
subclass with a non-empty message. Any other exception (IndexError, KeyError,
UnicodeDecodeError, a bare ValueError, ...) fails the test with the input that
caused it. Settings are derandomized and use no example database, so every run
tries the very same inputs.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import gmpy2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst
from phe import paillier

from fedpca import tables
from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.codec import ciphertext as codec_ciphertext
from fedpca.codec.keys import key_fingerprint, load_private_key, load_public_key
from fedpca.dp.accounting import Accountant
from fedpca.errors import ConfigError, FedpcaError
from fedpca.messages import (
    CiphertextBlock,
    CiphertextPayload,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    QueryResult,
    QueryState,
    QueryStatus,
    Task,
    UploadHeader,
    check_layout,
    ciphertext_width,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
)
from fedpca.owner.config import load_config as load_owner_config
from fedpca.proxy.config import load_config as load_proxy_config
from fedpca.query import Calibration, Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.tables import load_table
from fedpca.transport import serde
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import ciphertext_pb2 as ciphertext_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import query_pb2 as query_pb
from helpers import fuzz_settings

T = TypeVar("T")


def parse_or_refuse(parse: Callable[[], T]) -> T | None:
    """Run a parser: its result, or None after a FedpcaError with a message.

    Any other exception propagates and fails the test (hypothesis then shrinks and
    prints the input).
    """
    try:
        return parse()
    except FedpcaError as error:
        assert str(error).strip(), f"{type(error).__name__} raised without a message"
        return None


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the files written by the examples (each overwrites its own name)."""
    return tmp_path_factory.mktemp("fuzz")


# ==================================================================== protobuf
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalar_strategy(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Any value the wire can carry for one scalar field (edges included)."""
    kind = field.type
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return st.one_of(
            st.integers(low, high), st.sampled_from([low, high, 0, 1, 2, 3, 8, 48, 64, 512])
        )
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=12), st.sampled_from(["", "shares", "q", "a" * 200]))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if kind == FieldDescriptor.TYPE_ENUM:
        # proto3 enums are open: a peer may send numbers this version does not know.
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise AssertionError(f"no strategy for field type {kind} of {field.full_name}")


def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of one type with an arbitrary subset of fields set to arbitrary values."""
    message_class = message_factory.GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None:
            if depth >= 3:
                continue
            value: st.SearchStrategy[Any] = message_strategy(field.message_type, depth + 1)
        else:
            value = scalar_strategy(field)
        optional[field.name] = st.lists(value, max_size=4) if field.is_repeated else value

    def build(values: dict[str, Any]) -> Message:
        message = message_class()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            target = getattr(message, name) if field.is_repeated or field.message_type else None
            if field.is_repeated and field.message_type is not None:
                for item in value:
                    target.add().CopyFrom(item)
            elif field.is_repeated:
                target.extend(value)
            elif field.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


# (message class, wire -> domain, domain -> wire or None)
_DECODERS: list[tuple[type[Message], Callable[[Any], Any], Callable[[Any], Message] | None]] = [
    (query_pb.QuerySpec, serde.query_spec_from_proto, serde.query_spec_to_proto),
    (owner_pb.OwnerHello, serde.owner_hello_from_proto, serde.owner_hello_to_proto),
    (owner_pb.ProxyInfo, serde.proxy_info_from_proto, serde.proxy_info_to_proto),
    (
        owner_pb.TaskStreamRequest,
        serde.task_stream_request_from_proto,
        lambda decoded: serde.task_stream_request_to_proto(*decoded),
    ),
    (owner_pb.TaskEvent, serde.task_event_from_proto, serde.task_event_to_proto),
    (owner_pb.TaskDecline, serde.task_decline_from_proto, serde.task_decline_to_proto),
    (owner_pb.DeclineReceipt, serde.decline_receipt_from_proto, serde.decline_receipt_to_proto),
    (owner_pb.UploadMessage, serde.upload_header_from_message, None),
    (owner_pb.UploadReceipt, serde.upload_receipt_from_proto, serde.upload_receipt_to_proto),
    (
        analyst_pb.SubmitQueryRequest,
        serde.submit_query_request_from_proto,
        serde.submit_query_request_to_proto,
    ),
    (analyst_pb.QueryRef, serde.query_ref_from_proto, serde.query_ref_to_proto),
    (analyst_pb.QueryStatus, serde.query_status_from_proto, serde.query_status_to_proto),
    (
        analyst_pb.NoiseDescription,
        serde.noise_description_from_proto,
        serde.noise_description_to_proto,
    ),
    (
        analyst_pb.BudgetRequest,
        serde.budget_request_from_proto,
        lambda decoded: serde.budget_request_to_proto(*decoded),
    ),
    (analyst_pb.BudgetStatus, serde.budget_status_from_proto, serde.budget_status_to_proto),
    (analyst_pb.ResultMessage, lambda m: serde.decode_result([m]), None),
    (
        query_pb.OwnerTerms,
        lambda message: serde.owner_terms_from_proto(message, "OwnerTerms"),
        serde.owner_terms_to_proto,
    ),
]


def _wire(message: Message) -> bytes:
    return message.SerializeToString(deterministic=True)


def check_decoded(
    message: Message,
    decode: Callable[[Any], Any],
    encode: Callable[[Any], Message] | None,
) -> None:
    """Decode one message; a success must re-encode, and re-encoding must be stable."""
    decoded = parse_or_refuse(lambda: decode(message))
    if decoded is None:
        return
    if isinstance(decoded, UploadHeader):
        # Invariants of a decoded header: a valid layout and a consistent chunk count.
        assert check_layout(decoded.blocks) >= 2
        assembler = decoded.assembler()
        assert 1 <= assembler.total_chunks <= assembler.expected_ciphertexts
        return
    if encode is None:
        return
    # Whatever the wire carried must be representable on the wire again, and one
    # round of normalisation (defaults filled in, unknown variants dropped) is final.
    wire = _wire(encode(decoded))
    assert _wire(encode(decode(type(message).FromString(wire)))) == wire


@fuzz_settings(max_examples=400)
@given(st.sampled_from(_DECODERS), st.binary(max_size=120))
def test_random_bytes_into_every_message_parser(
    decoder: tuple[type[Message], Callable[[Any], Any], Callable[[Any], Message] | None],
    data: bytes,
) -> None:
    message_class, decode, encode = decoder
    try:
        message = message_class.FromString(data)
    except DecodeError:
        return  # protobuf itself refused the bytes; nothing reached fedpca
    check_decoded(message, decode, encode)


@fuzz_settings(max_examples=500)
@given(st.data())
def test_structured_messages_into_every_message_parser(data: st.DataObject) -> None:
    message_class, decode, encode = data.draw(st.sampled_from(_DECODERS), label="decoder")
    message = data.draw(message_strategy(message_class.DESCRIPTOR), label="message")
    check_decoded(message, decode, encode)


def _valid_spec(**changes: Any) -> QuerySpec:
    n = (1 << 511) + 187  # any odd modulus: serde does not check keys
    spec = QuerySpec(
        query_id="q-1",
        kind=QueryKind.PCA,
        n_features=3,
        epsilon=1.0,
        delta=1e-5,
        n_components=2,
        analyst_public_key_n=n,
        analyst_key_fingerprint="sha256:" + "ab" * 32,
        feature_lower=(-1.0, -1.0, -1.0),
        feature_upper=(1.0, 1.0, 1.0),
    )
    return replace(spec, **changes)


_VALID_MESSAGES: list[tuple[Message, int]] = [
    (serde.query_spec_to_proto(_valid_spec()), 0),
    (
        serde.task_event_to_proto(
            Task(_valid_spec(mode=ProtocolMode.MASKED), datetime(2030, 1, 1, tzinfo=UTC))
        ),
        4,
    ),
    (serde.query_status_to_proto(QueryStatus("q", QueryState.DONE, 2, 2)), 11),
]


@fuzz_settings(max_examples=300)
@given(
    st.sampled_from(_VALID_MESSAGES),
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(1, 255), st.sampled_from("xtid")),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_valid_encodings_into_their_parsers(
    valid: tuple[Message, int], edits: list[tuple[int, int, str]]
) -> None:
    message, decoder_index = valid
    data = bytearray(_wire(message))
    for position, value, operation in edits:
        where = position % (len(data) + 1)
        if operation == "x" and where < len(data):
            data[where] ^= value
        elif operation == "t":
            del data[where:]
        elif operation == "i":
            data[where:where] = bytes([value])
        elif operation == "d":
            del data[where : where + value % 8 + 1]
    message_class, decode, encode = _DECODERS[decoder_index]
    assert message_class is type(message)
    try:
        parsed = message_class.FromString(bytes(data))
    except DecodeError:
        return
    check_decoded(parsed, decode, encode)


# ============================================================= stream readers
_KEY_BITS = 64
_WIDTH = ciphertext_width(_KEY_BITS)
_BLOCKS = (
    CiphertextBlock("scatter", _KEY_BITS, 7, 8, 10, 2),
    CiphertextBlock("sum", _KEY_BITS, 7, 8, 3, 1),
)
# One ciphertext per chunk: a three-chunk stream.
_SMALL_MESSAGES = 64 + _WIDTH


def _payload(seed: int) -> CiphertextPayload:
    rng = np.random.default_rng(seed)
    values = [int.from_bytes(rng.bytes(_WIDTH), "big") for _ in range(3)]
    return CiphertextPayload.from_wire_order(_BLOCKS, values)


def _upload_stream() -> list[owner_pb.UploadMessage]:
    return serde.encode_upload("q-1", "sha256:" + "ab" * 32, "u-1", _payload(1), _SMALL_MESSAGES)


def _result_stream() -> list[analyst_pb.ResultMessage]:
    noise = NoiseDescription(
        NoiseMechanism.GAUSSIAN,
        Calibration.ANALYTIC,
        1.0,
        1e-5,
        (NoiseSection("scatter", 0.5),),
    )
    result = QueryResult(_valid_spec(), 3, noise, _payload(2))
    return serde.encode_result(result, _SMALL_MESSAGES)


def _header_scalars(descriptor: Descriptor) -> list[FieldDescriptor]:
    return [f for f in descriptor.fields if f.message_type is None and not f.is_repeated]


_BLOCK_FIELDS = [
    f for f in ciphertext_pb.CiphertextBlock.DESCRIPTOR.fields if f.message_type is None
]


@st.composite
def stream_mutations(draw: st.DrawFn, length: int, header: Descriptor) -> list[tuple[Any, ...]]:
    """A list of edits to a header-then-chunks stream of ``length`` messages."""
    index = st.integers(0, length + 1)
    header_field = st.sampled_from(_header_scalars(header)).flatmap(
        lambda f: st.tuples(st.just("header"), st.just(f.name), scalar_strategy(f))
    )
    block_field = st.tuples(st.just("block"), st.integers(0, 3), st.sampled_from(_BLOCK_FIELDS))
    operation = st.one_of(
        st.tuples(st.just("drop"), index),
        st.tuples(st.just("duplicate"), index),
        st.tuples(st.just("swap"), index, index),
        st.tuples(st.just("flip"), index, st.integers(0, 4 * _WIDTH), st.integers(1, 255)),
        st.tuples(st.just("resize"), index, st.integers(-_WIDTH - 1, _WIDTH + 1)),
        st.tuples(st.just("chunk_index"), index, st.integers(0, 2**32 - 1)),
        st.tuples(st.just("chunk_sha"), index, st.binary(max_size=40)),
        st.tuples(st.just("set_ciphertext"), index, st.integers(0, 2 ** (8 * _WIDTH) - 1)),
        st.tuples(st.just("rehash")),
        header_field,
        block_field.flatmap(lambda t: st.tuples(*map(st.just, t), scalar_strategy(t[2]))),
        st.tuples(st.just("drop_block"), st.integers(0, 3)),
        st.tuples(st.just("add_block"), message_strategy(_BLOCK_FIELDS[0].containing_type)),
        st.tuples(st.just("clear"), st.sampled_from([f.name for f in header.fields])),
        st.tuples(st.just("truncate"), index),
        st.tuples(st.just("header_as_chunk")),
    )
    return draw(st.lists(operation, min_size=1, max_size=4))


def _chain(messages: list[Any]) -> list[bytes]:
    """The links of the chunks in ``messages`` by the defining equation, in stream order."""
    link = hashlib.sha256(b"fedpca ciphertext chunk chain v1").digest()
    links = []
    for message in messages:
        if message.WhichOneof("payload") == "chunk":
            chunk = message.chunk
            link = hashlib.sha256(
                link + chunk.index.to_bytes(4, "big") + chunk.ciphertexts
            ).digest()
            links.append(link)
    return links


def _rehash(messages: list[Any]) -> None:
    """Recompute every chunk's link (to get past the hash-chain checks)."""
    chunks = [m for m in messages if m.WhichOneof("payload") == "chunk"]
    for message, link in zip(chunks, _chain(messages), strict=True):
        message.chunk.sha256 = link


def mutate_stream(messages: list[Any], edits: list[tuple[Any, ...]]) -> list[Any]:
    """Apply edits to copies of the messages; out-of-range indices wrap or are ignored."""
    stream = [type(m).FromString(_wire(m)) for m in messages]
    message_class = type(messages[0])
    for edit in edits:
        kind = edit[0]
        chunks = [m for m in stream if m.WhichOneof("payload") == "chunk"]
        headers = [m for m in stream if m.WhichOneof("payload") == "header"]
        if kind == "drop" and stream:
            del stream[edit[1] % len(stream)]
        elif kind == "duplicate" and stream:
            at = edit[1] % len(stream)
            stream.insert(at, type(stream[at]).FromString(_wire(stream[at])))
        elif kind == "swap" and stream:
            i, j = edit[1] % len(stream), edit[2] % len(stream)
            stream[i], stream[j] = stream[j], stream[i]
        elif kind == "flip" and chunks:
            chunk = chunks[edit[1] % len(chunks)].chunk
            data = bytearray(chunk.ciphertexts)
            if data:
                data[edit[2] % len(data)] ^= edit[3]
                chunk.ciphertexts = bytes(data)
        elif kind == "resize" and chunks:
            chunk = chunks[edit[1] % len(chunks)].chunk
            data = chunk.ciphertexts
            delta = edit[2]
            chunk.ciphertexts = data[: len(data) + delta] if delta < 0 else data + b"\x01" * delta
        elif kind == "chunk_index" and chunks:
            chunks[edit[1] % len(chunks)].chunk.index = edit[2]
        elif kind == "chunk_sha" and chunks:
            chunks[edit[1] % len(chunks)].chunk.sha256 = edit[2]
        elif kind == "set_ciphertext" and chunks:
            chunk = chunks[edit[1] % len(chunks)].chunk
            if len(chunk.ciphertexts) >= _WIDTH:
                chunk.ciphertexts = edit[2].to_bytes(_WIDTH, "big") + chunk.ciphertexts[_WIDTH:]
            _rehash(stream)
        elif kind == "rehash":
            _rehash(stream)
        elif kind == "header" and headers:
            setattr(headers[0].header, edit[1], edit[2])
        elif kind == "block" and headers:
            blocks = headers[0].header.blocks
            if blocks:
                setattr(blocks[edit[1] % len(blocks)], edit[2].name, edit[3])
        elif kind == "drop_block" and headers:
            blocks = headers[0].header.blocks
            if blocks:
                del blocks[edit[1] % len(blocks)]
        elif kind == "add_block" and headers:
            headers[0].header.blocks.add().CopyFrom(edit[1])
        elif kind == "clear" and headers:
            headers[0].header.ClearField(edit[1])
        elif kind == "truncate":
            del stream[edit[1] :]
        elif kind == "header_as_chunk" and headers:
            stream[stream.index(headers[0])] = message_class(
                chunk=ciphertext_pb.CiphertextChunk(index=0, ciphertexts=b"\x01" * _WIDTH)
            )
    return stream


def _check_payload(
    payload: CiphertextPayload, blocks: tuple[CiphertextBlock, ...], stream: list[Any]
) -> None:
    """An accepted stream: the layout's ciphertexts, exactly the chunks' bytes, and every
    chunk carrying the link the chain's defining equation gives."""
    assert payload.blocks == blocks
    for block in blocks:
        assert len(payload[block.name]) == block.n_ciphertexts
    chunks = [m.chunk for m in stream if m.WhichOneof("payload") == "chunk"]
    data = ciphertexts_to_bytes(payload.in_wire_order(), payload.ciphertext_bytes)
    assert data == b"".join(chunk.ciphertexts for chunk in chunks)
    assert [chunk.sha256 for chunk in chunks] == _chain(stream)


@fuzz_settings(max_examples=400)
@given(stream_mutations(4, owner_pb.UploadHeader.DESCRIPTOR))
def test_mutated_upload_streams_are_read_or_refused(edits: list[tuple[Any, ...]]) -> None:
    stream = mutate_stream(_upload_stream(), edits)
    read = parse_or_refuse(lambda: serde.read_upload(iter(stream)))
    if read is not None:
        header, payload = read
        _check_payload(payload, header.blocks, stream)
        assert header.total_chunks == len(stream) - 1


@fuzz_settings(max_examples=300)
@given(stream_mutations(4, analyst_pb.ResultHeader.DESCRIPTOR))
def test_mutated_result_streams_are_decoded_or_refused(edits: list[tuple[Any, ...]]) -> None:
    stream = mutate_stream(_result_stream(), edits)
    result = parse_or_refuse(lambda: serde.decode_result(iter(stream)))
    if result is not None:
        header = stream[0].header
        _check_payload(result.payload, result.payload.blocks, stream)
        assert header.total_chunks == len(stream) - 1
        assert (result.masked_mean_block is not None) == (result.query.mode is ProtocolMode.MASKED)


def test_huge_declared_counts_are_refused_before_any_chunk() -> None:
    header = _upload_stream()[0]
    header.header.total_chunks = 2**32 - 1
    with pytest.raises(FedpcaError, match="total_chunks"):
        serde.upload_header_from_message(header)
    header = _upload_stream()[0]
    header.header.blocks[0].n_ciphertexts = 2**64 - 1
    header.header.blocks[0].value_count = 2**64 - 1
    decoded = serde.upload_header_from_message(header)  # a layout may be large ...
    assembler = decoded.assembler()
    with pytest.raises(FedpcaError, match="layout declares"):  # ... but must be delivered
        for message in _upload_stream()[1:]:
            assembler.add(message.chunk)
        assembler.finish()


# ========================================================= ciphertext decoding
@fuzz_settings(max_examples=300)
@given(st.binary(max_size=300), st.integers(-3, 200))
def test_serde_ciphertext_framing(data: bytes, width: int) -> None:
    values = parse_or_refuse(lambda: ciphertexts_from_bytes(data, width))
    if values is not None:
        assert len(values) * width == len(data)
        assert ciphertexts_to_bytes(values, width) == data


@st.composite
def ciphertext_bytes(draw: st.DrawFn, public_key: Any, factor: int) -> tuple[bytes, int]:
    """Serialised 'ciphertexts', some outside Z*_{n^2}, and a declared count."""
    n = public_key.n
    n_square = n * n
    width = codec_ciphertext.ciphertext_byte_length(n.bit_length())
    value = st.one_of(
        st.integers(1, n_square - 1),
        st.sampled_from([0, 1, n_square - 1, n_square, n_square + 1, n, 2 * n, factor]),
        st.integers(1, n * factor).map(lambda k: (k * factor) % n_square),
        st.integers(n_square, 2 ** (8 * width) - 1),
    )
    values = draw(st.lists(value, max_size=5))
    data = b"".join(v.to_bytes(width, "big") for v in values)
    cut = draw(st.integers(-2, 2))
    data = data[: len(data) + cut] if cut < 0 else data + b"\x00" * cut
    count = len(values) + draw(st.sampled_from([0, 0, 0, -1, 1, -(10**6)]))
    return data, count


def test_codec_ciphertext_decoding(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, private_key = test_only_keypair_512
    n = public_key.n

    @fuzz_settings(max_examples=300)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        factor = data.draw(st.sampled_from([private_key.p, private_key.q]), label="factor")
        raw, count = data.draw(ciphertext_bytes(public_key, factor), label="bytes")
        values = parse_or_refuse(
            lambda: codec_ciphertext.ciphertexts_from_bytes(raw, public_key, count)
        )
        if values is not None:
            assert len(values) == count
            assert all(1 <= c < n * n and gmpy2.gcd(c, n) == 1 for c in values)

    run()


# =============================================================== owner tables
_CELLS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(
        [
            "",
            " ",
            "nan",
            "NaN",
            "-inf",
            "Infinity",
            "1e999",
            "-1e999",
            "0x10",
            "1_000",
            "١٢",
            "abc",
            '"',
            "\x00",
            "\ufeff1",
            " 1 ",
            "9" * 400,
            "9" * 5000,
            "label",
        ]
    ),
    st.text(max_size=6),
)


@st.composite
def csv_files(draw: st.DrawFn) -> bytes:
    rows = draw(st.lists(st.lists(_CELLS, max_size=4), max_size=5))
    delimiter = draw(st.sampled_from([",", ",", ";", "\t"]))
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    text = newline.join(delimiter.join(row) for row in rows)
    if draw(st.booleans()):
        text += newline
    if draw(st.booleans()):
        text = "\ufeff" + text
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-16", "latin-1"]))
    return text.encode(encoding, errors="replace")


def check_table(table: Any, label_column: Any, n_features: int | None) -> None:
    """Documented invariants of a loaded OwnerTable."""
    features, labels = table
    assert features.dtype == np.float64 and features.ndim == 2
    assert features.shape[0] >= 1 and features.shape[1] >= 1
    assert features.flags.c_contiguous and np.isfinite(features).all()
    if n_features is not None:
        assert features.shape[1] == n_features
    if label_column is None:
        assert labels is None
    else:
        assert labels is not None and labels.shape == (features.shape[0],)
        assert np.isfinite(labels).all()


_LABEL_COLUMNS = st.sampled_from([None, None, 0, 1, -1, 3, 99, -99, "label", "x"])
_N_FEATURES = st.sampled_from([None, None, 1, 2, 3])


def test_csv_tables(scratch: Path) -> None:
    path = scratch / "table.csv"

    @fuzz_settings(max_examples=400)
    @given(
        st.one_of(csv_files(), st.binary(max_size=80)),
        st.sampled_from(["auto", True, False]),
        _LABEL_COLUMNS,
        _N_FEATURES,
        st.sampled_from([None, ",", ";", "\t"]),
    )
    def run(
        content: bytes, header: Any, label_column: Any, n_features: Any, delimiter: Any
    ) -> None:
        path.write_bytes(content)
        table = parse_or_refuse(
            lambda: load_table(
                path,
                header=header,
                label_column=label_column,
                n_features=n_features,
                delimiter=delimiter,
            )
        )
        if table is not None:
            check_table(table, label_column, n_features)

    run()


@st.composite
def numeric_csv_files(draw: st.DrawFn) -> tuple[bytes, str]:
    """Well-formed numeric tables: what owners export, in the syntaxes they use."""
    n_columns = draw(st.integers(1, 5))
    cell = st.one_of(
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.integers(-(10**20), 10**20).map(str),
        st.floats(-1e6, 1e6).map(lambda x: f" {x:.3f} "),
        st.integers(-99, 99).map(lambda x: f'"{x}"'),
    )
    rows = draw(st.lists(st.lists(cell, min_size=n_columns, max_size=n_columns), min_size=1))
    delimiter = draw(st.sampled_from([",", ";", "\t"]))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    lines = [delimiter.join(row) for row in rows]
    if draw(st.booleans()):
        lines.insert(0, delimiter.join(f"c{j}" for j in range(n_columns)))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), "")
    return newline.join(lines).encode(), delimiter


def _fast_and_checked(path: Path, header: Any, delimiter: str) -> Any:
    """The fast reader's table, after checking that the checked reader agrees with it."""
    try:
        fast = tables._read_csv_fast(path, header, delimiter)
    except (UnicodeDecodeError, csv.Error):
        # Both readers decode the same bytes and read the first record with the same
        # csv reader: the checked one refuses the file too (load_table: DataError).
        with pytest.raises((UnicodeDecodeError, csv.Error, FedpcaError)):
            tables._read_csv_checked(path, header, delimiter)
        return None
    if fast is not None:
        checked = tables._read_csv_checked(path, header, delimiter)
        assert fast[1] == checked[1]
        assert fast[0].dtype == np.float64 and fast[0].flags.c_contiguous
        np.testing.assert_array_equal(fast[0], checked[0], strict=True)
    return fast


def test_csv_fast_reader_agrees_with_checked_reader(scratch: Path) -> None:
    """numpy's parser never accepts a file differently from the line-by-line reader."""
    path = scratch / "agree.csv"

    @fuzz_settings(max_examples=400)
    @given(
        csv_files(),
        st.sampled_from(["auto", True, False]),
        st.sampled_from([",", ";", "\t"]),
    )
    def run(content: bytes, header: Any, delimiter: str) -> None:
        path.write_bytes(content)
        _fast_and_checked(path, header, delimiter)

    run()


def test_csv_fast_reader_reads_well_formed_tables(scratch: Path) -> None:
    """The fast path is the one taken for ordinary numeric files (and agrees)."""
    path = scratch / "numeric.csv"

    @fuzz_settings(max_examples=200)
    @given(numeric_csv_files())
    def run(file: tuple[bytes, str]) -> None:
        content, delimiter = file
        path.write_bytes(content)
        assert _fast_and_checked(path, "auto", delimiter) is not None

    run()


_NPY_DTYPES = st.one_of(
    npst.floating_dtypes(),
    npst.integer_dtypes(),
    npst.unsigned_integer_dtypes(),
    npst.complex_number_dtypes(),
    npst.datetime64_dtypes(),
    npst.timedelta64_dtypes(),
    st.just(np.dtype(bool)),
    st.just(np.dtype("U3")),
    st.just(np.dtype([("a", "<f8"), ("b", "<i4")])),
)


@st.composite
def npy_files(draw: st.DrawFn) -> bytes:
    choice = draw(st.sampled_from(["array", "array", "mutated", "bytes", "object"]))
    if choice == "bytes":
        return draw(st.binary(max_size=200))
    if choice == "object":
        buffer = io.BytesIO()
        np.save(buffer, np.array([[1, "a"]], dtype=object), allow_pickle=True)
        return buffer.getvalue()
    array = draw(
        npst.arrays(_NPY_DTYPES, npst.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    )
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    data = bytearray(buffer.getvalue())
    if choice == "mutated":
        for position, value in draw(
            st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)), max_size=4)
        ):
            data[position] ^= value
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


def test_npy_tables(scratch: Path) -> None:
    path = scratch / "table.npy"

    @fuzz_settings(max_examples=300)
    @given(npy_files(), st.sampled_from([None, None, 0, -1, 5]), _N_FEATURES)
    def run(content: bytes, label_column: Any, n_features: Any) -> None:
        path.write_bytes(content)
        table = parse_or_refuse(
            lambda: load_table(path, label_column=label_column, n_features=n_features)
        )
        if table is not None:
            check_table(table, label_column, n_features)

    run()


_ARROW_COLUMNS = st.sampled_from(
    [
        pa.array([1.0, 2.0]),
        pa.array([1, 2], type=pa.int8()),
        pa.array([True, False]),
        pa.array([1.0, None]),
        pa.array([math.nan, 1.0]),
        pa.array([math.inf, 1.0]),
        pa.array(["a", "b"]),
        pa.array([None, None], type=pa.null()),
        pa.array([[1.0], [2.0]]),
        pa.array([1, 2], type=pa.uint64()),
        pa.array([1, 2], type=pa.timestamp("s")),
        pa.array(["x", "y"]).dictionary_encode(),
    ]
)


def test_parquet_tables(scratch: Path) -> None:
    path = scratch / "table.parquet"

    @fuzz_settings(max_examples=120)
    @given(
        st.one_of(
            st.binary(max_size=120),
            st.lists(_ARROW_COLUMNS, max_size=3).map(
                lambda columns: pa.table({f"c{i}": c for i, c in enumerate(columns)})
            ),
        ),
        st.sampled_from([None, 0, -1, "c1", "nope"]),
    )
    def run(content: Any, label_column: Any) -> None:
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            pq.write_table(content, path)
        table = parse_or_refuse(lambda: load_table(path, label_column=label_column))
        if table is not None:
            check_table(table, label_column, None)

    run()


# ==================================================================== configs
def _toml_string(text: str) -> str:
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + items + "}"
    return value.isoformat()  # date, time, datetime


def to_toml(document: dict[str, Any]) -> str:
    """A TOML text for a document of the values TOML can hold (tables last)."""
    lines = [
        f"{_toml_string(k)} = {_toml_value(v)}"
        for k, v in document.items()
        if not isinstance(v, dict)
    ]
    for name, table in document.items():
        if isinstance(table, dict):
            lines.append(f"[{_toml_string(name)}]")
            lines.extend(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"


_TOML_EDGE_STRINGS = st.sampled_from(
    [
        "",
        " ",
        "~",
        "~no-such-user-fedpca/x",
        "auto",
        "clip",
        "djn",
        "127.0.0.1:1",
        "h:99999",
        "h:" + "9" * 5000,
        "[::1]:5",
        "a:١",
        ":1",
        "sha256:" + "0" * 64,
        "sha256:" + "G" * 64,
        "../x",
        "/abs/path",
        "a\x00b",
    ]
)
_TOML_EDGE_NUMBERS = st.sampled_from(
    [
        *(0, -1, 1, 2**63 - 1, -(2**63), 10**30, 10**400, -(10**400)),
        *(0.0, -0.0, 1e-300, 5e-324, 1e308, math.inf, -math.inf, math.nan),
    ]
)
_TOML_SCALARS = st.one_of(
    _TOML_EDGE_STRINGS,
    _TOML_EDGE_NUMBERS,
    st.text(max_size=10),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.datetimes(),
    st.dates(),
    st.times(),
)
_TOML_KEYS = st.text(max_size=8)
_TOML_VALUES = st.recursive(
    _TOML_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TOML_KEYS, inner, max_size=3),
    max_leaves=6,
)

_VALID_OWNER = {
    "owner": {"id": "owner-1", "proxy": "127.0.0.1:50051", "state_dir": "state"},
    "tls": {"ca": "ca.pem", "cert": "cert.pem", "key": "key.pem", "insecure": False},
    "data": {"path": "data.csv", "header": "auto", "label_column": 0, "max_records": 1000},
    "privacy": {"neighbouring": "add-remove", "accountant": "zcdp"},
    "policy": {
        "accepted_analyst_keys": ["sha256:" + "0" * 64],
        "accepted_query_signers": ["ed25519:" + "ab" * 32],
        "max_epsilon_per_query": 1.0,
        "max_delta_per_query": 1e-6,
        "allow_not_private": False,
        "allow_masked_mode": False,
        "allowed_kinds": ["pca", "dca"],
        "min_quorum": 2,
        "max_tasks_per_day": 10,
    },
    "budget": {"epsilon": 10.0, "delta": 1e-5},
    "crypto": {"processes": 0, "obfuscation": "djn"},
}
_VALID_PROXY = {
    "proxy": {"id": "proxy", "listen": "127.0.0.1:0", "database": "p.sqlite3"},
    "tls": {
        "ca": "ca.pem",
        "cert": "cert.pem",
        "key": "key.pem",
        "insecure": False,
        "revoked_serials": ["1f:2e", "0a"],
    },
    "owners": {"allowed": ["hospital-a", "hospital-b"]},
    "privacy": {"neighbouring": "replace-one", "accountant": "zcdp", "max_delta_per_query": 1e-6},
    "budget": {"epsilon": 10.0, "delta": 1e-5, "analysts": {"alice": {"epsilon": 1.0}}},
    "crypto": {"processes": 0, "allow_insecure_test_keys": False},
}
_VALID_ANALYST = {
    "proxy": "proxy:7443",
    "key_dir": "keys",
    "server_name": "proxy",
    "insecure": False,
    "tls": {"ca": "ca.pem", "cert": "cert.pem", "key": "key.pem"},
}


@st.composite
def config_documents(draw: st.DrawFn, valid: dict[str, Any]) -> dict[str, Any]:
    """A valid document with a few keys removed, retyped or added — or a random one."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.dictionaries(_TOML_KEYS, _TOML_VALUES, max_size=4))
    document = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(1, 3))):
        tables = [k for k, v in document.items() if isinstance(v, dict)]
        section = draw(st.sampled_from([None, *tables]))
        target = document if section is None else document[section]
        keys = sorted(target)
        operation = draw(
            st.sampled_from(["perturb", "perturb", "retype", "remove", "add", "nested"])
        )
        if operation == "remove" and keys:
            del target[draw(st.sampled_from(keys))]
        elif operation == "perturb" and keys:
            # An edge value of the same kind as the valid one: reaches the range checks.
            key = draw(st.sampled_from(keys))
            kind = target[key]
            edge = _TOML_EDGE_STRINGS if isinstance(kind, str) else _TOML_EDGE_NUMBERS
            target[key] = draw(edge if not isinstance(kind, dict | list) else _TOML_VALUES)
        elif operation == "retype" and keys:
            target[draw(st.sampled_from(keys))] = draw(_TOML_VALUES)
        elif operation == "add":
            target[draw(_TOML_KEYS)] = draw(_TOML_VALUES)
        elif operation == "nested" and keys:
            inner = target.get(keys[0])
            if isinstance(inner, dict) and inner:
                inner[draw(st.sampled_from(sorted(inner)))] = draw(_TOML_VALUES)
    return document


def _check_owner_config(config: Any) -> None:
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", config.owner.id)
    assert config.owner.state_dir.is_absolute() and config.data.path.is_absolute()
    assert config.policy.max_epsilon_per_query > 0
    assert config.budget.epsilon > 0 and 0 < config.budget.delta < 1
    assert config.data.header in ("auto", True, False)
    assert not hasattr(config.data, "out_of_bounds")  # removed: values are always clipped
    # The declared public capacity is a positive integer (never a bool).
    assert type(config.data.max_records) is int and config.data.max_records >= 1
    assert isinstance(config.crypto.processes, int) and config.crypto.processes >= 0
    assert all(re.fullmatch("sha256:[0-9a-f]{64}", k) for k in config.policy.accepted_analyst_keys)
    assert all(
        re.fullmatch("ed25519:[0-9a-f]{64}", k) for k in config.policy.accepted_query_signers
    )
    assert config.privacy.neighbouring in set(Neighbouring)
    assert config.privacy.accountant in set(Accountant)
    policy = config.policy
    cap = policy.delta_cap(config.budget)
    assert 0 < cap <= config.budget.delta and (
        policy.max_delta_per_query is not None or cap <= 1e-5
    )
    assert isinstance(policy.allow_masked_mode, bool) and isinstance(policy.allow_not_private, bool)
    assert policy.allowed_kinds and set(policy.allowed_kinds) <= set(QueryKind)
    for count in (policy.min_quorum, policy.max_tasks_per_day):
        assert type(count) is int and count >= 1
    if not config.tls.insecure:
        config.tls.files()


def _check_proxy_config(config: Any) -> None:
    host, _, port = config.proxy.listen.rpartition(":")
    assert host and port.isascii() and port.isdigit() and 0 <= int(port) <= 65535
    assert math.isfinite(config.proxy.heartbeat_seconds) and config.proxy.heartbeat_seconds > 0
    assert config.proxy.database.is_absolute()
    assert isinstance(config.crypto.processes, int) and config.crypto.processes >= 0
    for budget in [config.budget.default, *config.budget.analysts.values()]:
        assert budget.epsilon > 0 and 0 < budget.delta < 1
    # The allow-list holds valid node ids only.
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", o) for o in config.owners.allowed)
    assert all(type(serial) is int for serial in config.tls.revoked_serials)
    privacy = config.privacy
    assert privacy.neighbouring in set(Neighbouring) and privacy.accountant in set(Accountant)
    cap = privacy.delta_cap(config.budget.default)
    assert 0 < cap < 1 and (privacy.max_delta_per_query is not None or cap <= 1e-5)
    if not config.tls.insecure:
        config.tls.files()


def _check_analyst_config(config: Any) -> None:
    assert config.proxy is None or isinstance(config.proxy, str)
    assert config.server_name is None or isinstance(config.server_name, str)
    assert isinstance(config.insecure, bool)
    assert config.key_dir is None or isinstance(config.key_dir, Path)
    if config.tls is not None:
        assert all(
            isinstance(p, Path)
            for p in (config.tls.ca_certificate, config.tls.certificate, config.tls.private_key)
        )


_CONFIG_LOADERS: dict[str, tuple[dict[str, Any], Callable[[Path], Any], Callable[[Any], None]]] = {
    "owner": (_VALID_OWNER, load_owner_config, _check_owner_config),
    "proxy": (_VALID_PROXY, load_proxy_config, _check_proxy_config),
    "analyst": (_VALID_ANALYST, load_analyst_config, _check_analyst_config),
}


@pytest.mark.parametrize("role", sorted(_CONFIG_LOADERS))
def test_toml_configs(role: str, scratch: Path) -> None:
    valid, load, check = _CONFIG_LOADERS[role]
    path = scratch / f"{role}.toml"
    path.write_text(to_toml(valid), encoding="utf-8")
    check(load(path))  # the template itself is valid

    @fuzz_settings(max_examples=600)
    @given(st.one_of(config_documents(valid).map(to_toml), st.binary(max_size=60)))
    def run(content: str | bytes) -> None:
        if isinstance(content, str):
            import tomllib

            tomllib.loads(content)  # the generator only writes valid TOML
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)
        config = parse_or_refuse(lambda: load(path))
        if config is not None:
            check(config)

    run()


# ================================================================== key files
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
_SMALL_FACTORS = [2, 3, 4, 5, 7, 9, 15, 17, 25, 27, 97, 65537, 2**61 - 1]


@st.composite
def key_documents(draw: st.DrawFn, private_key: Any) -> bytes:
    """Key-file bytes: near-valid documents, random JSON, or random bytes."""
    choice = draw(st.sampled_from(["document", "document", "document", "json", "bytes", "deep"]))
    if choice == "bytes":
        return draw(st.binary(max_size=80))
    if choice == "json":
        return json.dumps(draw(_JSON)).encode()
    if choice == "deep":
        return draw(st.sampled_from([b"[" * 5000, b"1" * 5000, b'{"n": ' + b"7" * 5000 + b"}"]))
    factor = st.one_of(
        st.sampled_from([private_key.p, private_key.q, private_key.p * 3, *_SMALL_FACTORS]),
        st.integers(2, 10**6),
    )
    p, q = draw(factor), draw(factor)
    n = draw(st.sampled_from([p * q, p * q, private_key.public_key.n, p * q + 2]))
    document: dict[str, Any] = {
        "format": draw(
            st.sampled_from(["fedpca-paillier-private-key", "fedpca-paillier-public-key"])
        ),
        "version": 1,
        "key_bits": n.bit_length(),
        "n": format(n, "x"),
        "fingerprint": key_fingerprint(paillier.PaillierPublicKey(n)),
        "p": format(p, "x"),
        "q": format(q, "x"),
    }
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        name = draw(st.sampled_from(sorted(document)))
        document[name] = draw(
            st.one_of(
                _JSON,
                st.sampled_from(["", "zz", "-5", "0x10", " ff ", "f_f", "0", "1", "7" * 5000]),
            )
        )
    return json.dumps(document).encode()


def test_key_files(test_only_keypair_512: tuple[Any, Any], scratch: Path) -> None:
    _, private_key = test_only_keypair_512
    path = scratch / "key.json"

    @fuzz_settings(max_examples=300)
    @given(key_documents(private_key), st.booleans())
    def run(content: bytes, allow_short: bool) -> None:
        path.write_bytes(content)
        path.chmod(0o600)
        public = parse_or_refuse(lambda: load_public_key(path, allow_insecure_test_key=allow_short))
        if public is not None:
            document = json.loads(content)
            assert public.n % 2 == 1 and key_fingerprint(public) == document["fingerprint"]
        private = parse_or_refuse(
            lambda: load_private_key(path, allow_insecure_test_key=allow_short)
        )
        if private is not None:
            n = private.public_key.n
            assert private.p * private.q == n and private.p != private.q
            # The key must decrypt what its public key encrypts, with a real obfuscator
            # r^n (with r = 1 even a key with composite factors would pass).
            r = next(r for r in range(2, 1000) if math.gcd(r, n) == 1)
            for message in {0, 1, 12345 % n, n - 1}:
                assert private.raw_decrypt(private.public_key.raw_encrypt(message, r)) == message

    run()


# ============================================================ regression tests
def test_out_of_range_timestamps_are_protocol_errors() -> None:
    """Found by fuzzing: Timestamp.ToDatetime raised a bare ValueError."""
    from google.protobuf.timestamp_pb2 import Timestamp

    for stamp in (Timestamp(seconds=2**62), Timestamp(seconds=-(2**62)), Timestamp(nanos=-5)):
        heartbeat = owner_pb.TaskEvent(heartbeat=owner_pb.Heartbeat(sent_at=stamp))
        status = analyst_pb.QueryStatus(query_id="q", state=2, deadline=stamp)
        info = owner_pb.ProxyInfo(server_time=stamp)
        for decode, message in (
            (serde.task_event_from_proto, heartbeat),
            (serde.query_status_from_proto, status),
            (serde.proxy_info_from_proto, info),
        ):
            with pytest.raises(FedpcaError, match="timestamp"):
                decode(message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "readable"),
        (b"PK\x03\x04", "readable"),
        (
            b"\x93NUMPY\x01\x00v\x00{'descr': '<f8', 'fortran_order': False, 'shape': (2,",
            "readable",
        ),
    ],
)
def test_unreadable_npy_files_are_data_errors(scratch: Path, content: bytes, message: str) -> None:
    """Found by fuzzing: EOFError, BadZipFile and tokenize.TokenError escaped np.load."""
    path = scratch / "regression.npy"
    path.write_bytes(content)
    with pytest.raises(FedpcaError, match=message):
        load_table(path)


def test_an_npz_archive_named_npy_is_a_data_error(scratch: Path) -> None:
    path = scratch / "archive.npy"
    with path.open("wb") as handle:
        np.savez(handle, a=np.ones((2, 2)))
    with pytest.raises(FedpcaError, match="readable"):
        load_table(path)


@pytest.mark.parametrize("role", sorted(_CONFIG_LOADERS))
@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not utf-8",
        b'key = "x"\n',
    ],
)
def test_config_files_that_are_not_utf8_or_unknown(
    role: str, scratch: Path, content: bytes
) -> None:
    """Found by fuzzing: a non-UTF-8 file raised UnicodeDecodeError."""
    _, load, _ = _CONFIG_LOADERS[role]
    path = scratch / f"regression-{role}.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError):
        load(path)


def _retyped(valid: dict[str, Any], section: str | None, key: str, value: Any) -> str:
    document = json.loads(json.dumps(valid))
    (document if section is None else document[section])[key] = value
    return to_toml(document)


@pytest.mark.parametrize(
    ("role", "section", "key", "value"),
    [
        ("owner", "budget", "epsilon", 10**400),
        ("owner", "policy", "max_epsilon_per_query", 10**400),
        ("owner", "owner", "state_dir", "~no-such-user-fedpca/state"),
        ("owner", "data", "path", "~no-such-user-fedpca/data.csv"),
        ("owner", "data", "out_of_bounds", "clip"),  # removed: values are always clipped
        ("owner", "data", "max_records", True),
        ("owner", "policy", "accepted_query_signers", ["ed25519:" + "AB" * 32]),
        ("owner", "policy", "max_delta_per_query", 1e-4),  # above budget.delta
        ("owner", "privacy", "neighbouring", "replace-all"),
        ("proxy", "proxy", "heartbeat_seconds", 10**400),
        ("proxy", "proxy", "database", "~no-such-user-fedpca/p.sqlite3"),
        ("proxy", "proxy", "listen", "h:" + "9" * 5000),
        ("proxy", "proxy", "listen", "h:١"),
        ("proxy", "owners", "allowed", ["hospital-a", "../etc"]),
        ("proxy", "owners", "allowed", ["hospital-a", "hospital-a"]),
        ("proxy", "tls", "revoked_serials", ["zz"]),
        ("proxy", "privacy", "max_delta_per_query", 1.5),
        ("analyst", None, "key_dir", "~no-such-user-fedpca/keys"),
    ],
)
def test_config_values_found_by_fuzzing(
    role: str, section: str | None, key: str, value: Any, scratch: Path
) -> None:
    """Huge integers (OverflowError), unknown ~user paths (RuntimeError), over-long or
    non-ASCII ports (ValueError / accepted) are ConfigErrors naming the key; so are the
    removed data.out_of_bounds and invalid capacities, signers, relations, delta caps,
    allow-lists and revoked serials."""
    valid, load, _ = _CONFIG_LOADERS[role]
    path = scratch / f"regression-{role}.toml"
    path.write_text(_retyped(valid, section, key, value), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(key)):
        load(path)


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe", b"[" * 5000, b"1" * 5000],
)
def test_key_files_that_are_not_json_objects(scratch: Path, content: bytes) -> None:
    """Found by fuzzing: UnicodeDecodeError, RecursionError and the int-digits ValueError."""
    path = scratch / "regression-key.json"
    path.write_bytes(content)
    for load in (load_public_key, load_private_key):
        with pytest.raises(FedpcaError):
            load(path, allow_insecure_test_key=True)


def test_a_private_key_with_composite_factors_is_refused(scratch: Path) -> None:
    """Found by fuzzing: p=3, q=9 raised ZeroDivisionError; p=5, q=9 loaded a key
    that cannot decrypt."""
    path = scratch / "regression-composite.json"
    for p, q in ((3, 9), (5, 9)):
        n = p * q
        document = {
            "format": "fedpca-paillier-private-key",
            "version": 1,
            "key_bits": n.bit_length(),
            "n": format(n, "x"),
            "fingerprint": key_fingerprint(paillier.PaillierPublicKey(n)),
            "p": format(p, "x"),
            "q": format(q, "x"),
        }
        path.write_text(json.dumps(document), encoding="utf-8")
        with pytest.raises(FedpcaError, match="prime"):
            load_private_key(path, allow_insecure_test_key=True)
