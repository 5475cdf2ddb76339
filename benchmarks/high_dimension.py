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

The crypto pools' worker processes (owners' encryption, the analyst's decryption) are
separate processes and not counted; they hold one task's items at a time.

Besides its ciphertexts, each role must hold by design (printed as "by design", the
least its peak above idle can be):

* an owner, its share's fixed-point values (int64, 8 bytes a value) while it encrypts
  them, next to the upload it keeps;
* the proxy, the packed noise it draws while the owners encrypt (one plaintext of
  ``key_bits / 8`` bytes per result ciphertext); its aggregate is in SQLite;
* the analyst, the noisy release it keeps (M(M+1)/2 + M + 1 float64 values, R as its
  upper triangle) and one packed working copy of the covariance (M(M+1)/2 values) for
  LAPACK's packed eigensolver.

The analyst's peak is also read just before the eigendecomposition (decryption and
decoding alone). Idle figures include each role's libraries: this script imports what
the analyst's ``fit`` would import at first use (gRPC, dp-accounting; printed) before
reading the analyst's idle figure.

It writes a figure (``--plot PATH``, ``--plot ''`` for none; by default
``docs/figures/high_dimension_<M>.png``): the time of each phase, and each role's
memory (idle and peak) beside the ciphertexts it holds and twice that.

Usage::

    python benchmarks/high_dimension.py [--features 2000] [--owners 2] [--rows 500]
                                        [--components 5] [--deadline 7200]
                                        [--plot PATH] [--keep DIR]

The last line reads ``features=<M> ciphertexts_per_owner=<n> end_to_end_seconds=<s>
max_peak_over_held=<x> max_growth_over_held=<y> analyst_growth_from_ready_over_held=<z>``:
the largest ratios, over the roles, of peak resident memory, and of its growth above
idle, to the ciphertext bytes held; and the analyst's growth above its memory once it
was ready (keys loaded, decryption workers started, connected: the query submitted),
which is how the servers' idle figures are taken (started and connected).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from end_to_end import owner_record, proxy_record
from synthetic import BOUND, owner_tables

from fedpca.allocator import map_large_blocks
from fedpca.analyst.estimators import FederatedPCA
from fedpca.app.cluster import LocalCluster
from fedpca.codec.ciphertext import ciphertext_byte_length
from fedpca.protocol import SHARES

KEY_BITS = 2048
MIB = 1024 * 1024
FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"


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
    design_mib: float
    """What the role must hold besides its ciphertexts (see the module docstring)."""

    @property
    def peak_over_held(self) -> float:
        return self.peak_mib / self.held_mib

    @property
    def growth_over_held(self) -> float:
        return (self.peak_mib - self.idle_mib) / self.held_mib


class MeasuredPCA(FederatedPCA):
    """FederatedPCA that reads this process's memory when its query is submitted (keys
    loaded, decryption workers started, connected: ready, as a server is once started)
    and just before it solves."""

    resident_when_submitted_mib_: float | None = None

    def _record_submission(self, status: Any) -> None:
        if self.resident_when_submitted_mib_ is None:
            self.resident_when_submitted_mib_ = proc_status_kib(os.getpid(), "VmRSS") / 1024

    def _solve(self, release: Any) -> None:
        self.peak_before_solve_mib_ = proc_status_kib(os.getpid(), "VmHWM") / 1024
        self.resident_at_solve_mib_ = proc_status_kib(os.getpid(), "VmRSS") / 1024
        super()._solve(release)


def log(message: str) -> None:
    print(message, flush=True)


def plot(
    phases: list[tuple[str, float]], memory: list[RoleMemory], path: Path, n_features: int
) -> None:
    """Phases (bars of seconds) and each role's idle and peak memory beside the
    ciphertexts it holds and twice that."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [label for label, _ in phases]
    left.barh(range(len(phases)), [seconds for _, seconds in phases], color="tab:blue")
    left.set_yticks(range(len(phases)), labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("seconds (phases overlap)")
    left.set_title(f"one private PCA, M = {n_features}: phases", fontsize=9)
    left.grid(True, axis="x", alpha=0.3)
    roles = [m.role.replace(" (this process)", "") for m in memory]
    positions = np.arange(len(memory))
    right.bar(positions, [m.idle_mib for m in memory], color="tab:gray", label="idle")
    right.bar(
        positions,
        [m.peak_mib - m.idle_mib for m in memory],
        bottom=[m.idle_mib for m in memory],
        color="tab:orange",
        label="peak above idle",
    )
    for x, m in zip(positions, memory, strict=True):
        right.hlines(m.idle_mib + m.held_mib, x - 0.4, x + 0.4, colors="black", linestyles=":")
        right.hlines(m.idle_mib + 2 * m.held_mib, x - 0.4, x + 0.4, colors="tab:red")
    right.plot([], [], ":", color="black", label="idle + ciphertexts held")
    right.plot([], [], "-", color="tab:red", label="idle + 2 × ciphertexts held")
    right.set_xticks(positions, roles, fontsize=8)
    right.set_ylabel("MiB (main process)")
    right.set_title("memory of each role", fontsize=9)
    right.legend(fontsize=7)
    right.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=2000)
    parser.add_argument("--owners", type=int, default=2)
    parser.add_argument("--rows", type=int, default=500, help="rows per owner")
    parser.add_argument("--components", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=7200.0, help="query deadline, s")
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG to write the figure to (default docs/figures/high_dimension_<M>.png; "
        "'' for none)",
    )
    args = parser.parse_args()
    tables = owner_tables(args.owners, args.rows, args.features, seed=0)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-highdim-"))
    cluster = LocalCluster(
        workdir=workdir, owner_tables=tables, key_bits=KEY_BITS, label_column=None
    )
    cluster.prepare()
    self_pid = os.getpid()
    # As `fedpca analyst` does (it is a process of its own; the estimators, as library
    # code, leave a host process's allocator alone): freed blocks go back to the system.
    map_large_blocks()
    # What fit imports at first use (gRPC, dp-accounting): loaded before the analyst's
    # idle figure, as the servers' idle figures include their libraries.
    before_imports = proc_status_kib(self_pid, "VmRSS") / 1024
    importlib.import_module("fedpca.analyst.client")
    importlib.import_module("dp_accounting.rdp")
    analyst_libraries_mib = proc_status_kib(self_pid, "VmRSS") / 1024 - before_imports
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
        model = MeasuredPCA(
            n_components=min(args.components, args.features),
            epsilon=1.0,
            delta=1e-5,
            bounds=(-BOUND, BOUND),
            quorum=args.owners,
            deadline_seconds=args.deadline,
            **cluster.analyst_connection(),
        )
        model.on_status = model._record_submission
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
    # As benchmarks/end_to_end.py: the clock starts at fit, before the analyst's keys,
    # connection and decryption workers, which are listed apart.
    submitted = started + timings["prepare"] + timings.get("start workers", 0.0)
    rows = [
        ("analyst: keys, connection, deployment, query", timings["prepare"]),
        ("analyst: start decryption workers", timings.get("start workers", 0.0)),
        ("submit → first owner encrypting", first_start - submitted),
        ("owners encrypt (overlapping)", last_end - first_start),
        ("last chunk → every page final (proxy)", float(done["final_after"])),
        ("analyst: waiting for the contributors", timings["wait"]),
        ("analyst: decrypting pages (overlapping)", timings["decrypt"]),
        ("analyst: last page → decrypted", timings["tail"]),
        ("analyst: eigendecomposition", timings["solve"]),
        ("end to end (fit → components)", end_to_end),
    ]
    for label, seconds in rows:
        log(f"  {label:<46}{seconds:9.2f} s")
    log(
        f"  crypto CPU: owners' encryption {sum(o.cpu_seconds for o in owners):.1f} s, "
        f"analyst's decryption {timings['decrypt_cpu']:.1f} s, proxy's check + fold "
        f"{float(done['fold_cpu']):.1f} s"
    )
    plan = model.release_.plan
    values = plan.owner_block(SHARES).layout.value_count
    design = {
        "proxy": per_owner * (KEY_BITS // 8) / MIB,
        **{name: values * 8 / MIB for name in owner_names},
        "analyst (this process)": (
            plan.statistics.value_count + args.features * (args.features + 1) // 2
        )
        * 8
        / MIB,
    }
    memory = [
        RoleMemory(name, idle[name], peaks[name], held_mib, design[name])
        for name in ["proxy", *owner_names, "analyst (this process)"]
    ]
    log("memory of each role's main process (MiB) against the ciphertexts it holds:")
    log(
        f"  {'role':<24}{'idle RSS':>9}{'peak':>9}{'peak-idle':>10}{'held':>7}"
        f"{'peak/held':>11}{'(peak-idle)/held':>18}{'by design':>11}{'/held':>7}"
    )
    for m in memory:
        log(
            f"  {m.role:<24}{m.idle_mib:>9.1f}{m.peak_mib:>9.1f}"
            f"{m.peak_mib - m.idle_mib:>10.1f}{m.held_mib:>7.1f}"
            f"{m.peak_over_held:>11.2f}{m.growth_over_held:>18.2f}"
            f"{m.design_mib:>11.1f}{m.design_mib / m.held_mib:>7.2f}"
        )
    analyst = memory[-1]
    before_solve = model.peak_before_solve_mib_
    log(
        f"  analyst's peak before the eigendecomposition: {before_solve:.1f} MiB "
        f"((peak-idle)/held {(before_solve - analyst.idle_mib) / held_mib:.2f}); resident "
        f"when the solve starts: {model.resident_at_solve_mib_:.1f} MiB"
    )
    ready = model.resident_when_submitted_mib_
    assert ready is not None
    from_ready = (analyst.peak_mib - ready) / held_mib
    log(
        f"  analyst when its query was submitted (keys, workers, connection: ready): "
        f"{ready:.1f} MiB; (peak-ready)/held {from_ready:.2f}"
    )
    log(
        f"  the analyst's idle figure includes its client libraries "
        f"({analyst_libraries_mib:.1f} MiB, imported before it was read)"
    )
    log(f"explained variance ratio: {np.round(model.explained_variance_ratio_, 4).tolist()}")
    figure = FIGURES / f"high_dimension_{args.features}.png" if args.plot is None else args.plot
    if figure:
        plot(rows[:-1], memory, Path(figure), args.features)
        log(f"figure: {figure}")
    log(
        f"features={args.features} ciphertexts_per_owner={per_owner} "
        f"end_to_end_seconds={end_to_end:.2f} "
        f"max_peak_over_held={max(m.peak_over_held for m in memory):.2f} "
        f"max_growth_over_held={max(m.growth_over_held for m in memory):.2f} "
        f"analyst_growth_from_ready_over_held={from_ready:.2f}"
    )


if __name__ == "__main__":
    main()
