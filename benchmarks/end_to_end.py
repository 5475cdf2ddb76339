"""End-to-end time of one private PCA over gRPC with mutual TLS.

madelon (2000 rows × 500 features, public bounds 0..999) is split over 10 owner
processes; one proxy process; the analyst runs here. 2048-bit analyst key, stats mode,
epsilon = 1, delta = 1e-5, 5 components. Prints per-phase times and the ratio of the
analyst's end-to-end time (submit → decrypted components) to the owners' encryption
phase (earliest start to latest finish of any owner's share encryption, read from the
owners' logs), and the proxy process's peak resident memory (run with --owners 2 and
10 to see that it does not grow with the number of owners).

Usage::

    python benchmarks/end_to_end.py [--owners 10] [--key-bits 2048] [--keep DIR]

The last line reads ``end_to_end_seconds=<float> ratio_vs_owner_encryption=<float>``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from fedpca.analyst.estimators import FederatedPCA
from fedpca.app.cluster import LocalCluster, split_rows

DATASET = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "madelon.csv"
ENCRYPTED = re.compile(
    r"^(?P<stamp>\S+ \S+) INFO fedpca\.owner\.node: query \S+: share encrypted "
    r"\((?P<variant>\w+), (?P<count>\d+) ciphertexts\) in (?P<seconds>[\d.]+) s"
)


def encryption_window(logs: list[str]) -> tuple[float, float, int]:
    """(start, end, ciphertexts) of all owners' encryption, as POSIX seconds."""
    starts, ends, count = [], [], 0
    for text in logs:
        for line in text.splitlines():
            match = ENCRYPTED.match(line)
            if match is None:
                continue
            end = dt.datetime.strptime(match["stamp"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            ends.append(end)
            starts.append(end - float(match["seconds"]))
            count += int(match["count"])
    if len(ends) != len(logs):
        raise SystemExit(f"found {len(ends)} encryption records in {len(logs)} owner logs")
    return min(starts), max(ends), count


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
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    args = parser.parse_args()
    if not DATASET.exists():
        raise SystemExit(f"{DATASET} not found: run from a checkout with ../shared/datasets")
    table = np.loadtxt(DATASET, delimiter=",")
    parts = split_rows(len(table), args.owners, seed=0)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-e2e-"))
    cluster = LocalCluster(
        workdir=workdir, owner_tables=[table[p] for p in parts], key_bits=args.key_bits
    )
    cluster.prepare()
    with cluster:
        cluster.start()
        model = FederatedPCA(
            n_components=args.components,
            epsilon=1.0,
            delta=1e-5,
            bounds=(0.0, 999.0),
            quorum=args.owners,
            deadline_seconds=600.0,
            **cluster.analyst_connection(),
        )
        started = time.time()
        model.fit(n_features=table.shape[1] - 1)
        finished = time.time()
        logs = [process.log_text() for process in cluster.owners]
        assert cluster.proxy is not None
        proxy_peak_mib = peak_rss_mib(cluster.proxy.process.pid)
    start, end, ciphertexts = encryption_window(logs)
    end_to_end = finished - started
    encryption = end - start
    print(f"dataset: {DATASET.name}, {len(table)} rows over {args.owners} owner processes")
    print(f"key: {args.key_bits}-bit Paillier; transport: gRPC with mutual TLS on loopback")
    for phase, seconds in cluster.timings.items():
        print(f"  {phase:<34}{seconds:8.2f} s (setup, not in end-to-end)")
    print(f"  {'submit → owners start encrypting':<34}{start - started:8.2f} s")
    print(f"  {'owners encrypt (' + str(ciphertexts) + ' ciphertexts)':<34}{encryption:8.2f} s")
    ready = started + model.timings_["submit"] + model.timings_["wait"]
    print(f"  {'last encryption → result ready':<34}{ready - end:8.2f} s")
    for phase in ("fetch", "decrypt", "solve"):
        print(f"  {'analyst ' + phase:<34}{model.timings_[phase]:8.2f} s")
    print(f"  {'end to end (submit → components)':<34}{end_to_end:8.2f} s")
    print(f"proxy process peak resident memory (VmHWM): {proxy_peak_mib:.1f} MiB")
    print(f"explained variance ratio: {np.round(model.explained_variance_ratio_, 4).tolist()}")
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"end_to_end_seconds={end_to_end:.2f} "
        f"ratio_vs_owner_encryption={end_to_end / encryption:.3f}"
    )


if __name__ == "__main__":
    main()
