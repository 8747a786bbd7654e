"""`kvmesh bench serve`'s pieces that need no cluster: the seeded trace and the summary."""

import argparse

import pytest

from kvmesh.bench import serve


def parse(*argv):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_trace_is_the_simulators_seeded_tenants_workload():
    args = parse("--rate", "4", "--num-requests", "30", "--num-tenants", "5", "--system-tokens", "64",
                 "--suffix-tokens", "8", "16", "--output-tokens", "4", "8")
    a, b = serve.build_trace(args, rate=4), serve.build_trace(args, rate=4)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(64 + 8 <= r.prompt_len <= 64 + 16 and 4 <= r.output_len <= 8 for r in a.requests)
    assert len({r.group for r in a.requests}) <= 5
    arrivals = [r.arrival for r in a.requests]
    assert arrivals == sorted(arrivals) and 3.0 < len(arrivals) / arrivals[-1] < 8.0  # ~4 req/s


def test_summary_percentiles_throughput_and_hit_rate():
    def result(sent, times, prompt, cached, out):
        return {"status": 200, "sent": sent, "end": times[-1], "token_times": times,
                "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    rows = [result(0.0, [0.1, 0.2, 0.3], 100, 50, 3), result(1.0, [1.3, 1.5], 100, 0, 2),
            {"status": 429, "sent": 2.0, "end": 2.0, "token_times": [], "usage": None},
            result(3.0, [3.1, 3.5], 100, 0, 5)]  # 5 tokens in 2 chunks: TPOT 0.4 s / 4 tokens
    s = serve.summarize(rows, duration=2.0)
    assert (s["requests"], s["ok"]) == (4, 3)
    assert s["ttft_p50_s"] == pytest.approx(0.1)
    assert s["tpot_p50_s"] == pytest.approx(0.1)  # of 0.1, 0.2 and 0.1
    assert s["output_tokens_per_s"] == pytest.approx(5.0)
    assert s["prefix_hit_rate"] == pytest.approx(50 / 300)


def test_the_urgent_class_is_a_seeded_share_of_the_requests():
    args = parse("--rate", "4", "--num-requests", "400")
    requests = serve.build_trace(args, rate=4).requests
    urgent = serve.urgent_requests(requests, 0.25, seed=0)
    assert urgent == serve.urgent_requests(requests, 0.25, seed=0)
    assert urgent != serve.urgent_requests(requests, 0.25, seed=1)
    assert 60 < len(urgent) < 140 and urgent <= {r.request_id for r in requests}
    assert serve.urgent_requests(requests, 0.0, seed=0) == set()
    with pytest.raises(ValueError, match=r"--urgent-share must be in \[0, 1\], got 1.5"):
        serve.run(parse("--rate", "1", "--urgent-share", "1.5"))


def test_the_summary_splits_latencies_by_class_when_some_requests_are_urgent():
    def result(sent, times, urgent):
        return {"status": 200, "sent": sent, "end": times[-1], "token_times": times, "urgent": urgent,
                "usage": {"prompt_tokens": 10, "completion_tokens": len(times),
                          "prompt_tokens_details": {"cached_tokens": 0}}}

    rows = [result(0.0, [0.1, 0.2], True), result(0.0, [0.9, 1.2], False), result(1.0, [1.05, 1.1], True),
            {"status": 429, "sent": 2.0, "end": 2.0, "token_times": [], "usage": None, "urgent": False}]
    s = serve.summarize(rows, duration=2.0)
    assert s["classes"]["urgent"]["ttft_p50_s"] == pytest.approx(0.075)
    assert (s["classes"]["urgent"]["ok"], s["classes"]["urgent"]["requests"]) == (2, 2)
    assert s["classes"]["normal"]["ttft_p50_s"] == pytest.approx(0.9)
    assert (s["classes"]["normal"]["ok"], s["classes"]["normal"]["requests"]) == (1, 2)
    assert s["classes"]["normal"]["tpot_p50_s"] == pytest.approx(0.3)
    assert "classes" not in serve.summarize([{**r, "urgent": False} for r in rows], duration=2.0)


def test_a_load_shape_is_required():
    with pytest.raises(ValueError, match="--rate"):
        serve.run(parse())


def test_cluster_processes_are_told_apart_by_their_command_lines():
    assert serve.role_of("ray::ProxyActor") == "proxy"
    assert serve.role_of("ray::ServeReplica:kvmesh:Ingress") == "ingress"
    assert serve.role_of("ray::ServeReplica:kvmesh:KVWorker") == "worker actor"
    assert serve.role_of("/usr/bin/python3 -m kvmesh.cluster.engine_process 17") == "engine"
    assert serve.role_of("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x") == "ray"
    assert serve.role_of("ray::KVEventHub") == "kv event hub"
    assert serve.role_of("python -m pytest") is None


def test_sample_summary_takes_step_times_over_each_interval():
    def at(t, running, waiting, steps, seconds):
        return {"t": t, "workers": {"w": {"running": running, "waiting": waiting, "kv_used": 0.1,
                                          "steps": steps, "step_seconds": seconds}}}

    samples = [at(0, 2, 0, 100, 1.0), at(1, 6, 3, 200, 2.0), at(2, 4, 1, 250, 3.0), at(3, 0, 0, 250, 3.0)]
    s = serve.sample_summary(samples)["w"]
    # intervals: 100 steps in 1.0 s (10 ms), 50 in 1.0 s (20 ms), none (idle: no step time)
    assert s["step_ms_p50"] == pytest.approx(15.0) and s["step_ms_max"] == pytest.approx(20.0)
    assert (s["running_p50"], s["running_max"], s["waiting_max"]) == (3.0, 6, 3)
    # 2.0 s inside Engine.step over the 3 s sampled; 3 running on average
    assert s["stepping_share"] == pytest.approx(2.0 / 3) and s["running_mean"] == pytest.approx(3.0)


def test_a_runs_step_time_is_taken_over_the_run_not_since_the_worker_started():
    # a sweep runs several rates on one cluster: the second run's step time is its own
    before = {"w": {"requests": 10, "tokens_out": 500, "preempted": 0, "steps": 1000, "step_seconds": 5.0,
                    "step_ms": 5.0, "hit_rate": 0.5}}
    after = {"w": {"requests": 30, "tokens_out": 2500, "preempted": 2, "steps": 1500, "step_seconds": 10.0,
                   "step_ms": 6.667, "hit_rate": 0.6}}
    d = serve._worker_deltas(before, after)["w"]
    assert (d["requests"], d["tokens_out"], d["preempted"]) == (20, 2000, 2)
    assert d["step_ms"] == pytest.approx(10.0)  # 5 s over 500 steps, not the 6.7 ms since start
