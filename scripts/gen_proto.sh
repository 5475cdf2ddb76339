#!/usr/bin/env bash
# Regenerate proto/fedpca/v1/*_pb2*.py(i) from the .proto files.
# Pass --check to only verify that the committed code is current.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m fedpca.transport.protogen "$@"
