"""The simulator's cluster routing (router/sim/copies.py): N RoutingState copies in turn, fed late
through an EventLog; and, with it off, the simulator exactly as before."""

import dataclasses
import json

import numpy as np
import pytest

from kvmesh.router.routing_state import RoutingState
from kvmesh.hashing import block_hashes
from kvmesh.router.sim.calibration import CostModel
from kvmesh.router.sim.cluster import SimConfig, simulate
from kvmesh.router.sim.copies import RouterCopies
from kvmesh.router.sim.run import run
from kvmesh.router.sim.worker import Job, SimWorker
from kvmesh.router.sim.workloads import SimRequest, assign_arrivals, make_workload

B = 16
CONFIG = SimConfig(num_workers=3, kv_blocks=400, max_batch=8, max_batched_tokens=2048, cap=12, seed=3)
SMALL = dict(num_tenants=6, system_tokens=512, suffix_tokens=(16, 128), output_tokens=(4, 32))


def per_worker(result):
    counts = {}
    for job in result.jobs:
        counts[job.worker_id] = counts.get(job.worker_id, 0) + 1
    return counts


def test_with_the_option_off_a_trace_routes_exactly_as_before_the_option_existed():
    # Recorded from the simulator at the commit before router_copies was added.
    report = run("tenants", ["kv_events", "round_robin"], CONFIG, num_requests=300, load=0.8,
                 workload_options=SMALL, keep_results=True)
    kv, rr = report["results"]["kv_events"], report["results"]["round_robin"]
    assert per_worker(kv) == {"worker-0": 117, "worker-1": 99, "worker-2": 84}
    assert sum(j.cached_tokens for j in kv.jobs) == 149504
    assert max(j.finish_time for j in kv.jobs) == pytest.approx(0.330543113025669, rel=1e-12)
    assert per_worker(rr) == {"worker-0": 100, "worker-1": 100, "worker-2": 100}
    assert sum(j.cached_tokens for j in rr.jobs) == 144384
    assert max(j.finish_time for j in rr.jobs) == pytest.approx(0.3309881775583779, rel=1e-12)
    assert "router_copies" not in report["config"]


def test_with_router_copies_every_request_of_a_trace_is_served():
    config = dataclasses.replace(CONFIG, router_copies=2, report_interval_s=0.05, event_delay_s=0.02)
    workload = make_workload("tenants", 300, seed=3, block_size=B, **SMALL)
    assign_arrivals(workload, 900.0)
    result = simulate(workload, "kv_events", config)
    assert len(result.jobs) == 300 and len(result.decision_ns) == 300
    for job in result.jobs:
        assert job.arrival <= job.first_token_time <= job.finish_time
    for w in result.workers:
        assert w.outstanding == 0 and w.cache.num_free == w.cache.capacity


def test_a_seeded_run_with_router_copies_is_reproducible():
    # kv_events breaks ties at random: each copy's generator is seeded from the config.
    config = dataclasses.replace(CONFIG, router_copies=2, event_delay_s=0.02)
    runs = []
    for _ in range(2):
        workload = make_workload("tenants", 300, seed=3, block_size=B, **SMALL)
        assign_arrivals(workload, 900.0)
        result = simulate(workload, "kv_events", config)
        runs.append([(j.worker_id, j.first_token_time, j.finish_time) for j in result.jobs])
    assert runs[0] == runs[1]


def test_the_cli_config_names_the_router_copies():
    config = dataclasses.replace(CONFIG, router_copies=2, event_delay_s=0.01)
    report = run("tenants", ["round_robin"], config, num_requests=50, load=0.5, workload_options=SMALL)
    assert report["config"]["router_copies"] == 2 and report["config"]["event_delay_s"] == 0.01
    assert report["policies"]["round_robin"]["requests"] == 50


def test_a_custom_routing_state_class_routes_the_trace():
    calls = []

    class Counting(RoutingState):
        def rank(self, *args, **kwargs):
            calls.append(self)
            return super().rank(*args, **kwargs)

    config = dataclasses.replace(CONFIG, router_copies=2)
    workload = make_workload("tenants", 40, seed=3, block_size=B, **SMALL)
    assign_arrivals(workload, 100.0)
    simulate(workload, "kv_events", config, routing_state=Counting)
    assert len(calls) == 40 and len(set(map(id, calls))) == 2  # both copies, in turn
    assert calls[0] is calls[2] and calls[0] is not calls[1]


def test_a_requests_end_reaches_the_copy_that_routed_it():
    # ROUTING.md: the simulated copies hear each end at once, as the ingress tells its own copy
    copies, ended = [], []

    class Recording(RoutingState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            copies.append(self)

        def finished(self, request_id, computed=True):
            heard = super().finished(request_id, computed)
            if heard:
                ended.append((id(self), request_id))
            return heard

    config = dataclasses.replace(CONFIG, router_copies=2)
    workload = make_workload("tenants", 40, seed=3, block_size=B, **SMALL)
    assign_arrivals(workload, 100.0)
    simulate(workload, "kv_events", config, routing_state=Recording)
    assert len(copies) == 2
    assert sorted(rid for _, rid in ended) == sorted(r.request_id for r in workload.requests)
    assert all(not copy.finished(r.request_id) for copy in copies for r in workload.requests)  # none left


@pytest.mark.parametrize("bad", [dict(router_copies=-1), dict(router_copies=1, report_interval_s=0),
                                 dict(event_delay_s=-0.1)])
def test_bad_router_copy_settings_are_refused(bad):
    with pytest.raises(ValueError):
        dataclasses.replace(CONFIG, **bad)


# ---- RouterCopies, step by step -------------------------------------------------------------------

def workers(n=2):
    return [SimWorker(f"w{i}", CostModel(), capacity_blocks=200, max_batch=8, max_batched_tokens=1024)
            for i in range(n)]


def sim_request(rid, prompt_len=160, output_len=8):
    tokens = np.random.default_rng(rid).integers(0, 1000, prompt_len + output_len).astype(np.int32)
    return SimRequest(request_id=rid, tokens=tokens, prompt_len=prompt_len, output_len=output_len,
                      hashes=np.array(block_hashes(tokens, B), dtype=np.uint64))


def test_requests_reach_the_copies_in_turn_each_with_its_own_round_robin():
    copies = RouterCopies(dataclasses.replace(CONFIG, router_copies=2), "round_robin", workers())
    chosen = [copies.route([], 100, None, now=0.0)[0] for _ in range(4)]
    assert chosen == ["w0", "w0", "w1", "w1"]  # copy A: w0, w1; copy B: w0, w1, interleaved


def test_a_burst_between_two_reports_is_spread_by_the_copy_s_own_count():
    config = dataclasses.replace(CONFIG, router_copies=1, report_interval_s=1.0)
    copies = RouterCopies(config, "least_loaded", workers())
    chosen = [copies.route([], 100, None, now=0.001 * k)[0] for k in range(6)]
    # No report since time 0 (both idle): only the copy's own count tells the workers apart, so
    # each pair of requests goes one to each (ties are broken at random).
    assert [set(chosen[k:k + 2]) for k in (0, 2, 4)] == [{"w0", "w1"}] * 3
    for wid in ("w0", "w1"):
        load = copies.copies[0].router.worker_state(wid).load
        assert load.waiting == 3 and load.timestamp == 0.0  # counted by the copy, not reported


def test_a_step_s_kv_events_reach_the_copies_event_delay_later():
    config = dataclasses.replace(CONFIG, router_copies=2, report_interval_s=1.0, event_delay_s=0.02)
    pool = workers()
    copies = RouterCopies(config, "kv_events", pool)
    request = sim_request(1)
    w0 = pool[0]
    w0.submit(Job(request=request, arrival=0.0), 0.0)
    end = w0.step_end
    w0.on_step_end(end)  # the prompt (10 full blocks) is computed and stored
    copies.on_step_end(w0, end)
    prompt = request.hashes[:10].tolist()
    for state in copies.copies:
        assert state.router.index.overlap(prompt, ["w0"]).get("w0", 0) == 0
    assert copies.next_time() == pytest.approx(end + 0.02)
    copies.fire()
    for state in copies.copies:
        assert state.router.index.overlap(prompt, ["w0"])["w0"] == 10


def test_loads_reach_the_copies_only_at_each_report():
    config = dataclasses.replace(CONFIG, router_copies=2, report_interval_s=0.05, event_delay_s=0.0)
    pool = workers()
    copies = RouterCopies(config, "least_loaded", pool)
    pool[1].submit(Job(request=sim_request(2), arrival=0.01), 0.01)
    assert copies.copies[1].router.worker_state("w1").load.running == 0
    assert copies.next_time() == pytest.approx(0.05)
    copies.fire()  # the report is sampled at 0.05 ...
    copies.fire()  # ... and delivered (no delay) at 0.05
    for state in copies.copies:
        load = state.router.worker_state("w1").load
        assert load.running + load.waiting == 1 and load.timestamp == pytest.approx(0.05)
    assert copies.next_time() == pytest.approx(0.10)


def test_the_sim_command_takes_the_router_copy_flags(capsys):
    from kvmesh.cli import main

    small = ["--workers", "2", "--requests", "40", "--kv-blocks", "300", "--no-progress",
             "--workload-opt", "num_tenants=3", "--workload-opt", "system_tokens=128",
             "--workload-opt", "suffix_tokens=(16,32)", "--workload-opt", "output_tokens=(4,8)"]
    assert main(["sim", "--policy", "kv_events", "--json", "--load", "0.5", "--router-copies", "2",
                 "--report-interval-s", "0.02", "--event-delay-s", "0.01", "--loads-with-events",
                 *small]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k: report["config"][k] for k in ("router_copies", "report_interval_s", "event_delay_s",
                                             "loads_with_events")} == {
        "router_copies": 2, "report_interval_s": 0.02, "event_delay_s": 0.01, "loads_with_events": True}
    assert report["policies"]["kv_events"]["requests"] == 40
    assert main(["sim", "--router-copies", "-1", *small]) == 2  # one-line error


def test_the_copies_hear_loads_on_simulated_time_and_never_go_stale():
    config = dataclasses.replace(CONFIG, router_copies=2, report_interval_s=0.05)
    copies = RouterCopies(config, "kv_events", workers())
    copies.fire()  # the report sampled at 0.05 ...
    copies.fire()  # ... delivered at 0.05
    for state in copies.copies:
        assert state.router.worker_state("w0").reported_at == pytest.approx(0.05)
        assert state.stale_workers(now=1e9) == set()  # silence is not measured in a simulation


def test_a_worker_at_the_cap_passes_the_request_to_the_next_in_the_copy_s_order():
    """docs/ROUTING.md: Serve's spill-over at --cap (a replica at max_ongoing_requests rejects,
    the next in the copy's order is tried), though round robin puts w0 first every other time."""
    pool = workers()
    copies = RouterCopies(dataclasses.replace(CONFIG, router_copies=1, cap=1), "round_robin", pool)
    pool[0].submit(Job(request=sim_request(1), arrival=0.0), 0.0)  # w0 at the cap, unreported
    assert [copies.route([], 100, None, now=0.0)[0] for _ in range(2)] == ["w1", "w1"]
