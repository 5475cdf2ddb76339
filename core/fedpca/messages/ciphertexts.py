"""Ciphertext blocks and payloads as they travel: named blocks in wire order.

A :class:`CiphertextPayload` is what an upload or a result carries: the packed
ciphertexts of each named :class:`CiphertextBlock`, block after block. It is not
the codec's :class:`fedpca.codec.PackedCiphertexts` (one block with its public key
and value bound, for homomorphic arithmetic): a payload holds plain integers and
only the layout a peer declares.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedpca.errors import CiphertextError, ConfigError, LayoutError, ProtocolError

__all__ = [
    "MAX_BLOCK_NAME_LENGTH",
    "MAX_LAYOUT_BLOCKS",
    "CiphertextBlock",
    "CiphertextPayload",
    "blocks_of",
    "check_layout",
    "ciphertext_width",
    "ciphertexts_from_bytes",
    "ciphertexts_to_bytes",
]


MAX_LAYOUT_BLOCKS = 1024
"""More blocks than any release plan declares (64 aggregates of a few sections each,
or three for PCA and DCA): a peer's header with more is refused before it is examined."""

MAX_BLOCK_NAME_LENGTH = 64
"""Longer than any plan's block name; a peer's longer name is refused, not quoted."""


@dataclass(frozen=True)
class CiphertextBlock:
    """One named block of packed ciphertexts, as declared on the wire.

    Stand-in for the codec's slot layout: :func:`blocks_of` builds it from a release
    plan, :mod:`fedpca.transport.serde` from and into messages.

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
        if len(self.name) > MAX_BLOCK_NAME_LENGTH:
            raise LayoutError(
                f"block name {self.name[:40]!r}... is longer than {MAX_BLOCK_NAME_LENGTH} "
                "characters"
            )
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
    if len(blocks) > MAX_LAYOUT_BLOCKS:
        raise LayoutError(f"{len(blocks)} blocks, more than any plan has ({MAX_LAYOUT_BLOCKS})")
    names = Counter(block.name for block in blocks)
    duplicates = sorted(name for name, count in names.items() if count > 1)
    if duplicates:
        raise LayoutError(f"duplicate block names in layout: {duplicates}")
    key_bits = {block.key_bits for block in blocks}
    if len(key_bits) != 1:
        raise LayoutError(f"blocks of one layout must share key_bits, got {sorted(key_bits)}")
    return blocks[0].ciphertext_bytes


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
class CiphertextPayload:
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
    ) -> CiphertextPayload:
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


def ciphertexts_to_bytes(ciphertexts: Iterable[int], width: int) -> bytes:
    """Concatenate ciphertexts as fixed-width unsigned big-endian integers.

    The one wire format of ciphertexts. Accepts ``int`` and anything with
    ``__index__`` (e.g. gmpy2 ``mpz``). No key is involved: the width is the one the
    layout declares; :func:`fedpca.codec.ciphertexts_to_bytes` adds the key's range
    check around this.

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
    """Split fixed-width big-endian ciphertexts (no range check against a key).

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
