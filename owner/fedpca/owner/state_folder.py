"""The owner node's state folder (``[owner] state_dir``): held by one node at a time,
and never given a new ledger once a node has run on it.

The folder holds the budget ledger, the shares of uploads in flight (``shares/``) and
the lock file a running node holds (``node.lock``). The lock file stays after the node
stops, so it also records that a node ran here: a folder with it (or with kept shares)
but without a ledger lost its ledger, and a new one would start the budget at zero.
"""

from __future__ import annotations

import os

from fedpca.errors import ConfigError
from fedpca.files import ExclusiveUse, database_missing
from fedpca.owner.config import OwnerConfig
from fedpca.owner.share_snapshots import SHARES_FOLDER

__all__ = [
    "LOCK_NAME",
    "refuse_if_another_process_serves",
    "refuse_where_a_node_ran",
    "use_state_folder",
]

LOCK_NAME = "node.lock"


def use_state_folder(config: OwnerConfig) -> ExclusiveUse:
    """Hold the node's state folder (its ledger and kept shares) for this process.

    Two nodes on one folder would each take the task stream from the other every
    time they reconnect and interleave their uploads in one ledger.
    """
    folder = config.owner.state_dir
    return ExclusiveUse(folder / LOCK_NAME, f"the owner's state folder {folder}")


def refuse_if_another_process_serves(config: OwnerConfig) -> None:
    """Refuse, before a node opens (and so migrates) the ledger, a folder another
    process holds: a newer node started beside a running older one migrated the
    ledger, then was refused the folder, and the older node could not restart (found
    by review). A holder in this very process (another node object, as tests build) is
    left to :func:`use_state_folder` when the node serves.

    Raises
    ------
    ConfigError
    """
    if not (config.owner.state_dir / LOCK_NAME).exists():
        return  # nobody holds it; taking it here would leave a lock file with no ledger
    try:
        use_state_folder(config).release()
    except ConfigError:
        holder = (config.owner.state_dir / LOCK_NAME).read_text(errors="replace").strip()
        if holder != str(os.getpid()):
            raise


def refuse_where_a_node_ran(config: OwnerConfig) -> None:
    """Refuse to create a ledger in a state folder a node has run on (its lock file or
    kept shares are there): its ledger is gone, and a new one would start the budget at
    zero.

    Raises
    ------
    ConfigError
    """
    ran = [p for p in (LOCK_NAME, SHARES_FOLDER) if (config.owner.state_dir / p).exists()]
    if ran:
        raise ConfigError(
            f"{config.owner.state_dir} holds {ran[0]} but no ledger "
            f"({database_missing(config.ledger_path)}): a node ran on this folder and its "
            "ledger is gone. A new one would start this owner's budget again at zero; "
            "restore the ledger from a backup (docs/operations.md)"
        )
