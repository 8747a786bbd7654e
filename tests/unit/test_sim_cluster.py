"""The simulated cluster, end to end, routed by the real Router fed by the workers' KV events."""

import pytest

from kvmesh.router.sim.cluster import SimConfig
from kvmesh.router.sim.metrics import METRICS
from kvmesh.router.sim.run import run

# 8 workers whose caches hold ~15 of the 24 tenants' system prompts: round robin thrashes them,
# routing by cache partitions the tenants. A small cap makes the cap bind under kv_events' affinity.
CONFIG = SimConfig(num_workers=8, kv_blocks=1000, max_batch=8, max_batched_tokens=2048, cap=12, seed=0)
TENANTS = dict(num_tenants=24, system_tokens=1024, suffix_tokens=(32, 256), output_tokens=(8, 64))


@pytest.fixture(scope="module")
def tenants_report():
    return run("tenants", ["round_robin", "kv_events"], CONFIG, num_requests=3000, load=0.9,
               workload_options=TENANTS, keep_results=True)


def test_kv_events_beats_round_robin_on_hit_rate_and_ttft_p99(tenants_report):
    rr, kv = tenants_report["policies"]["round_robin"], tenants_report["policies"]["kv_events"]
    assert kv["hit_rate"] > 1.5 * rr["hit_rate"]
    assert kv["hit_rate"] >= 0.9 * kv["oracle_hit_rate"]
    assert kv["ttft_p99_s"] < 0.5 * rr["ttft_p99_s"]


def test_kv_events_never_leaves_a_worker_idle_while_another_queues_past_its_cap(tenants_report):
    result = tenants_report["results"]["kv_events"]
    assert result.violations == 0
    assert result.peak_outstanding == CONFIG.cap  # the cap was reached (it binds) and never passed


def test_the_router_index_equals_every_worker_cache_after_the_run(tenants_report):
    result = tenants_report["results"]["kv_events"]
    for w in result.workers:
        assert result.router.index.worker_blocks(w.worker_id) == set(w.cache.cached_hashes())
        assert w.outstanding == 0 and w.cache.num_free == w.cache.capacity


def test_every_request_finishes_with_ordered_timestamps(tenants_report):
    for result in tenants_report["results"].values():
        assert len(result.jobs) == 3000
        for job in result.jobs:
            assert job.arrival <= job.first_token_time <= job.finish_time


def test_the_report_has_every_metric_and_the_config(tenants_report):
    for metrics in tenants_report["policies"].values():
        assert set(METRICS) <= set(metrics)
        assert metrics["idle_while_over_cap"] == 0  # ROUTING.md: must be 0
    cfg = tenants_report["config"]
    assert cfg["workers"] == 8 and cfg["workload"] == "tenants" and cfg["load"] == 0.9
    assert cfg["rate_req_s"] == pytest.approx(0.9 * cfg["capacity_req_s"])


def test_a_seeded_run_is_reproducible():
    small = dict(num_tenants=4, system_tokens=256, suffix_tokens=(16, 64), output_tokens=(4, 16))
    a = run("tenants", ["power_of_two"], CONFIG, num_requests=200, load=0.5, workload_options=small)
    b = run("tenants", ["power_of_two"], CONFIG, num_requests=200, load=0.5, workload_options=small)
    timing = {"decision_p50_us", "decision_p99_us", "decision_p999_us", "decision_max_us",
              "decision_cpu_p50_us", "decision_cpu_p99_us", "wall_s"}
    strip = lambda r: {k: v for k, v in r["policies"]["power_of_two"].items() if k not in timing}  # noqa: E731
    assert strip(a) == strip(b)


@pytest.mark.parametrize("workload", ["multiturn", "prefix_repetition", "random"])
def test_every_workload_runs_under_every_policy(workload):
    options = {
        "multiturn": dict(system_tokens=64, first_message_tokens=(16, 64), message_tokens=(8, 32),
                          output_tokens=(4, 16), turns=(2, 3), think_time_s=0.1),
        "prefix_repetition": dict(num_prefixes=3, prefix_tokens=128, suffix_tokens=16, output_tokens=8),
        "random": dict(prompt_tokens=(16, 64), output_tokens=(4, 16)),
    }[workload]
    report = run(workload, ["round_robin", "least_loaded", "power_of_two", "session", "prefix_approx",
                            "kv_events"], SimConfig(num_workers=3, kv_blocks=200, seed=1),
                 num_requests=60, load=0.5, workload_options=options)
    for name, metrics in report["policies"].items():
        assert metrics["requests"] == 60, name
        if workload == "random":
            assert metrics["hit_rate"] == 0.0 and metrics["oracle_hit_rate"] == 0.0
        else:
            assert 0.0 < metrics["hit_rate"] <= metrics["oracle_hit_rate"] + 1e-9, name


def test_kv_events_keeps_every_conversation_on_its_worker_and_hits_at_least_as_often_as_prefix_approx():
    # A small multiturn trace (8 workers, load 0.7): with the stay margin for continuations only, new
    # conversations spread from the start and no follow-up turn leaves its conversation's worker (the
    # previous margin, applied to the shared system prompt too, moved 8 turns here and hit less).
    report = run("multiturn", ["prefix_approx", "kv_events"], SimConfig(num_workers=8, seed=0),
                 num_requests=2000, load=0.7, keep_results=True)
    jobs = {j.request.request_id: j for j in report["results"]["kv_events"].jobs}
    moved = [j for j in jobs.values()
             if j.request.after is not None and jobs[j.request.after].worker_id != j.worker_id]
    assert moved == []
    kv, pa = report["policies"]["kv_events"], report["policies"]["prefix_approx"]
    assert kv["hit_rate"] >= pa["hit_rate"]
    assert kv["ttft_p99_s"] <= pa["ttft_p99_s"]


def test_prefix_approx_remembers_at_most_a_pool_of_blocks_per_worker():
    """docs/ROUTING.md: in the simulator prefix_approx's per-worker history bound is the pool size."""
    report = run("tenants", ["prefix_approx"], CONFIG, num_requests=200, load=0.5,
                 workload_options=TENANTS, keep_results=True)
    assert report["results"]["prefix_approx"].router.policy.max_blocks_per_worker == CONFIG.blocks_per_worker


def test_index_bytes_is_what_the_policy_routes_from():
    """`index_bytes` is the policy's own state (Policy.state_bytes): kv_events' block index,
    prefix_approx's tree (its history bounded by the simulated pool), nothing for round robin."""
    report = run("tenants", ["round_robin", "kv_events", "prefix_approx"], CONFIG, num_requests=300,
                 load=0.5, workload_options=TENANTS, keep_results=True)
    sizes = {name: report["policies"][name]["index_bytes"] for name in report["policies"]}
    assert sizes["round_robin"] == 0 and sizes["kv_events"] > 0 and sizes["prefix_approx"] > 0
    kv, approx = report["results"]["kv_events"], report["results"]["prefix_approx"]
    assert sizes["kv_events"] == kv.router.index.approx_bytes()
    assert sizes["prefix_approx"] == approx.router.policy.tree.approx_bytes()
    assert approx.router.policy.max_blocks_per_worker == CONFIG.blocks_per_worker
