"""python -m kvmesh.router.sim.decisions: one fresh process per run, a row of decision figures each;
--profile times the decision's phases (a benchmark: these tests check what it reports, not how fast)."""

import json

import pytest

from kvmesh.router.sim.decisions import main, profile


def test_each_run_reports_its_decision_figures_hit_rate_and_ttft(capsys):
    assert main(["--workers", "4,8", "--workloads", "tenants", "--seeds", "1-1", "--requests", "150",
                 "--jobs", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["workers"], r["workload"], r["seed"]) for r in rows] == [(4, "tenants", 1), (8, "tenants", 1)]
    for r in rows:
        assert 0 < r["decision_p50_us"] <= r["decision_p99_us"] <= r["decision_max_us"]
        assert 0 < r["decision_cpu_p50_us"] <= r["decision_cpu_p99_us"]
        assert 0 < r["hit_rate"] < 1 and r["ttft_p99_s"] > 0 and r["loadavg_1m"] >= 0


def test_profile_times_every_decision_and_the_work_between():
    result = profile(8, "multiturn", 1, 150, 0.7)
    phases = result["phases"]
    assert phases["decision (Router.route_request)"]["calls"] == 150
    assert phases["index walk (KVIndex.levels)"]["per_decision"] == 1.0
    assert phases["between: load updates (update_load)"]["calls"] > 150


def test_unknown_workload_is_named():
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        main(["--workloads", "chat"])
