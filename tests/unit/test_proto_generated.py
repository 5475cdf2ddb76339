"""The committed fedpca.v1 code must be exactly what the pinned generator produces."""

from __future__ import annotations

import importlib
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import protogen

REPO = Path(__file__).resolve().parents[2]


def test_committed_generated_code_is_current() -> None:
    stale = protogen.stale_files()
    assert stale == [], f"regenerate with python scripts/protogen.py; stale: {stale}"


def test_every_proto_has_its_generated_files() -> None:
    committed = {p.name for p in (protogen.proto_root() / "fedpca" / "v1").iterdir()}
    missing = set(protogen.generated_names()) - committed
    assert not missing


def test_check_detects_an_edited_proto(tmp_path: Path) -> None:
    # Work on a copy so the check is shown to fail without touching the repo.
    root = tmp_path / "proto"
    shutil.copytree(protogen.proto_root() / "fedpca", root / "fedpca")
    query_proto = root / "fedpca" / "v1" / "query.proto"
    text = query_proto.read_text()
    query_proto.write_text(
        text.replace("string query_id = 1;", "string query_id = 1;\n  int32 x = 99;")
    )
    assert protogen.stale_files(root) == ["query_pb2.py", "query_pb2.pyi"]


def test_check_detects_an_orphaned_generated_file(tmp_path: Path) -> None:
    root = tmp_path / "proto"
    shutil.copytree(protogen.proto_root() / "fedpca", root / "fedpca")
    (root / "fedpca" / "v1" / "legacy_pb2.py").write_text("# from a deleted .proto\n")
    assert protogen.stale_files(root) == ["legacy_pb2.py"]


def test_check_cli_exit_code(tmp_path: Path) -> None:
    assert protogen.main(["--check"]) == 0


@pytest.mark.parametrize("proto", sorted(p.stem for p in protogen.proto_files()))
def test_generated_modules_import_from_the_installed_package(proto: str) -> None:
    importlib.import_module(f"fedpca.v1.{proto}_pb2")
    importlib.import_module(f"fedpca.v1.{proto}_pb2_grpc")


def test_services_are_split_by_caller() -> None:
    owner = importlib.import_module("fedpca.v1.owner_service_pb2")
    analyst = importlib.import_module("fedpca.v1.analyst_service_pb2")
    owner_methods = {m.name for m in owner.DESCRIPTOR.services_by_name["OwnerService"].methods}
    analyst_methods = {
        m.name for m in analyst.DESCRIPTOR.services_by_name["AnalystService"].methods
    }
    assert owner_methods == {"Hello", "StreamTasks", "Upload", "DeclineTask"}
    assert analyst_methods == {
        "SubmitQuery",
        "GetQueryStatus",
        "WatchQueryStatus",
        "FetchResult",
        "GetBudget",
        "DescribeDeployment",
        "ListQueries",
        "CancelQuery",
    }
    tasks = owner.DESCRIPTOR.services_by_name["OwnerService"].methods_by_name["StreamTasks"]
    upload = owner.DESCRIPTOR.services_by_name["OwnerService"].methods_by_name["Upload"]
    assert tasks.server_streaming and not tasks.client_streaming
    assert upload.client_streaming and not upload.server_streaming


def _floor(requirement: str) -> Version:
    (spec,) = [s for s in Requirement(requirement).specifier if s.operator == ">="]
    return Version(spec.version)


def test_dependency_floors_cover_the_generated_code() -> None:
    # Generated code refuses to import on a runtime older than the generator's,
    # so the declared lower bounds must be at least the gencode versions.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {Requirement(d).name: d for d in project["dependencies"]}
    v1 = protogen.proto_root() / "fedpca" / "v1"
    protobuf_gen = re.search(
        r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", (v1 / "query_pb2.py").read_text()
    )
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'", (v1 / "query_pb2_grpc.py").read_text()
    )
    assert protobuf_gen is not None and grpc_gen is not None
    assert _floor(deps["protobuf"]) >= Version(".".join(protobuf_gen.groups()))
    assert _floor(deps["grpcio"]) >= Version(grpc_gen.group(1))
