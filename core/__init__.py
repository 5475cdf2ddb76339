"""fedpca: federated, differentially private PCA/DCA over packed Paillier and gRPC.

The shared kernel lives here (codec, dp, stats, transport); the role packages
``fedpca.owner``, ``fedpca.proxy`` and ``fedpca.analyst`` build on it.
"""

from __future__ import annotations

__version__ = "0.1.0"
