"""The one place that converts between ``fedpca.v1`` messages and domain objects.

gRPC servicers and clients only call the ``*_to_proto`` / ``*_from_proto``
functions and the ciphertext stream helpers defined here; nothing else in fedpca
touches generated message classes field by field.

Direction and errors
--------------------
``*_to_proto`` encodes a local, already valid domain object; a value that cannot
be represented on the wire raises :class:`~fedpca.errors.ConfigError` (or
:class:`~fedpca.errors.CiphertextError` for a ciphertext out of range).
``*_from_proto`` decodes what a peer sent; anything malformed raises
:class:`~fedpca.errors.ProtocolError` whose message names the field, chunk or
block at fault, so the servicer can return it verbatim as INVALID_ARGUMENT.

Ciphertext framing
------------------
A ciphertext stream is a header declaring named :class:`CiphertextBlock` s
followed by ordered ``CiphertextChunk`` messages. Each chunk carries fixed-width
unsigned big-endian ciphertexts (``2 * ceil(key_bits / 8)`` bytes each, because a
Paillier ciphertext lives in Z_{n^2}) and its own SHA-256; the header carries the
chunk count and a SHA-256 over all ciphertext bytes in order. Blocks follow one
another in declaration order and chunk boundaries ignore block boundaries.
"""

from __future__ import annotations

import hashlib
import logging
import math
import operator
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from fedpca.errors import CiphertextError, ConfigError, LayoutError, ProtocolError
from fedpca.query import Calibration, Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import ciphertext_pb2 as ciphertext_pb
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import query_pb2 as query_pb

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
"""Wire protocol version spoken by this module (the ``v1`` in ``fedpca.v1``)."""

DEFAULT_MAX_MESSAGE_BYTES = 3 * 1024 * 1024
"""Default upper bound for one serialised chunk message.

Well below the 8 MiB channel limit (:mod:`fedpca.transport.channels`) and gRPC's
4 MiB default, so a peer running with default limits still accepts our chunks.
"""


SHA256_BYTES = 32

# Worst-case framing around a chunk's ciphertext bytes inside an UploadMessage /
# ResultMessage: oneof tag + length (<= 6), index tag + varint (<= 6), sha256
# tag + length + 32 bytes (34), payload tag + length varint (<= 6). 64 leaves margin.
_CHUNK_FRAMING_BYTES = 64

UPLOAD_CHUNK_BYTES = 256 * 1024 + _CHUNK_FRAMING_BYTES
"""Message size owners cut uploads into: 512 ciphertexts of a 2048-bit key (256 KiB)
plus the chunk framing, i.e. exactly one aggregate page of the proxy, so a chunk
folds into one page. The proxy folds chunk by chunk, so what it holds per upload in
flight is about one chunk; smaller chunks keep that small, at the price of one SQLite
transaction each."""

# Upload ids end up in the proxy's durable store (file names, keys); keep them to
# a conservative alphabet so no store has to escape them.
_UPLOAD_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


# --------------------------------------------------------------------------- enums

_E = TypeVar("_E")
_W = TypeVar("_W", bound=int)

_KIND_TO_PROTO: dict[QueryKind, query_pb.QueryKind] = {
    QueryKind.PCA: query_pb.QUERY_KIND_PCA,
    QueryKind.DCA: query_pb.QUERY_KIND_DCA,
}
_MODE_TO_PROTO: dict[ProtocolMode, query_pb.ProtocolMode] = {
    ProtocolMode.STATS: query_pb.PROTOCOL_MODE_STATS,
    ProtocolMode.MASKED: query_pb.PROTOCOL_MODE_MASKED,
}
_CALIBRATION_TO_PROTO: dict[Calibration, query_pb.Calibration] = {
    Calibration.ZCDP: query_pb.CALIBRATION_ZCDP,
    Calibration.ANALYTIC: query_pb.CALIBRATION_ANALYTIC,
    Calibration.CLASSIC: query_pb.CALIBRATION_CLASSIC,
}
_NEIGHBOURING_TO_PROTO: dict[Neighbouring, query_pb.Neighbouring] = {
    Neighbouring.ADD_REMOVE: query_pb.NEIGHBOURING_ADD_REMOVE,
    Neighbouring.REPLACE_ONE: query_pb.NEIGHBOURING_REPLACE_ONE,
}


class ObfuscationVariant(StrEnum):
    """How an owner randomises Paillier encryptions."""

    FULL = "full"
    """Uniform r, obfuscator r^n mod n^2 (textbook Paillier)."""
    DJN = "djn"
    """Damgård-Jurik-Nielsen h_s^a with a short exponent a (extra assumption)."""


class DeclineReason(StrEnum):
    """Why an owner refuses a task."""

    POLICY_REFUSAL = "policy_refusal"
    KEY_NOT_PINNED = "key_not_pinned"
    BUDGET_EXHAUSTED = "budget_exhausted"


class UploadStatus(StrEnum):
    """Outcome of an upload at the proxy."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    """Same upload id accepted before; nothing was counted twice."""


class QueryState(StrEnum):
    """Lifecycle of a query at the proxy."""

    PENDING = "pending"
    COLLECTING = "collecting"
    AGGREGATING = "aggregating"
    NOISING = "noising"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """True for states a query never leaves."""
        return self in (QueryState.DONE, QueryState.FAILED)


class NoiseMechanism(StrEnum):
    """Noise-generating mechanism applied to a result."""

    GAUSSIAN = "gaussian"
    NONE = "none"
    """No noise (epsilon = inf, verification only; NOT PRIVATE)."""


_OBFUSCATION_TO_PROTO: dict[ObfuscationVariant, owner_pb.ObfuscationVariant] = {
    ObfuscationVariant.FULL: owner_pb.OBFUSCATION_VARIANT_FULL,
    ObfuscationVariant.DJN: owner_pb.OBFUSCATION_VARIANT_DJN_SHORT_EXPONENT,
}
_DECLINE_TO_PROTO: dict[DeclineReason, owner_pb.DeclineReason] = {
    DeclineReason.POLICY_REFUSAL: owner_pb.DECLINE_REASON_POLICY_REFUSAL,
    DeclineReason.KEY_NOT_PINNED: owner_pb.DECLINE_REASON_KEY_NOT_PINNED,
    DeclineReason.BUDGET_EXHAUSTED: owner_pb.DECLINE_REASON_BUDGET_EXHAUSTED,
}
_UPLOAD_STATUS_TO_PROTO: dict[UploadStatus, owner_pb.UploadReceipt.Status] = {
    UploadStatus.ACCEPTED: owner_pb.UploadReceipt.STATUS_ACCEPTED,
    UploadStatus.DUPLICATE: owner_pb.UploadReceipt.STATUS_DUPLICATE,
}
_STATE_TO_PROTO: dict[QueryState, analyst_pb.QueryState] = {
    QueryState.PENDING: analyst_pb.QUERY_STATE_PENDING,
    QueryState.COLLECTING: analyst_pb.QUERY_STATE_COLLECTING,
    QueryState.AGGREGATING: analyst_pb.QUERY_STATE_AGGREGATING,
    QueryState.NOISING: analyst_pb.QUERY_STATE_NOISING,
    QueryState.DONE: analyst_pb.QUERY_STATE_DONE,
    QueryState.FAILED: analyst_pb.QUERY_STATE_FAILED,
}
_MECHANISM_TO_PROTO: dict[NoiseMechanism, analyst_pb.NoiseMechanism] = {
    NoiseMechanism.GAUSSIAN: analyst_pb.NOISE_MECHANISM_GAUSSIAN,
    NoiseMechanism.NONE: analyst_pb.NOISE_MECHANISM_NONE,
}


def _invert(mapping: Mapping[_E, _W]) -> dict[_W, _E]:
    return {wire: domain for domain, wire in mapping.items()}


_KIND_FROM_PROTO = _invert(_KIND_TO_PROTO)
_MODE_FROM_PROTO = _invert(_MODE_TO_PROTO)
_CALIBRATION_FROM_PROTO = _invert(_CALIBRATION_TO_PROTO)
_NEIGHBOURING_FROM_PROTO = _invert(_NEIGHBOURING_TO_PROTO)
_OBFUSCATION_FROM_PROTO = _invert(_OBFUSCATION_TO_PROTO)
_DECLINE_FROM_PROTO = _invert(_DECLINE_TO_PROTO)
_UPLOAD_STATUS_FROM_PROTO = _invert(_UPLOAD_STATUS_TO_PROTO)
_STATE_FROM_PROTO = _invert(_STATE_TO_PROTO)
_MECHANISM_FROM_PROTO = _invert(_MECHANISM_TO_PROTO)


def _enum_from_proto(value: _W, mapping: Mapping[_W, _E], what: str) -> _E:
    """Decode a single-valued enum strictly: UNSPECIFIED or unknown is an error."""
    try:
        return mapping[value]
    except KeyError:
        raise ProtocolError(
            f"{what}: enum value {value} is unspecified or unknown to this version"
        ) from None


def _capabilities_from_proto(
    values: Iterable[owner_pb.ObfuscationVariant], what: str
) -> tuple[ObfuscationVariant, ...]:
    """Decode a capability list leniently: a newer peer may offer variants we lack."""
    known = []
    for value in values:
        variant = _OBFUSCATION_FROM_PROTO.get(value)
        if variant is None:
            logger.debug("%s: ignoring unknown obfuscation variant %d", what, value)
        else:
            known.append(variant)
    return tuple(known)


# ---------------------------------------------------------------- small helpers


def _set_scalars(message: Any, what: str, **values: Any) -> None:
    """Assign scalar fields, turning protobuf's range/type errors into ConfigError."""
    for name, value in values.items():
        try:
            setattr(message, name, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{what}.{name}={value!r} cannot be encoded: {exc}") from exc


def _extend(message: Any, what: str, name: str, values: Iterable[Any]) -> None:
    try:
        getattr(message, name).extend(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}.{name} cannot be encoded: {exc}") from exc


def _timestamp_to_proto(moment: datetime, what: str) -> timestamp_pb2.Timestamp:
    # A naive datetime would be read as UTC by protobuf and silently shift by
    # the local offset; deadlines must not depend on the sender's time zone.
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ConfigError(f"{what} must be a timezone-aware datetime, got naive {moment!r}")
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _timestamp_from_proto(stamp: timestamp_pb2.Timestamp, what: str) -> datetime:
    # A peer may send any int64 seconds / int32 nanos; protobuf's ToDatetime raises a
    # bare ValueError outside 0001-01-01..9999-12-31 or for nanos outside [0, 1e9).
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError) as exc:
        raise ProtocolError(f"{what} is not a valid timestamp: {exc}") from None


def _key_modulus_to_bytes(n: int) -> bytes:
    if n <= 0:
        raise ConfigError(f"analyst_public_key_n must be positive, got {n}")
    return n.to_bytes((n.bit_length() + 7) // 8, "big")


def _key_modulus_from_bytes(data: bytes, what: str) -> int:
    if not data:
        raise ProtocolError(f"{what}.analyst_public_key_n is empty")
    # One canonical encoding per key: fingerprints and equality checks on the
    # raw bytes must not depend on how a peer padded the modulus.
    if data[0] == 0:
        raise ProtocolError(
            f"{what}.analyst_public_key_n has a leading zero byte (not minimal big-endian)"
        )
    return int.from_bytes(data, "big")


def _require_text(value: str, what: str) -> str:
    if not value:
        raise ProtocolError(f"{what} is empty")
    return value


def _sha256_field(value: bytes, what: str) -> bytes:
    if len(value) != SHA256_BYTES:
        raise ProtocolError(f"{what} must be {SHA256_BYTES} bytes (SHA-256), got {len(value)}")
    return bytes(value)


# -------------------------------------------------------------------- QuerySpec

#: Names of the QuerySpec fields on the wire; equal to the dataclass field names.
QUERY_SPEC_WIRE_FIELDS: frozenset[str] = frozenset(query_pb.QuerySpec.DESCRIPTOR.fields_by_name)


def query_spec_to_proto(spec: QuerySpec) -> query_pb.QuerySpec:
    """Encode a :class:`~fedpca.query.QuerySpec`; every field is written explicitly.

    Raises
    ------
    ConfigError
        If a value does not fit its wire type (e.g. a negative label column).
    """
    what = f"QuerySpec {spec.query_id!r}"
    message = query_pb.QuerySpec()
    _set_scalars(
        message,
        what,
        query_id=spec.query_id,
        kind=_KIND_TO_PROTO[spec.kind],
        n_features=spec.n_features,
        clip_norm=spec.clip_norm,
        epsilon=spec.epsilon,
        delta=spec.delta,
        calibration=_CALIBRATION_TO_PROTO[spec.calibration],
        neighbouring=_NEIGHBOURING_TO_PROTO[spec.neighbouring],
        mode=_MODE_TO_PROTO[spec.mode],
        n_components=spec.n_components,
        quorum=spec.quorum,
        deadline_seconds=spec.deadline_seconds,
        max_records_per_owner=spec.max_records_per_owner,
        max_owners=spec.max_owners,
        frac_bits=spec.frac_bits,
        analyst_public_key_n=_key_modulus_to_bytes(spec.analyst_public_key_n),
        analyst_key_fingerprint=spec.analyst_key_fingerprint,
    )
    if spec.label_column is not None:
        _set_scalars(message, what, label_column=spec.label_column)
    _extend(message, what, "feature_lower", spec.feature_lower)
    _extend(message, what, "feature_upper", spec.feature_upper)
    _extend(message, what, "class_labels", spec.class_labels)
    _extend(message, what, "noise_weights", spec.noise_weights)
    return message


def query_spec_from_proto(message: query_pb.QuerySpec) -> QuerySpec:
    """Decode and validate a QuerySpec sent by a peer.

    Absent ``optional`` fields, UNSPECIFIED calibration and UNSPECIFIED mode take
    the :class:`~fedpca.query.QuerySpec` defaults; the kind has no default.

    Raises
    ------
    ProtocolError
        If the message is malformed or the spec it describes is invalid (the
        message of the underlying ConfigError is kept).
    """
    what = f"QuerySpec {message.query_id!r}"
    kwargs: dict[str, Any] = {
        "query_id": message.query_id,
        "kind": _enum_from_proto(message.kind, _KIND_FROM_PROTO, f"{what}.kind"),
        "n_features": message.n_features,
        "feature_lower": tuple(message.feature_lower),
        "feature_upper": tuple(message.feature_upper),
        "epsilon": message.epsilon,
        "delta": message.delta,
        "n_components": message.n_components,
        "class_labels": tuple(message.class_labels),
        "noise_weights": tuple(message.noise_weights),
        "analyst_public_key_n": _key_modulus_from_bytes(message.analyst_public_key_n, what),
        "analyst_key_fingerprint": message.analyst_key_fingerprint,
    }
    if message.calibration != query_pb.CALIBRATION_UNSPECIFIED:
        kwargs["calibration"] = _enum_from_proto(
            message.calibration, _CALIBRATION_FROM_PROTO, f"{what}.calibration"
        )
    if message.neighbouring != query_pb.NEIGHBOURING_UNSPECIFIED:
        kwargs["neighbouring"] = _enum_from_proto(
            message.neighbouring, _NEIGHBOURING_FROM_PROTO, f"{what}.neighbouring"
        )
    if message.mode != query_pb.PROTOCOL_MODE_UNSPECIFIED:
        kwargs["mode"] = _enum_from_proto(message.mode, _MODE_FROM_PROTO, f"{what}.mode")
    for name in (
        "clip_norm",
        "label_column",
        "quorum",
        "deadline_seconds",
        "max_records_per_owner",
        "max_owners",
        "frac_bits",
    ):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    try:
        return QuerySpec(**kwargs)
    except ConfigError as exc:
        raise ProtocolError(f"invalid {what}: {exc}") from exc


# ------------------------------------------------------------ ciphertext layout


@dataclass(frozen=True)
class CiphertextBlock:
    """One named block of packed ciphertexts, as declared on the wire.

    Stand-in for the codec's slot layout: only :func:`blocks_to_proto` and
    :func:`blocks_from_proto` build or read it from messages.

    Attributes
    ----------
    name : block name, unique within a layout (e.g. ``"scatter"``).
    key_bits : bit length of the Paillier modulus n.
    slot_bits : width B of one packed slot.
    slots_per_ciphertext : slots k per plaintext.
    value_count : values packed into this block.
    n_ciphertexts : ciphertexts in this block.
    """

    name: str
    key_bits: int
    slot_bits: int
    slots_per_ciphertext: int
    value_count: int
    n_ciphertexts: int

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("a ciphertext block needs a name")
        for attribute in (
            "key_bits",
            "slot_bits",
            "slots_per_ciphertext",
            "value_count",
            "n_ciphertexts",
        ):
            if getattr(self, attribute) < 1:
                raise LayoutError(
                    f"block {self.name!r}: {attribute} must be >= 1, got {getattr(self, attribute)}"
                )
        # The packed plaintext must stay below n, otherwise slots wrap mod n.
        if self.slot_bits * self.slots_per_ciphertext >= self.key_bits:
            raise LayoutError(
                f"block {self.name!r}: {self.slots_per_ciphertext} slots of {self.slot_bits} bits"
                f" do not fit below a {self.key_bits}-bit modulus"
            )
        if self.value_count > self.n_ciphertexts * self.slots_per_ciphertext:
            raise LayoutError(
                f"block {self.name!r}: {self.value_count} values do not fit in"
                f" {self.n_ciphertexts} ciphertexts of {self.slots_per_ciphertext} slots"
            )

    @property
    def ciphertext_bytes(self) -> int:
        """Wire width of one ciphertext: ``2 * ceil(key_bits / 8)`` (c < n^2)."""
        return ciphertext_width(self.key_bits)


def ciphertext_width(key_bits: int) -> int:
    """Fixed wire width in bytes of a ciphertext under a ``key_bits``-bit modulus."""
    if key_bits < 1:
        raise ConfigError(f"key_bits must be >= 1, got {key_bits}")
    return 2 * math.ceil(key_bits / 8)


def check_layout(blocks: Sequence[CiphertextBlock]) -> int:
    """Check a whole layout and return its ciphertext width in bytes.

    Raises
    ------
    LayoutError
        If the layout is empty, names repeat, or blocks disagree on key_bits
        (one stream is encrypted under one key and has one width).
    """
    if not blocks:
        raise LayoutError("a ciphertext layout needs at least one block")
    names = [block.name for block in blocks]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise LayoutError(f"duplicate block names in layout: {duplicates}")
    key_bits = {block.key_bits for block in blocks}
    if len(key_bits) != 1:
        raise LayoutError(f"blocks of one layout must share key_bits, got {sorted(key_bits)}")
    return blocks[0].ciphertext_bytes


def blocks_to_proto(blocks: Sequence[CiphertextBlock]) -> list[ciphertext_pb.CiphertextBlock]:
    """Encode a layout (the single domain → wire mapping of a block)."""
    check_layout(blocks)
    messages = []
    for block in blocks:
        message = ciphertext_pb.CiphertextBlock()
        _set_scalars(
            message,
            f"block {block.name!r}",
            name=block.name,
            key_bits=block.key_bits,
            slot_bits=block.slot_bits,
            slots_per_ciphertext=block.slots_per_ciphertext,
            value_count=block.value_count,
            n_ciphertexts=block.n_ciphertexts,
        )
        messages.append(message)
    return messages


def blocks_from_proto(
    messages: Iterable[ciphertext_pb.CiphertextBlock],
) -> tuple[CiphertextBlock, ...]:
    """Decode and check a layout (the single wire → domain mapping of a block).

    Raises
    ------
    ProtocolError
        If any block or the layout as a whole is invalid.
    """
    try:
        blocks = tuple(
            CiphertextBlock(
                name=message.name,
                key_bits=message.key_bits,
                slot_bits=message.slot_bits,
                slots_per_ciphertext=message.slots_per_ciphertext,
                value_count=message.value_count,
                n_ciphertexts=message.n_ciphertexts,
            )
            for message in messages
        )
        check_layout(blocks)
    except LayoutError as exc:
        raise ProtocolError(f"invalid ciphertext layout: {exc}") from exc
    return blocks


@dataclass(frozen=True)
class PackedCiphertexts:
    """Packed ciphertexts grouped into named blocks, in wire order.

    Attributes
    ----------
    blocks : the layout; ciphertexts travel block after block in this order.
    ciphertexts : block name -> that block's ciphertexts (``n_ciphertexts`` each).
    """

    blocks: tuple[CiphertextBlock, ...]
    ciphertexts: Mapping[str, Sequence[int]]

    def __post_init__(self) -> None:
        check_layout(self.blocks)
        names = {block.name for block in self.blocks}
        if set(self.ciphertexts) != names:
            raise LayoutError(
                f"ciphertexts given for blocks {sorted(self.ciphertexts)},"
                f" layout has {sorted(names)}"
            )
        for block in self.blocks:
            got = len(self.ciphertexts[block.name])
            if got != block.n_ciphertexts:
                raise LayoutError(
                    f"block {block.name!r} declares {block.n_ciphertexts} ciphertexts, got {got}"
                )

    @property
    def key_bits(self) -> int:
        return self.blocks[0].key_bits

    @property
    def ciphertext_bytes(self) -> int:
        return self.blocks[0].ciphertext_bytes

    @property
    def total_ciphertexts(self) -> int:
        return sum(block.n_ciphertexts for block in self.blocks)

    def in_wire_order(self) -> Iterator[int]:
        """All ciphertexts, block after block."""
        for block in self.blocks:
            yield from self.ciphertexts[block.name]

    def __getitem__(self, name: str) -> Sequence[int]:
        return self.ciphertexts[name]

    @classmethod
    def from_wire_order(
        cls, blocks: Sequence[CiphertextBlock], ciphertexts: Sequence[int]
    ) -> PackedCiphertexts:
        """Split a flat wire-order sequence back into blocks."""
        expected = sum(block.n_ciphertexts for block in blocks)
        if len(ciphertexts) != expected:
            raise LayoutError(f"layout declares {expected} ciphertexts, got {len(ciphertexts)}")
        grouped: dict[str, Sequence[int]] = {}
        start = 0
        for block in blocks:
            grouped[block.name] = ciphertexts[start : start + block.n_ciphertexts]
            start += block.n_ciphertexts
        return cls(tuple(blocks), grouped)


# ------------------------------------------------------ ciphertext bytes/chunks


def ciphertexts_to_bytes(ciphertexts: Iterable[int], width: int) -> bytes:
    """Concatenate ciphertexts as fixed-width unsigned big-endian integers.

    Accepts ``int`` and anything with ``__index__`` (e.g. gmpy2 ``mpz``).

    Raises
    ------
    CiphertextError
        If a ciphertext is negative or needs more than ``width`` bytes.
    """
    out = bytearray()
    for position, ciphertext in enumerate(ciphertexts):
        try:
            out += operator.index(ciphertext).to_bytes(width, "big")
        except OverflowError as exc:
            raise CiphertextError(
                f"ciphertext {position} is negative or does not fit in {width} bytes"
            ) from exc
    return bytes(out)


def ciphertexts_from_bytes(data: bytes, width: int, what: str = "ciphertext bytes") -> list[int]:
    """Split fixed-width big-endian ciphertexts.

    Raises
    ------
    ProtocolError
        If ``len(data)`` is not a multiple of ``width``.
    """
    if width < 1:
        raise ConfigError(f"ciphertext width must be >= 1, got {width}")
    if len(data) % width:
        raise ProtocolError(
            f"{what}: {len(data)} bytes is not a multiple of the ciphertext width {width}"
        )
    view = memoryview(data)
    return [int.from_bytes(view[i : i + width], "big") for i in range(0, len(data), width)]


def ciphertexts_per_chunk(width: int, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> int:
    """How many ciphertexts of ``width`` bytes fit in one chunk message."""
    per_chunk = (max_message_bytes - _CHUNK_FRAMING_BYTES) // width
    if per_chunk < 1:
        raise ConfigError(
            f"max_message_bytes={max_message_bytes} cannot hold one {width}-byte ciphertext"
            f" plus {_CHUNK_FRAMING_BYTES} bytes of framing"
        )
    return per_chunk


def encode_chunks(
    payload: PackedCiphertexts, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> tuple[list[ciphertext_pb.CiphertextChunk], bytes]:
    """Split a payload into chunk messages that each serialise under ``max_message_bytes``.

    Returns
    -------
    chunks : list of CiphertextChunk
        In order, indices 0, 1, ...; each with its own SHA-256.
    content_sha256 : bytes
        SHA-256 over all ciphertext bytes in order (for the stream header).
    """
    width = payload.ciphertext_bytes
    per_chunk = ciphertexts_per_chunk(width, max_message_bytes)
    content = hashlib.sha256()
    chunks: list[ciphertext_pb.CiphertextChunk] = []
    pending: list[int] = []

    def flush() -> None:
        data = ciphertexts_to_bytes(pending, width)
        content.update(data)
        chunks.append(
            ciphertext_pb.CiphertextChunk(
                index=len(chunks), ciphertexts=data, sha256=hashlib.sha256(data).digest()
            )
        )
        pending.clear()

    for ciphertext in payload.in_wire_order():
        pending.append(ciphertext)
        if len(pending) == per_chunk:
            flush()
    if pending:
        flush()
    return chunks, content.digest()


@dataclass(frozen=True)
class DecodedChunk:
    """Ciphertexts of one accepted chunk.

    Attributes
    ----------
    index : chunk index.
    offset : wire-order position of the first ciphertext in this chunk.
    ciphertexts : the decoded ciphertexts.
    """

    index: int
    offset: int
    ciphertexts: list[int]


class ChunkAssembler:
    """Validates one ordered stream of ``CiphertextChunk`` messages.

    Used by both the proxy (uploads) and the analyst (results). It does not keep
    the ciphertexts: :meth:`add` hands each chunk's ciphertexts back so a caller
    can fold them as they arrive; until :meth:`finish` has checked the count and
    the content hash, the caller must be able to take them out again (the proxy
    stages each folded chunk for that, see :mod:`fedpca.proxy.store`).

    Parameters
    ----------
    blocks : the layout declared by the stream header.
    total_chunks : number of chunks declared by the header.
    content_sha256 : SHA-256 over all ciphertext bytes declared by the header.
    label : prefix for error messages (e.g. ``"upload 'u1' for query 'q1'"``).
    """

    def __init__(
        self,
        blocks: Sequence[CiphertextBlock],
        total_chunks: int,
        content_sha256: bytes,
        label: str = "ciphertext stream",
    ) -> None:
        self._label = label
        try:
            self._width = check_layout(blocks)
        except LayoutError as exc:
            raise ProtocolError(f"{label}: invalid ciphertext layout: {exc}") from exc
        self._expected_ciphertexts = sum(block.n_ciphertexts for block in blocks)
        # Empty chunks are refused, so more chunks than ciphertexts cannot be honest.
        if not 1 <= total_chunks <= self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: total_chunks={total_chunks} must be in"
                f" [1, {self._expected_ciphertexts}] (the declared ciphertext count)"
            )
        self._total_chunks = total_chunks
        self._content_sha256 = _sha256_field(content_sha256, f"{label}: content_sha256")
        self._hasher = hashlib.sha256()
        self._chunks_received = 0
        self._ciphertexts_received = 0
        self._bytes_received = 0
        self._finished = False

    @property
    def chunks_received(self) -> int:
        return self._chunks_received

    @property
    def ciphertexts_received(self) -> int:
        return self._ciphertexts_received

    @property
    def bytes_received(self) -> int:
        return self._bytes_received

    @property
    def total_chunks(self) -> int:
        return self._total_chunks

    @property
    def expected_ciphertexts(self) -> int:
        return self._expected_ciphertexts

    def add(self, chunk: ciphertext_pb.CiphertextChunk) -> DecodedChunk:
        """Check the next chunk and return its ciphertexts.

        Raises
        ------
        ProtocolError
            Out-of-order or surplus index, empty chunk, length not a multiple of
            the ciphertext width, per-chunk hash mismatch, or more ciphertexts
            than the layout declares.
        """
        label = self._label
        if self._finished:
            raise ProtocolError(f"{label}: chunk {chunk.index} arrived after the stream ended")
        expected_index = self._chunks_received
        if chunk.index != expected_index:
            raise ProtocolError(
                f"{label}: chunk index {chunk.index} arrived, expected {expected_index}"
                " (chunks must arrive in order starting at 0)"
            )
        if expected_index >= self._total_chunks:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} exceeds the declared total_chunks"
                f"={self._total_chunks}"
            )
        data = chunk.ciphertexts
        if not data:
            raise ProtocolError(f"{label}: chunk {chunk.index} is empty")
        if len(data) % self._width:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} has {len(data)} bytes, not a multiple of the"
                f" ciphertext width {self._width}"
            )
        declared = _sha256_field(chunk.sha256, f"{label}: chunk {chunk.index} sha256")
        actual = hashlib.sha256(data).digest()
        if declared != actual:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} SHA-256 mismatch"
                f" (declared {declared.hex()[:16]}…, computed {actual.hex()[:16]}…)"
            )
        count = len(data) // self._width
        if self._ciphertexts_received + count > self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: chunk {chunk.index} brings the ciphertext count to"
                f" {self._ciphertexts_received + count}, layout declares"
                f" {self._expected_ciphertexts}"
            )
        self._hasher.update(data)
        decoded = DecodedChunk(
            index=chunk.index,
            offset=self._ciphertexts_received,
            ciphertexts=ciphertexts_from_bytes(data, self._width),
        )
        self._chunks_received += 1
        self._ciphertexts_received += count
        self._bytes_received += len(data)
        return decoded

    def finish(self) -> None:
        """Check that the stream is complete and its content hash matches.

        Raises
        ------
        ProtocolError
            Missing chunks, too few ciphertexts, or content hash mismatch.
        """
        label = self._label
        if self._chunks_received != self._total_chunks:
            raise ProtocolError(
                f"{label}: stream ended after {self._chunks_received} of"
                f" {self._total_chunks} declared chunks"
            )
        if self._ciphertexts_received != self._expected_ciphertexts:
            raise ProtocolError(
                f"{label}: received {self._ciphertexts_received} ciphertexts, layout declares"
                f" {self._expected_ciphertexts}"
            )
        actual = self._hasher.digest()
        if actual != self._content_sha256:
            raise ProtocolError(
                f"{label}: content SHA-256 mismatch (declared"
                f" {self._content_sha256.hex()[:16]}…, computed {actual.hex()[:16]}…)"
            )
        self._finished = True


def _collect(
    blocks: Sequence[CiphertextBlock],
    assembler: ChunkAssembler,
    chunks: Iterable[ciphertext_pb.CiphertextChunk],
) -> PackedCiphertexts:
    flat: list[int] = []
    for chunk in chunks:
        flat.extend(assembler.add(chunk).ciphertexts)
    assembler.finish()
    return PackedCiphertexts.from_wire_order(blocks, flat)


# ----------------------------------------------------------------------- upload


def new_upload_id() -> str:
    """A fresh random upload id (reuse it when retrying the same upload)."""
    return secrets.token_hex(16)


def blocks_of(blocks: Iterable[Any]) -> tuple[CiphertextBlock, ...]:
    """The wire declaration of release-plan blocks (:class:`fedpca.protocol.Block`).

    Each block contributes its name and slot layout; this is the one place where a
    plan's layout becomes what an upload or result header declares.
    """
    return tuple(
        CiphertextBlock(
            name=block.name,
            key_bits=block.layout.key_bits,
            slot_bits=block.layout.slot_bits,
            slots_per_ciphertext=block.layout.slots_per_ciphertext,
            value_count=block.layout.value_count,
            n_ciphertexts=block.layout.n_ciphertexts,
        )
        for block in blocks
    )


@dataclass(frozen=True)
class UploadHeader:
    """Validated first message of an upload.

    Attributes
    ----------
    query_id : the query answered.
    analyst_key_fingerprint : key the ciphertexts are encrypted under.
    upload_id : owner-chosen nonce; retries of the same upload reuse it.
    blocks : the layout.
    total_chunks : chunks that follow.
    content_sha256 : SHA-256 over all ciphertext bytes in order.
    public_record_count : masked mode only: the owner's record count, in the
        clear; None (absent on the wire) in stats mode.
    """

    query_id: str
    analyst_key_fingerprint: str
    upload_id: str
    blocks: tuple[CiphertextBlock, ...]
    total_chunks: int
    content_sha256: bytes
    public_record_count: int | None = None

    @property
    def label(self) -> str:
        """Prefix for error and log messages about this upload."""
        return f"upload {self.upload_id!r} for query {self.query_id!r}"

    def assembler(self) -> ChunkAssembler:
        """A :class:`ChunkAssembler` checking the chunks this header announces."""
        return ChunkAssembler(self.blocks, self.total_chunks, self.content_sha256, self.label)


def encode_upload(
    query_id: str,
    analyst_key_fingerprint: str,
    upload_id: str,
    payload: PackedCiphertexts,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    public_record_count: int | None = None,
) -> list[owner_pb.UploadMessage]:
    """Build the full Upload client stream: header first, then chunks.

    Returns a list rather than a generator so that a retry can resend the very
    same messages (same upload id, same hashes). ``public_record_count`` is the
    owner's clear-text record count, sent in masked mode only.
    """
    if not _UPLOAD_ID_RE.fullmatch(upload_id):
        raise ConfigError(f"upload_id {upload_id!r} must match {_UPLOAD_ID_RE.pattern}")
    chunks, content_sha256 = encode_chunks(payload, max_message_bytes)
    header = owner_pb.UploadHeader(
        query_id=query_id,
        analyst_key_fingerprint=analyst_key_fingerprint,
        upload_id=upload_id,
        blocks=blocks_to_proto(payload.blocks),
        total_chunks=len(chunks),
        content_sha256=content_sha256,
    )
    if public_record_count is not None:
        _set_scalars(header, "UploadHeader", public_record_count=public_record_count)
    return [owner_pb.UploadMessage(header=header)] + [
        owner_pb.UploadMessage(chunk=chunk) for chunk in chunks
    ]


def upload_header_from_message(message: owner_pb.UploadMessage) -> UploadHeader:
    """Decode the first message of an upload stream.

    Raises
    ------
    ProtocolError
        If the message is not a header or any header field is invalid.
    """
    if message.WhichOneof("payload") != "header":
        raise ProtocolError("an upload must start with an UploadHeader")
    header = message.header
    query_id = _require_text(header.query_id, "UploadHeader.query_id")
    if not _UPLOAD_ID_RE.fullmatch(header.upload_id):
        raise ProtocolError(
            f"UploadHeader.upload_id {header.upload_id!r} must match {_UPLOAD_ID_RE.pattern}"
        )
    label = f"upload {header.upload_id!r} for query {query_id!r}"
    decoded = UploadHeader(
        query_id=query_id,
        analyst_key_fingerprint=_require_text(
            header.analyst_key_fingerprint, f"{label}: analyst_key_fingerprint"
        ),
        upload_id=header.upload_id,
        blocks=_blocks_with_label(header.blocks, label),
        total_chunks=header.total_chunks,
        content_sha256=_sha256_field(header.content_sha256, f"{label}: content_sha256"),
        public_record_count=(
            header.public_record_count if header.HasField("public_record_count") else None
        ),
    )
    # Check chunk count against the layout now, before any chunk is read.
    decoded.assembler()
    return decoded


def upload_chunk_from_message(message: owner_pb.UploadMessage) -> ciphertext_pb.CiphertextChunk:
    """Extract the chunk of a non-first upload message (ProtocolError otherwise)."""
    kind = message.WhichOneof("payload")
    if kind != "chunk":
        raise ProtocolError(f"expected a ciphertext chunk after the upload header, got {kind}")
    return message.chunk


def read_upload(
    messages: Iterable[owner_pb.UploadMessage],
) -> tuple[UploadHeader, PackedCiphertexts]:
    """Read and fully validate a complete upload stream."""
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None:
        raise ProtocolError("upload stream is empty (expected an UploadHeader)")
    header = upload_header_from_message(first)
    payload = _collect(
        header.blocks, header.assembler(), (upload_chunk_from_message(m) for m in iterator)
    )
    return header, payload


@dataclass(frozen=True)
class UploadReceipt:
    """The proxy's answer to an upload."""

    query_id: str
    upload_id: str
    status: UploadStatus
    chunks_received: int
    ciphertexts_received: int


def upload_receipt_to_proto(receipt: UploadReceipt) -> owner_pb.UploadReceipt:
    message = owner_pb.UploadReceipt()
    _set_scalars(
        message,
        "UploadReceipt",
        query_id=receipt.query_id,
        upload_id=receipt.upload_id,
        status=_UPLOAD_STATUS_TO_PROTO[receipt.status],
        chunks_received=receipt.chunks_received,
        ciphertexts_received=receipt.ciphertexts_received,
    )
    return message


def upload_receipt_from_proto(message: owner_pb.UploadReceipt) -> UploadReceipt:
    return UploadReceipt(
        query_id=message.query_id,
        upload_id=message.upload_id,
        status=_enum_from_proto(message.status, _UPLOAD_STATUS_FROM_PROTO, "UploadReceipt.status"),
        chunks_received=message.chunks_received,
        ciphertexts_received=message.ciphertexts_received,
    )


def _blocks_with_label(
    messages: Iterable[ciphertext_pb.CiphertextBlock], label: str
) -> tuple[CiphertextBlock, ...]:
    try:
        return blocks_from_proto(messages)
    except ProtocolError as exc:
        raise ProtocolError(f"{label}: {exc}") from exc


# ---------------------------------------------------------------- owner session


@dataclass(frozen=True)
class OwnerHello:
    """What an owner announces (informational; identity comes from its certificate)."""

    node_id: str
    software_version: str
    obfuscation_variants: tuple[ObfuscationVariant, ...] = ()


def owner_hello_to_proto(hello: OwnerHello) -> owner_pb.OwnerHello:
    return owner_pb.OwnerHello(
        node_id=hello.node_id,
        software_version=hello.software_version,
        obfuscation_variants=[_OBFUSCATION_TO_PROTO[v] for v in hello.obfuscation_variants],
    )


def owner_hello_from_proto(message: owner_pb.OwnerHello) -> OwnerHello:
    return OwnerHello(
        node_id=message.node_id,
        software_version=message.software_version,
        obfuscation_variants=_capabilities_from_proto(
            message.obfuscation_variants, "OwnerHello.obfuscation_variants"
        ),
    )


@dataclass(frozen=True)
class ProxyInfo:
    """The proxy's answer to an owner's hello."""

    proxy_id: str
    software_version: str
    authenticated_node_id: str
    heartbeat_interval_seconds: float
    max_message_bytes: int
    server_time: datetime
    protocol_version: int = PROTOCOL_VERSION


def proxy_info_to_proto(info: ProxyInfo) -> owner_pb.ProxyInfo:
    message = owner_pb.ProxyInfo(server_time=_timestamp_to_proto(info.server_time, "server_time"))
    _set_scalars(
        message,
        "ProxyInfo",
        proxy_id=info.proxy_id,
        software_version=info.software_version,
        protocol_version=info.protocol_version,
        authenticated_node_id=info.authenticated_node_id,
        heartbeat_interval_seconds=info.heartbeat_interval_seconds,
        max_message_bytes=info.max_message_bytes,
    )
    return message


def proxy_info_from_proto(message: owner_pb.ProxyInfo) -> ProxyInfo:
    if not message.HasField("server_time"):
        raise ProtocolError("ProxyInfo.server_time is missing")
    return ProxyInfo(
        proxy_id=message.proxy_id,
        software_version=message.software_version,
        protocol_version=message.protocol_version,
        authenticated_node_id=message.authenticated_node_id,
        heartbeat_interval_seconds=message.heartbeat_interval_seconds,
        max_message_bytes=message.max_message_bytes,
        server_time=_timestamp_from_proto(message.server_time, "ProxyInfo.server_time"),
    )


def task_stream_request_to_proto(node_id: str) -> owner_pb.TaskStreamRequest:
    """Open the task stream; the node id is informational (the certificate decides)."""
    return owner_pb.TaskStreamRequest(node_id=node_id)


def task_stream_request_from_proto(message: owner_pb.TaskStreamRequest) -> str:
    """Return the node id the owner claims (informational only)."""
    return message.node_id


@dataclass(frozen=True)
class Heartbeat:
    """Application-level keep-alive on the task stream."""

    sent_at: datetime


@dataclass(frozen=True)
class Task:
    """A request to an owner to contribute to one query."""

    query: QuerySpec
    upload_deadline: datetime
    accepted_obfuscation_variants: tuple[ObfuscationVariant, ...] = (
        ObfuscationVariant.FULL,
        ObfuscationVariant.DJN,
    )


@dataclass(frozen=True)
class TaskCancellation:
    """Withdraws a previously delivered task."""

    query_id: str
    reason: str


TaskEvent = Heartbeat | Task | TaskCancellation
"""One event on an owner's task stream."""


def task_event_to_proto(event: TaskEvent) -> owner_pb.TaskEvent:
    """Wrap a heartbeat, task or cancellation in a TaskEvent."""
    if isinstance(event, Heartbeat):
        return owner_pb.TaskEvent(
            heartbeat=owner_pb.Heartbeat(sent_at=_timestamp_to_proto(event.sent_at, "sent_at"))
        )
    if isinstance(event, Task):
        return owner_pb.TaskEvent(
            task=owner_pb.Task(
                query=query_spec_to_proto(event.query),
                upload_deadline=_timestamp_to_proto(event.upload_deadline, "upload_deadline"),
                accepted_obfuscation_variants=[
                    _OBFUSCATION_TO_PROTO[v] for v in event.accepted_obfuscation_variants
                ],
            )
        )
    return owner_pb.TaskEvent(
        cancellation=owner_pb.TaskCancellation(query_id=event.query_id, reason=event.reason)
    )


def task_event_from_proto(message: owner_pb.TaskEvent) -> TaskEvent:
    """Unwrap a TaskEvent (ProtocolError if empty or a task lacks its query/deadline)."""
    kind = message.WhichOneof("event")
    if kind == "heartbeat":
        if not message.heartbeat.HasField("sent_at"):
            raise ProtocolError("Heartbeat.sent_at is missing")
        return Heartbeat(
            sent_at=_timestamp_from_proto(message.heartbeat.sent_at, "Heartbeat.sent_at")
        )
    if kind == "task":
        task = message.task
        if not task.HasField("query"):
            raise ProtocolError("Task.query is missing")
        if not task.HasField("upload_deadline"):
            raise ProtocolError(f"Task for query {task.query.query_id!r}: upload_deadline missing")
        return Task(
            query=query_spec_from_proto(task.query),
            upload_deadline=_timestamp_from_proto(task.upload_deadline, "Task.upload_deadline"),
            accepted_obfuscation_variants=_capabilities_from_proto(
                task.accepted_obfuscation_variants, "Task.accepted_obfuscation_variants"
            ),
        )
    if kind == "cancellation":
        return TaskCancellation(
            query_id=_require_text(message.cancellation.query_id, "TaskCancellation.query_id"),
            reason=message.cancellation.reason,
        )
    raise ProtocolError("TaskEvent carries no event (unknown to this version or empty)")


@dataclass(frozen=True)
class TaskDecline:
    """An owner's refusal of one task. ``detail`` must not contain data-dependent values."""

    query_id: str
    reason: DeclineReason
    detail: str = ""


def task_decline_to_proto(decline: TaskDecline) -> owner_pb.TaskDecline:
    return owner_pb.TaskDecline(
        query_id=decline.query_id,
        reason=_DECLINE_TO_PROTO[decline.reason],
        detail=decline.detail,
    )


def task_decline_from_proto(message: owner_pb.TaskDecline) -> TaskDecline:
    return TaskDecline(
        query_id=_require_text(message.query_id, "TaskDecline.query_id"),
        reason=_enum_from_proto(message.reason, _DECLINE_FROM_PROTO, "TaskDecline.reason"),
        detail=message.detail,
    )


def decline_receipt_to_proto(query_id: str) -> owner_pb.DeclineReceipt:
    return owner_pb.DeclineReceipt(query_id=query_id)


def decline_receipt_from_proto(message: owner_pb.DeclineReceipt) -> str:
    """Return the acknowledged query id."""
    return message.query_id


# ---------------------------------------------------------------- analyst side


def submit_query_request_to_proto(spec: QuerySpec) -> analyst_pb.SubmitQueryRequest:
    return analyst_pb.SubmitQueryRequest(query=query_spec_to_proto(spec))


def submit_query_request_from_proto(message: analyst_pb.SubmitQueryRequest) -> QuerySpec:
    if not message.HasField("query"):
        raise ProtocolError("SubmitQueryRequest.query is missing")
    return query_spec_from_proto(message.query)


def query_ref_to_proto(query_id: str) -> analyst_pb.QueryRef:
    return analyst_pb.QueryRef(query_id=query_id)


def query_ref_from_proto(message: analyst_pb.QueryRef) -> str:
    """Return the referenced query id (ProtocolError if empty)."""
    return _require_text(message.query_id, "QueryRef.query_id")


@dataclass(frozen=True)
class QueryStatus:
    """Progress of one query as the proxy reports it.

    Attributes
    ----------
    query_id : the query.
    state : lifecycle state.
    owners_contributed : accepted uploads so far.
    quorum : owners required.
    owners_declined : owners that declined the task.
    deadline : when collection closes (timezone-aware), None before publication.
    failure_reason : set only in state FAILED.
    owners_uploading : owners whose upload is streaming in, not yet complete.
    """

    query_id: str
    state: QueryState
    owners_contributed: int
    quorum: int
    owners_declined: int = 0
    deadline: datetime | None = None
    failure_reason: str | None = None
    owners_uploading: int = 0

    @property
    def terminal(self) -> bool:
        return self.state.terminal


def query_status_to_proto(status: QueryStatus) -> analyst_pb.QueryStatus:
    message = analyst_pb.QueryStatus()
    _set_scalars(
        message,
        f"QueryStatus {status.query_id!r}",
        query_id=status.query_id,
        state=_STATE_TO_PROTO[status.state],
        owners_contributed=status.owners_contributed,
        quorum=status.quorum,
        owners_declined=status.owners_declined,
        owners_uploading=status.owners_uploading,
    )
    if status.deadline is not None:
        message.deadline.CopyFrom(_timestamp_to_proto(status.deadline, "QueryStatus.deadline"))
    if status.failure_reason is not None:
        message.failure_reason = status.failure_reason
    return message


def query_status_from_proto(message: analyst_pb.QueryStatus) -> QueryStatus:
    what = f"QueryStatus {message.query_id!r}"
    return QueryStatus(
        query_id=_require_text(message.query_id, "QueryStatus.query_id"),
        state=_enum_from_proto(message.state, _STATE_FROM_PROTO, f"{what}.state"),
        owners_contributed=message.owners_contributed,
        quorum=message.quorum,
        owners_declined=message.owners_declined,
        deadline=(
            _timestamp_from_proto(message.deadline, f"{what}.deadline")
            if message.HasField("deadline")
            else None
        ),
        failure_reason=message.failure_reason if message.HasField("failure_reason") else None,
        owners_uploading=message.owners_uploading,
    )


@dataclass(frozen=True)
class NoiseSection:
    """Noise added to one section, sigma in real (decoded) units."""

    name: str
    sigma: float


@dataclass(frozen=True)
class NoiseDescription:
    """Everything public about the noise in a result."""

    mechanism: NoiseMechanism
    calibration: Calibration
    epsilon: float
    delta: float
    sections: tuple[NoiseSection, ...] = ()


def noise_description_to_proto(noise: NoiseDescription) -> analyst_pb.NoiseDescription:
    return analyst_pb.NoiseDescription(
        mechanism=_MECHANISM_TO_PROTO[noise.mechanism],
        calibration=_CALIBRATION_TO_PROTO[noise.calibration],
        epsilon=noise.epsilon,
        delta=noise.delta,
        sections=[analyst_pb.NoiseSection(name=s.name, sigma=s.sigma) for s in noise.sections],
    )


def noise_description_from_proto(message: analyst_pb.NoiseDescription) -> NoiseDescription:
    return NoiseDescription(
        mechanism=_enum_from_proto(
            message.mechanism, _MECHANISM_FROM_PROTO, "NoiseDescription.mechanism"
        ),
        calibration=_enum_from_proto(
            message.calibration, _CALIBRATION_FROM_PROTO, "NoiseDescription.calibration"
        ),
        epsilon=message.epsilon,
        delta=message.delta,
        sections=tuple(NoiseSection(name=s.name, sigma=s.sigma) for s in message.sections),
    )


@dataclass(frozen=True)
class QueryResult:
    """A noised, still encrypted result as the analyst receives it.

    Attributes
    ----------
    query : the query as the proxy ran it.
    n_owners : owners whose contributions were aggregated.
    noise : the noise that was added.
    payload : the ciphertext blocks.
    masked_mean_block : masked mode only: the block holding Enc(v + b).
    public_record_count : masked mode only: the public record count N (sum of
        the owners' counts) the analyst unmasks the scatter with; None in stats
        mode, where N is a noised statistic nobody but the analyst learns.
    """

    query: QuerySpec
    n_owners: int
    noise: NoiseDescription
    payload: PackedCiphertexts
    masked_mean_block: str | None = field(default=None)
    public_record_count: int | None = field(default=None)

    def __post_init__(self) -> None:
        masked = self.query.mode is ProtocolMode.MASKED
        label = f"query {self.query.query_id!r}"
        if masked and self.masked_mean_block is None:
            raise LayoutError(f"{label}: masked mode needs masked_mean_block")
        if not masked and self.masked_mean_block is not None:
            raise LayoutError(f"{label}: masked_mean_block is only valid in masked mode")
        count = self.public_record_count
        if masked and count is None:
            raise LayoutError(f"{label}: masked mode needs public_record_count")
        if not masked and count is not None:
            raise LayoutError(
                f"{label}: public_record_count is only valid in masked mode (in stats mode "
                "N is noised)"
            )
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 1
        ):
            raise LayoutError(f"{label}: public_record_count must be an int >= 1, got {count!r}")
        if self.masked_mean_block is not None and self.masked_mean_block not in {
            block.name for block in self.payload.blocks
        }:
            raise LayoutError(
                f"query {self.query.query_id!r}: masked_mean_block {self.masked_mean_block!r}"
                " is not a block of the result"
            )


def encode_result(
    result: QueryResult, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[analyst_pb.ResultMessage]:
    """Build the full FetchResult server stream: header first, then chunks."""
    chunks, content_sha256 = encode_chunks(result.payload, max_message_bytes)
    header = analyst_pb.ResultHeader(
        query=query_spec_to_proto(result.query),
        n_owners=result.n_owners,
        blocks=blocks_to_proto(result.payload.blocks),
        noise=noise_description_to_proto(result.noise),
        total_chunks=len(chunks),
        content_sha256=content_sha256,
    )
    if result.masked_mean_block is not None:
        header.masked_mean_block = result.masked_mean_block
    if result.public_record_count is not None:
        _set_scalars(header, "ResultHeader", public_record_count=result.public_record_count)
    return [analyst_pb.ResultMessage(header=header)] + [
        analyst_pb.ResultMessage(chunk=chunk) for chunk in chunks
    ]


def decode_result(messages: Iterable[analyst_pb.ResultMessage]) -> QueryResult:
    """Read and fully validate a FetchResult stream.

    Raises
    ------
    ProtocolError
        On any framing, layout, hash or count problem, or an invalid header.
    """
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None or first.WhichOneof("payload") != "header":
        raise ProtocolError("a result stream must start with a ResultHeader")
    header = first.header
    for name in ("query", "noise"):
        if not header.HasField(name):
            raise ProtocolError(f"ResultHeader.{name} is missing")
    query = query_spec_from_proto(header.query)
    label = f"result of query {query.query_id!r}"
    blocks = _blocks_with_label(header.blocks, label)
    assembler = ChunkAssembler(blocks, header.total_chunks, header.content_sha256, label)

    def chunks() -> Iterator[ciphertext_pb.CiphertextChunk]:
        for message in iterator:
            kind = message.WhichOneof("payload")
            if kind != "chunk":
                raise ProtocolError(f"{label}: expected a ciphertext chunk, got {kind}")
            yield message.chunk

    payload = _collect(blocks, assembler, chunks())
    try:
        return QueryResult(
            query=query,
            n_owners=header.n_owners,
            noise=noise_description_from_proto(header.noise),
            payload=payload,
            masked_mean_block=(
                header.masked_mean_block if header.HasField("masked_mean_block") else None
            ),
            public_record_count=(
                header.public_record_count if header.HasField("public_record_count") else None
            ),
        )
    except LayoutError as exc:
        raise ProtocolError(f"{label}: {exc}") from exc


@dataclass(frozen=True)
class BudgetStatus:
    """Cumulative privacy loss of one analyst, epsilons reported at ``delta``."""

    analyst_id: str
    delta: float
    epsilon_spent: float
    epsilon_remaining: float
    epsilon_limit: float
    n_releases: int


def budget_request_to_proto(delta: float | None = None) -> analyst_pb.BudgetRequest:
    message = analyst_pb.BudgetRequest()
    if delta is not None:
        message.delta = delta
    return message


def budget_request_from_proto(message: analyst_pb.BudgetRequest) -> float | None:
    """Return the requested delta, or None for the proxy's configured delta."""
    if not message.HasField("delta"):
        return None
    if not 0 < message.delta < 1:
        raise ProtocolError(f"BudgetRequest.delta must be in (0, 1), got {message.delta}")
    return message.delta


def budget_status_to_proto(status: BudgetStatus) -> analyst_pb.BudgetStatus:
    message = analyst_pb.BudgetStatus()
    _set_scalars(
        message,
        "BudgetStatus",
        analyst_id=status.analyst_id,
        delta=status.delta,
        epsilon_spent=status.epsilon_spent,
        epsilon_remaining=status.epsilon_remaining,
        epsilon_limit=status.epsilon_limit,
        n_releases=status.n_releases,
    )
    return message


def budget_status_from_proto(message: analyst_pb.BudgetStatus) -> BudgetStatus:
    return BudgetStatus(
        analyst_id=message.analyst_id,
        delta=message.delta,
        epsilon_spent=message.epsilon_spent,
        epsilon_remaining=message.epsilon_remaining,
        epsilon_limit=message.epsilon_limit,
        n_releases=message.n_releases,
    )
