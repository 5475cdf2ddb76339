"""Node folders: what ``fedpca proxy init`` and ``fedpca owner init`` write.

A node folder holds everything one process needs, with paths relative to it, so it
can be copied to the node's machine, mounted into a container or turned into a
Kubernetes ConfigMap and Secret without editing a path::

    <folder>/<role>.toml     the configuration (paths relative to this folder)
    <folder>/tls/ca.pem      the fedpca CA certificate (0644)
    <folder>/tls/cert.pem    this node's certificate (0644)
    <folder>/tls/key.pem     this node's private key (0600)
    <folder>/state/          durable state (SQLite), the only folder it writes to

The TLS files are copies of the node's own files from a ``fedpca certs init``
directory (never the CA key), or of files named one by one.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from fedpca.errors import ConfigError
from fedpca.files import undone_on_failure
from fedpca.transport.certs import (
    CertificateDirectory,
    NodeIdentity,
    TlsFiles,
    TlsMaterial,
    read_certificate,
    read_private_key,
    write_certificate,
    write_private_key,
)

__all__ = [
    "NodeFolder",
    "config_path",
    "prepare_folder",
    "refuse_changed_settings",
    "settings_given",
    "writing_folder",
]

logger = logging.getLogger(__name__)

TLS_DIR = "tls"
STATE_DIR = "state"


@dataclass(frozen=True)
class NodeFolder:
    """The layout of a node folder."""

    root: Path

    @property
    def tls(self) -> TlsFiles:
        tls = self.root / TLS_DIR
        return TlsFiles(tls / "ca.pem", tls / "cert.pem", tls / "key.pem")

    @property
    def state(self) -> Path:
        return self.root / STATE_DIR

    def install_tls(
        self,
        identity: NodeIdentity,
        *,
        certs: Path | None = None,
        files: TlsFiles | None = None,
    ) -> TlsMaterial:
        """Copy ``identity``'s TLS files into ``tls/`` and check them.

        Parameters
        ----------
        identity : the node the certificate must name.
        certs : a ``fedpca certs init`` directory to take the node's files from, or
        files : the CA certificate, certificate and key named one by one.

        Raises
        ------
        ConfigError
            Neither or both sources, missing files, a certificate of another node, or
            material that does not belong together (:meth:`TlsMaterial.load`).
        """
        if (certs is None) == (files is None):
            raise ConfigError("give either a certificates directory or the three TLS files")
        source = CertificateDirectory(certs).node_files(identity) if certs is not None else files
        assert source is not None
        if certs is not None and not source.ca_certificate.is_file():
            raise ConfigError(
                f"{certs} is not a certificates directory: it has no {source.ca_certificate.name}"
                f" under {source.ca_certificate.parent.name}/ (`fedpca certs init --out DIR` "
                "creates one; or name the node's files with --ca, --cert and --key)"
            )
        for path in (source.ca_certificate, source.certificate, source.private_key):
            if not path.is_file():
                raise ConfigError(
                    f"{path} does not exist"
                    + (
                        f" (issue it with `fedpca certs issue --dir {certs} --role "
                        f"{identity.role.value} --node-id {identity.node_id}`)"
                        if certs is not None
                        else ""
                    )
                )
        material = TlsMaterial.load(source)
        if material.identity != identity:
            raise ConfigError(
                f"{source.certificate} is the certificate of {material.identity}, not {identity}"
            )
        target = self.tls
        write_certificate(target.ca_certificate, read_certificate(source.ca_certificate))
        write_certificate(target.certificate, read_certificate(source.certificate))
        write_private_key(target.private_key, read_private_key(source.private_key))
        return material

    def make_state(self) -> None:
        self.state.mkdir(mode=0o700, parents=True, exist_ok=True)


def prepare_folder(root: Path, config_name: str, *, force: bool) -> NodeFolder:
    """Create ``root`` for a new node folder; refuse to overwrite a config without ``force``.

    Raises
    ------
    ConfigError
        ``root/config_name`` exists and ``force`` is False, or ``root`` holds fedpca's
        sources (a folder of its repository: the roles' folders share their names).
    """
    config = root / config_name
    sources = root / "fedpca"
    if sources.is_dir() and next(sources.rglob("*.py"), None) is not None:
        # A new user's walkthrough ran `proxy init --out proxy` in a clone of fedpca,
        # whose proxy/ holds the proxy's sources: its keys and database went in there.
        raise ConfigError(
            f"{root} holds Python sources ({sources}/): it looks like a folder of fedpca's "
            "own repository. Run init in a folder of your own (e.g. cd ~/deployment), "
            "not in the repository"
        )
    if config.exists() and not force:
        # Named from what the folder holds: an analyst's folder has no state/.
        kept = f", its {STATE_DIR}/ included" if (root / STATE_DIR).is_dir() else ""
        raise ConfigError(
            f"{config} already exists; pass --force to write {config_name} and {TLS_DIR}/ "
            f"again (everything else in {root} is kept{kept})"
        )
    root.mkdir(parents=True, exist_ok=True)
    return NodeFolder(root)


@contextmanager
def writing_folder(
    root: Path, config_name: str, *, force: bool, also: Iterable[Path] = ()
) -> Iterator[NodeFolder]:
    """:func:`prepare_folder`, with everything the body writes undone if it raises.

    A failed ``init`` (TLS files of another node, a value the role's loader refuses)
    removes what it created, ``root`` itself included when it did not exist, and puts
    back the configuration and TLS files it replaced (``--force``), so that the command
    can be run again as it is; nothing that existed before is removed. ``also``: other
    folders the body writes into (an owner's ``--state-dir``).
    """
    tls = NodeFolder(root).tls
    replaced = (root / config_name, tls.ca_certificate, tls.certificate, tls.private_key)
    with undone_on_failure((root, *also), replaced):
        yield prepare_folder(root, config_name, force=force)


def config_path(path: Path, config_dir: Path) -> str:
    """``path`` as the configuration file should name it: relative to ``config_dir`` when
    it lies inside it (the folder can move), else absolute."""
    absolute = Path(os.path.abspath(path))
    base = Path(os.path.abspath(config_dir))
    try:
        return absolute.relative_to(base).as_posix()
    except ValueError:
        return str(absolute)


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def refuse_changed_settings(
    path: Path,
    new_text: str,
    *,
    replace_settings: bool,
    requested: Iterable[str] = (),
    settable: Iterable[str] | None = None,
) -> None:
    """Refuse to replace the configuration ``path`` with ``new_text`` when that changes
    or drops a setting, unless ``replace_settings`` or the setting is ``requested``.

    ``init --force`` writes every setting from its flags and their defaults: run again
    to pin one more analyst key, it had silently raised an owner's budget from 1 to 3,
    lowered its quorum and dropped its other limits, and a proxy's had dropped revoked
    certificates and budget overrides (found by an operator's review). The error lists
    each change. A setting the file lacks that a default would add is a change too (a
    file without ``listen`` read as loopback; rewritten, it listened on every address:
    review). A file that cannot be read as TOML is refused whatever the flags: what it
    holds (revocations, a database elsewhere) would be lost without a word (review).

    ``requested`` names the settings (dotted keys, e.g. ``owners.allowed``; a table's
    name covers its keys) whose flags were given (:func:`settings_given`): changing
    them is what was asked. A new user's ``proxy init --force --owners a,b,c`` was
    refused for changing the owners until ``--replace-settings`` was added. Each change
    accepted is logged (a WARNING): a required flag is always given, so a re-run with
    fewer owners or a larger ``--max-records`` is accepted, and the log says so.

    ``settable`` names the settings some flag of the command writes (None: all of
    them). A change to one no flag writes (``crypto.processes`` of an owner) is named
    apart, as kept only by editing the file: the error told an operator to "give the
    flags that keep them", flags that do not exist (an operator's walkthrough, stop 42).

    Raises
    ------
    ConfigError
    """
    if not path.is_file():
        return
    try:
        old = _flat(tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"{path} exists and cannot be read ({exc}): `init --force` keeps what it holds "
            "(revocations, paths, limits), so fix it first, or move it away to write a "
            "new one from the flags alone"
        ) from exc
    new = _flat(tomllib.loads(new_text))
    asked = tuple(requested)
    changed = {
        key: f"{key}: {old[key]!r} -> {new[key]!r}"
        if key in new
        else f"{key}: {old[key]!r} dropped"
        for key in sorted(old)
        if new.get(key, _MISSING) != old[key]
    }
    changed.update({key: f"{key}: {new[key]!r} added" for key in sorted(set(new) - set(old))})
    unasked = [key for key in changed if not _covered(key, asked)]
    changes = [changed[key] for key in unasked]
    if changes and not replace_settings:
        flags = None if settable is None else tuple(settable)
        unflagged = [key for key in unasked if flags is not None and not _covered(key, flags)]
        them = "it" if len(unflagged) == 1 else "them"
        no_flag = (
            f" No flag of `init` writes {', '.join(unflagged)}: keep {them} by editing "
            f"{path.name} by hand instead of running `init --force`, or set {them} again "
            "by hand after --replace-settings."
            if unflagged
            else ""
        )
        raise ConfigError(
            f"{path} would change these settings: {'; '.join(changes)}. `init --force` "
            "writes every setting from its flags and their defaults; changes by flags "
            "given are accepted, not those of defaults: give the flags that keep them, "
            f"edit {path.name} by hand instead, or pass --replace-settings to accept the "
            f"changes.{no_flag}"
        )
    for change in changed.values():
        logger.warning("%s: %s", path.name, change)


_MISSING = object()


def _covered(key: str, names: Iterable[str]) -> bool:
    """Whether the dotted setting ``key`` is one of ``names`` or in a table among them."""
    return any(key == name or key.startswith(f"{name}.") for name in names)


def settings_given(flag_settings: Mapping[str, Iterable[str]]) -> list[str]:
    """The settings (dotted keys) of the current click command's flags that were given
    on its command line or in the environment, not left at their defaults.

    ``flag_settings`` maps each parameter's name to the settings it writes; the result
    is the ``requested`` of :func:`refuse_changed_settings`.
    """
    context = click.get_current_context()
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return [
        key
        for name, keys in flag_settings.items()
        if context.get_parameter_source(name) in given
        for key in keys
    ]
