"""Regenerate (or check) the committed protobuf/gRPC code in ``proto/fedpca/v1``.

The generated modules are committed so that installing fedpca needs no code
generator. This script is the single definition of how they are produced; the
drift test (tests/unit/test_proto_generated.py) calls it too, so the command line
cannot diverge between the two.

Usage (from the repository, with the test extras installed)::

    python scripts/protogen.py           # rewrite the committed files
    python scripts/protogen.py --check   # exit 1 if they are stale

``grpcio-tools`` is a test/dev dependency only (pinned to the lower bound of the
grpcio requirement, because generated code refuses to import on an older grpcio).
"""

from __future__ import annotations

import argparse
import filecmp
import importlib
import importlib.resources
import logging
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

#: Suffixes of every file the generator writes for one ``.proto``.
GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_root() -> Path:
    """Return the include root holding ``fedpca/v1/*.proto``: the repository's proto/."""
    return Path(__file__).resolve().parent.parent / "proto"


def proto_files(root: Path | None = None) -> list[Path]:
    """Return the ``.proto`` sources, relative to ``root``, in a stable order."""
    root = proto_root() if root is None else root
    return sorted(p.relative_to(root) for p in (root / "fedpca" / "v1").glob("*.proto"))


def generated_names(root: Path | None = None) -> list[str]:
    """Return the file names (in ``fedpca/v1``) the generator produces."""
    names: list[str] = []
    for proto in proto_files(root):
        stem = proto.stem
        names.extend(stem + suffix for suffix in GENERATED_SUFFIXES)
    return sorted(names)


def generate(out_dir: Path, root: Path | None = None) -> list[Path]:
    """Run protoc for every ``.proto`` under ``root`` and write into ``out_dir``.

    Parameters
    ----------
    out_dir : Path
        Output root; files land in ``out_dir/fedpca/v1``.
    root : Path, optional
        Include root holding ``fedpca/v1/*.proto``; defaults to :func:`proto_root`.

    Returns
    -------
    list of Path
        The generated files.

    Raises
    ------
    RuntimeError
        If protoc reports an error.
    """
    # grpcio-tools is a dev dependency without type information.
    protoc = importlib.import_module("grpc_tools.protoc")

    root = proto_root() if root is None else root
    # grpc_tools bundles the well-known types (google/protobuf/timestamp.proto);
    # only its command-line wrapper adds that include path automatically.
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_files(root)),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}: {' '.join(args)}")
    target = out_dir / "fedpca" / "v1"
    return [target / name for name in generated_names(root)]


def stale_files(root: Path | None = None) -> list[str]:
    """Return committed generated files that differ from a fresh generation.

    A file counts as stale if its content differs, if it is missing, or if it is
    a leftover ``*_pb2*`` file whose ``.proto`` no longer exists.
    """
    root = proto_root() if root is None else root
    committed_dir = root / "fedpca" / "v1"
    with tempfile.TemporaryDirectory(prefix="fedpca-protogen-") as tmp:
        fresh_dir = Path(tmp) / "fedpca" / "v1"
        generate(Path(tmp), root)
        expected = {p.name for p in fresh_dir.iterdir() if _is_generated(p.name)}
        present = {p.name for p in committed_dir.iterdir() if _is_generated(p.name)}
        stale = sorted(present ^ expected)
        for name in sorted(expected & present):
            if not filecmp.cmp(fresh_dir / name, committed_dir / name, shallow=False):
                stale.append(name)
    return sorted(stale)


def regenerate(root: Path | None = None) -> list[Path]:
    """Rewrite the committed generated files in place (and drop orphans)."""
    root = proto_root() if root is None else root
    committed_dir = root / "fedpca" / "v1"
    with tempfile.TemporaryDirectory(prefix="fedpca-protogen-") as tmp:
        fresh = generate(Path(tmp), root)
        for orphan in committed_dir.iterdir():
            if _is_generated(orphan.name) and orphan.name not in {p.name for p in fresh}:
                logger.info("removing orphaned generated file %s", orphan)
                orphan.unlink()
        written = []
        for path in fresh:
            dest = committed_dir / path.name
            shutil.copyfile(path, dest)
            written.append(dest)
    return written


def _is_generated(name: str) -> bool:
    return name.endswith(GENERATED_SUFFIXES)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: regenerate, or with ``--check`` report stale files."""
    parser = argparse.ArgumentParser(prog="python scripts/protogen.py")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated files (run python scripts/protogen.py):", *stale, sep="\n  ")
            return 1
        print("generated code is up to date")
        return 0
    for path in regenerate():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
