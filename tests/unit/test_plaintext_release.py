"""The plaintext release equals what a real deployment decrypts, bit for bit.

:mod:`fedpca.app.plaintext_release` computes a release without transport and without
Paillier, using the roles' own code for everything else; the benchmarks measure utility
with it. Here the same signed query runs through a real proxy and real owner nodes over
mutual TLS (:mod:`inprocess`, TEST-ONLY 512-bit key) whose proxy draws its noise from a
seeded sampler, and the plaintext path, given a sampler with the same seed, must produce
the same released numbers exactly: the same noisy statistics (stats mode) or the same
noisy centred scatter (masked mode), at a finite epsilon. The slow tier checks the
same against separate processes at 2048 bits with epsilon = inf
(tests/integration/test_end_to_end.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.analyst.decode import decrypt_result
from fedpca.app.plaintext_release import fold_owner_shares, plaintext_release, release_from_folded
from fedpca.codec import CryptoPool
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.query import Neighbouring, ProtocolMode
from fedpca.tables import OwnerTable
from helpers import TEST_SIGNER, query_builder
from inprocess import deployment, labelled

M = 5
PROXY_SEED = 5  # the seed of the in-process proxy's TEST-ONLY sampler (inprocess.py)
_spec = query_builder(
    n_features=M,
    n_components=2,
    epsilon=1.0,
    delta=1e-5,
    quorum=3,
    deadline_seconds=60.0,
    feature_lower=(-2.0,) * M,
    feature_upper=(2.0,) * M,
)


def _tables() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    # Some values outside the public bounds and rows beyond the clip norm: the owners'
    # scaling, clipping and quantisation all take part.
    return {f"owner-{i + 1}": rng.normal(0.0, 1.2, size=(n, M)) for i, n in enumerate((40, 25, 7))}


@pytest.mark.parametrize("mode", [ProtocolMode.STATS, ProtocolMode.MASKED])
def test_plaintext_release_equals_the_decrypted_release(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any], mode: ProtocolMode
) -> None:
    public_key, private_key = test_only_keypair_512
    relation = Neighbouring.REPLACE_ONE if mode is ProtocolMode.MASKED else Neighbouring.ADD_REMOVE
    spec = _spec(public_key, mode=mode, neighbouring=relation)
    tables = _tables()
    with deployment(
        workdir=tmp_path,
        tables={owner: labelled(rows) for owner, rows in tables.items()},
        pool=pool,
        public_key=public_key,
        neighbouring=relation,
    ) as running:
        outcome = running.run(spec)
        assert outcome.state == "done", outcome
        with running.analyst() as client:
            fetched = client.fetch(spec.query_id, public_key=public_key, signer=TEST_SIGNER)
    decrypted = decrypt_result(fetched.result, private_key, expected_query=spec, pool=pool)

    plaintext = plaintext_release(
        spec,
        [OwnerTable(rows, None) for rows in tables.values()],
        key_bits=public_key.n.bit_length(),
        capacities=[running.capacity] * len(tables),
        sampler=TestOnlySeededSampler(PROXY_SEED),
    )

    assert plaintext.n_owners == decrypted.n_owners == 3
    assert plaintext.sigmas == decrypted.sigmas and plaintext.private
    if mode is ProtocolMode.STATS:
        assert plaintext.statistics is not None and decrypted.statistics is not None
        np.testing.assert_array_equal(plaintext.statistics.scatter, decrypted.statistics.scatter)
        np.testing.assert_array_equal(plaintext.statistics.sums, decrypted.statistics.sums)
        assert plaintext.statistics.count == decrypted.statistics.count
        assert plaintext.statistics.count != 72  # the count is noised
    else:
        assert plaintext.public_count == decrypted.public_count == 72
        # Equal up to the proxy's uniform residues (secret, so not seeded): each moves an
        # entry by less than 2^-f in clip units (f = 32 here: 2.3e-10).
        difference = plaintext.centred_scatter - decrypted.centred_scatter
        assert 0 < np.abs(difference).max() < 2.0**-spec.frac_bits
    if mode is ProtocolMode.STATS:
        np.testing.assert_array_equal(plaintext.pca().components, decrypted.pca().components)
    else:
        np.testing.assert_allclose(
            plaintext.pca().components, decrypted.pca().components, rtol=0, atol=1e-6
        )


def test_each_release_from_the_same_fold_draws_fresh_noise(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    public_key, _ = test_only_keypair_512
    spec = _spec(public_key)
    folded = fold_owner_shares(
        spec, [OwnerTable(rows, None) for rows in _tables().values()], key_bits=512
    )
    first = release_from_folded(folded, sampler=TestOnlySeededSampler(1))
    second = release_from_folded(folded, sampler=TestOnlySeededSampler(2))
    exact = release_from_folded(
        fold_owner_shares(
            _spec(public_key, epsilon=math.inf),
            [OwnerTable(rows, None) for rows in _tables().values()],
            key_bits=512,
        )
    )
    assert first.statistics is not None and second.statistics is not None
    assert exact.statistics is not None and exact.statistics.count == 72
    assert not np.array_equal(first.statistics.scatter, second.statistics.scatter)
    # Both differ from the exact scatter by noise of the calibrated scale.
    upper = np.triu_indices(M)
    for release in (first, second):
        assert release.statistics is not None
        errors = (release.statistics.scatter - exact.statistics.scatter)[upper]
        sigma = release.sigmas["scatter"]
        assert np.all(np.abs(errors) < 6 * sigma) and np.std(errors) > sigma / 4
