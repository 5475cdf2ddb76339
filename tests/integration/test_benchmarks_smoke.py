"""Each benchmark runs once in a small configuration, so that it keeps working.

These are not timed tests: they check that a benchmark completes against the real
processes it drives and that its last line reports what its docstring promises.
The figures themselves come from full runs (docs/performance.md).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedpca.protocol import ReleasePlan
from fedpca.proxy.limits import PeerLimits
from fedpca.query import QueryKind, QuerySpec

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float = 240.0) -> dict[str, str]:
    """Run ``benchmarks/<script>`` with ``args``; the key=value pairs of its last line."""
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCHMARKS.parent,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    last = completed.stdout.strip().splitlines()[-1]
    return dict(pair.split("=", 1) for pair in last.split())


def test_scale_owners_completes_with_every_owner(tmp_path: Path) -> None:
    plot = tmp_path / "scale.png"
    result = run_benchmark(
        "scale_owners.py", "--owners", "2,6", "--owners-per-driver", "3", "--plot", str(plot)
    )
    # The benchmark exits non-zero unless the result aggregates all 6 owners.
    assert result["owners"] == "6"
    assert float(result["end_to_end_seconds"]) > 0
    assert math.isfinite(float(result["proxy_growth_kib_per_owner"]))
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_scale_owners_runs_the_owner_daemon_as_well(tmp_path: Path) -> None:
    result = run_benchmark("scale_owners.py", "--owners", "3", "--clients", "node", "--plot", "")
    assert result["owners"] == "3"


def test_high_dimension_reports_its_layout_memory_and_figure(tmp_path: Path) -> None:
    figure = tmp_path / "high_dimension.png"
    result = run_benchmark(
        "high_dimension.py", "--features", "50", "--rows", "60", "--plot", str(figure)
    )
    spec = QuerySpec(
        query_id="q",
        kind=QueryKind.PCA,
        n_features=50,
        epsilon=1.0,
        delta=1e-5,
        n_components=5,
        analyst_public_key_n=(1 << 2047) + 1,
        analyst_key_fingerprint="unused",
    )
    plan = ReleasePlan.for_query(spec, 2048)
    assert int(result["ciphertexts_per_owner"]) == sum(
        block.layout.n_ciphertexts for block in plan.owner_blocks
    )
    # Peak over held includes each role's libraries; growth over held is the part the
    # query adds, and is at most the peak.
    assert float(result["max_peak_over_held"]) >= float(result["max_growth_over_held"]) > 0
    assert figure.read_bytes().startswith(b"\x89PNG")


def test_proxy_ingest_compares_both_modes() -> None:
    result = run_benchmark(
        "proxy_ingest.py", "--uploaders", "3", "--features", "150", "--trials", "1"
    )
    assert float(result["group_commit_chunks_per_s"]) > 0
    assert float(result["no_group_commit_chunks_per_s"]) > 0
    assert math.isfinite(float(result["speedup"]))


def test_proxy_memory_folds_concurrent_uploads() -> None:
    result = run_benchmark(
        "proxy_memory.py", "--features", "200", "--owners-small", "1", "--owners-large", "2"
    )
    # One extra owner's upload: M = 200 needs several hundred 512-byte ciphertexts.
    assert float(result["extra_upload_mib"]) > 0.1
    assert math.isfinite(float(result["growth_over_uploaded"]))


def test_connection_memory_measures_both_transports() -> None:
    result = run_benchmark("connection_memory.py", "--connections", "5")
    assert math.isfinite(float(result["mtls_kib_per_connection"]))
    assert math.isfinite(float(result["plaintext_kib_per_connection"]))


def test_hostile_calls_memory_compares_the_earlier_limits_with_the_defaults() -> None:
    result = run_benchmark("hostile_calls_memory.py", "--rounds", "1", "--channels", "2")
    # The earlier limits (64 calls of 8 MiB a peer) let the same attack hold more
    # memory than the defaults (16 calls of 2 MiB).
    assert float(result["before_growth_mib"]) > float(result["after_growth_mib"]) >= 0


def test_hostile_stream_reopen_admits_the_allowed_openings_only() -> None:
    result = run_benchmark("hostile_stream_reopen.py", "--bystanders", "2", "--seconds", "2")
    # The attacker reopens as fast as it can; the proxy admits the shipped limit a minute.
    assert int(result["attack_opened"]) == PeerLimits().max_task_stream_opens_per_minute
    assert float(result["proxy_cpu_attack"]) >= 0 and float(result["hello_ms_attack"]) > 0


def test_end_to_end_reports_the_floor_from_its_own_run() -> None:
    result = run_benchmark("end_to_end.py", "--owners", "2", "--rows", "200", "--features", "20")
    floor = float(result["floor_seconds"])
    end_to_end = float(result["end_to_end_seconds"])
    assert floor > 0 and end_to_end > 0
    # The floor is CPU the run's processes spent within the round, divided by the cores:
    # the round cannot have taken less time than that.
    assert end_to_end >= floor
    # The ratio is the two figures of the same run.
    assert float(result["ratio_vs_floor"]) == pytest.approx(end_to_end / floor, rel=0.05)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="--split-cores needs Linux and 2 CPUs to split",
)
def test_end_to_end_on_split_cores_reports_both_phases() -> None:
    result = run_benchmark(
        "end_to_end.py", "--owners", "2", "--rows", "200", "--features", "20", "--split-cores"
    )
    encrypting = float(result["encrypting_seconds"])
    decrypting = float(result["decrypting_seconds"])
    end_to_end = float(result["end_to_end_seconds"])
    assert encrypting > 0 and decrypting > 0 and end_to_end > 0
    # The CPUs any thread of the owners (workers included) and of the analyst may use at
    # the end, read back from each thread.
    owner_cpus = set(result["owner_cpus"].split(","))
    analyst_cpus = set(result["analyst_cpus"].split(","))
    assert owner_cpus and analyst_cpus and not owner_cpus & analyst_cpus
    # The figures it compares are this run's own.
    assert float(result["one_after_other_seconds"]) == pytest.approx(
        encrypting + decrypting, abs=0.002
    )
    assert float(result["ratio_vs_longer"]) == pytest.approx(
        end_to_end / max(encrypting, decrypting), rel=0.01
    )


def test_aggregation_utility_reports_every_setting(tmp_path: Path) -> None:
    plot = tmp_path / "utility.png"
    result = run_benchmark(
        "aggregation_utility.py", "--trials", "2", "--regression-trials", "2", "--plot", str(plot)
    )
    for setting in ("replace_one", "add_remove", "add_remove_bounded"):
        assert 0 < float(result[f"fed_over_central_{setting}"]) < 10
    assert math.isfinite(float(result["r2_fed_bounded"]))
    assert plot.stat().st_size > 0


def test_packing_benchmark_compares_words_with_shifts() -> None:
    result = run_benchmark("packing.py", "--values", "2000", "--repeats", "1")
    assert all(
        float(result[f"{step}_{way}_ms"]) > 0
        for step in ("pack", "unpack")
        for way in ("words", "shifts")
    )
    assert float(result["pack_speedup"]) > 0 and float(result["unpack_speedup"]) > 0


def test_noise_sampler_reports_its_cost_per_value() -> None:
    result = run_benchmark("noise_sampler.py", "--values", "200")
    low, high = float(result["us_per_value_min"]), float(result["us_per_value_max"])
    assert 0 < low <= high
    opendp_low = float(result["opendp_us_per_value_min"])
    assert 0 < opendp_low <= float(result["opendp_us_per_value_max"])
    assert 0 < float(result["speedup_min"]) <= float(result["speedup_max"])
    # 200 draws estimate a standard deviation to about 5 %: these bounds are six
    # standard errors wide, and a sampler that ignored its scale falls far outside.
    assert 0.7 < float(result["sd_over_sigma_min"]) <= float(result["sd_over_sigma_max"]) < 1.3


def test_owner_task_timing_reports_the_dca_ratio_and_the_sampling_step() -> None:
    result = run_benchmark(
        "owner_task_timing.py",
        "--repeats",
        "1",
        "--largest",
        "20000",
        "--most-bins",
        "4096",
        "--residual-scale",
        "10",
    )
    assert float(result["dca_ratio_largest_over_smallest"]) > 0
    assert all(float(us) > 0 for us in result["pca_boundary_us"].split(","))
    assert float(result["histogram_ratio_spread_over_one_bin"]) > 0
    assert float(result["grouped_ratio_full_over_empty"]) > 0
    assert all(float(r) > 0 for r in result["large_histogram_ratios"].split(","))
    assert float(result["wide_file_ratio"]) > 0 and float(result["subnormal_ratio"]) > 0
    assert len(result["sampling_ratios"].split(",")) == 3


def test_owner_encrypt_compares_with_the_published_design_and_the_bare_loop() -> None:
    result = run_benchmark("owner_encrypt.py", "--features", "20", "--published-sample", "5")
    assert float(result["ratio_vs_published"]) > 0
    assert float(result["speedup_over_bare"]) > 0


def test_primitives_reports_the_cost_of_each_operation() -> None:
    result = run_benchmark("primitives.py", "--repeat", "5")
    # Decryption and a full r^n encryption both cost more than a table-driven DJN one.
    assert float(result["decrypt_over_djn_table"]) > 1
    assert float(result["full_over_djn_table"]) > 1


def test_mode_utility_compares_both_modes() -> None:
    result = run_benchmark("mode_utility.py", "--trials", "1", "--epsilons", "1")
    assert result["settings"] == "4"  # four datasets at one epsilon
    mean_gain, min_gain = float(result["mean_gain"]), float(result["min_gain"])
    assert math.isfinite(mean_gain) and mean_gain >= min_gain - 0.0001  # 4 decimals
    # "Better everywhere" must agree with the smallest gain, whichever way it reads
    # (a gain printed as -0.0000 satisfies both sides, as it should).
    if result["stats_better_everywhere"] == "True":
        assert min_gain >= 0
    else:
        assert result["stats_better_everywhere"] == "False" and min_gain <= 0


def test_discrete_gaussian_gap_and_privacy_cost_print_their_summaries() -> None:
    gap = run_benchmark("discrete_gaussian_gap.py")
    assert 0 <= abs(float(gap["max_excess_at_256"])) < 1e-3
    # The proven zCDP conversion is looser than the continuous PLD at the same z.
    assert float(gap["zcdp_epsilon"]) > float(gap["pld_epsilon"]) > 0
    cost = run_benchmark("privacy_cost.py")
    assert 1 < float(cost["pca_sigma_ratio_min"]) <= float(cost["pca_sigma_ratio_max"])


def test_next_query_epsilon_reports_both_accountants() -> None:
    result = run_benchmark("next_query_epsilon.py", "--runs", "1")
    assert float(result["zcdp_seconds_max"]) > 0 and float(result["pld_seconds_max"]) > 0
    assert int(result["checks_max"]) >= 1
