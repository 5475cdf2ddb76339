"""Transport for fedpca: wire serialisation, TLS certificates and gRPC channels.

- :mod:`fedpca.transport.serde` converts between ``fedpca.v1`` messages and the domain
  objects of :mod:`fedpca.messages`.
- :mod:`fedpca.transport.certs` creates the CA and node certificates and reads identities.
- :mod:`fedpca.transport.channels` builds mutual-TLS servers and channels.
- :mod:`fedpca.transport.addresses` checks ``host:port`` addresses where they are given.
- :mod:`fedpca.transport.ports` says why a listening address cannot be bound.
"""

from __future__ import annotations
