"""Each policy's contract: what it picks, what it never picks."""

import collections

import pytest

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored, KVEventBatch, WorkerLoad
from kvmesh.router import CostWeights, KVIndex, RouteRequest, WorkerSet, WorkerState, make_policy
from kvmesh.router.policies import POLICY_NAMES

B = 16
PROMPT = list(range(10 * B))
H = block_hashes(PROMPT, B)
REQ = RouteRequest(block_hashes=H, num_prompt_tokens=len(PROMPT))


def workers(*outstanding, cap=None, unhealthy=()):
    return [WorkerState(f"w{i}", WorkerLoad(f"w{i}", running=n), healthy=f"w{i}" not in unhealthy, cap=cap)
            for i, n in enumerate(outstanding)]


def index_with(holdings: dict[str, int]) -> KVIndex:
    index = KVIndex()
    for wid, n in holdings.items():
        index.apply(KVEventBatch(wid, 0, 0, [BlockStored(H[:n], None, n * B)]))
    return index


def policy(name, index=None, **kw):
    return make_policy(name, index=index if index is not None else KVIndex(), block_size=B, seed=0, **kw)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_skips_unhealthy_and_puts_full_workers_last(name):
    ws = workers(0, 0, 5, 0, cap=4, unhealthy=("w1",))
    for _ in range(8):
        ranked = policy(name).rank(REQ, ws)
        assert "w1" not in ranked
        assert ranked[-1] == "w2"  # the only full one: spill-over only
        assert sorted(ranked[:-1]) == ["w0", "w3"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_full_workers_come_last_least_outstanding_first(name):
    """docs/ROUTING.md: the spill-over, when every eligible worker is ranked, is the full workers by
    outstanding requests, fewest first; with none eligible it is all there is."""
    for loads in ((0, 7, 5, 0), (9, 7, 5, 8)):  # w1, w2 full (cap 4); then every worker full
        ws = workers(*loads, cap=4)
        full = sorted((w for w, n in zip(["w0", "w1", "w2", "w3"], loads) if n >= 4),
                      key=lambda w: loads[int(w[1])])
        for _ in range(4):
            ranked = policy(name).rank(REQ, ws)
            assert ranked[-len(full):] == full, (loads, ranked)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_returns_nothing_when_no_worker_is_healthy(name):
    assert policy(name).rank(REQ, workers(0, 0, unhealthy=("w0", "w1"))) == []


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_accepts_a_worker_set(name):
    ws = WorkerSet()
    for i in range(3):
        ws.add(f"w{i}", cap=2)
    ws.update_load(WorkerLoad("w1", running=2))
    ranked = policy(name).rank(REQ, ws)
    assert ranked[-1] == "w1" and sorted(ranked) == ["w0", "w1", "w2"]


def test_round_robin_cycles_over_eligible_workers():
    p = policy("round_robin")
    ws = workers(0, 0, 0)
    assert [p.rank(REQ, ws)[0] for _ in range(6)] == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_loaded_picks_fewest_outstanding_then_fewest_queued_tokens():
    ws = workers(3, 1, 1, 2)
    ws[1].load.waiting_prefill_tokens = 500
    ws[2].load.waiting_prefill_tokens = 100
    assert policy("least_loaded").rank(REQ, ws) == ["w2", "w1", "w3", "w0"]


def test_power_of_two_never_picks_the_most_loaded():
    p = policy("power_of_two")
    ws = workers(0, 5, 10)
    firsts = collections.Counter(p.rank(REQ, ws)[0] for _ in range(200))
    assert set(firsts) == {"w0", "w1"}
    assert firsts["w0"] > firsts["w1"]  # w0 wins whenever sampled: 2/3 of the time


def test_session_keeps_a_key_on_one_worker():
    p = policy("session")
    ws = workers(0, 0, 0, 0)
    req = RouteRequest(H, len(PROMPT), session_key="user-42")
    assert len({p.rank(req, ws)[0] for _ in range(20)}) == 1


def test_session_skips_a_full_owner_to_the_next_on_the_ring():
    p = policy("session")
    ws = workers(0, 0, 0, 0, cap=1)
    req = RouteRequest(H, len(PROMPT), session_key="user-42")
    first, second = p.rank(req, ws)[:2]
    ws[int(first[1:])].load.running = 1
    assert p.rank(req, ws)[0] == second


def test_session_without_a_key_groups_by_first_block():
    p = policy("session")
    ws = workers(0, 0, 0, 0, 0, 0, 0, 0)
    other_suffixes = [RouteRequest(block_hashes(PROMPT[:B] + [7000 + i] * B, B), 2 * B) for i in range(10)]
    assert len({p.rank(r, ws)[0] for r in other_suffixes}) == 1


def _owners(p, keys):
    return {k: p.owner(k) for k in keys}


def test_session_moves_only_keys_of_the_leaving_worker_and_about_1_over_n_on_join():
    p = make_policy("session")
    for i in range(10):
        p.add_worker(f"w{i}")
    keys = [f"session-{i}" for i in range(5000)]
    before = _owners(p, keys)
    p.add_worker("w10")
    after_join = _owners(p, keys)
    moved = [k for k in keys if before[k] != after_join[k]]
    assert all(after_join[k] == "w10" for k in moved)  # only to the new worker
    assert 0.04 < len(moved) / len(keys) < 0.16  # ~1/11
    p.remove_worker("w3")
    after_leave = _owners(p, keys)
    moved = [k for k in keys if after_join[k] != after_leave[k]]
    assert moved and all(after_join[k] == "w3" for k in moved)  # only w3's keys move


def test_prefix_approx_sends_a_repeated_prefix_where_it_sent_it_before():
    p = policy("prefix_approx")
    ws = workers(0, 0, 0, 0)
    first = p.rank(REQ, ws)[0]
    for w in ws:
        w.load.running = 1 if w.worker_id == first else 0  # its own earlier request
    assert p.rank(REQ, ws)[0] == first
    other = RouteRequest(block_hashes([9] * 10 * B, B), 10 * B)
    assert p.rank(other, ws)[0] != first  # no match: least loaded


def test_prefix_approx_follows_a_match_of_at_least_half_the_prompt_by_default():
    """docs/ROUTING.md: the best match if it covers >= 50% of the prompt, else least loaded."""
    for shared_blocks, follows in ((6, True), (4, False)):  # of 10 blocks
        p = policy("prefix_approx")
        ws = workers(0, 0, 0, 0)
        first = p.rank(REQ, ws)[0]
        for w in ws:
            w.load.running = 1 if w.worker_id == first else 0  # its earlier request, in flight
        prompt = PROMPT[:shared_blocks * B] + [7] * ((10 - shared_blocks) * B)
        other = RouteRequest(block_hashes(prompt, B), len(prompt))
        assert (p.rank(other, ws)[0] == first) is follows, shared_blocks


def test_prefix_approx_balances_when_load_is_imbalanced():
    p = policy("prefix_approx", balance_abs=4, balance_rel=1.5)
    ws = workers(0, 0)
    first = p.rank(REQ, ws)[0]
    ws[int(first[1:])].load.running = 10
    assert p.rank(REQ, ws)[0] != first


def test_prefix_approx_history_is_bounded_per_worker():
    p = policy("prefix_approx", max_blocks_per_worker=4)
    ws = workers(0)
    p.rank(REQ, ws)
    assert p.tree.num_blocks == 4
    assert p.tree.overlap(H) == {}  # the first blocks were the least recent
    assert p.tree.worker_blocks("w0") == set(H[-4:])


def test_kv_events_prefers_the_worker_holding_the_prefix():
    p = policy("kv_events", index_with({"w2": 10, "w1": 4}))
    assert p.rank(REQ, workers(0, 0, 0, 0))[:2] == ["w2", "w1"]


def test_kv_events_routes_on_the_blocks_not_on_a_session_key():
    # SERVING.md: under kv_events a session key (`prompt_cache_key`, `user`) changes nothing
    p = policy("kv_events", index_with({"w2": 10, "w1": 4}))
    for key in ("alice", "bob", "session-7"):
        keyed = RouteRequest(block_hashes=H, num_prompt_tokens=len(PROMPT), session_key=key)
        assert p.rank(keyed, workers(0, 1, 0, 2)) == p.rank(REQ, workers(0, 1, 0, 2))


def test_kv_events_ignores_cache_on_a_full_or_unhealthy_worker():
    p = policy("kv_events", index_with({"w2": 10, "w1": 4}))
    assert p.rank(REQ, workers(0, 0, 3, 0, cap=3))[0] == "w1"
    assert p.rank(REQ, workers(0, 0, 0, 0, unhealthy=("w2",)))[0] == "w1"


def test_kv_events_trades_cache_hits_against_queued_prefill():
    # No hysteresis here (stay_margin=0): this is the cost alone.
    weights = CostWeights(prefill=2.0, queued_prefill=1.0, running_decode=0.0, kv_pressure=0.0,
                          outstanding=0.0, stay_margin=0.0)
    p = policy("kv_events", index_with({"w0": 10}), weights=weights)
    ws = workers(0, 0)
    ws[0].load.waiting_prefill_tokens = 310  # less than the 2 * 159 it would save
    assert p.rank(REQ, ws)[0] == "w0"
    ws[0].load.waiting_prefill_tokens = 330  # more
    assert p.rank(REQ, ws)[0] == "w1"


def test_kv_events_counts_running_context_and_kv_pressure():
    weights = CostWeights(prefill=1.0, queued_prefill=0.0, running_decode=0.1, kv_pressure=400.0,
                          outstanding=0.0, stay_margin=0.0)
    p = policy("kv_events", index_with({"w0": 10}), weights=weights)
    ws = workers(0, 0)
    ws[0].load.running_decode_tokens = 1400  # 140 < 159 saved
    assert p.rank(REQ, ws)[0] == "w0"
    ws[0].load.kv_total_blocks, ws[0].load.kv_free_blocks = 100, 50  # + 400 * 0.25 = 100 more
    assert p.rank(REQ, ws)[0] == "w1"


def test_kv_events_counts_requests_in_flight():
    weights = CostWeights(prefill=2.0, queued_prefill=0.0, running_decode=0.0, kv_pressure=0.0,
                          outstanding=100.0, stay_margin=0.0)
    p = policy("kv_events", index_with({"w0": 10}), weights=weights)
    assert p.rank(REQ, workers(3, 0))[0] == "w0"  # 300 < 2 * 159 saved
    assert p.rank(REQ, workers(4, 0))[0] == "w1"  # 400 > 318


def test_kv_events_keeps_the_prefix_holder_within_the_stay_margin():
    # stay_min_cached=0: the margin for any holder, however short its prefix (see the next test).
    weights = CostWeights(prefill=2.0, queued_prefill=1.0, running_decode=0.0, kv_pressure=0.0,
                          outstanding=0.0, stay_margin=100.0, stay_min_cached=0.0)
    p = policy("kv_events", index_with({"w0": 10, "w1": 4}), weights=weights)
    ws = workers(0, 0, 0)
    # w0 costs 2 + queue, w1 2 * 96 = 192, w2 2 * 160 = 320: w0 stays first while its queue is
    # at most 100 above the best other worker's cost (w1, 192), and the rest keep the cost order.
    ws[0].load.waiting_prefill_tokens = 290
    assert p.rank(REQ, ws) == ["w0", "w1", "w2"]
    ws[0].load.waiting_prefill_tokens = 291
    assert p.rank(REQ, ws) == ["w1", "w0", "w2"]
    # The holder of the longest prefix only: w1 (4 blocks) gets no margin against w2.
    ws[0].load.waiting_prefill_tokens = 10_000
    ws[1].load.waiting_prefill_tokens = 140  # w1 332 vs w2 320
    assert p.rank(REQ, ws) == ["w2", "w1", "w0"]
    # A full holder cannot stay: the margin passes to the longest holder among eligible workers.
    full = workers(0, 0, 0, cap=1)
    full[0].load.running = 1
    full[1].load.waiting_prefill_tokens = 200  # 392 vs w2's 320: within 100
    assert p.rank(REQ, full) == ["w1", "w2", "w0"]


def test_kv_events_margin_keeps_only_a_holder_of_most_of_the_prompt():
    # A holder of 4 of 10 blocks (a short shared prefix, such as a system prompt in front of a new
    # conversation) gets no margin: the request goes by cost. One of 5 or more blocks keeps it.
    weights = CostWeights(prefill=2.0, queued_prefill=1.0, running_decode=0.0, kv_pressure=0.0,
                          outstanding=0.0, stay_margin=100.0, stay_min_cached=0.5)
    # pending_requests=0: the index alone (a repeated request would otherwise follow the first, in flight).
    short = policy("kv_events", index_with({"w0": 4}), weights=weights, pending_requests=0)
    ws = workers(0, 0)
    ws[0].load.waiting_prefill_tokens = 140  # w0: 2 * 96 + 140 = 332 against w1's 320
    assert short.rank(REQ, ws) == ["w1", "w0"]
    half = policy("kv_events", index_with({"w0": 5}), weights=weights, pending_requests=0)
    ws[0].load.waiting_prefill_tokens = 260  # w0: 2 * 80 + 260 = 420, within 100 of 320
    assert half.rank(REQ, ws) == ["w0", "w1"]
    ws[0].load.waiting_prefill_tokens = 261
    assert half.rank(REQ, ws) == ["w1", "w0"]


def worker_set(*queued):
    ws = WorkerSet()
    for i, q in enumerate(queued):
        ws.add(f"w{i}")
        ws.update_load(WorkerLoad(f"w{i}", waiting_prefill_tokens=q))
    return ws


@pytest.mark.parametrize("as_set", [False, True])
def test_kv_events_charges_new_work_behind_a_short_prefix_its_delay_alone(as_set):
    # A worker missing a short shared prefix (under stay_min_cached of the prompt: a new conversation
    # behind a system prompt) pays the delay of computing it (queued_prefill per token), not the
    # prefill weight that also charges a second copy; a continuation pays the full prefill weight.
    weights = CostWeights(prefill=2.0, queued_prefill=1.0, running_decode=0.0, kv_pressure=0.0,
                          outstanding=0.0, stay_margin=0.0, stay_min_cached=0.5)

    def first(held_blocks: int, queue: int) -> str:
        p = policy("kv_events", index_with({"w0": held_blocks}), weights=weights, pending_requests=0)
        if as_set:
            return p.top(REQ, worker_set(queue, 0), 1)[0]
        ws = workers(0, 0)
        ws[0].load.waiting_prefill_tokens = queue
        return p.rank(REQ, ws)[0]

    # 3 of 10 blocks: w0 costs 1 * 112 + queue against w1's 1 * 160 (at 2 per token: 224 + queue
    # against 320, and w0 would win up to a queue of 96).
    assert first(3, 47) == "w0"
    assert first(3, 49) == "w1"
    # 5 of 10 blocks (half the prompt): the full weight, 2 * 80 + queue against 320.
    assert first(5, 159) == "w0"
    assert first(5, 161) == "w1"


def test_kv_events_default_margin_is_one_engine_step_for_a_continuation():
    p = policy("kv_events", index_with({"w0": 9}), pending_requests=0)  # the default weights
    ws = workers(0, 0)
    # w0 saves 2 * 144 prompt tokens; 8000 queued tokens more is within the 8192 margin.
    ws[0].load.waiting_prefill_tokens = 8000
    assert p.rank(REQ, ws)[0] == "w0"
    ws[0].load.waiting_prefill_tokens = 8192 + 2 * 144 + 1
    assert p.rank(REQ, ws)[0] == "w1"


IN_FLIGHT = CostWeights(prefill=2.0, queued_prefill=1.0, running_decode=0.0, kv_pressure=0.0,
                        outstanding=0.0, stay_margin=0.0, in_flight=1.0)


def test_kv_events_credits_the_worker_computing_a_prefix_in_flight_with_a_copy_saved():
    sibling = RouteRequest(block_hashes(PROMPT[:8 * B] + [7] * (2 * B), B), len(PROMPT))  # 8 blocks shared

    def sibling_goes_to_first(queue: int, **kw) -> bool:
        # Nothing in the index yet: the first request's blocks are still being computed where it went.
        p = policy("kv_events", weights=IN_FLIGHT, **kw)
        ws = workers(0, 0, 0)
        first = p.rank(REQ, ws)[0]
        ws[int(first[1:])].load.waiting_prefill_tokens = queue
        return p.rank(sibling, ws)[0] == first

    # The others cost 2 * 160 = 320; the first's worker 320 + its queue - 1 * 128 in-flight tokens
    # (the copy is saved, not the delay: it computes them again alongside).
    assert sibling_goes_to_first(127)
    assert not sibling_goes_to_first(129)
    # Without the record, any queue sends the sibling elsewhere.
    assert not sibling_goes_to_first(1, pending_requests=0)


def test_kv_events_in_flight_blocks_continue_what_the_index_shows():
    p = policy("kv_events", index_with({"w0": 4, "w1": 4}), weights=IN_FLIGHT)
    ws = workers(0, 0, 0)
    ws[1].load.waiting_prefill_tokens = 1  # w0 is cheaper and takes the request
    assert p.rank(REQ, ws)[0] == "w0"
    # w0 is computing blocks 4-9 (95 more prompt tokens): 2 * 96 + queue - 95 against w1's 193.
    ws[0].load.waiting_prefill_tokens = 95
    assert p.rank(REQ, ws)[0] == "w0"
    ws[0].load.waiting_prefill_tokens = 97
    assert p.rank(REQ, ws)[0] == "w1"  # which now is the one computing blocks 4-9 (the latest record)
    p.remove_worker("w1")  # a worker that left keeps no in-flight record
    assert len(p.pending) == 0


def test_kv_events_cost_caps_a_full_hit_one_token_short():
    p = policy("kv_events", index_with({"w0": 10}))
    ws = workers(0, 0)
    cached = p.cached_tokens(REQ, make_cols(ws))
    assert cached.tolist() == [len(PROMPT) - 1, 0]


def make_cols(ws):
    from kvmesh.router.workers import LoadColumns
    return LoadColumns.from_states(ws)


def test_kv_events_breaks_ties_at_random():
    p = policy("kv_events", pending_requests=0)  # else the repeated prompt follows the first, in flight
    firsts = collections.Counter(p.rank(REQ, workers(0, 0, 0, 0))[0] for _ in range(400))
    assert set(firsts) == {"w0", "w1", "w2", "w3"}


def test_least_loaded_breaks_ties_at_random():
    """docs/ROUTING.md: fewest outstanding, then fewest queued prefill tokens; ties random."""
    p = policy("least_loaded")
    firsts = collections.Counter(p.rank(REQ, workers(3, 1, 1, 1))[0] for _ in range(400))
    assert set(firsts) == {"w1", "w2", "w3"}


def test_kv_events_temperature_spreads_the_first_choice():
    cold = policy("kv_events", index_with({"w0": 10}))
    hot = policy("kv_events", index_with({"w0": 10}), temperature=1.0)
    ws = workers(0, 0, 0)
    assert {cold.rank(REQ, ws)[0] for _ in range(50)} == {"w0"}
    hot_firsts = collections.Counter(hot.rank(REQ, ws)[0] for _ in range(300))
    assert len(hot_firsts) == 3 and hot_firsts["w0"] == max(hot_firsts.values())


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="takes no option 'virtual_nodes'"):
        make_policy("round_robin", virtual_nodes=3)
    with pytest.raises(ValueError, match="needs the KV index"):
        make_policy("kv_events")
    with pytest.raises(ValueError, match="kv_pressure must be >= 0"):
        CostWeights(kv_pressure=-1)
