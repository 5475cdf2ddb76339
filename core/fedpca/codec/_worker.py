"""Process-pool workers for Paillier encryption and decryption.

This module is what every pool worker imports, so it deliberately imports only
``gmpy2``, ``secrets`` and stdlib modules that multiprocessing has already loaded in
every worker (``os``, ``select``, ``threading``, ``time``) at module level: with the "spawn" and
"forkserver" start methods each worker re-imports it, and pulling in numpy (~0.1 s)
or phe (~0.05 s, it imports click through ``phe.command_line``) would make pool
start-up dominate small batches.  ``phe`` is imported lazily, only by the tasks that
use its key classes (standard r^n encryption and CRT decryption).

Every task is a top-level function taking plain ints so that it pickles cheaply;
per-key precomputation (the DJN window table, phe's private-key CRT constants) is
cached in the worker process and reused across chunks and across calls.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import threading
import time
from typing import Any

import gmpy2

# Fixed-base window width for the DJN obfuscator h_s^a.  With w = 8 the exponent's
# little-endian bytes are the window digits, and each obfuscator costs at most
# ceil(exponent_bits / 8) modular multiplications and no squarings (56 for the
# 448-bit exponent of a 2048-bit key) instead of ~448 squarings plus ~224
# multiplications in a plain powmod.  Measured at 2048 bits on the development
# machine: 0.23 ms per obfuscator with the table vs 1.85 ms with gmpy2.powmod; the
# table (56 rows x 255 entries, ~7 MB) takes ~0.06 s to build once per key and
# worker.  w = 6 measured 0.30 ms, w = 4 0.41 ms.
_WINDOW_BITS = 8
_WINDOW_SIZE = 1 << _WINDOW_BITS

# A worker keeps the tables of at most this many keys (each ~7-13 MB).
_MAX_CACHED_KEYS = 2

# How often a worker checks that the process that created its pool still exists.
_CREATOR_POLL_S = 0.5

_djn_tables: dict[tuple[int, int, int], list[list[Any]]] = {}
_private_keys: dict[int, Any] = {}


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _MAX_CACHED_KEYS:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _djn_table(n: int, h_s: int, exponent_bits: int) -> list[list[Any]]:
    """Return rows ``T[i][d] = h_s^(d * 256^i) mod n^2`` for d in 0..255.

    Entry 0 of each row is unused (a zero digit multiplies by nothing).
    """
    cache_key = (n, h_s, exponent_bits)
    table = _djn_tables.get(cache_key)
    if table is not None:
        return table
    n_square = gmpy2.mpz(n) * n
    base = gmpy2.mpz(h_s)
    table = []
    for _ in range((exponent_bits + _WINDOW_BITS - 1) // _WINDOW_BITS):
        row = [gmpy2.mpz(1), base]
        for _ in range(2, _WINDOW_SIZE):
            row.append(row[-1] * base % n_square)
        table.append(row)
        base = row[-1] * base % n_square
    _remember(_djn_tables, cache_key, table)
    return table


def encrypt_chunk_djn(n: int, h_s: int, exponent_bits: int, plaintexts: list[int]) -> list[int]:
    """Encrypt plaintexts in [0, n) with DJN obfuscators ``h_s^a``, a < 2^exponent_bits uniform.

    Parameters
    ----------
    n : int
        Paillier modulus.
    h_s : int
        ``h^n mod n^2`` for the per-key random ``h = -x^2 mod n``.
    exponent_bits : int
        Length of the short random exponent.
    plaintexts : list of int, shape (count,)
        Raw plaintexts, already reduced into [0, n).

    Returns
    -------
    list of int, shape (count,)
        Ciphertexts ``(1 + m n) h_s^a mod n^2``.
    """
    table = _djn_table(n, h_s, exponent_bits)
    n_mpz = gmpy2.mpz(n)
    n_square = n_mpz * n_mpz
    exponent_bytes = (exponent_bits + 7) // 8
    one = gmpy2.mpz(1)
    out: list[int] = []
    for m in plaintexts:
        obfuscator = one
        digits = secrets.randbits(exponent_bits).to_bytes(exponent_bytes, "little")
        for row, digit in zip(table, digits, strict=True):
            if digit:
                obfuscator = obfuscator * row[digit] % n_square
        # g = n + 1, so g^m = 1 + m n (mod n^2): the nude ciphertext needs no powmod.
        out.append(int((1 + m * n_mpz) * obfuscator % n_square))
    return out


def encrypt_chunk_standard(n: int, plaintexts: list[int]) -> list[int]:
    """Encrypt plaintexts in [0, n) with phe's full ``r^n`` obfuscator, r uniform in [1, n).

    Parameters
    ----------
    n : int
        Paillier modulus.
    plaintexts : list of int, shape (count,)
        Raw plaintexts in [0, n).

    Returns
    -------
    list of int, shape (count,)
    """
    from phe.paillier import PaillierPublicKey

    public_key = PaillierPublicKey(n)
    # phe draws r with random.SystemRandom when r_value is None; drawing it here
    # from `secrets` keeps the randomness source explicit and identical for both
    # variants.  r shares a factor with n only with probability ~2^-1023.
    return [
        int(public_key.raw_encrypt(m, r_value=secrets.randbelow(n - 1) + 1)) for m in plaintexts
    ]


def decrypt_chunk(n: int, p: int, q: int, ciphertexts: list[int]) -> list[int]:
    """Decrypt ciphertexts with phe's CRT ``raw_decrypt``; results lie in [0, n).

    Parameters
    ----------
    n, p, q : int
        Modulus and its prime factors.
    ciphertexts : list of int, shape (count,)

    Returns
    -------
    list of int, shape (count,)
    """
    private_key = _private_keys.get(n)
    if private_key is None:
        from phe.paillier import PaillierPrivateKey, PaillierPublicKey

        private_key = PaillierPrivateKey(PaillierPublicKey(n), p, q)
        _remember(_private_keys, n, private_key)
    return [int(private_key.raw_decrypt(c)) for c in ciphertexts]


def timed(function: Any, *args: Any) -> tuple[Any, float]:
    """Run a task and return its result with the CPU seconds this worker spent on it
    (the pool adds them up per task kind: the measured cost of each operation)."""
    started = time.process_time()
    result = function(*args)
    return result, time.process_time() - started


def warm_up() -> bool:
    """No-op task used to start worker processes ahead of timing-sensitive work."""
    return True


def watch_creator(creator_pid: int) -> None:
    """Pool initializer: ignore Ctrl-C, and exit once the process that created the pool
    is gone.

    A terminal's Ctrl-C sends SIGINT to the whole process group, workers included; each
    printed a KeyboardInterrupt traceback while its creator was handling the interrupt
    (cancelling the query, stopping the node). The creator shuts its pool down itself,
    so workers ignore SIGINT (SIGTERM still ends them).

    A creator killed with SIGKILL (``kill -9`` of an owner node daemon or of the
    proxy) never shuts its pool down, and the workers block forever on the call
    queue, whose pipe they hold open themselves: they would live on as orphans.
    A daemon thread therefore ends the process with ``os._exit`` when either

    * our parent changed: with "spawn" the parent is the creator itself; with
      "forkserver" it is the fork server, which exits as soon as its creator dies
      (EOF on its "alive" pipe).  Either way we are re-parented at that moment,
      even while the dead creator is still an unreaped zombie; or
    * ``creator_pid`` no longer exists, which covers a creator that died before
      this initializer ran (our parent then was already the re-parenting one).

    It sleeps on process descriptors of the creator and of our parent (``pidfd_open``,
    Linux 5.3+), which become readable when either exits, so an idle worker never
    wakes; where they are not available it checks every ``_CREATOR_POLL_S`` seconds.
    ``PR_SET_PDEATHSIG`` is not used: with "spawn" it fires when the *thread* that
    spawned the worker exits, and the executor spawns workers from whichever thread
    submits work.

    Parameters
    ----------
    creator_pid : int
        ``os.getpid()`` of the process that created the executor.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()

    def creator_is_gone() -> bool:
        if os.getppid() != parent_pid:
            return True
        try:
            os.kill(creator_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # the pid exists (under another user): not proof of death
            pass
        return False

    def watch() -> None:
        creator, parent = _exit_descriptor(creator_pid), _exit_descriptor(parent_pid)
        if creator is not None and parent is not None and not creator_is_gone():
            select.select([creator, parent], [], [])  # until one of them exits
        else:
            while not creator_is_gone():
                time.sleep(_CREATOR_POLL_S)
        # Nobody is left to collect results or to shut us down; skip all cleanup.
        os._exit(1)

    threading.Thread(target=watch, name="fedpca-creator-watch", daemon=True).start()


def _exit_descriptor(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits, or None (no
    ``pidfd_open`` here, or no such process)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
