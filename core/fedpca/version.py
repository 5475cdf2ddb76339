"""The version of the installed fedpca distribution (set in pyproject.toml)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("fedpca")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
