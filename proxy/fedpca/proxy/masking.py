"""Masked mode (corrected Wang & Chang, PCA only): the proxy's mask and noise, encrypted.

See :mod:`fedpca.protocol` for the plan and docs/privacy.md for the analysis. With
N = Σ public counts, a uniform mask b ∈ [0, W)^M and discrete Gaussian E on the
upper triangle, every slot (i, j) of the result holds, in 2^(2f) units,

    T_ij = N 2^f R_ij + v_i b_j + b_i v_j + b_i b_j + N 2^f E_ij + F_ij,

F_ij uniform on N 2^f consecutive integers around 0, and the masked sum holds v + b.
The analyst computes S + E = (T − v′v′ᵀ) / (N 2^(2f)) with v′ = v + b (F moves each
entry by less than 2^-(f+1)). For the row-aligned packed
ciphertext of row i with columns j_0..j_{k'-1} (padding slots get coefficient 0):

    Enc(T) = Enc(R_chunk)^(N 2^f) · Enc(v_i)^(Σ_s 2^(B s) b_{j_s})
             · Enc(window_{j_0})^(b_i)
             · Enc(Σ_s 2^(B s) (b_i b_{j_s} + N 2^f E_{i j_s} + F_{i j_s})),

all exponents non-negative, the last factor a fresh encryption by the proxy. The
exponentiations run on the crypto pool (:mod:`fedpca.proxy._mask_worker`).

Owners must encode their sum vector *once* and fill both SUM_SINGLE and
SUM_WINDOWS from the same integers: the proxy cannot check it (everything is
encrypted), and independently rounded copies leave a term (v_i − v′_i)·b_j of the
order of the mask (~2^100) in the analyst's T − v′v′ᵀ.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

import gmpy2
import numpy as np
from phe.paillier import PaillierPublicKey

from fedpca.codec import (
    CryptoPool,
    ciphertexts_from_bytes,
    ciphertexts_to_bytes,
    pack_slots,
)
from fedpca.dp.noise import NoiseSampler, symmetric_noise
from fedpca.errors import LayoutError, QueryStateError
from fedpca.masked_release import (
    mask_width,
    masked_residue,
    masked_sum_bound,
    row_aligned_positions,
)
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SUM_SINGLE,
    SUM_WINDOWS,
    ReleasePlan,
    masked_sigma,
)
from fedpca.proxy import _mask_worker
from fedpca.proxy.store_records import stored_block

__all__ = ["masked_result"]

logger = logging.getLogger(__name__)


def masked_result(
    plan: ReleasePlan,
    public_key: PaillierPublicKey,
    aggregate: Mapping[str, bytes],
    public_n: int,
    pool: CryptoPool,
    noise_sampler: NoiseSampler | None,
) -> tuple[dict[str, bytes], list[dict[str, Any]], dict[str, float]]:
    """Mask and noise a masked-mode aggregate under encryption.

    Parameters
    ----------
    plan : the query's release plan.
    public_key : the analyst key the aggregate is encrypted under.
    aggregate : owner block name -> the folded ciphertexts, serialised.
    public_n : N, the sum of the owners' public record counts.
    pool : the crypto pool (fresh encryptions, mask exponentiations).
    noise_sampler : integer Gaussian sampler (None: the production one).

    Returns
    -------
    blocks : result block name -> its ciphertexts, serialised.
    sections : the noise of each section (name, sigma, sigma_int).
    timings : seconds spent in each step.
    """
    spec = plan.spec
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
        stored_block(aggregate, SCATTER_ROWS), public_key, rows_layout.n_ciphertexts
    )
    singles = ciphertexts_from_bytes(stored_block(aggregate, SUM_SINGLE), public_key, m)
    windows = ciphertexts_from_bytes(stored_block(aggregate, SUM_WINDOWS), public_key, m)

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
            m, sigma_int, sampler=noise_sampler, bound=plan.bounds.noise_headroom
        )
    else:
        logger.warning("query %s: no noise added (epsilon = inf): NOT PRIVATE", spec.query_id)
        noise = np.zeros(m * (m + 1) // 2, dtype=np.int64)
    timings["sample_seconds"] = time.perf_counter() - started

    scale = public_n << f
    # The noise is a multiple of N 2^f and v vᵀ is not: alone it would leave the analyst
    # v vᵀ mod N 2^f exactly. A uniform residue F in every entry makes that residue
    # uniform and independent of the data (the proof: masked_release.masked_rounding_slack).
    positions = row_aligned_positions(m, k)
    fresh_values: list[int] = []
    for position in positions:
        if position is None:
            fresh_values.append(0)
            continue
        i, j = position
        noise_ij = scale * int(noise[_tri_index(i, j, m)])
        if sigma_int > 0:  # epsilon = inf: nothing to hide
            noise_ij += masked_residue(scale)
        fresh_values.append(mask[i] * mask[j] + noise_ij)
    fresh_bound = width * width + scale * (plan.bounds.noise_headroom + 1)
    packed = pack_slots(fresh_values, rows_layout, fresh_bound)
    started = time.perf_counter()
    fresh = pool.encrypt(public_key, [p % n for p in packed])
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
    masked_scatter = pool.map(_mask_worker.mask_scatter_chunk, (n, scale, slot_bits), items)
    timings["mask_seconds"] = time.perf_counter() - started

    sum_layout = plan.result_block(MASKED_SUM).layout
    started = time.perf_counter()
    encrypted_mask = pool.encrypt_packed(public_key, mask, sum_layout, width)
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


def _mask_width(plan: ReleasePlan) -> int:
    """W of the mean mask, from the query's public bounds (the bound on the summed sum
    vector, as the plan sizes it), cross-checked against the plan's masked-sum bound,
    v_bound + W."""
    v_bound = masked_sum_bound(plan.spec)
    width = mask_width(v_bound)
    if plan.result_block(MASKED_SUM).bound != v_bound + width:
        raise LayoutError("the masked-sum bound of the plan does not match the mask width")
    return width


def _tri_index(i: int, j: int, m: int) -> int:
    """Position of (i, j), i <= j, in the row-major upper triangle of an m×m matrix."""
    return i * m - i * (i - 1) // 2 + (j - i)
