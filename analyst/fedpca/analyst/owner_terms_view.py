"""``fedpca analyst deployment``: the terms the connected owners stated, for reading.

Owners of one deployment mostly state the same terms, so owners with equal terms are
shown together, each set of terms once (hundreds of owners would otherwise repeat the
same lines hundreds of times).
"""

from __future__ import annotations

from fedpca.formatting import column_ranges, first_of, printable
from fedpca.messages import DeploymentInfo
from fedpca.owner_terms import OwnerTerms

__all__ = ["OWNERS_NAMED_PER_TERMS", "owner_terms_lines"]

OWNERS_NAMED_PER_TERMS = 10
"""Owners named above one set of terms; the others are counted."""


def _yes_no(allowed: bool) -> str:
    return "accepted" if allowed else "declined"


def _terms_lines(terms: OwnerTerms) -> list[str]:
    schema = terms.schema
    label = "" if schema.label_column is None else f", labels in column {schema.label_column}"
    allowed = (
        "any of them"
        if terms.allowed_columns is None
        else f"only {column_ranges(terms.allowed_columns)}"
        if terms.allowed_columns
        else "none"
    )
    kinds = ", ".join(kind.value for kind in terms.allowed_kinds) or "nothing"
    lines = [
        f"    answers:          {kinds}",
        f"    file columns:     {schema.n_columns} (0 to {schema.n_columns - 1}{label}); a query "
        f"may read {allowed}",
        f"    epsilon:          at most {terms.max_epsilon_per_query:g} per query, measured at "
        f"delta {terms.budget_delta:g} ({printable(terms.accountant)})",
        f"    delta:            at most {terms.max_delta_per_query:g} per query",
        f"    quorum:           at least {terms.min_quorum}",
        f"    masked mode:      {_yes_no(terms.allow_masked_mode)}",
        f"    epsilon = inf:    {_yes_no(terms.allow_not_private)}",
        f"    tasks per day:    at most {terms.max_tasks_per_day}",
        f"    neighbouring:     {terms.neighbouring.value}",
    ]
    if terms.max_records is not None:
        lines.append(f"    capacity:         {terms.max_records} records (enforced)")
    return lines


def owner_terms_lines(info: DeploymentInfo) -> list[str]:
    """The owners' terms in ``info`` (asked with them), owners with equal terms together;
    then how many connected owners stated none."""
    grouped: dict[OwnerTerms, list[str]] = {}
    for owner_id, terms in info.owner_terms:
        grouped.setdefault(terms, []).append(printable(owner_id))
    lines = [
        "owners' terms:    as each connected owner states them (the owner decides; "
        "a query they do not meet is declined)"
    ]
    for terms, owners in grouped.items():
        lines.append(f"  {first_of(owners, OWNERS_NAMED_PER_TERMS)}:")
        lines.extend(_terms_lines(terms))
    silent = info.owners_connected - len(info.owner_terms)
    if silent > 0:
        lines.append(
            f"  {silent} connected owners state no terms this version can read (a fedpca "
            "older than terms, or newer)"
        )
    if len(lines) == 1:
        lines[0] = "owners' terms:    none stated (no owner connected)"
    return lines
