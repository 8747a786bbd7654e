"""`kvmesh sim --seeds`: the 95% t-interval, the paired difference, seed specs, and a tiny run."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.router.sim.stats import interval, paired_differences, parse_seeds, t975

SMALL = ["--workers", "2", "--requests", "200", "--kv-blocks", "300", "--no-progress",
         "--workload-opt", "num_tenants=3", "--workload-opt", "system_tokens=128",
         "--workload-opt", "suffix_tokens=(16,32)", "--workload-opt", "output_tokens=(4,8)"]


def test_interval_of_known_data():
    # mean 3, sample sd sqrt(2.5), t_{0.975,4} = 2.776: half-width 2.776 * 1.5811 / sqrt(5) = 1.963
    iv = interval([1, 2, 3, 4, 5])
    assert iv["mean"] == 3 and iv["n"] == 5
    assert iv["lo"] == pytest.approx(3 - 1.963, abs=1e-3) and iv["hi"] == pytest.approx(3 + 1.963, abs=1e-3)


def test_interval_of_one_value_or_constant_data_is_a_point():
    assert interval([7.0]) == {"mean": 7.0, "lo": 7.0, "hi": 7.0, "n": 1}
    iv = interval([2.0] * 10)
    assert iv["lo"] == iv["hi"] == 2.0
    with pytest.raises(ValueError, match="at least one"):
        interval([])


def test_t_quantile_past_the_table_approaches_the_normal():
    assert t975(9) == 2.262
    assert t975(40) == pytest.approx(2.0211, abs=1e-3) and t975(120) == pytest.approx(1.9799, abs=1e-3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)


def test_paired_difference_cancels_the_seed_to_seed_variance():
    # The seeds differ by a lot; "a" is always exactly 1 above kv_events: a zero-width paired interval,
    # while the two policies' own intervals overlap.
    per_seed = [{"policies": {"a": {"m": base + 1}, "kv_events": {"m": base}}} for base in (10, 50, 90)]
    paired = paired_differences(per_seed, ["m"])
    assert paired == {"a": {"m": {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 3}}}
    assert interval([11, 51, 91])["lo"] < interval([10, 50, 90])["hi"]
    assert paired_differences(per_seed, ["m"], reference="missing") == {}


@pytest.mark.parametrize("spec, seeds", [("0-9", list(range(10))), ("0,3,5", [0, 3, 5]), ("4", [0, 1, 2, 3]),
                                         ("100-102,7", [100, 101, 102, 7]), (" 2-2 ", [2])])
def test_seed_specs(spec, seeds):
    assert parse_seeds(spec) == seeds


@pytest.mark.parametrize("spec, message", [("0", "count must be >= 1"), ("5-2", "runs backwards"),
                                           ("1,1", "twice"), ("a-b", "a count"), ("1-", "a count"),
                                           ("", "a count")])
def test_bad_seed_specs_name_the_flag(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_seeds(spec)


def test_bad_seed_spec_is_a_one_line_cli_error(capsys):
    assert main(["sim", "--seeds", "3-1", *SMALL]) == 2
    assert "--seeds: range '3-1' runs backwards" in capsys.readouterr().err


def test_seed_and_seeds_are_exclusive():
    with pytest.raises(SystemExit):
        main(["sim", "--seed", "1", "--seeds", "0-2", *SMALL])


def test_json_over_three_seeds_has_per_seed_values_summary_and_paired(capsys):
    assert main(["sim", "--seeds", "0-2", "--policy", "round_robin,kv_events", "--json", *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seeds"] == [0, 1, 2]
    assert [r["config"]["seed"] for r in report["per_seed"]] == [0, 1, 2]
    assert all(r["policies"]["kv_events"]["requests"] == 200 for r in report["per_seed"])
    p99 = [r["policies"]["round_robin"]["ttft_p99_s"] for r in report["per_seed"]]
    assert len(set(p99)) > 1  # each seed is its own trace
    summary = report["summary"]["round_robin"]["ttft_p99_s"]
    assert summary == interval(p99)
    diffs = [r["policies"]["round_robin"]["hit_rate"] - r["policies"]["kv_events"]["hit_rate"]
             for r in report["per_seed"]]
    assert report["paired"]["round_robin"]["hit_rate"] == pytest.approx(interval(diffs))
    assert list(report["paired"]) == ["round_robin"]


def test_table_and_interval_plot(capsys, tmp_path):
    path = tmp_path / "p99.png"
    assert main(["sim", "--seeds", "0,5", "--policy", "round_robin,kv_events", "--plot", str(path),
                 *SMALL, "--requests", "40"]) == 0  # the last --requests wins
    out = capsys.readouterr().out
    assert "2 seeds (0,5); mean [95% t-interval]" in out
    assert "minus kv_events, paired by seed" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seeds_in_parallel_processes_give_the_same_reports(capsys):
    """`--jobs 2` runs the seeds in child processes: every simulated quantity equals the sequential
    run's (decision times and the run's wall time are clock readings and differ)."""
    args = ["sim", *SMALL, "--policy", "kv_events,round_robin", "--seeds", "0-2", "--json"]

    def reports(extra):
        assert main(args + extra) == 0
        out = json.loads(capsys.readouterr().out)
        return [{p: {k: v for k, v in m.items() if not k.startswith(("decision", "wall"))}
                 for p, m in r["policies"].items()} for r in out["per_seed"]], out["seeds"]

    sequential, seeds = reports([])
    parallel, parallel_seeds = reports(["--jobs", "2"])
    assert seeds == parallel_seeds == [0, 1, 2]
    assert parallel == sequential
    assert sequential[0] != sequential[1]  # the seeds are different traces


@pytest.mark.parametrize("extra, message", [(["--jobs", "0", "--seeds", "2"], "--jobs must be >= 1"),
                                            (["--jobs", "2"], "give --seeds too")])
def test_bad_jobs_name_the_flag(extra, message, capsys):
    assert main(["sim", *SMALL, *extra]) != 0
    assert message in capsys.readouterr().err
