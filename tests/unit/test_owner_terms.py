"""An owner's stated terms: the analyst judges a query by them as the owner does.

The property that matters: an owner's terms, as it states them on its task stream and
as the analyst decodes them from the proxy's answer, refuse a query exactly when the
owner's own check of the signed task does, and with the same reason (the analyst is
told before it submits what the owner would answer after). Every rule of the terms is
exercised here against :func:`fedpca.owner.policy.check_task`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.errors import ProtocolError
from fedpca.formatting import column_ranges
from fedpca.messages import DeploymentInfo, Task
from fedpca.owner.config import DataConfig, OwnerConfig, PrivacyConfig
from fedpca.owner.local_table import LocalTable
from fedpca.owner.policy import Refusal, TaskAccepted, check_task, stated_terms
from fedpca.owner_terms import MAX_STATED_COUNT, OwnerTerms
from fedpca.query import Aggregate, Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.table_schema import TableSchema
from fedpca.transport import serde
from fedpca.v1 import query_pb2 as query_pb
from helpers import make_query, owner_policy_config, signed_task


def _config(public_key: Any, data: DataConfig | None = None, **policy: Any) -> OwnerConfig:
    return owner_policy_config(public_key, data, **policy)


def _table(label_column: int | None = 0) -> LocalTable:
    rng = np.random.default_rng(0)
    columns = np.column_stack([rng.choice([-1.0, 1.0], size=20), rng.normal(size=(20, 3))])
    return LocalTable(columns, label_column, "test")


def _task(spec: QuerySpec) -> Task:
    return signed_task(spec, datetime.now(UTC) + timedelta(minutes=5))


def _pca(public_key: Any, **fields: Any) -> QuerySpec:
    return make_query(public_key, **{"epsilon": 1.0, "quorum": 2, **fields})


def _dca(public_key: Any, **fields: Any) -> QuerySpec:
    dca = {"kind": QueryKind.DCA, "n_components": 1, "label_column": 0, "class_labels": (-1.0, 1.0)}
    return _pca(public_key, **{**dca, **fields})


def _stats(public_key: Any, columns: tuple[int, ...]) -> QuerySpec:
    part = Aggregate.statistics(columns, (0.0,) * len(columns), (1.0,) * len(columns))
    return _pca(
        public_key,
        kind=QueryKind.AGGREGATE,
        n_features=len(columns),
        n_components=1,
        delta=1e-6,
        aggregates=(part,),
    )


REPLACE_ONE = PrivacyConfig(neighbouring=Neighbouring.REPLACE_ONE)
ENFORCED = DataConfig(Path("data.csv"), max_records=100, enforce_max_records=True)

# (case, owner configuration changes, query, label column of the owner's table)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], int | None]] = [
    ("pca", {}, {}, 0),
    ("dca", {}, {"dca": True}, 0),
    ("epsilon over the cap", {}, {"epsilon": 3.0}, 0),
    ("epsilon at a large delta", {"max_delta_per_query": 0.999}, {"delta": 0.99}, 0),
    ("delta over the cap", {}, {"delta": 1.0000001e-5}, 0),
    ("not private", {}, {"epsilon": math.inf}, 0),
    ("not private, allowed", {"allow_not_private": True}, {"epsilon": math.inf}, 0),
    ("relation", {}, {"neighbouring": Neighbouring.REPLACE_ONE}, 0),
    (
        "masked",
        {"privacy": REPLACE_ONE},
        {"mode": ProtocolMode.MASKED, "neighbouring": Neighbouring.REPLACE_ONE},
        0,
    ),
    (
        "masked, allowed",
        {"privacy": REPLACE_ONE, "allow_masked_mode": True},
        {"mode": ProtocolMode.MASKED, "neighbouring": Neighbouring.REPLACE_ONE},
        0,
    ),
    ("kind", {"allowed_kinds": (QueryKind.PCA,)}, {"dca": True}, 0),
    ("quorum", {"min_quorum": 3}, {}, 0),
    ("bounded, not enforced", {}, {"bounded_owner_tables": True, "max_records_per_owner": 100}, 0),
    (
        "bounded, below the capacity",
        {"data": ENFORCED},
        {"bounded_owner_tables": True, "max_records_per_owner": 99},
        0,
    ),
    (
        "bounded, enforced",
        {"data": ENFORCED},
        {"bounded_owner_tables": True, "max_records_per_owner": 100},
        0,
    ),
    ("allowed columns", {"allowed_columns": (0, 1, 2)}, {}, 0),
    (
        "allowed columns, named",
        {"allowed_columns": (0, 1, 2)},
        {"n_features": 2, "feature_columns": (1, 2)},
        0,
    ),
    ("features", {}, {"n_features": 4}, 0),
    ("features, no label column", {}, {"n_features": 4}, None),
    ("feature column missing", {}, {"n_features": 2, "feature_columns": (1, 9)}, 0),
    ("label column as feature", {}, {"n_features": 2, "feature_columns": (0, 1)}, 0),
    ("dca label missing", {}, {"dca": True, "label_column": 7}, 0),
    ("dca label elsewhere", {}, {"dca": True, "label_column": 1}, 0),
    ("aggregate", {}, {"stats": (1, 3)}, 0),
    ("aggregate column missing", {}, {"stats": (1, 4)}, 0),
    ("aggregate, allowed columns", {"allowed_columns": (1, 2)}, {"stats": (1, 3)}, 0),
]


def _case(public_key: Any, owner: dict[str, Any], query: dict[str, Any]) -> Any:
    owner = dict(owner)
    privacy, data = owner.pop("privacy", None), owner.pop("data", None)
    config = _config(public_key, data, **owner)
    if privacy is not None:
        config = replace(config, privacy=privacy)
    query = dict(query)
    if "stats" in query:
        return config, _stats(public_key, query.pop("stats"))
    builder = _dca if query.pop("dca", False) else _pca
    return config, builder(public_key, **query)


@pytest.mark.parametrize(
    ("owner", "query", "label"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_stated_terms_refuse_what_the_owner_refuses_with_its_reason(
    test_only_keypair_512: tuple[Any, Any],
    owner: dict[str, Any],
    query: dict[str, Any],
    label: int | None,
) -> None:
    public_key, _ = test_only_keypair_512
    config, spec = _case(public_key, owner, query)
    table = _table(label)
    decided = check_task(_task(spec), config, table)
    # As the analyst holds them: stated by the owner, carried on the wire, decoded.
    sent = serde.owner_terms_to_proto(stated_terms(config, table))
    terms = serde.owner_terms_from_proto(
        query_pb.OwnerTerms.FromString(sent.SerializeToString()), "t"
    )
    assert terms == stated_terms(config, table)
    if isinstance(decided, TaskAccepted):
        assert terms.refusal(spec) is None
    else:
        assert isinstance(decided, Refusal)
        assert terms.refusal(spec) == decided.detail


def test_the_cases_cover_acceptance_and_every_rule(test_only_keypair_512: tuple[Any, Any]) -> None:
    """The table above is not vacuous: it has accepted queries, and refusals by each
    rule (a case table of only acceptances would pass the property trivially)."""
    public_key, _ = test_only_keypair_512
    reasons = []
    for _, owner, query, label in CASES:
        config, spec = _case(public_key, owner, query)
        decided = check_task(_task(spec), config, _table(label))
        reasons.append("accepted" if isinstance(decided, TaskAccepted) else decided.detail)
    assert reasons.count("accepted") == 8
    for phrase in (
        "max_epsilon_per_query",
        "per-query cap",
        "allow_not_private",
        "adjacency",
        "allow_masked_mode",
        "allowed_kinds",
        "min_quorum",
        "does not enforce its max_records",
        "below this owner's public max_records",
        "not in policy.allowed_columns",
        "4 features; this owner's data has 3",
        "reads feature column 9",
        "this owner's label column, as a feature",
        "reads labels from column 7",
        "labels are in column 0",
        "reads column 4 (0-based)",
    ):
        assert any(phrase in reason for reason in reasons), phrase


def test_stated_terms_are_the_owners_configuration_and_schema(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(
        public_key,
        ENFORCED,
        allowed_columns=(0, 2),
        allowed_kinds=(QueryKind.PCA,),
        min_quorum=3,
        max_tasks_per_day=7,
        max_delta_per_query=1e-7,
        allow_masked_mode=True,
    )
    terms = stated_terms(config, _table(label_column=-1))
    assert terms == OwnerTerms(
        schema=TableSchema(4, 3),
        neighbouring=Neighbouring.ADD_REMOVE,
        allowed_kinds=(QueryKind.PCA,),
        allowed_columns=(0, 2),
        allow_masked_mode=True,
        allow_not_private=False,
        max_delta_per_query=1e-7,
        max_epsilon_per_query=1.5,
        budget_delta=1e-5,
        accountant="zcdp",
        min_quorum=3,
        max_tasks_per_day=7,
        max_records=100,
    )
    # Not enforced: no capacity is stated (a query for bounded tables is declined).
    assert stated_terms(_config(public_key), _table()).max_records is None


def _wire(public_key: Any, **fields: Any) -> Any:
    message = serde.owner_terms_to_proto(stated_terms(_config(public_key), _table()))
    for name, value in fields.items():
        if isinstance(value, list):
            message.ClearField(name)
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"n_columns": 0}, "n_columns = 0"),
        ({"n_columns": (1 << 16) + 1}, "n_columns"),
        ({"label_column": 4}, "label_column = 4"),
        ({"allowed_columns": [1, 4], "columns_limited": True}, "names column 4"),
        ({"allowed_columns": [1]}, "without columns_limited"),
        ({"allowed_kinds": ["pca", "pcb"]}, "unknown release kind 'pcb'"),
        ({"allowed_kinds": ["pca"] * 6}, "more than 5 kinds"),
        ({"max_delta_per_query": 1.0}, "max_delta_per_query = 1.0"),
        ({"budget_delta": -0.5}, "budget_delta = -0.5"),
        ({"max_epsilon_per_query": math.nan}, "max_epsilon_per_query = nan"),
        ({"max_epsilon_per_query": -1.0}, "max_epsilon_per_query = -1.0"),
        ({"min_quorum": 0}, "min_quorum = 0"),
        ({"neighbouring": 0}, "neighbouring"),
        # A newer owner's accountant: left out like terms not stated, not a refusal.
        ({"accountant": "rdp-2031"}, "unknown accountant 'rdp-2031'"),
        ({"min_quorum": (1 << 31) + 1}, "min_quorum = 2147483649: too large"),
    ],
)
def test_terms_out_of_range_are_a_protocol_error(
    test_only_keypair_512: tuple[Any, Any], fields: dict[str, Any], match: str
) -> None:
    message = _wire(test_only_keypair_512[0], **fields)
    with pytest.raises(ProtocolError, match=match):
        serde.owner_terms_from_proto(message, "OwnerTerms")


def test_too_many_allowed_columns_are_refused(test_only_keypair_512: tuple[Any, Any]) -> None:
    message = _wire(test_only_keypair_512[0], n_columns=10_000, columns_limited=True)
    message.ClearField("allowed_columns")
    message.allowed_columns.extend(range(serde_limit() + 1))
    with pytest.raises(ProtocolError, match="more than 8192 columns"):
        serde.owner_terms_from_proto(message, "OwnerTerms")
    del message.allowed_columns[-1]
    assert serde.owner_terms_from_proto(message, "OwnerTerms").allowed_columns == tuple(
        range(serde_limit())
    )


def serde_limit() -> int:
    from fedpca.transport.serde.query import MAX_STATED_ALLOWED_COLUMNS

    return MAX_STATED_ALLOWED_COLUMNS


def test_a_long_unknown_kind_is_quoted_short() -> None:
    """The proxy logs why it does not pass an owner's terms on: a peer's million-
    character kind name must not reach the log whole (found by review)."""
    message = query_pb.OwnerTerms(n_columns=3, min_quorum=1, allowed_kinds=["x" * 1_000_000])
    with pytest.raises(ProtocolError) as refused:
        serde.owner_terms_from_proto(message, "OwnerTerms")
    assert len(str(refused.value)) < 200 and "unknown release kind" in str(refused.value)


def test_counts_beyond_the_wire_are_stated_as_its_bound(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """An operator's "no limit" (max_tasks_per_day = 2**40) made the terms unencodable
    and the node reconnect forever without serving (found by review)."""
    config = _config(test_only_keypair_512[0], max_tasks_per_day=1 << 40, min_quorum=1 << 33)
    terms = stated_terms(config, _table())
    assert (terms.max_tasks_per_day, terms.min_quorum) == (MAX_STATED_COUNT, MAX_STATED_COUNT)
    sent = serde.task_stream_request_to_proto("owner-1", (), terms)
    assert serde.stated_terms_from_proto(sent) == terms


def test_an_analyst_reads_terms_of_at_most_the_connected_owners(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """Each stated terms costs the analyst a judgement of its query: a proxy sending
    terms of more owners than it says are connected is refused (found by review); an
    entry with an overlong owner id is left out, not the whole answer."""
    terms = stated_terms(_config(test_only_keypair_512[0]), _table())
    info = DeploymentInfo(
        proxy_id="proxy",
        software_version="test",
        protocol_version=6,
        owners_registered=3,
        owners_connected=2,
        neighbouring=Neighbouring.ADD_REMOVE,
        max_delta_per_query=1e-5,
        accountant="zcdp",
        analyst_id="alice",
        budget_epsilon=1.0,
        budget_delta=1e-5,
        server_time=datetime.now(UTC),
        owner_terms=(("owner-1", terms), ("x" * 10_000, terms)),
    )
    decoded = serde.deployment_info_from_proto(serde.deployment_info_to_proto(info))
    assert decoded.owner_terms == (("owner-1", terms),)
    too_many = replace(info, owners_connected=1)
    with pytest.raises(ProtocolError, match="terms of 2 owners, but 1 connected"):
        serde.deployment_info_from_proto(serde.deployment_info_to_proto(too_many))


def test_an_owner_may_keep_its_terms_to_itself(tmp_path: Path) -> None:
    """``policy.state_terms = false``: the node states none (default: it states them)."""
    from fedpca.owner.config import load_config

    config_text = f"""
[owner]
id = "owner-1"
proxy = "127.0.0.1:50051"
[tls]
insecure = true
[data]
path = "data.csv"
max_records = 100
[policy]
accepted_analyst_keys = ["sha256:{"ab" * 32}"]
max_epsilon_per_query = 1.0
STATE_TERMS
[budget]
epsilon = 10.0
delta = 1e-5
"""
    path = tmp_path / "owner.toml"
    path.write_text(config_text.replace("STATE_TERMS", ""))
    assert load_config(path).policy.state_terms is True
    path.write_text(config_text.replace("STATE_TERMS", "state_terms = false"))
    assert load_config(path).policy.state_terms is False


def test_column_ranges() -> None:
    assert column_ranges([]) == ""
    assert column_ranges([4]) == "4"
    assert column_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
    assert column_ranges([5, 6, 2, 3]) == "5-6, 2-3"
    assert column_ranges(range(2000)) == "0-1999"
