"""The proxy's query lifecycle: submission, uploads, quorum, deadlines, noise and mask.

Pure domain code: no gRPC here (:mod:`fedpca.proxy.servicer` translates), and
every durable change goes through :class:`~fedpca.proxy.store.ProxyStore`.

Lifecycle of one query::

    submit ──▶ COLLECTING ──(quorum reached, or deadline with >= quorum)──▶ NOISING ──▶ DONE
                   └──────────(deadline with fewer than quorum owners)──────────────▶ FAILED

* **submit** validates the query (key size and fingerprint, the release plan) and
  checks the analyst's budget *in the same SQLite transaction* that inserts the
  query and records the release, so two concurrent submissions can never both
  spend the last of a budget, and no owner ever works on a refused query.
* **uploads** are checked against the plan (state, key fingerprint, exact block
  layouts) from their header, then streamed through an :class:`UploadStream`: each
  chunk's ciphertexts are checked (in Z*_{n^2}) and folded into the encrypted
  aggregate (multiplied mod n^2) as it arrives; completing the upload records it
  (owner count checked) and a stream that fails is taken out again, both atomically
  in the store.
* **finish** moves COLLECTING to NOISING, adds noise (stats mode) or noise and mean
  mask (masked mode) under encryption and stores the result, which sets DONE. The
  aggregate itself is never modified, so a crash anywhere in between leaves a
  NOISING query whose inputs are intact; :meth:`Coordinator.recover` finishes it on
  restart. Noise is then drawn afresh, but only one result can ever be stored
  (the store refuses a second), so nothing is released twice.

Stats-mode noise is prepared while owners encrypt
--------------------------------------------------
The noise does not depend on the data (only on the public query), so a stats-mode
query's noise is drawn and encrypted under the analyst key on a background thread
as soon as the query is submitted (or found COLLECTING at start-up), instead of
after the quorum: at M = 500 that takes the ~2 s of sampling and encryption off the
time between the last upload and the result. The prepared noise

* lives in this process's memory only, as ciphertexts (the plaintext draws are
  dropped once encrypted), and is never persisted. A restarted proxy draws fresh
  noise for its queries; that is sound for the same reason as the recovery above:
  the store keeps at most one result per query, so exactly one noise vector is ever
  added to a released result, and a vector that was drawn but never released left
  no trace outside the dead process;
* belongs to one query id and is taken out of the table when the query is finished
  (used once) or fails (discarded), so no vector is ever added to two results;
* is taken as it stands when the query is finished: if its preparation has not
  started, it is cancelled and the noise drawn then, as before; if it is being
  computed, the finisher waits for it (less time than starting over); if it failed,
  the query fails with that error, as it would have with the noise drawn at the end
  (drawing again after a draw beyond the slot headroom would truncate the noise
  distribution).

The same sampler is used either way (a test-only seeded sampler when one was
injected).

Masked mode (corrected Wang & Chang, PCA only; see :mod:`fedpca.protocol`)
--------------------------------------------------------------------------
With N = Σ public counts, a uniform mask b ∈ [0, W)^M and discrete Gaussian E on
the upper triangle, every slot (i, j) of the result holds, in 2^(2f) units,

    T_ij = N 2^f R_ij + v_i b_j + b_i v_j + b_i b_j + N 2^f E_ij,

and the masked sum holds v + b. The analyst computes
S + E = (T − v′v′ᵀ) / (N 2^(2f)) with v′ = v + b. For the row-aligned packed
ciphertext of row i with columns j_0..j_{k'-1} (padding slots get coefficient 0):

    Enc(T) = Enc(R_chunk)^(N 2^f) · Enc(v_i)^(Σ_s 2^(B s) b_{j_s})
             · Enc(window_{j_0})^(b_i) · Enc(Σ_s 2^(B s) (b_i b_{j_s} + N 2^f E_{i j_s})),

all exponents non-negative, the last factor a fresh encryption by the proxy. The
exponentiations run on the crypto pool (:mod:`fedpca.proxy._mask_worker`).

Owners must encode their sum vector *once* and fill both SUM_SINGLE and
SUM_WINDOWS from the same integers: the proxy cannot check it (everything is
encrypted), and independently rounded copies leave a term (v_i − v′_i)·b_j of the
order of the mask (~2^100) in the analyst's T − v′v′ᵀ.

Measured cost of the noise step at 2048 bits (one run, 2 worker processes on 2
cores shared with other work, production OpenDP sampler, epsilon = 1):

* M = 34: stats 0.36 s (20 ciphertexts; sampling 0.35 s), masked 0.44 s (76 row
  ciphertexts; mask exponentiations 0.38 s).
* M = 500: stats 2.2 s (3811 ciphertexts; sampling 1.6 s, encryption 0.5 s), masked
  19.2 s (12,750 row ciphertexts; mask exponentiations 15.9 s, fresh encryptions
  1.5 s, sampling 1.4 s). A plain powmod per factor would cost ~8 ms instead of
  ~2 ms per row ciphertext (see :mod:`fedpca.proxy._mask_worker`).

The stats-mode sampling and encryption above now run while owners encrypt: in
``benchmarks/end_to_end.py`` (M = 500, 10 owners) the noise step at finish took
0.09 s and "last encryption -> result ready" fell from 4.2-4.4 s to 1.6-2.0 s.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import gmpy2
import numpy as np
from phe.paillier import PaillierPublicKey

from fedpca.codec import (
    MIN_KEY_BITS,
    CryptoPool,
    PackedCiphertexts,
    PackingBounds,
    SerialisedCiphertextGroup,
    add_packed,
    check_owner_count,
    ciphertext_byte_length,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
    key_fingerprint,
    owner_value_bound,
    pack_slots,
    validate_ciphertexts,
)
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.dp.noise import NoiseSampler, symmetric_noise
from fedpca.errors import (
    CiphertextError,
    ConfigError,
    FedpcaError,
    LayoutError,
    NotFoundError,
    ProtocolError,
    QueryStateError,
)
from fedpca.messages import (
    BudgetStatus,
    CiphertextBlock,
    CiphertextPayload,
    NoiseDescription,
    NoiseMechanism,
    NoiseSection,
    QueryResult,
    QueryState,
    QueryStatus,
    Task,
    TaskCancellation,
    UploadHeader,
    blocks_of,
)
from fedpca.messages import (
    ciphertexts_from_bytes as wire_ciphertexts_from_bytes,
)
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SHARES,
    SUM_SINGLE,
    SUM_WINDOWS,
    ReleasePlan,
    mask_width,
    masked_sigma,
    row_aligned_positions,
)
from fedpca.proxy import _mask_worker
from fedpca.proxy.config import ProxyConfig
from fedpca.proxy.store import ProxyStore, QueryRecord, UploadCompletion
from fedpca.query import Calibration, ProtocolMode, QueryKind, QuerySpec

__all__ = [
    "Coordinator",
    "result_blocks",
    "spec_from_dict",
    "spec_to_dict",
    "wire_blocks",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMER_INTERVAL = 0.5
"""Seconds between deadline checks of :meth:`Coordinator.run_timers`."""

_MAX_DEADLINE = 366 * 24 * 3600.0
"""Longest ``deadline_seconds`` a query may ask for (one year)."""


# --------------------------------------------------------------- spec <-> JSON
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
        elif isinstance(value, QueryKind | ProtocolMode | Calibration):
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
            elif name == "kind":
                value = QueryKind(value)
            elif name == "mode":
                value = ProtocolMode(value)
            elif name == "calibration":
                value = Calibration(value)
            elif isinstance(value, list):
                value = tuple(float(v) for v in value)
            elif name in ("epsilon", "delta", "clip_norm", "deadline_seconds"):
                value = float(value)
            kwargs[name] = value
        return QuerySpec(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"stored query cannot be read back: {exc}") from exc


def _float_out(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


# ------------------------------------------------------------- plan <-> layout
def wire_blocks(plan: ReleasePlan) -> tuple[CiphertextBlock, ...]:
    """The layout owners must declare in their upload header, in order."""
    return blocks_of(plan.owner_blocks)


def result_blocks(plan: ReleasePlan) -> tuple[CiphertextBlock, ...]:
    """The layout of the result the proxy returns, in order."""
    return blocks_of(plan.result_blocks)


def _tri_index(i: int, j: int, m: int) -> int:
    """Position of (i, j), i <= j, in the row-major upper triangle of an m×m matrix."""
    return i * m - i * (i - 1) // 2 + (j - i)


@dataclass(frozen=True)
class _QueryContext:
    spec: QuerySpec
    plan: ReleasePlan
    public_key: PaillierPublicKey


@dataclass(frozen=True)
class _EncryptedNoise:
    """A stats-mode query's noise, encrypted under its analyst key (memory only)."""

    ciphertexts: PackedCiphertexts
    sample_seconds: float
    encrypt_seconds: float


def _draw_encrypted_noise(
    context: _QueryContext, pool: CryptoPool, sampler: NoiseSampler | None
) -> _EncryptedNoise:
    """Draw a stats-mode query's discrete Gaussian noise and encrypt it, packed.

    Only the ciphertexts are kept; the plaintext draws go out of scope here.
    """
    plan = context.plan
    started = time.perf_counter()
    values = plan.noise_values(sampler)
    sampled = time.perf_counter()
    ciphertexts = pool.encrypt_packed(
        context.public_key, values, plan.owner_block(SHARES).layout, plan.bounds.noise_headroom
    )
    del values
    return _EncryptedNoise(ciphertexts, sampled - started, time.perf_counter() - sampled)


class UploadStream:
    """One owner's upload in progress: its chunks are folded as they arrive.

    Made by :meth:`Coordinator.begin_upload`. Call :meth:`add` for each chunk in
    wire order, then :meth:`complete` once the whole stream (and its content hash)
    has been verified; on any failure call :meth:`abandon`, which takes the
    chunks folded so far out of the aggregate again. A retry of an upload the
    proxy already accepted (``duplicate``) folds nothing and completes as
    "duplicate".
    """

    def __init__(
        self,
        coordinator: Coordinator,
        owner_id: str,
        header: UploadHeader,
        context: _QueryContext,
        stream: int,
        *,
        duplicate: bool,
    ) -> None:
        self.coordinator = coordinator
        self.owner_id = owner_id
        self.header = header
        self.context = context
        self.stream = stream
        self.duplicate = duplicate
        self.algebra = SerialisedCiphertextGroup(context.public_key.n)
        self.total = sum(block.layout.n_ciphertexts for block in context.plan.owner_blocks)
        self.fold_seconds = 0.0
        self._announced = False

    def add(self, position: int, ciphertexts: Sequence[int]) -> None:
        """Check one chunk's ciphertexts (wire positions from ``position``) and fold them.

        Raises
        ------
        CiphertextError
            A ciphertext outside Z*_{n^2}.
        QueryStateError, ProtocolError
            From :meth:`ProxyStore.fold_chunk` (query closed, a different upload
            already accepted from this owner, superseded by a newer stream).
        """
        if self.duplicate:
            return
        started = time.perf_counter()
        public_key = self.context.public_key
        validate_ciphertexts(ciphertexts, public_key)
        folded = self.coordinator.store.fold_chunk(
            self.header.query_id,
            self.owner_id,
            self.header.upload_id,
            self.stream,
            position,
            ciphertexts_to_bytes(ciphertexts, public_key),
            self.total,
            self.algebra,
        )
        self.duplicate = not folded
        self.fold_seconds += time.perf_counter() - started
        if folded and not self._announced:
            self._announced = True  # watchers see this owner as uploading
            self.coordinator._notify()

    def complete(self) -> UploadCompletion:
        """Accept the upload, exactly once; closes the query when it makes the quorum.

        Raises
        ------
        EncodingOverflowError
            More owners than the query's max_owners.
        ProtocolError
            A second, different upload from this owner, a replay of ciphertexts
            accepted for another query, or chunks that do not cover the layout.
        QueryStateError
            The query stopped collecting meanwhile.
        """
        coordinator = self.coordinator
        header = self.header
        bounds = self.context.plan.bounds

        def owner_count_fits(n_contributed: int) -> None:
            check_owner_count(bounds, n_contributed + 1)

        receipt = coordinator.store.complete_upload(
            header.query_id,
            self.owner_id,
            header.upload_id,
            self.stream,
            header.content_sha256.hex(),
            self.total,
            self.algebra,
            public_count=header.public_record_count,
            before_accept=owner_count_fits,
        )
        if receipt.duplicate:
            logger.info("query %s: duplicate upload from %s", header.query_id, self.owner_id)
            return receipt
        coordinator._uploaded(header.query_id, receipt, self.fold_seconds)
        return receipt

    def abandon(self) -> None:
        """Take this stream's folded chunks out of the aggregate (after a failure)."""
        if self.duplicate:
            return
        try:
            removed = self.coordinator.store.discard_stream(
                self.header.query_id, self.owner_id, self.stream, self.algebra
            )
        except FedpcaError as exc:
            logger.warning(
                "%s: could not take the unfinished upload out: %s", self.header.label, exc
            )
            return
        if removed:
            self.coordinator._notify()
            logger.info(
                "%s: unfinished upload of %s taken out of the aggregate (%d chunks)",
                self.header.label,
                self.owner_id,
                removed,
            )


class Coordinator:
    """Runs every query's lifecycle on top of the durable store.

    Parameters
    ----------
    store : the proxy's SQLite store.
    config : the proxy configuration (budgets, test-key switch).
    pool : a started or lazily starting crypto pool (noise encryption, mask).
    noise_sampler : integer Gaussian sampler; default the production discrete
        Gaussian (OpenDP). Tests inject a seeded one.
    clock : wall-clock seconds (injected by tests of deadlines).
    allow_insecure_test_keys : TEST ONLY: accept analyst keys below 2048 bits
        (also enabled by ``[crypto] allow_insecure_test_keys`` in the config).
    background : finish queries on a background thread (the server) or in the
        calling thread (tests, recovery tools).
    precompute_noise : draw and encrypt stats-mode noise on a background thread
        from submission on (see the module docstring); default: ``background``.
    """

    def __init__(
        self,
        store: ProxyStore,
        config: ProxyConfig,
        pool: CryptoPool,
        noise_sampler: NoiseSampler | None = None,
        clock: Callable[[], float] = time.time,
        *,
        allow_insecure_test_keys: bool = False,
        background: bool = True,
        precompute_noise: bool | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.pool = pool
        self.noise_sampler = noise_sampler
        self.clock = clock
        self.allow_insecure_test_keys = (
            allow_insecure_test_keys or config.crypto.allow_insecure_test_keys
        )
        if self.allow_insecure_test_keys:
            logger.warning(
                "TEST ONLY: analyst keys shorter than %d bits are accepted", MIN_KEY_BITS
            )
        self._contexts: dict[str, _QueryContext] = {}
        self._lock = threading.Lock()
        self._finishing: set[str] = set()
        self._fold_seconds: dict[str, float] = {}
        self._stream_numbers = itertools.count(1)
        self._changed = threading.Condition()
        self._version = 0
        self._stopping = threading.Event()
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise")
            if background
            else None
        )
        if precompute_noise is None:
            precompute_noise = background
        self._noise_executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise-prep")
            if precompute_noise
            else None
        )
        # query id -> stats-mode noise being (or already) drawn and encrypted; an
        # entry is removed when its query takes it, fails or the coordinator stops.
        self._prepared_noise: dict[str, Future[_EncryptedNoise]] = {}

    # ------------------------------------------------------------ change feed
    @property
    def version(self) -> int:
        """Increases on every query change; pair with :meth:`wait_for_change`."""
        with self._changed:
            return self._version

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Block until the version differs from ``seen``, ``timeout`` passes or shutdown."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._version != seen or self._stopping.is_set(), timeout
            )
            return self._version

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def shutdown(self, wait: bool = True) -> None:
        """Wake every waiting stream and stop the background finisher.

        A query whose noise step is cut short stays NOISING and is finished by
        :meth:`recover` on the next start.
        """
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            prepared, self._prepared_noise = self._prepared_noise, {}
        for future in prepared.values():
            future.cancel()
        if self._noise_executor is not None:
            self._noise_executor.shutdown(wait=wait, cancel_futures=True)

    # ------------------------------------------------------------------ owners
    def enroll(self, owner_id: str, info: Mapping[str, Any] | None = None) -> None:
        """Record that an owner said hello (or is alive on its task stream)."""
        self.store.touch_owner(owner_id, info)

    # ------------------------------------------------------------------ submit
    def submit(self, analyst_id: str, spec: QuerySpec) -> QueryRecord:
        """Validate a query, charge the analyst's budget and publish it to owners.

        Resubmitting the same query id with the same spec returns the existing
        record without charging again.

        Raises
        ------
        ConfigError
            Short or malformed analyst key, fingerprint mismatch, invalid deadline,
            or a query the release plan cannot serve (also LayoutError /
            EncodingOverflowError / CalibrationError from the plan).
        BudgetExceededError
            The release would exceed the analyst's total budget.
        ProtocolError
            The query id exists with a different spec.
        """
        context = self._validate(spec)
        plan = context.plan
        budget = self.config.budget.for_analyst(analyst_id)
        event = plan.privacy_event(analyst_id)
        event_record = json.loads(event.to_json())

        def charge(conn: Any) -> None:
            from fedpca.dp.accounting import check_budget  # slow import (dp_accounting)

            ledger = [PrivacyEvent.from_dict(r) for r in self.store.releases(analyst_id, conn)]
            check_budget(ledger, event, budget).raise_if_exceeded()
            self.store.record_release(conn, analyst_id, spec.query_id, event_record)

        deadline_at = self.clock() + spec.deadline_seconds
        self.store.set_analyst_budget(analyst_id, budget.epsilon, budget.delta)
        record = self.store.create_query(
            spec.query_id,
            analyst_id,
            spec_to_dict(spec),
            plan.describe(),
            deadline_at,
            before_insert=charge,
        )
        with self._lock:
            self._contexts.setdefault(spec.query_id, context)
        if record.state is QueryState.COLLECTING:
            self._prepare_noise(context)
        if not spec.private:
            logger.warning("query %s: epsilon = inf, the result will be NOT PRIVATE", spec.query_id)
        logger.info(
            "query %s from %s: %s %s, M=%d, quorum %d, deadline in %.0f s",
            spec.query_id,
            analyst_id,
            spec.kind.value,
            spec.mode.value,
            spec.n_features,
            spec.quorum,
            spec.deadline_seconds,
        )
        self._notify()
        return record

    def _validate(self, spec: QuerySpec) -> _QueryContext:
        n = spec.analyst_public_key_n
        if n < 3 or n % 2 == 0:
            raise ConfigError("analyst_public_key_n is not a Paillier modulus (must be odd, > 1)")
        bits = n.bit_length()
        if bits < MIN_KEY_BITS and not self.allow_insecure_test_keys:
            raise ConfigError(
                f"the analyst key has {bits} bits; at least {MIN_KEY_BITS} are required"
            )
        public_key = PaillierPublicKey(n)
        if key_fingerprint(public_key) != spec.analyst_key_fingerprint:
            raise ConfigError(
                "analyst_key_fingerprint does not match analyst_public_key_n "
                f"(expected {key_fingerprint(public_key)})"
            )
        # The deadline travels as a timestamp (task stream, query status): a query whose
        # deadline lies past year 9999 was stored and charged, and then every status
        # and every owner's task stream failed with INTERNAL (datetime out of range).
        if not (math.isfinite(spec.deadline_seconds) and spec.deadline_seconds <= _MAX_DEADLINE):
            raise ConfigError(
                f"deadline_seconds must be finite and at most {_MAX_DEADLINE:.0f} (one year),"
                f" got {spec.deadline_seconds!r}"
            )
        plan = ReleasePlan.for_query(spec, bits)
        # Uploads are held in memory while their content hash is checked, so the
        # proxy bounds them before any owner is asked to encrypt anything.
        ciphertexts = sum(block.layout.n_ciphertexts for block in plan.owner_blocks)
        upload_mib = ciphertexts * ciphertext_byte_length(bits) / 2**20
        limit = self.config.proxy.max_upload_mib
        if upload_mib > limit:
            raise ConfigError(
                f"this query needs uploads of {upload_mib:.1f} MiB per owner ({ciphertexts} "
                f"ciphertexts); this proxy accepts at most {limit:g} MiB (proxy.max_upload_mib)"
            )
        return _QueryContext(spec, plan, public_key)

    def _context(self, query_id: str) -> _QueryContext:
        with self._lock:
            context = self._contexts.get(query_id)
        if context is not None:
            return context
        record = self.store.query(query_id)  # NotFoundError for unknown ids
        spec = spec_from_dict(record.spec)
        public_key = PaillierPublicKey(spec.analyst_public_key_n)
        plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
        context = _QueryContext(spec, plan, public_key)
        with self._lock:
            return self._contexts.setdefault(query_id, context)

    def plan(self, query_id: str) -> ReleasePlan:
        """The release plan of a stored query."""
        return self._context(query_id).plan

    # ------------------------------------------------------------------- tasks
    def tasks_for(self, owner_id: str) -> list[QuerySpec]:
        """COLLECTING queries this owner has neither uploaded to nor declined."""
        return [task.query for task in self.pending_tasks(owner_id)]

    def pending_tasks(self, owner_id: str) -> list[Task]:
        """:meth:`tasks_for` with each query's upload deadline, ready for the task stream."""
        now = self.clock()
        tasks = []
        for record in self.store.queries(QueryState.COLLECTING):
            if record.deadline_at <= now:
                continue
            if owner_id in self.store.declines(record.query_id):
                continue
            if any(u.owner_id == owner_id for u in self.store.uploads(record.query_id)):
                continue
            tasks.append(
                Task(
                    query=self._context(record.query_id).spec,
                    upload_deadline=datetime.fromtimestamp(record.deadline_at, UTC),
                )
            )
        return tasks

    def withdrawn_tasks(self, owner_id: str, query_ids: Sequence[str]) -> list[TaskCancellation]:
        """Cancellations for delivered tasks the owner should no longer answer.

        A task is withdrawn when its query stopped collecting (quorum reached,
        failed, done) or its deadline passed before this owner answered. Tasks
        the owner uploaded to or declined need no cancellation.
        """
        now = self.clock()
        cancellations = []
        for query_id in query_ids:
            try:
                record = self.store.query(query_id)
            except NotFoundError:
                continue
            if owner_id in self.store.declines(query_id) or any(
                u.owner_id == owner_id for u in self.store.uploads(query_id)
            ):
                continue
            if record.state is QueryState.FAILED:
                reason = f"query failed: {record.failure_reason}"
            elif record.state is not QueryState.COLLECTING:
                reason = "uploads are closed (the quorum was reached)"
            elif record.deadline_at <= now:
                reason = "the upload deadline has passed"
            else:
                continue
            cancellations.append(TaskCancellation(query_id=query_id, reason=reason))
        return cancellations

    def decline(self, owner_id: str, query_id: str, reason: str) -> None:
        """Record an owner's refusal of a task (it is not offered again)."""
        self.store.record_decline(query_id, owner_id, reason)
        logger.info("query %s: owner %s declined (%s)", query_id, owner_id, reason)
        self._notify()

    # ----------------------------------------------------------------- uploads
    def _is_retry(self, owner_id: str, header: UploadHeader) -> bool:
        digest = header.content_sha256.hex()
        return any(
            u.owner_id == owner_id
            and u.upload_id == header.upload_id
            and u.content_sha256 == digest
            for u in self.store.uploads(header.query_id)
        )

    def check_upload_header(self, owner_id: str, header: UploadHeader) -> bool:
        """Everything that can be checked before a single chunk is read.

        Returns True when the header is a retry of an upload already accepted.

        A retry of an upload this owner already had accepted passes the state and
        deadline checks (the store then answers "duplicate"), even after the query
        has moved on; it must still match the plan like any other upload.

        Raises
        ------
        NotFoundError
            Unknown query.
        QueryStateError
            The query no longer collects uploads (late upload).
        CiphertextError
            The header names another analyst key.
        LayoutError
            The blocks differ from the plan's owner blocks.
        ProtocolError
            The public record count is missing (masked mode), present (stats mode)
            or above the query's max_records_per_owner.
        """
        context = self._context(header.query_id)
        spec = context.spec
        # Key, layout and count are checked before the retry shortcut: a genuine retry
        # resends the very same header, and one with the same upload id and content
        # hash but e.g. another layout or a stats-mode record count was answered
        # "duplicate" without ever being validated.
        if header.analyst_key_fingerprint != spec.analyst_key_fingerprint:
            raise CiphertextError(
                f"{header.label}: encrypted under key {header.analyst_key_fingerprint}, the "
                f"query uses {spec.analyst_key_fingerprint}"
            )
        expected = wire_blocks(context.plan)
        if tuple(header.blocks) != expected:
            raise LayoutError(f"{header.label}: {_layout_difference(header.blocks, expected)}")
        count = header.public_record_count
        if spec.mode is ProtocolMode.MASKED:
            if count is None:
                raise ProtocolError(
                    f"{header.label}: masked mode needs the owner's public_record_count"
                )
            if count > spec.max_records_per_owner:
                raise ProtocolError(
                    f"{header.label}: public_record_count {count} exceeds the query's "
                    f"max_records_per_owner={spec.max_records_per_owner}"
                )
        elif count is not None:
            raise ProtocolError(
                f"{header.label}: public_record_count must be absent in stats mode (the "
                "count is a noised statistic)"
            )
        if self._is_retry(owner_id, header):
            return True
        record = self.store.query(header.query_id)
        if record.state is not QueryState.COLLECTING:
            raise QueryStateError(
                f"query {header.query_id!r} is {record.state.value}: uploads are no longer accepted"
            )
        if self.clock() >= record.deadline_at:
            raise QueryStateError(f"query {header.query_id!r}: the upload deadline has passed")
        return False

    def begin_upload(self, owner_id: str, header: UploadHeader) -> UploadStream:
        """Check an upload's header and open the stream its chunks are folded through.

        Raises the errors of :meth:`check_upload_header`.
        """
        duplicate = self.check_upload_header(owner_id, header)
        context = self._context(header.query_id)
        with self._lock:
            stream = next(self._stream_numbers)
        return UploadStream(self, owner_id, header, context, stream, duplicate=duplicate)

    def _uploaded(self, query_id: str, receipt: UploadCompletion, fold_seconds: float) -> None:
        with self._lock:
            self._fold_seconds[query_id] = self._fold_seconds.get(query_id, 0.0) + fold_seconds
        self._notify()
        if receipt.n_contributed >= self._context(query_id).spec.quorum:
            self.close(query_id)

    # --------------------------------------------------------- quorum/deadline
    def close(self, query_id: str) -> None:
        """Stop collecting (COLLECTING → NOISING) and finish the query.

        A no-op if another thread closed it first. The result is computed on the
        background thread (or here, without one).
        """
        try:
            self.store.set_state(
                query_id,
                QueryState.NOISING,
                expect=(QueryState.COLLECTING,),
                algebra=self._algebra(query_id),
            )
        except QueryStateError:
            return
        logger.info("query %s: collection closed, adding noise", query_id)
        self._notify()
        self._schedule(query_id)

    def _schedule(self, query_id: str) -> None:
        if self._executor is None:
            self.finish(query_id)
            return
        try:
            self._executor.submit(self.finish, query_id)
        except RuntimeError:
            # Shutting down: the query stays NOISING and recover() finishes it.
            logger.info("query %s: shutting down, noise step deferred to restart", query_id)

    def check_deadlines(self) -> list[str]:
        """Finish or fail COLLECTING queries that are due; returns their ids.

        Due means: the quorum is already reached (e.g. after a crash between the
        last fold and closing), or the deadline has passed. At the deadline a
        query with at least ``quorum`` owners is finished, otherwise it fails.
        """
        now = self.clock()
        due = []
        for record in self.store.queries(QueryState.COLLECTING):
            quorum = int(record.spec.get("quorum", 1))
            if record.n_contributed >= quorum:
                due.append(record.query_id)
                self.close(record.query_id)
            elif record.deadline_at <= now:
                due.append(record.query_id)
                reason = f"deadline passed with {record.n_contributed} of {quorum} required owners"
                try:
                    self.store.set_state(
                        record.query_id,
                        QueryState.FAILED,
                        expect=(QueryState.COLLECTING,),
                        failure_reason=reason,
                    )
                except QueryStateError:
                    continue  # an upload closed it in the meantime
                logger.warning("query %s failed: %s", record.query_id, reason)
                self._discard_noise(record.query_id)
                self._notify()
        return due

    def run_timers(
        self, stop_event: threading.Event, interval: float = DEFAULT_TIMER_INTERVAL
    ) -> None:
        """Check deadlines every ``interval`` seconds until ``stop_event`` is set."""
        while not stop_event.wait(interval):
            try:
                self.check_deadlines()
            except Exception:
                logger.exception("deadline check failed; retrying")

    def recover(self) -> list[str]:
        """After a (re)start: finish every NOISING query, then handle due ones.

        Returns
        -------
        The ids of the queries that were finished, failed or scheduled.
        """
        handled = []
        for record in self.store.queries(QueryState.NOISING):
            logger.warning(
                "query %s was interrupted while adding noise; finishing", record.query_id
            )
            handled.append(record.query_id)
            self._schedule(record.query_id)
        for record in self.store.queries(QueryState.COLLECTING):
            # Upload streams died with the old process: take their chunks out (the
            # owners resend), and noise prepared before the restart: draw it anew.
            removed = self.store.discard_partial_uploads(
                record.query_id, self._algebra(record.query_id)
            )
            if removed:
                logger.warning(
                    "query %s: %d chunks of uploads interrupted by the restart taken out",
                    record.query_id,
                    removed,
                )
            self._prepare_noise(self._context(record.query_id))
        return handled + self.check_deadlines()

    # ------------------------------------------------------------------ finish
    def finish(self, query_id: str) -> QueryRecord:
        """Add noise (and the mask) and store the result; idempotent.

        COLLECTING is first moved to NOISING; a DONE or FAILED query is returned
        as is. Errors while adding noise fail the query (the reason names the error
        class only: messages may carry noise values). A crash (process death)
        leaves it NOISING for :meth:`recover`.
        """
        with self._lock:
            if query_id in self._finishing:
                return self.store.query(query_id)
            self._finishing.add(query_id)
        try:
            record = self.store.query(query_id)
            if record.state is QueryState.COLLECTING:
                try:
                    record = self.store.set_state(
                        query_id,
                        QueryState.NOISING,
                        expect=(QueryState.COLLECTING,),
                        algebra=self._algebra(query_id),
                    )
                except QueryStateError:
                    record = self.store.query(query_id)
                self._notify()
            if record.state is not QueryState.NOISING:
                return record
            try:
                blocks, meta = self._compute_result(record)
                record = self.store.store_result(query_id, blocks, meta)
            except Exception as exc:
                if self._stopping.is_set():
                    # Interrupted by shutdown (e.g. the pool was closed under us):
                    # leave NOISING, the next start finishes it from the intact aggregate.
                    logger.warning(
                        "query %s: noise step interrupted by shutdown (%s); it will be "
                        "finished on restart",
                        query_id,
                        type(exc).__name__,
                    )
                    return self.store.query(query_id)
                if isinstance(exc, FedpcaError):
                    logger.error("query %s: noise step failed: %s", query_id, type(exc).__name__)
                else:
                    logger.exception("query %s: noise step failed", query_id)
                reason = f"adding noise failed ({type(exc).__name__}); see the proxy log"
                try:
                    record = self.store.set_state(
                        query_id,
                        QueryState.FAILED,
                        expect=(QueryState.NOISING,),
                        failure_reason=reason,
                    )
                except QueryStateError:
                    record = self.store.query(query_id)
            else:
                logger.info(
                    "query %s done: %d owners, noise step %.2f s",
                    query_id,
                    record.n_contributed,
                    meta["timings"]["noise_seconds"],
                )
            self._notify()
            return record
        finally:
            with self._lock:
                self._finishing.discard(query_id)
            # Done (its noise was taken), failed or already terminal: prepared noise
            # of this query, if any is left, must never be used.
            self._discard_noise(query_id)

    def _algebra(self, query_id: str) -> SerialisedCiphertextGroup:
        return SerialisedCiphertextGroup(self._context(query_id).public_key.n)

    @staticmethod
    def _aggregate_blocks(context: _QueryContext, data: bytes) -> dict[str, bytes]:
        """Split the wire-order aggregate into the plan's owner blocks."""
        width = ciphertext_byte_length(context.public_key.n.bit_length())
        blocks = context.plan.owner_blocks
        expected = sum(block.layout.n_ciphertexts for block in blocks) * width
        if len(data) != expected:
            raise LayoutError(
                f"query {context.spec.query_id!r}: the aggregate holds {len(data)} bytes, "
                f"the plan {expected}"
            )
        out: dict[str, bytes] = {}
        start = 0
        for block in blocks:
            end = start + block.layout.n_ciphertexts * width
            out[block.name] = data[start:end]
            start = end
        return out

    def _compute_result(self, record: QueryRecord) -> tuple[dict[str, bytes], dict[str, Any]]:
        context = self._context(record.query_id)
        n_owners = record.n_contributed
        if n_owners < 1:
            raise QueryStateError(f"query {record.query_id!r} has no uploads to release")
        aggregate = self._aggregate_blocks(context, self.store.aggregate(record.query_id))
        started = time.perf_counter()
        if context.spec.mode is ProtocolMode.MASKED:
            public_n = sum(u.public_count or 0 for u in self.store.uploads(record.query_id))
            blocks, sections, timings = self._masked_result(context, aggregate, public_n)
        else:
            public_n = None
            blocks, sections, timings = self._stats_result(context, aggregate, n_owners)
        timings["noise_seconds"] = time.perf_counter() - started
        with self._lock:
            fold_seconds = self._fold_seconds.get(record.query_id)
        if fold_seconds is not None:
            # Only folds done by this process; absent after a restart.
            timings["fold_seconds"] = fold_seconds
        meta: dict[str, Any] = {
            "n_owners": n_owners,
            "mode": context.spec.mode.value,
            "not_private": not context.spec.private,
            "sections": sections,
            "plan": context.plan.describe(),
            "timings": timings,
        }
        if public_n is not None:
            meta["public_n"] = public_n
        return blocks, meta

    # -------------------------------------------------------------- stats mode
    def _stats_result(
        self, context: _QueryContext, aggregate: Mapping[str, bytes], n_owners: int
    ) -> tuple[dict[str, bytes], list[dict[str, Any]], dict[str, float]]:
        plan = context.plan
        block = plan.owner_block(SHARES)
        layout = block.layout
        data = _block_bytes(aggregate, SHARES)
        # Every owner packed values bounded by block.bound, so the sum is bounded by
        # n_owners times that; add_packed then proves sum + noise fits a slot.
        total = PackedCiphertexts(
            context.public_key,
            layout,
            tuple(ciphertexts_from_bytes(data, context.public_key, layout.n_ciphertexts)),
            n_owners * block.bound,
        )
        sections = [
            {"name": s.name, "sigma": s.sigma, "sigma_int": s.sigma_int} for s in plan.sections
        ]
        timings: dict[str, float] = {}
        if not plan.private:
            logger.warning(
                "query %s: no noise added (epsilon = inf): NOT PRIVATE", plan.spec.query_id
            )
            return {SHARES: total.to_bytes()}, sections, timings
        noise = self._take_noise(plan.spec.query_id)
        if noise is None:
            noise = _draw_encrypted_noise(context, self.pool, self.noise_sampler)
        else:
            timings["noise_precomputed"] = 1.0
        timings["sample_seconds"] = noise.sample_seconds
        timings["encrypt_seconds"] = noise.encrypt_seconds
        return {SHARES: add_packed(total, noise.ciphertexts).to_bytes()}, sections, timings

    # ----------------------------------------------------- prepared noise
    def _prepare_noise(self, context: _QueryContext) -> None:
        """Start drawing and encrypting a stats-mode query's noise in the background."""
        spec = context.spec
        if (
            self._noise_executor is None
            or spec.mode is not ProtocolMode.STATS
            or not context.plan.private
        ):
            return
        with self._lock:
            if spec.query_id in self._prepared_noise or self._stopping.is_set():
                return
            try:
                future = self._noise_executor.submit(
                    _draw_encrypted_noise, context, self.pool, self.noise_sampler
                )
            except RuntimeError:  # shutting down: the noise is drawn at finish
                return
            self._prepared_noise[spec.query_id] = future
        logger.info("query %s: preparing its noise while owners encrypt", spec.query_id)

    def _take_noise(self, query_id: str) -> _EncryptedNoise | None:
        """The prepared noise of a query, removed from the table; None: draw it now.

        Not prepared, or not started yet (then cancelled: drawing now is as fast):
        None. Being computed: waited for (faster than starting over). Failed: its
        error is raised, exactly as if the noise had been drawn now; drawing again
        after e.g. a draw beyond the headroom would truncate the distribution.
        """
        with self._lock:
            future = self._prepared_noise.pop(query_id, None)
        if future is None or future.cancel():
            return None
        noise = future.result()
        logger.info("query %s: using the noise prepared while owners encrypted", query_id)
        return noise

    def _discard_noise(self, query_id: str) -> None:
        """Drop a query's prepared noise (it failed or is finished); never used again."""
        with self._lock:
            future = self._prepared_noise.pop(query_id, None)
        if future is not None:
            future.cancel()  # if it is already running, its result is simply dropped
            logger.info("query %s: prepared noise discarded", query_id)

    def prepared_noise(self, query_id: str) -> Future[_EncryptedNoise] | None:
        """TEST AID: the pending preparation of a query's noise, if any (not removed)."""
        with self._lock:
            return self._prepared_noise.get(query_id)

    # ------------------------------------------------------------- masked mode
    def _masked_result(
        self, context: _QueryContext, aggregate: Mapping[str, bytes], public_n: int
    ) -> tuple[dict[str, bytes], list[dict[str, Any]], dict[str, float]]:
        plan = context.plan
        spec = context.spec
        public_key = context.public_key
        n = public_key.n
        m = spec.n_features
        f = spec.frac_bits
        if public_n < 1:
            raise QueryStateError(f"query {spec.query_id!r}: the owners reported no records")
        rows_block = plan.owner_block(SCATTER_ROWS)
        rows_layout = rows_block.layout
        k = rows_layout.slots_per_ciphertext
        slot_bits = rows_layout.slot_bits
        scatter = ciphertexts_from_bytes(
            _block_bytes(aggregate, SCATTER_ROWS), public_key, rows_layout.n_ciphertexts
        )
        singles = ciphertexts_from_bytes(_block_bytes(aggregate, SUM_SINGLE), public_key, m)
        windows = ciphertexts_from_bytes(_block_bytes(aggregate, SUM_WINDOWS), public_key, m)

        width = _mask_width(plan)
        timings: dict[str, float] = {}
        # b uniform on [0, W): secrets, because the mask hides v from the analyst.
        mask = [secrets.randbelow(width) for _ in range(m)]
        sigma, sigma_int = masked_sigma(plan, public_n)
        started = time.perf_counter()
        if sigma_int > 0:
            # The plan sized the headroom for the worst case N = 1; sigma_int only
            # shrinks as N grows, so the same bound holds for every draw.
            noise = symmetric_noise(
                m, sigma_int, sampler=self.noise_sampler, bound=plan.bounds.noise_headroom
            )
        else:
            logger.warning("query %s: no noise added (epsilon = inf): NOT PRIVATE", spec.query_id)
            noise = np.zeros(m * (m + 1) // 2, dtype=np.int64)
        timings["sample_seconds"] = time.perf_counter() - started

        scale = public_n << f
        positions = row_aligned_positions(m, k)
        fresh_values: list[int] = []
        for position in positions:
            if position is None:
                fresh_values.append(0)
                continue
            i, j = position
            fresh_values.append(mask[i] * mask[j] + scale * int(noise[_tri_index(i, j, m)]))
        fresh_bound = width * width + scale * plan.bounds.noise_headroom
        packed = pack_slots(fresh_values, rows_layout, fresh_bound)
        started = time.perf_counter()
        fresh = self.pool.encrypt(public_key, [p % n for p in packed])
        timings["encrypt_seconds"] = time.perf_counter() - started

        items: list[_mask_worker.MaskItem] = []
        for index, ciphertext in enumerate(scatter):
            slots = [p for p in positions[index * k : (index + 1) * k] if p is not None]
            i, j0 = slots[0]
            items.append(
                (
                    singles[i],
                    ciphertext,
                    windows[j0],
                    fresh[index],
                    mask[i],
                    tuple(mask[j] for _, j in slots),
                )
            )
        started = time.perf_counter()
        masked_scatter = self.pool.map(
            _mask_worker.mask_scatter_chunk, (n, scale, slot_bits), items
        )
        timings["mask_seconds"] = time.perf_counter() - started

        sum_layout = plan.result_block(MASKED_SUM).layout
        started = time.perf_counter()
        encrypted_mask = self.pool.encrypt_packed(public_key, mask, sum_layout, width)
        n_square = gmpy2.mpz(n) * n
        masked_sum = [
            int(gmpy2.mpz(windows[t]) * encrypted_mask.ciphertexts[index] % n_square)
            for index, t in enumerate(range(0, m, k))
        ]
        timings["mask_sum_seconds"] = time.perf_counter() - started
        blocks = {
            SCATTER_ROWS: ciphertexts_to_bytes(masked_scatter, public_key),
            MASKED_SUM: ciphertexts_to_bytes(masked_sum, public_key),
        }
        sections = [{"name": "scatter", "sigma": sigma, "sigma_int": sigma_int}]
        return blocks, sections, timings

    # ---------------------------------------------------------------- reading
    def status(self, query_id: str, analyst_id: str | None = None) -> QueryStatus:
        """The status of a query; with ``analyst_id``, only that analyst's queries exist."""
        record = self._record_for(query_id, analyst_id)
        return QueryStatus(
            query_id=record.query_id,
            state=record.state,
            owners_contributed=record.n_contributed,
            quorum=int(record.spec.get("quorum", 1)),
            owners_declined=len(self.store.declines(query_id)),
            deadline=datetime.fromtimestamp(record.deadline_at, UTC),
            failure_reason=record.failure_reason,
            owners_uploading=len(self.store.partial_uploads(query_id)),
        )

    def _record_for(self, query_id: str, analyst_id: str | None) -> QueryRecord:
        record = self.store.query(query_id)
        if analyst_id is not None and record.analyst_id != analyst_id:
            # Another analyst's query is reported as unknown: its existence is not ours to tell.
            raise NotFoundError(f"unknown query {query_id!r}")
        return record

    def result(self, query_id: str, analyst_id: str | None = None) -> QueryResult:
        """The stored, noise-added result, ready for :func:`fedpca.transport.serde.encode_result`.

        Raises
        ------
        NotFoundError
            Unknown query (or another analyst's).
        QueryStateError
            Not DONE yet (or FAILED).
        """
        record = self._record_for(query_id, analyst_id)
        data, meta = self.store.result(query_id)
        context = self._context(query_id)
        spec = context.spec
        blocks = result_blocks(context.plan)
        ciphertexts: dict[str, list[int]] = {}
        for block in blocks:
            ciphertexts[block.name] = wire_ciphertexts_from_bytes(
                _block_bytes(data, block.name), block.ciphertext_bytes, f"result {block.name}"
            )
        private = not meta.get("not_private", False)
        noise = NoiseDescription(
            mechanism=NoiseMechanism.GAUSSIAN if private else NoiseMechanism.NONE,
            calibration=spec.calibration,
            epsilon=spec.epsilon,
            delta=spec.delta,
            sections=tuple(
                NoiseSection(name=s["name"], sigma=float(s["sigma"]))
                for s in meta.get("sections", [])
            ),
        )
        masked = spec.mode is ProtocolMode.MASKED
        public_n = meta.get("public_n")
        return QueryResult(
            query=spec,
            n_owners=int(meta.get("n_owners", record.n_contributed)),
            noise=noise,
            payload=CiphertextPayload(blocks, ciphertexts),
            masked_mean_block=MASKED_SUM if masked else None,
            # Masked mode: the analyst divides by N to unmask the scatter.
            public_record_count=int(public_n) if masked and public_n is not None else None,
        )

    def result_meta(self, query_id: str) -> dict[str, Any]:
        """The JSON metadata stored with a result (sigmas, public N, timings)."""
        return self.store.result(query_id)[1]

    def budget(self, analyst_id: str, delta: float | None = None) -> BudgetStatus:
        """An analyst's cumulative privacy loss.

        ``epsilon_spent`` is composed at ``delta`` (default: the budget's delta);
        ``epsilon_remaining`` is always measured at the budget's own delta, the one
        its epsilon limit refers to.
        """
        from fedpca.dp.accounting import compose_epsilon  # slow import (dp_accounting)

        limit = self.config.budget.for_analyst(analyst_id)
        at = limit.delta if delta is None else delta
        ledger = [PrivacyEvent.from_dict(r) for r in self.store.releases(analyst_id)]
        spent = compose_epsilon(ledger, at)
        if math.isinf(limit.epsilon):
            remaining = math.inf
        else:
            used = spent if at == limit.delta else compose_epsilon(ledger, limit.delta)
            remaining = max(0.0, limit.epsilon - used)
        return BudgetStatus(
            analyst_id=analyst_id,
            delta=at,
            epsilon_spent=spent,
            epsilon_remaining=remaining,
            epsilon_limit=limit.epsilon,
            n_releases=len(ledger),
        )


# ---------------------------------------------------------------------- helpers
def _block_bytes(blocks: Mapping[str, bytes], name: str) -> bytes:
    data = blocks.get(name)
    if data is None:
        raise LayoutError(f"stored data has no block {name!r}")
    return data


def _mask_width(plan: ReleasePlan) -> int:
    """W of the mean mask, from the query's public bounds.

    protocol._masked_plan derives it from the bound on the summed sum vector,
    v_bound = max_owners · owner_value_bound(c, max_records_per_owner, 1 owner, f);
    it is recomputed here the same way (protocol.py exposes no helper) and
    cross-checked against the plan's masked-sum bound, v_bound + W.
    """
    spec = plan.spec
    per_owner = PackingBounds(spec.clip_norm, spec.max_records_per_owner, 1, spec.frac_bits, 0)
    v_bound = spec.max_owners * owner_value_bound(per_owner)
    width = mask_width(v_bound)
    if plan.result_block(MASKED_SUM).bound != v_bound + width:
        raise LayoutError("the masked-sum bound of the plan does not match the mask width")
    return width


def _layout_difference(got: Sequence[CiphertextBlock], expected: Sequence[CiphertextBlock]) -> str:
    if [b.name for b in got] != [b.name for b in expected]:
        return (
            f"blocks {[b.name for b in got]} declared, the query's plan has "
            f"{[b.name for b in expected]}"
        )
    for mine, theirs in zip(got, expected, strict=True):
        if mine != theirs:
            return f"block {mine.name!r} is {mine}, the query's plan requires {theirs}"
    return "layout differs from the plan"
