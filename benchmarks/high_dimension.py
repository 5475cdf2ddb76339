"""One private PCA at M = 2,000 features over 2 owners: time per phase and memory per role.

A spiked-covariance sample (:mod:`synthetic`, seed 0, ``--rows`` rows per owner, public
bounds [-4, 4]) is split over ``--owners`` owner processes; one proxy process; the
analyst runs here. Everything is the real deployment on loopback
(:class:`fedpca.app.cluster.LocalCluster`: ``fedpca proxy serve`` and ``fedpca owner
serve`` processes, gRPC with mutual TLS, a 2048-bit analyst key), stats mode,
epsilon = 1, delta = 1e-5, 5 components, the query's default public bounds on
owners and records (max_owners = 256, max_records_per_owner = 2^20), which give
60,697 ciphertexts per owner at M = 2,000 and 379,016 at M = 5,000.

Phases are read as ``benchmarks/end_to_end.py`` reads them (owners' and proxy's logs,
the estimator's timings). Memory: the peak resident set (VmHWM, ``/proc/<pid>/status``)
of each role's main process, taken once the query is done, and its resident set
just before the query (VmRSS, idle: interpreter, libraries, gRPC), against the bytes
of ciphertexts that role holds for the query (512 bytes per 2048-bit ciphertext):

* an owner keeps every chunk message of its upload until the proxy acknowledges the
  upload (a retry replays them), i.e. all of its ciphertexts;
* the proxy folds chunks into the encrypted aggregate, one copy of the layout; it
  lives in SQLite, so most of it need not be resident;
* the analyst (this process) receives the result, one copy of the layout.

The crypto pools' worker processes (owners' encryption, the analyst's decryption, the
proxy's noise) are separate processes and not counted; they hold one task's items
at a time.

Usage::

    python benchmarks/high_dimension.py [--features 2000] [--owners 2] [--rows 500]
                                        [--keep DIR]

The last line reads ``features=<M> ciphertexts_per_owner=<n> end_to_end_seconds=<s>
max_peak_over_held=<x>``: the largest ratio, over the roles, of peak resident memory
to the ciphertext bytes held.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from end_to_end import owner_record, proxy_record
from synthetic import BOUND, owner_tables

from fedpca.analyst.estimators import FederatedPCA
from fedpca.app.cluster import LocalCluster
from fedpca.codec.ciphertext import ciphertext_byte_length

KEY_BITS = 2048
MIB = 1024 * 1024


def proc_status_kib(pid: int, field: str) -> int:
    """A memory field (``VmRSS``, ``VmHWM``) of a live process, in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"no {field} for process {pid}")


@dataclass(frozen=True)
class RoleMemory:
    role: str
    idle_mib: float
    peak_mib: float
    held_mib: float

    @property
    def peak_over_held(self) -> float:
        return self.peak_mib / self.held_mib

    @property
    def growth_over_held(self) -> float:
        return (self.peak_mib - self.idle_mib) / self.held_mib


def log(message: str) -> None:
    print(message, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=2000)
    parser.add_argument("--owners", type=int, default=2)
    parser.add_argument("--rows", type=int, default=500, help="rows per owner")
    parser.add_argument("--components", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=7200.0, help="query deadline, s")
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    args = parser.parse_args()
    tables = owner_tables(args.owners, args.rows, args.features, seed=0)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-highdim-"))
    cluster = LocalCluster(
        workdir=workdir, owner_tables=tables, key_bits=KEY_BITS, label_column=None
    )
    cluster.prepare()
    self_pid = os.getpid()
    with cluster:
        cluster.start()
        assert cluster.proxy is not None
        pids = {
            "proxy": cluster.proxy.process.pid,
            **{p.name: p.process.pid for p in cluster.owners},
        }
        owner_names = [p.name for p in cluster.owners]
        idle = {name: proc_status_kib(pid, "VmRSS") / 1024 for name, pid in pids.items()}
        idle["analyst (this process)"] = proc_status_kib(self_pid, "VmRSS") / 1024
        log(f"M = {args.features}: {args.owners} owners connected; submitting the query")
        model = FederatedPCA(
            n_components=min(args.components, args.features),
            epsilon=1.0,
            delta=1e-5,
            bounds=(-BOUND, BOUND),
            quorum=args.owners,
            deadline_seconds=args.deadline,
            **cluster.analyst_connection(),
        )
        started = time.time()
        model.fit(n_features=args.features)
        finished = time.time()
        peaks = {name: proc_status_kib(pid, "VmHWM") / 1024 for name, pid in pids.items()}
        peaks["analyst (this process)"] = proc_status_kib(self_pid, "VmHWM") / 1024
        owners = [owner_record(process.log_text()) for process in cluster.owners]
        done = proxy_record(cluster.proxy.log_text())
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)

    timings = model.timings_
    per_owner = owners[0].ciphertexts
    held_mib = per_owner * ciphertext_byte_length(KEY_BITS) / MIB
    end_to_end = finished - started
    first_start = min(o.started for o in owners)
    last_end = max(o.finished for o in owners)
    log("")
    log(
        f"synthetic spiked covariance, {args.rows} rows per owner × {args.features} features "
        f"over {args.owners} owner processes, one proxy process, the analyst here; "
        f"{os.cpu_count()} cores; {KEY_BITS}-bit Paillier, gRPC with mutual TLS on loopback"
    )
    log(f"{per_owner} ciphertexts per owner ({held_mib:.1f} MiB)")
    for phase, seconds in cluster.timings.items():
        log(f"  {phase:<46}{seconds:9.2f} s (setup, not in end-to-end)")
    rows = [
        ("submit → first owner encrypting", first_start - started),
        ("owners encrypt (overlapping)", last_end - first_start),
        ("last chunk → every page final (proxy)", float(done["final_after"])),
        ("analyst: waiting for the contributors", timings["wait"]),
        ("analyst: decrypting pages (overlapping)", timings["decrypt"]),
        ("analyst: last page → decrypted", timings["tail"]),
        ("analyst: eigendecomposition", timings["solve"]),
        ("end to end (submit → components)", end_to_end),
    ]
    for label, seconds in rows:
        log(f"  {label:<46}{seconds:9.2f} s")
    log(
        f"  crypto CPU: owners' encryption {sum(o.cpu_seconds for o in owners):.1f} s, "
        f"analyst's decryption {timings['decrypt_cpu']:.1f} s, proxy's check + fold "
        f"{float(done['fold_cpu']):.1f} s"
    )
    memory = [
        RoleMemory(name, idle[name], peaks[name], held_mib)
        for name in ["proxy", *owner_names, "analyst (this process)"]
    ]
    log("memory of each role's main process (MiB) against the ciphertexts it holds:")
    log(
        f"  {'role':<24}{'idle RSS':>9}{'peak':>9}{'held':>9}{'peak/held':>11}"
        f"{'(peak-idle)/held':>18}"
    )
    for m in memory:
        log(
            f"  {m.role:<24}{m.idle_mib:>9.1f}{m.peak_mib:>9.1f}{m.held_mib:>9.1f}"
            f"{m.peak_over_held:>11.2f}{m.growth_over_held:>18.2f}"
        )
    log(f"explained variance ratio: {np.round(model.explained_variance_ratio_, 4).tolist()}")
    log(
        f"features={args.features} ciphertexts_per_owner={per_owner} "
        f"end_to_end_seconds={end_to_end:.2f} "
        f"max_peak_over_held={max(m.peak_over_held for m in memory):.2f}"
    )


if __name__ == "__main__":
    main()
