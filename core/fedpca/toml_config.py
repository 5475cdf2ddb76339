"""What every role's TOML configuration file has in common.

Each role (owner, proxy, analyst) declares its own sections and keys and checks
their values; this module holds the part they share:

* the file is read as UTF-8 TOML, and every error is a
  :class:`~fedpca.errors.ConfigError` that names the file;
* unknown keys are refused: a misspelt ``max_epsilon_per_querry`` or ``epsilion``
  that silently fell back to a default would weaken a policy or a budget without
  anyone noticing;
* relative paths are resolved against the folder holding the file, so a
  configuration can be moved together with its certificates and data.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fedpca.errors import ConfigError

__all__ = [
    "did_you_mean",
    "load_toml_config",
    "read_toml",
    "reject_unknown_keys",
    "require_keys",
    "resolve_path",
    "toml_value",
]

_Config = TypeVar("_Config")


def read_toml(path: str | os.PathLike[str], role: str) -> dict[str, Any]:
    """The parsed TOML document of a ``role`` configuration file.

    Raises
    ------
    ConfigError
        If the file cannot be read, is not UTF-8 text or is not valid TOML.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {role} config {file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file}: not a UTF-8 text file ({exc.reason})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: invalid TOML: {exc}") from exc


def load_toml_config(
    path: str | os.PathLike[str],
    role: str,
    build: Callable[[Mapping[str, Any], Path], _Config],
) -> _Config:
    """Read a ``role`` configuration file and build it with ``build(document, base_dir)``.

    ``base_dir`` is the folder holding the file, for :func:`resolve_path`. A
    ConfigError raised by ``build`` is prefixed with the file name.
    """
    file = Path(path)
    document = read_toml(file, role)
    try:
        return build(document, file.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from exc


def reject_unknown_keys(
    table: Mapping[str, Any], known: Collection[str], section: str = ""
) -> None:
    """Refuse keys of ``table`` outside ``known``; ``section`` is the table's dotted name.

    Raises
    ------
    ConfigError
        Naming every unknown key with its section (``policy.max_epsilon_per_querry``)
        and listing the known ones.
    """
    unknown = sorted(set(table) - set(known))
    if unknown:
        where = f"section [{section}]" if section else "the top level"
        names = ", ".join(f"{section}.{key}" if section else key for key in unknown)
        raise ConfigError(
            f"unknown keys in {where}: {names} (known: {', '.join(sorted(known))})"
            + did_you_mean(unknown, known)
        )


def did_you_mean(unknown: Iterable[str], known: Collection[str]) -> str:
    """``"; did you mean columns for colums?"`` for the unknown names close to a known
    one (difflib's ratio at least 0.75), or "" when none is."""
    pairs = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
        if close:
            pairs.append(f"{close[0]} for {name}")
    return f"; did you mean {', '.join(pairs)}?" if pairs else ""


def require_keys(
    table: Mapping[str, Any], required: Sequence[str], section: str, condition: str
) -> None:
    """Refuse ``table`` unless it has every key of ``required``, naming all that are
    missing (``[tls] needs ca, cert and key unless tls.insecure = true: tls.cert,
    tls.key missing``); ``condition`` says when they are needed.

    Raises
    ------
    ConfigError
        Some key of ``required`` is missing.
    """
    missing = [f"{section}.{key}" for key in required if key not in table]
    if missing:
        names = ", ".join(required[:-1]) + " and " + required[-1] if required[1:] else required[0]
        raise ConfigError(f"[{section}] needs {names} {condition}: {', '.join(missing)} missing")


def resolve_path(value: str, base_dir: Path, key: str) -> Path:
    """A path from the file: ``~`` expanded, relative ones resolved against ``base_dir``.

    Raises
    ------
    ConfigError
        Naming ``key`` if ``~user`` names an unknown user.
    """
    try:
        path = Path(value).expanduser()
    except RuntimeError as exc:  # "~user/..." naming an unknown user
        raise ConfigError(f"{key}: cannot expand {value!r}: {exc}") from None
    return path if path.is_absolute() else base_dir / path


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (for configuration files that fedpca writes).

    Strings are basic strings with backslashes, quotes and control characters
    escaped; floats keep every digit (``repr``), infinity is ``inf``; lists are
    inline arrays.

    Raises
    ------
    TypeError
        A value of another type.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            raise TypeError("nan cannot be written to a configuration file")
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str | Path):
        text = str(value)
        escaped = "".join(
            {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch)
            or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
            for ch in text
        )
        return f'"{escaped}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
