"""Claims of docs/METRICS.md (and one of docs/ROUTING.md) on a live cluster that no other test would
catch if they stopped being true: one CPU worker with a KV pool of 24 blocks, one ingress replica,
over HTTP on 127.0.0.1.

- ROUTING.md "Router copies": the cluster's request router applies router/gc_tuning.py's collector
  settings when it starts, in the ingress process that holds the router copy (read from that
  process through Ray's `__ray_call__`, as reliability_support.worker_pids does);
- `kvmesh_ingress_rss_bytes`: the resident memory of the ingress replica's process, no labels;
- `kvmesh_router_index_blocks`: the block hashes of that ingress's router copy of the KV index,
  bounded by the workers' KV pools, no labels;
- the token counters: prompt, output and cached (`usage.prompt_tokens_details.cached_tokens`)
  tokens of successful requests, under both names, and `status="200"` for each of them, streamed
  or not;
- `kvmesh_kv_usage_ratio` / `kvmesh_kv_free_blocks`: cached blocks no request holds count as free;
- `kvmesh_prefix_hit_rate`: a worker's cached / prompt tokens since it started (with one worker:
  the cluster's cached / prompt counters), `kvmesh_worker_requests` the requests it accepted;
- "a worker reports its load ... at least every second when idle": the load reports the KV event
  hub holds, read twenty times a second for four seconds of idleness.
"""

import json
import subprocess
import sys
import time

import psutil
import pytest

from cluster_support import MODEL, config_cluster, cpu_config
from reliability_support import http, metrics, per_worker, wait_until

from kvmesh.cluster.local import loopback_ray_env
from kvmesh.router.gc_tuning import ROUTING_GC_THRESHOLDS

pytestmark = pytest.mark.slow

BLOCK = 16
POOL_BLOCKS = 24
# tiny-llama: 2 layers x 1 KV head x 16 dims x K,V x fp32 = 256 B per token
KV_BYTES = POOL_BLOCKS * BLOCK * 256
# routing.policy_options, not the defaults (8,192 and 4,096), to see them reach the router copy
POLICY_OPTIONS = {"weights": {"stay_margin": 4096}, "pending_requests": 1000}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = cpu_config(engine={"kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 4},
                        routing={"policy_options": POLICY_OPTIONS})
    with config_cluster(tmp_path_factory, config) as c:
        yield c


_INGRESS_STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="serve", logging_level="ERROR")

def state(replica):
    import gc, os
    from kvmesh.cluster import router_copies
    copies = [c for c in router_copies.ROUTER_COPIES if hasattr(c, "state")]
    policy = copies[0].state.router.policy if copies else None
    return {"pid": os.getpid(), "gc_threshold": list(gc.get_threshold()),
            "gc_frozen": gc.get_freeze_count(), "router_copies": len(router_copies.ROUTER_COPIES),
            "stay_margin": policy.weights.stay_margin if policy else None,
            "pending_requests": policy.pending.max_requests if policy else None,
            "unended": sum(len(c.state._routed) for c in copies),
            "computed": sum(1 for c in copies for _, _, done in c.state.router.policy.pending._records.values() if done),
            "router_worker_ids": sorted(copies[0].state.router.worker_ids()) if copies else None}

actors = ray.util.list_named_actors(all_namespaces=True)
for a in actors:
    if "#Ingress#" in a["name"]:
        actor = ray.get_actor(a["name"], namespace=a["namespace"])
        found = ray.get(actor.__ray_call__.remote(state), timeout=60)
        found["worker_actor_names"] = sorted(b["name"] for b in actors if "#KVWorker#" in b["name"])
        print(json.dumps(found), flush=True)
"""


def ingress_state(cluster) -> list[dict]:
    """Each ingress replica's process id, collector thresholds, frozen object count and router
    copies, asked of the replica actor by a driver in a separate process (Ray reads its loopback
    setting at import)."""
    done = subprocess.run([sys.executable, "-c", _INGRESS_STATE, cluster.ray_address],
                          capture_output=True, text=True, env=loopback_ray_env(), timeout=180, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def complete(cluster, prompt_ids, max_tokens=4, stream=False):
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if not stream:
        status, answer, _ = http(cluster.http_url + "/v1/completions", body)
        assert status == 200, answer
        return answer["usage"]
    import urllib.request

    body.update(stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(cluster.http_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


def prompt(seed: int, blocks: int) -> list[int]:
    """`blocks` full blocks of token ids (tiny-llama's vocabulary is 512), distinct per seed."""
    return [5 + (seed * 37 + i * 11) % 500 for i in range(blocks * BLOCK)]


def one(found: dict, name: str) -> float:
    """A metric documented with no labels: its one sample, named without braces."""
    assert not any(k.startswith(name + "{") for k in found), [k for k in found if k.startswith(name)]
    return found[name]


def idle(cluster) -> dict:
    """/metrics once the worker's last report shows nothing running or waiting."""
    def check():
        found = metrics(cluster.http_url)
        busy = (sum(per_worker(found, "kvmesh_running_requests").values())
                + sum(per_worker(found, "kvmesh_queue_depth").values()))
        return found if per_worker(found, "kvmesh_running_requests") and busy == 0 else None
    return wait_until(check, 30, what="an idle worker reported")


def test_the_ingress_process_holding_the_router_copy_runs_with_the_routing_gc_settings(cluster):
    """ROUTING.md: the cluster's request router (cluster/request_router.py initialize_state)
    applies tune_gc_for_routing when it starts: the collector's thresholds are 100,000 / 50 / 100
    in the ingress process that holds the copy. (Its gc.freeze is not asserted: a Serve replica's
    heap is frozen with or without the tuning, so a count of frozen objects tells nothing.)"""
    complete(cluster, prompt(0, 2), max_tokens=1)  # the copy exists (made at the ingress's warm-up)
    states = ingress_state(cluster)
    assert len(states) == 1 and states[0]["router_copies"] >= 1, states
    assert tuple(states[0]["gc_threshold"]) == ROUTING_GC_THRESHOLDS == (100_000, 50, 100), states


def test_the_router_copy_hears_each_request_end_from_the_ingress(cluster):
    """ROUTING.md "Router copies": the ingress tells the copy that routed a request of its end, in
    the same process (cluster/router_copies.py): once the answers are back, the copy waits on no
    request it routed, and the prefixes of the finished ones are marked computed."""
    for seed in (41, 42):
        complete(cluster, prompt(seed, 3), max_tokens=2)
    complete(cluster, prompt(43, 3), max_tokens=2, stream=True)
    states = ingress_state(cluster)
    assert len(states) == 1 and states[0]["unended"] == 0, states
    assert states[0]["computed"] >= 3, states


def test_the_router_copy_s_policy_takes_routing_policy_options(cluster):
    """docs/ROUTING.md: routing.policy_options reach the policy of the cluster's router copy."""
    complete(cluster, prompt(0, 2), max_tokens=1)
    (state,) = ingress_state(cluster)
    assert (state["stay_margin"], state["pending_requests"]) == (4096, 1000), state


def test_ingress_rss_bytes_is_the_ingress_process_s_resident_memory(cluster):
    (state,) = ingress_state(cluster)
    reported = one(metrics(cluster.http_url), "kvmesh_ingress_rss_bytes")
    actual = psutil.Process(state["pid"]).memory_info().rss
    assert actual * 0.8 <= reported <= actual * 1.25, (reported, actual)


def test_router_index_blocks_counts_the_copy_s_hashes_bounded_by_the_workers_pool(cluster):
    idle(cluster)
    complete(cluster, prompt(1, 5), max_tokens=1)  # 5 full prompt blocks stored on the worker
    wait_until(lambda: one(metrics(cluster.http_url), "kvmesh_router_index_blocks") >= 5, 30,
               what="the router copy indexed the prompt's 5 blocks")
    for seed in range(2, 12):  # 50 distinct prompt blocks through a pool of 24: most are evicted
        complete(cluster, prompt(seed, 5), max_tokens=1)
    time.sleep(1.5)  # the last batches reach the copy (a worker publishes within its report interval)
    idle(cluster)
    blocks = one(metrics(cluster.http_url), "kvmesh_router_index_blocks")
    assert 5 <= blocks <= POOL_BLOCKS, blocks


def test_token_counters_are_the_successful_answers_usage_under_both_names(cluster):
    before = idle(cluster)
    shared = prompt(100, 6)
    usages = [complete(cluster, shared), complete(cluster, shared),  # the second hits the cache
              complete(cluster, shared + prompt(101, 1), max_tokens=6, stream=True),
              complete(cluster, prompt(102, 3), max_tokens=3, stream=True)]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0, usages
    after = metrics(cluster.http_url)

    def delta(name: str, label: str = "model") -> float:
        key = f'{name}{{{label}="{MODEL}"}}'
        return after[key] - before[key]

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    output_tokens = sum(u["completion_tokens"] for u in usages)
    cached_tokens = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    ok = f'kvmesh_requests_total{{model="{MODEL}",status="200"}}'
    assert after[ok] - before[ok] == len(usages)  # streamed or not
    assert {"prompt": delta("kvmesh_prompt_tokens_total"),
            "output": delta("kvmesh_generation_tokens_total"),
            "cached": delta("kvmesh_cached_prompt_tokens_total")} == {
        "prompt": prompt_tokens, "output": output_tokens, "cached": cached_tokens}
    assert {"prompt": delta("vllm:prompt_tokens_total", "model_name"),
            "output": delta("vllm:generation_tokens_total", "model_name"),
            "queries": delta("vllm:prefix_cache_queries_total", "model_name"),
            "hits": delta("vllm:prefix_cache_hits_total", "model_name"),
            "per request": delta("vllm:request_prompt_tokens_sum", "model_name"),
            "requests": delta("vllm:request_prompt_tokens_count", "model_name")} == {
        "prompt": prompt_tokens, "output": output_tokens, "queries": prompt_tokens,
        "hits": cached_tokens, "per request": prompt_tokens, "requests": len(usages)}


def test_cached_blocks_no_request_holds_count_as_free(cluster):
    held = prompt(200, 4)
    complete(cluster, held, max_tokens=1)
    found = idle(cluster)
    free = per_worker(found, "kvmesh_kv_free_blocks")
    usage = per_worker(found, "kvmesh_kv_usage_ratio")
    assert list(free.values()) == [POOL_BLOCKS] and list(usage.values()) == [0.0], (free, usage)
    assert [v for k, v in found.items() if k.startswith("vllm:kv_cache_usage_perc{")] == [0.0]
    # ... and the blocks counted free above are still cached: the same prompt hits them
    assert complete(cluster, held, max_tokens=1)["prompt_tokens_details"]["cached_tokens"] >= 3 * BLOCK


def test_a_worker_s_prefix_hit_rate_is_its_cached_over_prompt_tokens(cluster):
    """With one worker and only successful requests, the worker's gauges since it started match
    the ingress's counters: hit rate = cached / prompt tokens, requests accepted = answered."""
    complete(cluster, prompt(300, 3), max_tokens=1)
    complete(cluster, prompt(300, 3), max_tokens=1)

    def matched():
        found = metrics(cluster.http_url)
        cached = found[f'kvmesh_cached_prompt_tokens_total{{model="{MODEL}"}}']
        prompt_tokens = found[f'kvmesh_prompt_tokens_total{{model="{MODEL}"}}']
        answered = found[f'kvmesh_requests_total{{model="{MODEL}",status="200"}}']
        rate = per_worker(found, "kvmesh_prefix_hit_rate")
        accepted = per_worker(found, "kvmesh_worker_requests")
        ok = (len(rate) == 1 and list(rate.values())[0] == pytest.approx(cached / prompt_tokens, abs=1e-9)
              and list(accepted.values()) == [answered])
        return ok or None

    # workers publish their counters about once a second
    wait_until(matched, 20, interval_s=0.5, what="hit rate = cached / prompt tokens")


_IDLE_REPORTS = """
import json, sys, time, ray
ray.init(address=sys.argv[1], namespace="serve", logging_level="ERROR")
hub = ray.get_actor("kvmesh-kv-events-kvmesh", namespace="serve")
stamps = set()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    loads, _ = ray.get(hub.loads.remote(), timeout=30)
    stamps |= {(w, load.timestamp, load.running + load.waiting) for w, load in loads.items()}
    time.sleep(0.05)
print(json.dumps(sorted(stamps)))
"""


def test_an_idle_worker_reports_its_load_at_least_every_second(cluster):
    idle(cluster)
    watch_s = 4.0
    started = time.time()
    done = subprocess.run([sys.executable, "-c", _IDLE_REPORTS, cluster.ray_address, str(watch_s)],
                          capture_output=True, text=True, env=loopback_ray_env(), timeout=180, check=True)
    reports = [tuple(r) for r in json.loads(done.stdout.splitlines()[-1])]
    assert {w for w, _, _ in reports} and all(busy == 0 for _, _, busy in reports), reports
    stamps = sorted(t for _, t, _ in reports if t >= started)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) >= watch_s - 1 and max(gaps) <= 1.0, (len(stamps), gaps)


def test_the_worker_label_is_the_serve_replica_id_the_router_s_index_uses(cluster):
    """METRICS.md: the `worker` label is the Serve replica id of the worker (the id `serve status`
    shows, the end of its actor's name, and the id the router's KV index uses)."""
    idle(cluster)
    labels = sorted(per_worker(metrics(cluster.http_url), "kvmesh_kv_free_blocks"))
    (state,) = ingress_state(cluster)
    assert len(labels) == 1 and state["router_worker_ids"] == labels, (labels, state)
    assert [name.rsplit("#", 1)[1] for name in state["worker_actor_names"]] == labels, state
