"""The owner node's Prometheus metrics and health checks (the opt-in monitoring port).

=========================================  ==========  ==================================
metric                                     type        what
=========================================  ==========  ==================================
``fedpca_owner_tasks_total{outcome}``      counter     tasks handled, by outcome (uploaded,
                                                       declined, cancelled, rejected,
                                                       expired, retry, error; see below)
``fedpca_owner_task_seconds{outcome}``     histogram   time from taking a task up to its
                                                       outcome (checks, encryption, upload)
``fedpca_owner_connected``                 gauge       1 while the task stream is open
``fedpca_owner_epsilon_spent``             gauge       composed epsilon of the ledger at the
                                                       budget's delta (closed form)
``fedpca_owner_epsilon_limit``             gauge       the owner's total epsilon
``fedpca_owner_certificate_expiry_``       gauge       when the node's certificate and its
``timestamp_seconds{certificate}``                     CA's expire (POSIX seconds)
``fedpca_owner_state_free_bytes``          gauge       free space beside the ledger
=========================================  ==========  ==================================

The outcomes that deserve an alert at this owner are ``rejected`` (the proxy refused
an upload for a fault of its own: invalid, not allowed) and ``error`` (a task raised);
``cancelled`` counts tasks whose query ended or closed to this owner before its upload
was taken, through nothing this owner did (another owner declined, the analyst
cancelled, the quorum was reached without it), and ``expired`` those that missed the
upload deadline.

Nothing here depends on the records: outcomes are decided from public facts, and the
work per task is padded to the owner's public capacity (docs/privacy.md). The port
serves the owner's own operators; keep it inside the organisation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fedpca.dp.accounting import Accountant, composed_gaussian_epsilon
from fedpca.monitoring import certificate_expiry, free_space
from fedpca.owner.ledger_records import TaskOutcome

__all__ = ["OwnerMetrics"]

logger = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class OwnerMetrics:
    """Every metric of one owner node, in a registry of its own."""

    def __init__(self, node: Any) -> None:
        self.registry = CollectorRegistry()
        self.tasks = Counter(
            "fedpca_owner_tasks",
            "Tasks handled, by outcome (retry: left open for a re-delivery).",
            ["outcome"],
            registry=self.registry,
        )
        self.task_seconds = Histogram(
            "fedpca_owner_task_seconds",
            "Seconds from taking a task up to its outcome.",
            ["outcome"],
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        # Every outcome's series exists from the start, at 0: Prometheus' increase()
        # misses the first count of a series that appears at 1, so an alert on the first
        # rejected upload would never fire.
        for label in ("retry", "error", *(outcome.value for outcome in TaskOutcome)):
            self.tasks.labels(label)
        self.registry.register(_NodeCollector(node))

    def task_finished(self, outcome: TaskOutcome | None, seconds: float) -> None:
        """Count one handled task (``outcome`` None: left open; "error": it raised)."""
        label = "retry" if outcome is None else outcome.value
        self.tasks.labels(label).inc()
        self.task_seconds.labels(label).observe(seconds)

    def task_failed(self, seconds: float) -> None:
        self.tasks.labels("error").inc()
        self.task_seconds.labels("error").observe(seconds)


class _NodeCollector(Collector):
    def __init__(self, node: Any) -> None:
        self._node = node
        # The node's TLS material is read once, at start: its expiry is parsed once too.
        self._expiry = certificate_expiry("owner", node.tls_material)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        node = self._node
        yield GaugeMetricFamily(
            "fedpca_owner_connected",
            "1 while the task stream to the proxy is open.",
            value=1.0 if node.connected.is_set() else 0.0,
        )
        budget = node.config.budget
        try:
            ledger = node.ledger
            if ledger.accountant is Accountant.ZCDP:
                spent = ledger.spent(budget.delta)  # closed form: what the ledger admits by
            else:
                # A PLD composition takes longer the more analysts have spent, and a
                # scrape in this process slowed a task beside it by that much (found by
                # review): the Gaussian's closed form instead, the figure the PLD
                # accountant computes numerically (to within its discretisation).
                spent = composed_gaussian_epsilon(
                    [entry.event for entry in ledger.events()],
                    budget.delta,
                    neighbouring=ledger.neighbouring,
                )
        except Exception:  # a scrape must not fail on the ledger
            logger.exception("metrics: cannot compose the owner's ledger")
        else:
            yield GaugeMetricFamily(
                "fedpca_owner_epsilon_spent",
                "Composed epsilon of every release of this owner's data at the budget's "
                "delta (zcdp: the ledger's own figure; pld-continuous: the Gaussian's "
                "closed form, which the PLD accountant approximates from above).",
                value=spent,
            )
        yield GaugeMetricFamily(
            "fedpca_owner_epsilon_limit",
            "The owner's total epsilon (+Inf: unlimited).",
            value=budget.epsilon,
        )
        if self._expiry is not None:
            yield self._expiry
        yield free_space("owner", node.config.owner.state_dir)
