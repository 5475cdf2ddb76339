from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CiphertextBlock(_message.Message):
    __slots__ = ("name", "key_bits", "slot_bits", "slots_per_ciphertext", "value_count", "n_ciphertexts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_BITS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BITS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    VALUE_COUNT_FIELD_NUMBER: _ClassVar[int]
    N_CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    key_bits: int
    slot_bits: int
    slots_per_ciphertext: int
    value_count: int
    n_ciphertexts: int
    def __init__(self, name: _Optional[str] = ..., key_bits: _Optional[int] = ..., slot_bits: _Optional[int] = ..., slots_per_ciphertext: _Optional[int] = ..., value_count: _Optional[int] = ..., n_ciphertexts: _Optional[int] = ...) -> None: ...

class CiphertextChunk(_message.Message):
    __slots__ = ("index", "ciphertexts", "sha256")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    index: int
    ciphertexts: bytes
    sha256: bytes
    def __init__(self, index: _Optional[int] = ..., ciphertexts: _Optional[bytes] = ..., sha256: _Optional[bytes] = ...) -> None: ...
