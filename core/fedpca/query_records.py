"""A query's spec as strict JSON: how the proxy stores it and how a proxy's export of
an owner's releases carries it (:mod:`fedpca.release_exports`).

Read back, a spec hashes (:func:`fedpca.query.spec_digest`) exactly as the one written,
so the analyst's signature over it still verifies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from fedpca.errors import ConfigError
from fedpca.query import (
    Aggregate,
    Calibration,
    Neighbouring,
    ProtocolMode,
    QueryKind,
    QuerySpec,
)

__all__ = ["spec_from_dict", "spec_to_dict"]


def spec_to_dict(spec: QuerySpec) -> dict[str, Any]:
    """JSON-ready form of a query (strict JSON: an infinite epsilon is ``"inf"``).

    The analyst modulus is written as a hex string: 2048+-bit integers are valid
    JSON, but many JSON readers silently turn them into floats.
    """
    record: dict[str, Any] = {}
    for spec_field in fields(QuerySpec):
        value = getattr(spec, spec_field.name)
        if spec_field.name == "analyst_public_key_n":
            value = format(value, "x")
        elif spec_field.name == "aggregates":
            value = [part.to_dict() for part in value]
        elif isinstance(value, QueryKind | ProtocolMode | Calibration | Neighbouring):
            value = value.value
        elif isinstance(value, tuple):
            value = [_float_out(v) for v in value]
        elif isinstance(value, float):
            value = _float_out(value)
        record[spec_field.name] = value
    return record


def spec_from_dict(record: Mapping[str, Any]) -> QuerySpec:
    """Inverse of :func:`spec_to_dict`.

    Raises
    ------
    ConfigError
        Missing or unknown keys, or values the query refuses.
    """
    names = {f.name for f in fields(QuerySpec)}
    unknown = sorted(set(record) - names)
    if unknown:
        raise ConfigError(f"stored query has unknown keys {unknown}")
    kwargs: dict[str, Any] = {}
    try:
        for name, value in record.items():
            if name == "analyst_public_key_n":
                value = int(value, 16)
            elif name == "aggregates":
                value = tuple(Aggregate.from_dict(part) for part in value)
            elif name == "kind":
                value = QueryKind(value)
            elif name == "mode":
                value = ProtocolMode(value)
            elif name == "calibration":
                value = Calibration(value)
            elif name == "neighbouring":
                value = Neighbouring(value)
            elif isinstance(value, list):
                value = tuple(float(v) for v in value)
            elif name in ("epsilon", "delta", "clip_norm", "deadline_seconds"):
                value = float(value)
            kwargs[name] = value
        return QuerySpec(**kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"stored query cannot be read back: {exc}") from exc


def _float_out(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value
