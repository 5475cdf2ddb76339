"""What this build of fedpca is: the installed distribution's version (set in
pyproject.toml) and the wire protocol version it speaks, and the check a node makes of
the wire protocol a peer states."""

from __future__ import annotations

from importlib import metadata

from fedpca.errors import ProtocolVersionError

__all__ = ["PROTOCOL_VERSION", "__version__", "build_description", "check_peer_protocol"]

try:
    __version__ = metadata.version("fedpca")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

PROTOCOL_VERSION = 6
"""Wire protocol version spoken by this build (messages of package ``fedpca.v1``;
re-exported as :data:`fedpca.messages.PROTOCOL_VERSION`). Builds of one distribution
version may speak different ones: ``fedpca --version`` prints both.

Version 2: chunks carry links of a hash chain instead of per-chunk hashes under a
content hash declared in the header (uploads stream while the owner encrypts, results
stream page by page), and an interrupted upload resumes where the proxy's durable
copy ends.

Version 3: the proxy acknowledges an upload's header in the call's initial metadata
(:data:`~fedpca.messages.uploads.UPLOAD_ACCEPTED_METADATA`) once it has recorded the
upload as begun, and the owner sends no chunk before that: an upload refused at its
header leaves both the owner and the analyst refunded, one accepted leaves both
charged.

Version 4: the same messages; the mechanism behind them changed, so that an owner
refuses a proxy without the fixes: masked mode adds a uniform residue to every scatter
entry (v vᵀ mod N 2^f was exact before), and DCA under replace-one is calibrated for a
swap in two capped classes at once (docs/privacy.md).

Version 5: every private query's noise headroom grows by the most one coordinate can
move between neighbours (sigma / z), so that the proxy's refusal of a draw beyond it is
accounted as an additive delta of n 2^-100 (docs/privacy.md, "Headroom refusal"):
slots, and so layouts, differ from version 4 for the same query. And a query carries
the time its analyst's client signed it (``QuerySpec.issued_at``, in the signed
digest): owners answer it only until issued_at + deadline_seconds (plus 5 minutes),
and decline a query without one.

Version 6: a PCA or DCA query may name the owners' file columns that are its features
(``QuerySpec.feature_columns``, in the signed digest when named). An owner of version 5
would drop the field and decline the query as badly signed; the version says why.

Owners and analysts state this version on every call (request metadata
:data:`fedpca.transport.channels.PROTOCOL_VERSION_METADATA`, which adds nothing to the
messages, so builds without it still work with version 5 ones) and the proxy refuses
another (:func:`check_peer_protocol`)."""


MAX_STATED_PROTOCOL = 16
"""Characters of a peer's stated protocol version quoted in a refusal (it is the peer's
text, and refusals are logged)."""


def build_description() -> str:
    """``0.2.0 (wire protocol 4)``: what tells two builds apart (``fedpca --version``)."""
    return f"{__version__} (wire protocol {PROTOCOL_VERSION})"


def check_peer_protocol(peer: str, stated: str | None, here: str) -> None:
    """Refuse a peer that states another wire protocol version than this build's.

    Parameters
    ----------
    peer : who stated it, as the refusal names it (e.g. ``owner/hospital-a``).
    stated : the version the peer stated (request metadata
        :data:`fedpca.transport.channels.PROTOCOL_VERSION_METADATA`); None if it stated
        none, as builds before the metadata existed do: those are not refused here (an
        owner of such a build still checks the proxy's version itself).
    here : this node, as the refusal names it (``this proxy``).

    Raises
    ------
    ProtocolVersionError
        If ``stated`` is not this build's :data:`PROTOCOL_VERSION`.
    """
    if stated is None or stated.strip() == str(PROTOCOL_VERSION):
        return
    raise ProtocolVersionError(peer, stated[:MAX_STATED_PROTOCOL], PROTOCOL_VERSION, here)
