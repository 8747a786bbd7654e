"""`kvmesh sim`: table, JSON and figure; one-line errors."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.router.policies import POLICY_NAMES

SMALL = ["--workers", "2", "--requests", "40", "--kv-blocks", "300", "--no-progress",
         "--workload-opt", "num_tenants=3", "--workload-opt", "system_tokens=128",
         "--workload-opt", "suffix_tokens=(16,32)", "--workload-opt", "output_tokens=(4,8)"]


def test_json_has_every_policy_and_the_config(capsys):
    assert main(["sim", "--policy", "all", "--json", "--load", "0.5", *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["policies"]) == list(POLICY_NAMES)
    assert report["config"]["workers"] == 2 and report["config"]["requests"] == 40
    assert report["policies"]["kv_events"]["requests"] == 40
    # docs/ROUTING.md's defaults of the knobs SMALL leaves alone
    assert {k: report["config"].get(k) for k in ("max_batch", "max_batched_tokens", "cap")} == {
        "max_batch": 128, "max_batched_tokens": 8192, "cap": 256}, report["config"]


def test_table_and_plot(capsys, tmp_path):
    path = tmp_path / "ttft.png"
    assert main(["sim", "--policy", "round_robin,kv_events", "--rate", "20", "--plot", str(path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "round_robin" in out and "kv_events" in out and "ttft p99 ms" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_policy_is_a_one_line_error(capsys):
    assert main(["sim", "--policy", "nope", *SMALL]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_unknown_workload_option_is_a_one_line_error(capsys):
    assert main(["sim", "--workload-opt", "bogus=1", *SMALL[:-8]]) == 2
    assert "bogus" in capsys.readouterr().err


def test_load_and_rate_are_exclusive():
    with pytest.raises(SystemExit):
        main(["sim", "--load", "0.5", "--rate", "3", *SMALL])


def test_a_plot_into_a_missing_folder_is_refused_before_the_run(capsys, tmp_path):
    assert main(["sim", "--workers", "2", "--requests", "20", "--no-progress",
                 "--plot", str(tmp_path / "no-such-dir" / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "its folder does not exist" in err
