"""Packed Paillier codec: fixed-point encoding, slot packing, encryption on a process pool.

Typical owner-side use::

    layout = SlotLayout.from_bounds(bounds, key_bits, value_count)
    values = encode_fixed_point(share, bounds.frac_bits)
    with CryptoPool() as pool:
        packed = pool.encrypt_packed(public_key, values, layout, owner_value_bound(bounds))

The public names are re-exported lazily (PEP 562): the pool's worker processes
import ``fedpca.codec._worker``, which runs this ``__init__``, and must not pay
for numpy or phe imports they never use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ciphertext import (
        PackedCiphertexts,
        SerialisedCiphertextGroup,
        add_packed,
        ciphertext_byte_length,
        ciphertexts_from_bytes,
        ciphertexts_to_bytes,
        scalar_multiply,
        validate_ciphertexts,
    )
    from .fixed_point import decode_fixed_point, encode_fixed_point
    from .keys import (
        DEFAULT_KEY_BITS,
        MIN_KEY_BITS,
        generate_keypair,
        key_fingerprint,
        load_private_key,
        load_public_key,
        save_private_key,
        save_public_key,
    )
    from .matrix import (
        symmetric_from_upper_triangle,
        upper_triangle,
    )
    from .packing import (
        PackingBounds,
        SlotLayout,
        check_owner_count,
        owner_value_bound,
        pack_slots,
        slot_value_bound,
        unpack_slots,
    )
    from .paillier import DEFAULT_OBFUSCATION, CryptoPool, Obfuscation

_EXPORTS = {
    "fedpca.codec.ciphertext": (
        "PackedCiphertexts",
        "SerialisedCiphertextGroup",
        "add_packed",
        "ciphertext_byte_length",
        "ciphertexts_from_bytes",
        "ciphertexts_to_bytes",
        "scalar_multiply",
        "validate_ciphertexts",
    ),
    "fedpca.codec.fixed_point": ("decode_fixed_point", "encode_fixed_point"),
    "fedpca.codec.keys": (
        "DEFAULT_KEY_BITS",
        "MIN_KEY_BITS",
        "generate_keypair",
        "key_fingerprint",
        "load_private_key",
        "load_public_key",
        "save_private_key",
        "save_public_key",
    ),
    "fedpca.codec.matrix": (
        "symmetric_from_upper_triangle",
        "upper_triangle",
    ),
    "fedpca.codec.packing": (
        "PackingBounds",
        "SlotLayout",
        "check_owner_count",
        "owner_value_bound",
        "pack_slots",
        "slot_value_bound",
        "unpack_slots",
    ),
    "fedpca.codec.paillier": ("DEFAULT_OBFUSCATION", "CryptoPool", "Obfuscation"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DEFAULT_KEY_BITS",
    "DEFAULT_OBFUSCATION",
    "MIN_KEY_BITS",
    "CryptoPool",
    "Obfuscation",
    "PackedCiphertexts",
    "PackingBounds",
    "SerialisedCiphertextGroup",
    "SlotLayout",
    "add_packed",
    "check_owner_count",
    "ciphertext_byte_length",
    "ciphertexts_from_bytes",
    "ciphertexts_to_bytes",
    "decode_fixed_point",
    "encode_fixed_point",
    "generate_keypair",
    "key_fingerprint",
    "load_private_key",
    "load_public_key",
    "owner_value_bound",
    "pack_slots",
    "save_private_key",
    "save_public_key",
    "scalar_multiply",
    "slot_value_bound",
    "symmetric_from_upper_triangle",
    "unpack_slots",
    "upper_triangle",
    "validate_ciphertexts",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
