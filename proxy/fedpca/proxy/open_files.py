"""Enough open files for one connection per owner.

Every owner holds one TCP connection to the proxy for as long as it serves (its task
stream), so a proxy for 1,000 owners needs more than 1,000 file descriptors. Most
Linux systems start services with a soft limit of 1,024 (and a hard limit far above
it): past it the proxy could accept no more connections, and owners would see only
connection failures. The proxy raises its soft limit at start, as far as the hard
limit allows, and says in its log when even the hard limit is too low.
"""

from __future__ import annotations

import logging

__all__ = ["RESERVED_FILES", "ensure_open_files", "needed_open_files"]

logger = logging.getLogger(__name__)

RESERVED_FILES = 256
"""Descriptors for everything but owners: analysts' connections, the SQLite database and
its journal, the monitoring server, the crypto workers' pipes, the log."""


def needed_open_files(owner_count: int) -> int:
    """Descriptors a proxy for ``owner_count`` owners may hold at once.

    Two per owner: its serving connection, and a second one while it reconnects
    (the old socket may not be closed yet when the new one arrives).
    """
    return 2 * owner_count + RESERVED_FILES


def ensure_open_files(needed: int) -> int | None:
    """Raise this process's soft limit on open files to its hard limit.

    Every connection takes a descriptor, the owners' and anyone else's: a review held
    the last of a 1,024 soft limit (what systemd gives a service) with one certificate's
    idle connections and every new connection failed meanwhile. The whole hard limit
    leaves the most room; ``needed`` (the owners' share) decides only whether to warn.
    Never lowers the limit (only root may raise the hard one).

    Returns
    -------
    int or None
        The soft limit now in force; None where the platform has no such limit
        (Windows).
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    target = max(needed, soft) if hard == resource.RLIM_INFINITY else max(hard, soft)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("open files limit raised from %d to %d", soft, target)
    if target < needed:
        logger.warning(
            "this process may open at most %d files but a proxy for its owners may need "
            "%d (one connection per owner): raise the hard limit (LimitNOFILE= in the "
            "systemd unit, ulimit -Hn, or the container's nofile ulimit)",
            target,
            needed,
        )
    return target
