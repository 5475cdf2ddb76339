"""End-to-end time of one private PCA over gRPC with mutual TLS, against the crypto floor.

madelon (2000 rows × 500 features, public bounds 0..999) is split over 10 owner
processes; one proxy process; the analyst runs here. 2048-bit analyst key, stats mode,
epsilon = 1, delta = 1e-5, 5 components. Every role runs on this machine.

The crypto floor is the run's own cryptographic work divided by the cores:
(owners' encryption CPU seconds + the analyst's decryption CPU seconds + the proxy's
CPU seconds checking and folding chunks) ÷ cores. Each term is measured in this run by
the process that did the work (the crypto workers time each task with
``time.process_time``; the proxy times its folding threads with ``time.thread_time``)
and read back from the owners' and the proxy's logs and the estimator's timings. The
ratio end to end ÷ floor is what the pipeline costs on top of the cryptography.

``--split-cores`` stands in for separate machines: every thread of the owners'
processes (and their crypto workers) may run on the first half of the CPUs only, the
proxy and the analyst on the other half. The owners' encryption and the analyst's
decryption then no longer compete for cores, and the run shows what the pipelined
round costs where they do not: about the longer of the two, not their sum.

Usage::

    python benchmarks/end_to_end.py [--owners 10] [--key-bits 2048] [--components 5]
                                    [--rows N] [--features M] [--split-cores] [--keep DIR]

The last line reads ``end_to_end_seconds=<s> floor_seconds=<s> ratio_vs_floor=<x>``;
with ``--split-cores``, ``end_to_end_seconds=<s> encrypting_seconds=<s>
decrypting_seconds=<s> one_after_other_seconds=<s> ratio_vs_longer=<x>
owner_cpus=<list> analyst_cpus=<list>`` (the CPUs that any thread of the owners'
processes and their workers, and of the analyst's process, may use at the end, read
back from each thread).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from fedpca.analyst.estimators import FederatedPCA
from fedpca.app.cluster import LocalCluster, split_rows
from fedpca.data import dataset_path

_STAMP = r"^(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO "
ENCRYPTING = re.compile(_STAMP + r"fedpca\.owner\.node: query \S+: encrypting (?P<count>\d+) ")
ENCRYPTED = re.compile(
    _STAMP + r"fedpca\.owner\.node: query \S+: share encrypted \(\w+, (?P<count>\d+) "
    r"ciphertexts\) in (?P<seconds>[\d.]+) s, (?P<cpu>[\d.]+) CPU-s"
)
DONE = re.compile(
    _STAMP + r"fedpca\.proxy\.coordinator: query \S+ done: \d+ contributors, every page final, "
    r"(?P<fold_cpu>[\d.]+) CPU-s checking and folding chunks, (?P<noise_cpu>[\d.]+) CPU-s "
    r"drawing noise, (?P<final_after>[\d.]+) s after the last chunk arrived"
)


def threads(pid: int) -> list[Path]:
    """The /proc folders of a process's threads; none if the process has ended."""
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []


def process_tree(pid: int) -> list[int]:
    """A process and its live descendants (from /proc)."""
    found = []
    pending = [pid]
    while pending:
        current = pending.pop()
        tasks = threads(current)
        if not tasks:
            continue  # the process ended meanwhile
        found.append(current)
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended meanwhile
            pending.extend(int(child) for child in children)
    return found


def threads_affinity(pids: list[int]) -> set[int]:
    """The CPUs any thread of these processes may run on (read back from each thread)."""
    cpus: set[int] = set()
    for pid in pids:
        for task in threads(pid):
            try:
                cpus |= os.sched_getaffinity(int(task.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return cpus


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant (from /proc).

    Read before and after the round, the difference is the CPU a role spent on it,
    crypto workers included (they live as long as the node)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for current in process_tree(pid):
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        # Fields after the parenthesised command name; utime and stime are 14 and 15.
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Let every thread of process ``pid`` run on ``cpus`` only.

    Linux sets affinity per thread; threads and processes started later inherit it
    from the thread that starts them."""
    for task in threads(pid):
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile


def split_cpus() -> tuple[set[int], set[int]]:
    """The CPUs for the owners and the CPUs for the proxy and the analyst: two halves."""
    if not hasattr(os, "sched_getaffinity"):
        raise SystemExit("--split-cores needs Linux (CPU affinity)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--split-cores needs at least 2 CPUs")
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def _stamp(match: re.Match[str]) -> float:
    return dt.datetime.strptime(match["stamp"], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass(frozen=True)
class OwnerRecord:
    """One owner's encryption, read from its log."""

    started: float
    finished: float
    ciphertexts: int
    cpu_seconds: float


def owner_record(log: str) -> OwnerRecord:
    """The single encryption an owner's log reports (POSIX times)."""
    starts = [_stamp(m) for m in map(ENCRYPTING.match, log.splitlines()) if m]
    ends = [m for m in map(ENCRYPTED.match, log.splitlines()) if m]
    if len(starts) != 1 or len(ends) != 1:
        raise SystemExit(f"expected one encryption per owner log, found {len(starts)}/{len(ends)}")
    end = ends[0]
    return OwnerRecord(starts[0], _stamp(end), int(end["count"]), float(end["cpu"]))


def proxy_record(log: str) -> re.Match[str]:
    """The proxy's 'done' line of the query."""
    found = [m for m in map(DONE.match, log.splitlines()) if m]
    if len(found) != 1:
        raise SystemExit(f"expected one 'done' line in the proxy log, found {len(found)}")
    return found[0]


def machine_idle_seconds() -> float:
    """Core-seconds every core of the machine has spent idle (or waiting for I/O) since
    boot (/proc/stat). Read before and after the round, the difference is the time the
    round left a core without work: the part of end to end that is waiting, not CPU."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """Peak resident set size of a live process (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmHWM for process {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owners", type=int, default=10)
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--components", type=int, default=5)
    parser.add_argument(
        "--rows", type=int, default=None, help="use only the first ROWS rows (CI smoke run)"
    )
    parser.add_argument(
        "--features", type=int, default=None, help="use only the first FEATURES features"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="owners on half of the CPUs, proxy and analyst on the other half (Linux)",
    )
    args = parser.parse_args()
    # The bundled copy of madelon (label in column 0).
    table = np.loadtxt(dataset_path("madelon"), delimiter=",")
    if args.rows is not None:
        table = table[: args.rows]
    if args.features is not None:
        table = table[:, : args.features + 1]
    n_features = table.shape[1] - 1
    parts = split_rows(len(table), args.owners, seed=0)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-e2e-"))
    cluster = LocalCluster(
        workdir=workdir, owner_tables=[table[p] for p in parts], key_bits=args.key_bits
    )
    cluster.prepare()
    with cluster:
        cluster.start()
        if args.split_cores:
            owner_cpus, other_cpus = split_cpus()
            for owner in cluster.owners:
                for pid in process_tree(owner.process.pid):
                    pin_threads(pid, owner_cpus)
            assert cluster.proxy is not None
            for pid in process_tree(cluster.proxy.process.pid):
                pin_threads(pid, other_cpus)
            pin_threads(os.getpid(), other_cpus)  # the analyst; its decryption workers follow
            # numpy's BLAS started a thread per CPU before the pinning; more threads than
            # CPUs spin against each other in the eigendecomposition.
            threadpool_limits(len(other_cpus))
        model = FederatedPCA(
            n_components=min(args.components, n_features),
            epsilon=1.0,
            delta=1e-5,
            bounds=(0.0, 999.0),
            quorum=args.owners,
            deadline_seconds=600.0,
            **cluster.analyst_connection(),
        )
        assert cluster.proxy is not None
        pids = {
            "owners": [o.process.pid for o in cluster.owners],
            "proxy": [cluster.proxy.process.pid],
        }
        cpu_before = {role: sum(map(process_tree_cpu_seconds, p)) for role, p in pids.items()}
        analyst_cpu = resource.getrusage(resource.RUSAGE_SELF)
        idle_before = machine_idle_seconds()
        started = time.time()
        model.fit(n_features=n_features)
        finished = time.time()
        idle = machine_idle_seconds() - idle_before
        role_cpu = {
            role: sum(map(process_tree_cpu_seconds, p)) - cpu_before[role]
            for role, p in pids.items()
        }
        after = resource.getrusage(resource.RUSAGE_SELF)
        analyst_main_cpu = (after.ru_utime + after.ru_stime) - (
            analyst_cpu.ru_utime + analyst_cpu.ru_stime
        )
        owners = [owner_record(process.log_text()) for process in cluster.owners]
        done = proxy_record(cluster.proxy.log_text())
        proxy_peak_mib = peak_rss_mib(cluster.proxy.process.pid)
        if args.split_cores:  # read back from every thread, not what was asked for
            owner_pids = [p for o in cluster.owners for p in process_tree(o.process.pid)]
            servers = set(owner_pids) | set(process_tree(cluster.proxy.process.pid))
            owners_ran_on = threads_affinity(owner_pids)
            analyst_ran_on = threads_affinity(
                [p for p in process_tree(os.getpid()) if p not in servers]
            )
    cores = os.cpu_count() or 1
    timings = model.timings_
    encrypt_cpu = sum(o.cpu_seconds for o in owners)
    ciphertexts = sum(o.ciphertexts for o in owners)
    per_owner = owners[0].ciphertexts
    decrypt_cpu = timings["decrypt_cpu"]
    fold_cpu = float(done["fold_cpu"])
    floor = (encrypt_cpu + decrypt_cpu + fold_cpu) / cores
    end_to_end = finished - started
    first_start = min(o.started for o in owners)
    last_end = max(o.finished for o in owners)

    print(f"dataset: madelon, {len(table)} rows × {n_features} features over")
    print(f"  {args.owners} owner processes, one proxy process, the analyst here; {cores} cores")
    print(f"key: {args.key_bits}-bit Paillier; transport: gRPC with mutual TLS on loopback")
    for phase, seconds in cluster.timings.items():
        print(f"  {phase:<44}{seconds:8.2f} s (setup, not in end-to-end)")
    rows = [
        ("analyst: keys, connection, deployment, query", timings["prepare"]),
        ("analyst: start decryption workers", timings.get("start workers", 0.0)),
        (
            "submit → first owner encrypting",
            first_start - started - timings["prepare"] - timings["start workers"],
        ),
        (f"owners encrypt ({ciphertexts} ciphertexts, overlapping)", last_end - first_start),
        ("last chunk → every page final (proxy)", float(done["final_after"])),
        ("analyst: waiting for the contributors", timings["wait"]),
        ("analyst: decrypting pages (overlapping)", timings["decrypt"]),
        ("analyst: last page → decrypted", timings["tail"]),
        ("analyst: eigendecomposition", timings["solve"]),
        ("end to end (fit → components)", end_to_end),
    ]
    for label, seconds in rows:
        print(f"  {label:<44}{seconds:8.2f} s")
    print("crypto work measured in this run (CPU seconds, by the process that did it):")
    print(
        f"  owners' encryption {encrypt_cpu:8.2f}  "
        f"({encrypt_cpu / ciphertexts * 1e3:.3f} ms per ciphertext)"
    )
    # The result has the layout of one owner's share: as many ciphertexts to decrypt.
    print(
        f"  analyst's decryption {decrypt_cpu:6.2f}  "
        f"({decrypt_cpu / per_owner * 1e3:.3f} ms per ciphertext)"
    )
    print(f"  proxy's check + fold {fold_cpu:6.2f}  ({ciphertexts} ciphertexts folded)")
    print(
        f"  proxy's noise draws  {float(done['noise_cpu']):6.2f}  (not crypto: outside the floor)"
    )
    print(
        f"  analyst's own process {analyst_main_cpu:5.2f}  (receiving, checking, unpacking, "
        "decoding, solving: outside the floor)"
    )
    print(f"  floor = total ÷ {cores} cores = {floor:.2f} s; {per_owner} ciphertexts per owner")
    print("all CPU of each role during the round (processes and their crypto workers):")
    print(
        f"  owners {role_cpu['owners']:8.2f}  ({role_cpu['owners'] - encrypt_cpu:.2f} besides "
        "encryption: policy, budget, statistics, chunking, gRPC)"
    )
    proxy_other = role_cpu["proxy"] - fold_cpu - float(done["noise_cpu"])
    print(
        f"  proxy  {role_cpu['proxy']:8.2f}  ({proxy_other:.2f} besides folding and noise: "
        "submission, store, gRPC)"
    )
    print(
        f"  idle   {idle:8.2f}  (cores without work during the round, of "
        f"{end_to_end * cores:.2f} core-seconds)"
    )
    print(f"proxy process peak resident memory (VmHWM): {proxy_peak_mib:.1f} MiB")
    print(f"explained variance ratio: {np.round(model.explained_variance_ratio_, 4).tolist()}")
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.split_cores:
        encrypting = last_end - first_start
        # The analyst's decryption workers share its CPUs: their CPU time is the least
        # time decrypting alone would take there.
        decrypting = decrypt_cpu / len(other_cpus)
        print(
            f"split cores: owners on CPUs {sorted(owner_cpus)}, proxy and analyst on "
            f"{sorted(other_cpus)}\n"
            f"  owners encrypting (first start → last end)   {encrypting:8.2f} s\n"
            f"  analyst decrypting (its CPU ÷ its CPUs)      {decrypting:8.2f} s\n"
            f"  one after the other                          {encrypting + decrypting:8.2f} s\n"
            f"  end to end                                   {end_to_end:8.2f} s"
        )
        print(
            f"end_to_end_seconds={end_to_end:.3f} encrypting_seconds={encrypting:.3f} "
            f"decrypting_seconds={decrypting:.3f} "
            f"one_after_other_seconds={encrypting + decrypting:.3f} "
            f"ratio_vs_longer={end_to_end / max(encrypting, decrypting):.3f} "
            f"owner_cpus={','.join(map(str, sorted(owners_ran_on)))} "
            f"analyst_cpus={','.join(map(str, sorted(analyst_ran_on)))}"
        )
        return
    print(
        f"end_to_end_seconds={end_to_end:.3f} floor_seconds={floor:.3f} "
        f"ratio_vs_floor={end_to_end / floor:.3f}"
    )


if __name__ == "__main__":
    main()
