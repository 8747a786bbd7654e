"""docs/ROUTING.md, sentence by sentence: the behaviour statements that no other test checked.

Each test's docstring quotes the sentence it checks. Real router objects, small deterministic inputs.
"""

import collections
import json

import numpy as np
import pytest

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored, KVEventBatch, KVSnapshot, WorkerLoad
from kvmesh.router import CostWeights, KVIndex, Router, RouteRequest, WorkerState, make_policy
from kvmesh.router.cost import worker_cost, worker_costs
from kvmesh.router.load_order import LoadKey
from kvmesh.router.workers import columns_of

B = 16
PROMPT = list(range(10 * B))
H = block_hashes(PROMPT, B)
REQ = RouteRequest(block_hashes=H, num_prompt_tokens=len(PROMPT))


def workers(*outstanding, cap=None):
    return [WorkerState(f"w{i}", WorkerLoad(f"w{i}", running=n), cap=cap) for i, n in enumerate(outstanding)]


def policy(name, index=None, **kw):
    return make_policy(name, index=index if index is not None else KVIndex(), block_size=B, seed=0, **kw)


# --- Design and API ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kv_events", "least_loaded", "prefix_approx"])
def test_route_with_a_limit_returns_only_the_first_k_of_the_ranking(name):
    """"`limit=k` returns only the first k (`Policy.top`); with `limit=1` kv_events finds its choice
    without a pass over every worker" (the same choice: here loads differ, so there is no tie)."""
    def router():
        r = Router(policy=name, block_size=B, seed=0,
                   **({"pending_requests": 0} if name == "kv_events" else {}))
        for i, (running, queued) in enumerate([(3, 900), (1, 50), (2, 400), (0, 700), (5, 10)]):
            r.add_worker(f"w{i}", cap=64)
            r.update_load(WorkerLoad(f"w{i}", running=running, waiting_prefill_tokens=queued))
        r.on_events(KVEventBatch("w2", 0, 0, [BlockStored(H[:6], None, 6 * B)]))
        return r

    full = router().route(H, len(PROMPT))
    assert len(full) == 5
    for k in (1, 2, 4):
        assert router().route(H, len(PROMPT), limit=k) == full[:k], k
    with pytest.raises(ValueError, match="limit"):
        router().route(H, len(PROMPT), limit=0)


# --- Policies -----------------------------------------------------------------------------------

def test_power_of_two_puts_the_less_loaded_of_its_two_samples_first():
    """"`power_of_two` | two random eligible workers, the less loaded first": the two sampled lead
    the ranking, the less loaded of them first; the rest follow by load."""
    p = policy("power_of_two")
    ws = workers(0, 5, 10, 20)
    load = {w.worker_id: w.load.running for w in ws}
    pairs = collections.Counter()
    for _ in range(200):
        ranked = p.rank(REQ, ws)
        assert load[ranked[0]] < load[ranked[1]], ranked
        rest = [load[w] for w in ranked[2:]]
        assert rest == sorted(rest)
        pairs[frozenset(ranked[:2])] += 1
    assert len(pairs) == 6  # every pair of the four is sampled


@pytest.mark.parametrize("first_load, other_load, balances", [
    (33, 0, True),     # max - min 33 > 32 and 33 > 1.5 * 0
    (32, 0, False),    # max - min 32: not > 32
    (98, 65, True),    # 33 > 32 and 98 > 97.5
    (99, 66, False),   # 33 > 32 but 99 is not > 1.5 * 66
])
def test_prefix_approx_balances_only_past_both_default_thresholds(first_load, other_load, balances):
    """"`prefix_approx` | ... least loaded when max - min outstanding > 32 and max > 1.5 min, else the
    best match if it covers >= 50% of the prompt, else least loaded" (the defaults `balance_abs` (32),
    `balance_rel` (1.5))."""
    p = policy("prefix_approx")
    ws = workers(0, 0)
    first = p.rank(REQ, ws)[0]  # its history now holds the whole prompt there
    other = "w1" if first == "w0" else "w0"
    for w in ws:
        w.load.running = first_load if w.worker_id == first else other_load
    assert p.rank(REQ, ws)[0] == (other if balances else first)


def test_the_kv_events_cost_is_the_documented_formula_with_the_default_weights():
    """"cost_w = 2.0 * (prompt tokens - cached_w) + 1.0 * waiting_prefill_tokens_w + 0.05 *
    running_decode_tokens_w + 512 * kv_usage_w ** 2 + 256 * (running_w + waiting_w) - 1.0 *
    in-flight shared tokens_w" (the in-flight credit is checked in test_router_policies)."""
    load = WorkerLoad("w0", running=1, waiting=2, waiting_prefill_tokens=100, running_decode_tokens=1000,
                      kv_free_blocks=50, kv_total_blocks=100)  # kv_usage 0.5
    expected = 2.0 * (160 - 32) + 1.0 * 100 + 0.05 * 1000 + 512 * 0.5 ** 2 + 256 * 3
    cols = columns_of([WorkerState("w0", load)])
    assert worker_costs(160, np.array([32.0]), cols, CostWeights()).tolist() == [expected]
    key = LoadKey(waiting_prefill_tokens=100, running_decode_tokens=1000, kv_usage=0.5, outstanding=3)
    assert worker_cost(160, 32, key, CostWeights()) == expected


def test_kv_events_gives_no_in_flight_credit_to_new_work_behind_a_short_prefix():
    """"when the longest prefix any worker holds or is computing is under `stay_min_cached` (half) of
    the prompt, a missing token weighs `queued_prefill` (1) instead of `prefill` (2), with no in-flight
    credit." A request sharing 3 of 10 blocks with a prefill in flight costs the computing worker
    1 * 160 + its queue (no credit for the 48 shared tokens), so a queue of 1 sends it elsewhere."""
    weights = CostWeights(prefill=2.0, queued_prefill=1.0, running_decode=0.0, kv_pressure=0.0,
                          outstanding=0.0, stay_margin=0.0, in_flight=1.0)
    short_sibling = RouteRequest(block_hashes(PROMPT[:3 * B] + [7] * (7 * B), B), len(PROMPT))
    long_sibling = RouteRequest(block_hashes(PROMPT[:8 * B] + [7] * (2 * B), B), len(PROMPT))

    def goes_to_the_computing_worker(sibling, queue):
        p = policy("kv_events", weights=weights)
        ws = workers(0, 0, 0)
        first = p.rank(REQ, ws)[0]  # nothing in the index: its blocks are being computed there
        ws[int(first[1:])].load.waiting_prefill_tokens = queue
        return p.rank(sibling, ws)[0] == first

    assert not goes_to_the_computing_worker(short_sibling, 1)
    # Half the prompt or more in flight: a continuation, credited (2 * 160 + 100 - 128 < 320).
    assert goes_to_the_computing_worker(long_sibling, 100)


# --- Index and events -----------------------------------------------------------------------------

def test_a_snapshot_s_hashes_each_become_their_own_run():
    """"a snapshot's sorted hashes are not a chain, so each becomes its own run" (and the walk still
    counts the leading blocks)."""
    index = KVIndex()
    assert index.apply_snapshot(KVSnapshot("a", 0, 3, list(H[:5]), B))
    runs = [index._blocks[h] for h in H[:5]]
    assert len({id(r) for r in runs}) == 5
    assert [list(r.hashes) for r in runs] == [[h] for h in H[:5]]
    assert index.overlap(H) == {"a": 5}
    # The same blocks stored as one event are one run: the snapshot is what splits them.
    chained = KVIndex()
    chained.apply(KVEventBatch("a", 0, 0, [BlockStored(H[:5], None, 5 * B)]))
    assert len({id(chained._blocks[h]) for h in H[:5]}) == 1


# --- Simulator ------------------------------------------------------------------------------------

def test_kvmesh_sim_kv_blocks_default_is_the_h200_pool(capsys):
    """"Other knobs: `--kv-blocks`, ..." with "KV pool 71,381 blocks of 16 (1.14 M tokens) per worker"
    (the `--kv-blocks` default; the other knobs' defaults: tests/unit/test_sim_cli.py)."""
    import gc

    from kvmesh.cli import main

    before = gc.get_threshold()
    try:  # kvmesh sim tunes the collector as a routing process does: put it back
        assert main(["sim", "--workers", "2", "--requests", "20", "--workload", "random", "--load", "0.5",
                     "--json", "--no-progress"]) == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert (cfg["kv_blocks_per_worker"], cfg["block_size"]) == (71_381, 16)
    assert round(71_381 * 16 / 1e6, 2) == 1.14


def test_the_step_time_model_gives_the_documented_examples():
    """"A running context token costs ~27 ns per step (114,688 B at 4.23 TB/s)"; "`0.5 ms + max((weights + KV read) / (4.23 TB/s * 0.9), FLOPs / (789 TFLOP/s * 0.5))` ... E.g. a
    decode step of 1 x 1k context 0.84 ms, 64 x 1k 2.8 ms, 128 x 8k 32 ms; a prefill of 1k new tokens
    3.1 ms, 8k 38 ms, 512 new after 8k cached 4.2 ms." (to the printed digit)"""
    from kvmesh.router.sim.calibration import CostModel

    cost = CostModel()
    hw = cost.hardware
    assert (hw.step_overhead_s, hw.copy_bandwidth, hw.bandwidth_efficiency, hw.matmul_flops,
            hw.matmul_efficiency) == (0.5e-3, 4.23e12, 0.9, 789e12, 0.5)
    # "A running context token costs ~27 ns per step (114,688 B at 4.23 TB/s)"
    assert cost.model.kv_bytes_per_token == 114_688
    assert 114_688 / 4.23e12 == pytest.approx(27e-9, abs=0.5e-9)
    ms = lambda s: s * 1e3  # noqa: E731
    assert ms(cost.decode_step_time(1, 1024)) == pytest.approx(0.84, abs=0.005)
    assert ms(cost.decode_step_time(64, 64 * 1024)) == pytest.approx(2.8, abs=0.05)
    assert ms(cost.decode_step_time(128, 128 * 8192)) == pytest.approx(32, abs=0.5)
    assert ms(cost.prefill_time(1024)) == pytest.approx(3.1, abs=0.05)
    assert ms(cost.prefill_time(8192)) == pytest.approx(38, abs=0.5)
    assert ms(cost.prefill_time(512, 8192)) == pytest.approx(4.2, abs=0.05)
    # the memory-bound case is the bandwidth term plus the overhead
    m = cost.model
    memory = (m.weight_bytes + 1024 * m.kv_bytes_per_token) / (4.23e12 * 0.9)
    assert cost.decode_step_time(1, 1024) == pytest.approx(0.5e-3 + memory)


def test_the_workloads_are_shaped_as_documented():
    """"`tenants` (128 tenants, 8,192-token system prompts, 64-512-token user messages, 16-128 output
    tokens, Zipf(0.5) popularity, ...); `multiturn` (shared 1,024-token system prompt, first message
    500-4,000 tokens, 3-12 turns, each turn = previous prompt + answer (32-384) + new message
    (100-1,500), exponential think time mean 1 s, ...); `prefix_repetition` (vLLM's: 32 prefixes of
    2,048 tokens, 256-token suffixes, 128 output)"."""
    from kvmesh.router.sim.workloads import make_workload

    tenants = make_workload("tenants", 400, seed=0)
    assert (tenants.params["num_tenants"], tenants.params["tenant_skew"]) == (128, 0.5)
    assert all(8192 + 64 <= r.prompt_len <= 8192 + 512 and 16 <= r.output_len <= 128
               for r in tenants.requests)
    system = {r.group: tuple(r.prompt_token_ids[:8192]) for r in tenants.requests}
    assert all(tuple(r.prompt_token_ids[:8192]) == system[r.group] for r in tenants.requests)
    assert len(system) > 64 and all(0 <= g < 128 for g in system)
    # Zipf popularity: the lower-ranked tenants are asked more
    counts = collections.Counter(r.group for r in tenants.requests)
    assert sum(counts[g] for g in range(16)) > sum(counts[g] for g in range(112, 128))

    multi = make_workload("multiturn", 400, seed=0)
    by_id = {r.request_id: r for r in multi.requests}
    shared = {tuple(r.prompt_token_ids[:1024]) for r in multi.requests}
    assert len(shared) == 1
    turns = collections.Counter(r.group for r in multi.requests)
    last = max(turns)
    assert all(3 <= n <= 12 for g, n in turns.items() if g != last)  # the last one is cut by the count
    think = []
    for r in multi.requests:
        if r.after is None:
            assert 1024 + 500 <= r.prompt_len <= 1024 + 4000
        else:
            prev = by_id[r.after]
            assert 32 <= prev.output_len <= 384
            assert 100 <= r.prompt_len - prev.prompt_len - prev.output_len <= 1500
            think.append(r.think_time_s)
    assert 0.8 < np.mean(think) < 1.2

    # "the prompts nearly fill one worker's pool": 128 system prompts against 71,381 blocks of 16
    assert 0.9 < 128 * 8192 / (71_381 * 16) < 1.0
    # "the simulator's trace keeps them as a uint64 array, and `SimRequest.prompt_hashes` copies its
    # bytes": an array('Q') of the prompt's full blocks
    r = tenants.requests[0]
    assert r.hashes.dtype == np.uint64
    hashes = r.prompt_hashes(B)
    assert hashes.typecode == "Q" and hashes.tolist() == r.hashes[:r.prompt_len // B].tolist()

    rep = make_workload("prefix_repetition", 200, seed=0)
    assert {(r.prompt_len, r.output_len) for r in rep.requests} == {(2048 + 256, 128)}
    assert len({tuple(r.prompt_token_ids[:2048]) for r in rep.requests}) == 32


def test_hit_rate_and_imbalance_are_as_defined():
    """"`hit_rate` = cached / prompt tokens; ... `imbalance` = max / mean worker busy time"."""
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.router.sim.run import run

    small = dict(num_tenants=4, system_tokens=256, suffix_tokens=(16, 64), output_tokens=(4, 16))
    report = run("tenants", ["round_robin"], SimConfig(num_workers=3, kv_blocks=2000, seed=0),
                 num_requests=200, load=0.5, workload_options=small, keep_results=True)
    result, metrics = report["results"]["round_robin"], report["policies"]["round_robin"]
    cached = sum(j.cached_tokens for j in result.jobs)
    prompt = sum(j.request.prompt_len for j in result.jobs)
    assert 0 < cached < prompt
    assert metrics["hit_rate"] == pytest.approx(cached / prompt)
    busy = [w.busy_time for w in result.workers]
    assert metrics["imbalance"] == pytest.approx(max(busy) / (sum(busy) / len(busy)))
    assert metrics["imbalance"] > 1.0


def test_a_chunk_holds_about_two_sqrt_buckets_and_at_least_64():
    """"sorted by load cost in chunks of consecutive buckets (bisection; a chunk holds about
    2 sqrt(buckets), at least 64, ...)"; "(split beyond twice that, merged below half)"."""
    import math

    from kvmesh.router.cost import load_cost
    from kvmesh.router.load_order import LoadOrder

    def chunks_of(num_buckets, keep_every=2):
        order = LoadOrder(lambda key: load_cost(key, CostWeights()), slot_of=lambda w: int(w[1:]))
        for i in range(num_buckets):  # one worker per bucket, every load distinct
            order.update(f"w{i}", LoadKey(float((i * 7919) % num_buckets), 0.0, 0.0, 0.0))
            target = max(64, 2 * math.isqrt(i + 1))
            assert max(len(c.buckets) for c in order._chunks) <= 2 * target, i  # split beyond twice
        for i in range(num_buckets):  # buckets leave: short chunks join a neighbour
            if i % keep_every:
                order.update(f"w{i}", None)
        left = len(range(0, num_buckets, keep_every))
        lengths = [len(c.buckets) for c in order._chunks]
        target = max(64, 2 * math.isqrt(left))
        assert len(lengths) == 1 or min(lengths[:-1]) >= target // 2, lengths  # merged below half
        return lengths

    assert chunks_of(120) == [60]  # 2 sqrt(120) = 20, but at least 64: one chunk up to 128
    assert len(chunks_of(400)) > 1  # 200 buckets left: past twice 64
    lengths = chunks_of(6000)  # 3000 left: 2 sqrt(3000) = 108, chunks of 54-216
    assert sum(lengths) == 3000 and max(lengths) <= 2 * 108 and len(lengths) >= 3000 // 216
    lengths = chunks_of(6000, keep_every=8)  # 750 left, chunks of ~20-40 made: at least 32 each
    assert sum(lengths) == 750 and len(lengths) > 1


def test_the_simulated_worker_decodes_first_admits_in_order_and_reserves_the_whole_output():
    """"**Worker**: continuous batching, chunked prefill, decodes first, FCFS admission when the blocks
    fit, ... A request reserves its prompt and whole output at admission (no preemption)"."""
    from kvmesh.router.sim.calibration import CostModel
    from kvmesh.router.sim.worker import Job, SimWorker
    from kvmesh.router.sim.workloads import SimRequest

    def request(rid, prompt_len, output_len):
        tokens = np.random.default_rng(rid).integers(0, 1000, prompt_len + output_len).astype(np.int32)
        return SimRequest(request_id=rid, tokens=tokens, prompt_len=prompt_len, output_len=output_len,
                          hashes=np.array(block_hashes(tokens, B), dtype=np.uint64))

    w = SimWorker("w0", CostModel(), capacity_blocks=40, max_batch=8, max_batched_tokens=256)
    a = Job(request(0, 100, 30), 0.0)  # 130 tokens: 9 blocks
    w.submit(a, 0.0)
    assert (w.cache.num_free, a.private_blocks) == (40 - 9, 9)  # prompt and output, at admission
    b = Job(request(1, 300, 20), 0.0)  # 20 blocks
    c = Job(request(2, 200, 30), 0.0)  # 15 blocks: does not fit after a and b
    d = Job(request(3, 10, 2), 0.0)  # 1 block: fits, but comes after c
    for job in (b, c, d):
        w.submit(job, 0.0)
    w.on_step_end(w.step_end)  # a's prefill done; b admitted, c waits for blocks and d behind it
    assert list(w.waiting) == [c, d] and w.cache.num_free == 40 - 9 - 20
    # The next step: a's decode first, then b's prompt in the rest of the 256-token budget.
    assert w.step.num_decode == 1 and [(j, n) for j, n in w.step.chunks] == [(b, 255)]
    admitted = {id(a), id(b)}
    while w.step_end is not None:
        w.on_step_end(w.step_end)
        waiting = {id(j) for j in w.waiting}
        assert not waiting & admitted  # no preemption: an admitted request never waits again
        admitted |= {id(j) for j in (a, b, c, d)} - waiting
        if id(d) in admitted:
            assert id(c) in admitted  # first come first served
    assert all(j.finish_time is not None for j in (a, b, c, d))


def test_the_oracle_caches_every_block_forever_from_first_sight():
    """"`oracle_hit_rate` = the same with every block cached forever from first sight" (prompt and
    output blocks of earlier requests; a hit capped one token short, as a real one)."""
    from kvmesh.router.sim.metrics import oracle_hit_rate
    from kvmesh.router.sim.workloads import make_workload

    rep = make_workload("prefix_repetition", 30, seed=0, num_prefixes=3, prefix_tokens=64, suffix_tokens=32,
                        output_tokens=8)
    seen_prefixes, cached = set(), 0
    for r in sorted(rep.requests, key=lambda r: r.start_offset):
        prefix = tuple(r.prompt_token_ids[:64])
        cached += 64 if prefix in seen_prefixes else 0
        seen_prefixes.add(prefix)
    assert oracle_hit_rate(rep) == pytest.approx(cached / (30 * 96))
    # A prompt seen whole (4 blocks, no suffix) hits 3 blocks: the last token is computed again.
    whole = make_workload("prefix_repetition", 10, seed=0, num_prefixes=1, prefix_tokens=64, suffix_tokens=0,
                          output_tokens=8)
    assert oracle_hit_rate(whole) == pytest.approx(9 * 48 / (10 * 64))

    multi = make_workload("multiturn", 40, seed=0, turns=(3, 3))
    by_id = {r.request_id: r for r in multi.requests}
    expected = 0
    first_seen = False
    for r in sorted(multi.requests, key=lambda r: (r.start_offset, r.request_id)):
        limit = (r.prompt_len - 1) // B
        if r.after is not None:  # the previous turn's prompt and answer, every full block of it
            expected += min(len(by_id[r.after].hashes), limit) * B
        elif first_seen:  # the shared 1,024-token system prompt
            expected += 1024
        first_seen = True
    assert oracle_hit_rate(multi) == pytest.approx(expected / sum(r.prompt_len for r in multi.requests))


def test_the_plain_simulator_publishes_a_worker_s_load_after_each_routed_request():
    """"loads are published after each step and each routed request": a burst that arrives before
    any step ends is spread evenly by least_loaded, which sees each routed request at once;
    "`--rate R` gives requests/s"."""
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.router.sim.run import run

    wide = dict(num_tenants=2, system_tokens=4096, suffix_tokens=(64, 128), output_tokens=(4, 8))
    report = run("tenants", ["least_loaded"], SimConfig(num_workers=4, kv_blocks=4000, seed=0),
                 num_requests=16, load=None, rate=100_000.0, workload_options=wide, keep_results=True)
    assert report["config"]["rate_req_s"] == 100_000.0
    jobs = report["results"]["least_loaded"].jobs
    assert max(j.arrival for j in jobs) < min(j.first_token_time for j in jobs)  # one burst
    assert sorted(collections.Counter(j.worker_id for j in jobs).values()) == [4, 4, 4, 4]


def test_the_api_defaults():
    """"`Router(policy="kv_events", block_size=16)`", "`kv_events` (default)", "`RouteRequest(block_hashes,
    num_prompt_tokens, session_key=None)`; `WorkerState(worker_id, load, healthy=True, cap=None,
    reported_at=None)`", "`RoutingState(policy, block_size, cap=None, temperature=0.0, seed=None,
    clock=time.monotonic, stale_load_s=STALE_LOAD_S)`; `rank(block_hashes, num_prompt_tokens,
    session_key, candidates, avoid=(), request_id=None, keep_stale=True)`", "`Router(policy="kv_events",
    weights=CostWeights(...), temperature=0.0, pending_requests=4096)`", "prefix_approx
    `max_blocks_per_worker` (100,000), `cache_threshold` (0.5), `balance_abs` (32), `balance_rel` (1.5)"."""
    import inspect
    import time

    from kvmesh.router import routing_state
    from kvmesh.router.routing_state import RoutingState

    router = Router()
    assert (router.policy.name, router.block_size) == ("kv_events", 16)
    assert (router.policy.weights, router.policy.temperature, router.policy.pending.max_requests) == (
        CostWeights(), 0.0, 4096)
    tuned = Router(policy="kv_events", weights=CostWeights(stay_margin=1.0), temperature=0.1,
                   pending_requests=7)
    assert (tuned.policy.weights.stay_margin, tuned.policy.temperature, tuned.policy.pending.max_requests) == (
        1.0, 0.1, 7)
    request = RouteRequest(H, len(PROMPT))
    assert request.session_key is None
    state = WorkerState("w0", WorkerLoad("w0"))
    assert (state.healthy, state.cap, state.reported_at) == (True, None, None)
    from kvmesh.router.policies import policy_defaults
    assert policy_defaults("prefix_approx") == {"max_blocks_per_worker": 100_000, "cache_threshold": 0.5,
                                                "balance_abs": 32, "balance_rel": 1.5}
    params = inspect.signature(RoutingState).parameters
    assert {k: params[k].default for k in ("cap", "temperature", "seed", "clock", "stale_load_s")} == {
        "cap": None, "temperature": 0.0, "seed": None, "clock": time.monotonic,
        "stale_load_s": routing_state.STALE_LOAD_S}
    params = inspect.signature(RoutingState.rank).parameters
    assert list(params)[1:5] == ["block_hashes", "num_prompt_tokens", "session_key", "candidates"]
    assert {k: params[k].default for k in ("avoid", "request_id", "keep_stale")} == {
        "avoid": (), "request_id": None, "keep_stale": True}


def test_kvmesh_sim_takes_kv_events_temperature_as_an_option_which_a_serving_config_refuses():
    """"One difference: `kvmesh sim` has no `routing.temperature`, so it takes kv_events' temperature
    as an option (`--policy-opt kv_events.temperature=0.2`), which a serving config's `policy_options`
    refuses." (Corrected: the sentence before said the simulator checks options "the same way".)"""
    from kvmesh.commands.sim import parse_policy_options
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.router.sim.run import run
    from kvmesh.serve_config import parse_config

    options = parse_policy_options(["kv_events.temperature=0.2"], ["kv_events"])
    assert options == {"kv_events": {"temperature": 0.2}}
    for copies in (0, 2):
        config = SimConfig(num_workers=2, kv_blocks=2000, seed=0, router_copies=copies, policy_options=options)
        report = run("prefix_repetition", ["kv_events"], config, num_requests=20, load=0.5, keep_results=True)
        assert report["results"]["kv_events"].router.policy.temperature == 0.2
    with pytest.raises(ValueError, match="temperature: set routing.temperature instead"):
        parse_config({"routing": {"policy_options": {"temperature": 0.2}}})
    assert parse_config({"routing": {"temperature": 0.2}}).routing.temperature == 0.2


def test_the_simulator_freezes_its_setup_in_a_process_tuned_for_routing():
    """"**The simulator's setup frozen** (`gc_tuning.freeze_setup`, called by the simulator once the
    trace, the router and the simulated workers exist, in a process tuned for routing)": its workers
    and trace leave every collection, what the event loop makes (each request's `Job`) does not; in
    a process with CPython's settings nothing is frozen."""
    import gc

    from kvmesh.router.gc_tuning import tune_gc_for_routing
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.router.sim.run import run

    small = dict(num_tenants=2, system_tokens=64, suffix_tokens=(16, 32), output_tokens=(2, 4))

    def simulate():
        report = run("tenants", ["round_robin"], SimConfig(num_workers=2, kv_blocks=500, seed=0),
                     num_requests=20, load=0.5, workload_options=small, keep_results=True)
        result = report["results"]["round_robin"]
        collected = {id(o) for o in gc.get_objects()}  # frozen objects are in no generation
        return (id(result.workers[0]) in collected, id(result.jobs[0].request) in collected,
                id(result.jobs[0]) in collected)

    before = gc.get_threshold()
    gc.unfreeze()
    try:
        assert simulate() == (True, True, True)  # CPython's settings: nothing frozen
        tune_gc_for_routing()
        assert simulate() == (False, False, True)  # the workers and the trace frozen, not the jobs
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_cap_counts_running_and_waiting_requests():
    """"`router.add_worker("replica-a", cap=64)  # cap = max outstanding (running + waiting)`": a
    worker whose running and waiting requests reach its cap is full (spill-over, ranked last)."""
    for name in ("kv_events", "round_robin", "least_loaded"):
        router = Router(policy=name, block_size=B, seed=0)
        router.add_worker("a", cap=4)
        router.add_worker("b", cap=4)
        router.update_load(WorkerLoad("a", running=1, waiting=3))  # 4 outstanding: full
        router.update_load(WorkerLoad("b", running=3, waiting=0, waiting_prefill_tokens=5000))
        for _ in range(3):
            assert router.route(H, len(PROMPT)) == ["b", "a"], name
        router.update_load(WorkerLoad("a", running=1, waiting=2))  # 3: eligible again
        assert "a" in {router.route(H, len(PROMPT))[0] for _ in range(4)}, name


def test_load_assumes_a_router_that_always_finds_the_prefix():
    """"`--load L` is a fraction of the estimated capacity (`router/sim/capacity.py`: prefill of what
    the oracle leaves uncached plus decode at a full batch; errs low)"; "`--load` assumes a router that
    always finds the prefix": a trace whose requests share one prefix is estimated to serve more
    requests per second than the same request shapes sharing nothing, by the prefill the oracle saves."""
    import dataclasses

    from kvmesh.router.sim.calibration import CostModel
    from kvmesh.router.sim.capacity import capacity_req_s
    from kvmesh.router.sim.workloads import Workload, make_workload

    shape = dict(num_prefixes=1, prefix_tokens=2048, suffix_tokens=256, output_tokens=16)
    shared = make_workload("prefix_repetition", 10, seed=0, **shape)
    alone = Workload("prefix_repetition", [
        dataclasses.replace(make_workload("prefix_repetition", 1, seed=100 + i, **shape).requests[0],
                            request_id=i, start_offset=r.start_offset)
        for i, r in enumerate(shared.requests)], B, shared.params)
    cost = CostModel()
    fast, slow = (capacity_req_s(w, cost, num_workers=1, max_batch=128) for w in (shared, alone))
    # per request: the prefill of 2,304 tokens, against 256 after 2,048 cached for 9 of the 10
    saved = 9 * (cost.prefill_time(2304) - cost.prefill_time(256, 2048)) / 10
    assert 1 / fast == pytest.approx(1 / slow - saved)
