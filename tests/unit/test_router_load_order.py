"""LoadOrder (the eligible workers by load cost, kept by a WorkerSet) and the kv_events choice made from
it: equal to the full ranking's first on random states, ties broken over every tied worker."""

import collections
import random

import pytest

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored, KVEventBatch, WorkerLoad
from kvmesh.router import CostWeights, KVIndex, RouteRequest, WorkerSet, make_policy
from kvmesh.router.cost import load_cost
from kvmesh.router import load_order
from kvmesh.router.load_order import LoadKey, LoadOrder

B = 16
WEIGHTS = CostWeights()


def random_load(rng: random.Random, wid: str) -> WorkerLoad:
    return WorkerLoad(wid, running=rng.randrange(6), waiting=rng.randrange(3),
                      waiting_prefill_tokens=rng.randrange(5000), running_decode_tokens=rng.randrange(10**6),
                      kv_free_blocks=rng.randrange(1000), kv_total_blocks=1000, healthy=rng.random() > 0.05)


def expected_keys(ws: WorkerSet) -> dict[str, LoadKey]:
    cols = ws.columns()
    return {wid: LoadKey(cols.waiting_prefill_tokens[i], cols.running_decode_tokens[i], cols.kv_usage[i],
                         cols.outstanding[i])
            for i, wid in enumerate(cols.ids) if cols.eligible[i]}


def test_load_order_follows_the_worker_set_through_loads_membership_health_and_caps():
    rng = random.Random(0)
    ws = WorkerSet()
    order = LoadOrder(lambda key: load_cost(key, WEIGHTS))
    ws.watch(order)
    for step in range(3000):
        wid = f"w{rng.randrange(40)}"
        action = rng.random()
        if wid not in ws:
            ws.add(wid, cap=rng.choice([None, 3, 6]))
        elif action < 0.05:
            ws.remove(wid)
        elif action < 0.1:
            ws.set_healthy(wid, rng.random() < 0.7)
        elif action < 0.15:
            ws.set_cap(wid, rng.choice([None, 2, 5]))
        else:
            ws.update_load(random_load(rng, wid))
        keys = expected_keys(ws)
        assert len(order) == len(keys) and all(order.key_of(w) == k for w, k in keys.items())
        excluded = rng.sample(sorted(keys), min(len(keys), 3))
        outside = {w: k for w, k in keys.items() if w not in excluded}
        found = order.cheapest(excluded)
        if not outside:
            assert found == []
            continue
        best = min(load_cost(k, WEIGHTS) for k in outside.values())
        bucket, count = found[0]
        assert bucket.cost == best
        assert count == sum(1 for k in outside.values() if k == bucket.key)
        members = {order.pick(bucket, i, excluded) for i in range(count)}
        assert members == {w for w, k in outside.items() if k == bucket.key}
    # one bucket per eligible load, by ascending cost: emptied buckets leave the order
    costs = [b.cost for b in order._in_order()]
    assert {b.key for b in order._in_order()} == set(keys.values()) and len(costs) == len(set(keys.values()))
    assert costs == sorted(costs) == [load_cost(b.key, WEIGHTS) for b in order._in_order()]


def test_idle_workers_share_one_bucket():
    ws = WorkerSet()
    order = LoadOrder(lambda key: load_cost(key, WEIGHTS))
    ws.watch(order)
    for i in range(1000):
        ws.add(f"w{i}")
    ws.update_load(WorkerLoad("w7", running=1))
    [(bucket, count)] = order.cheapest(["w3"])  # one bucket: the idle ones, w3 left out
    assert count == 998 and len(list(order._in_order())) == 2
    assert {order.pick(bucket, i, ["w3"]) for i in range(count)} == {f"w{i}" for i in range(1000)} - {"w3", "w7"}


def _cluster(rng: random.Random, num_workers: int, chains: list[list[int]]):
    index = KVIndex()
    seqs = collections.Counter()
    for i in range(num_workers):
        for chain in rng.sample(chains, 2):
            wid = f"w{i}"
            n = rng.randrange(len(chain) + 1)
            index.apply(KVEventBatch(wid, 0, seqs[wid], [BlockStored(chain[:n], None, n * B)]))
            seqs[wid] += 1
    return index


@pytest.mark.parametrize("list_members", [0, 16])  # a mask's groups never listed / as tuned
def test_kv_events_choice_equals_the_full_ranking_on_random_states(monkeypatch, list_members):
    """Two policies on one index: one chooses from a WorkerSet (holders + load order), the other ranks
    a plain list of the same workers (every worker costed); with loads drawn so that no two costs tie,
    every choice is the same, hysteresis and in-flight credit included (their pending records then
    evolve alike)."""
    monkeypatch.setattr(load_order, "LIST_MEMBERS", list_members)
    rng = random.Random(3)
    chains = [block_hashes([c] + list(range(40 * B)), B) for c in range(6)]
    index = _cluster(rng, 64, chains)
    fast = make_policy("kv_events", index=index, block_size=B, seed=0)
    full = make_policy("kv_events", index=index, block_size=B, seed=0)
    ws = WorkerSet()
    for i in range(64):
        ws.add(f"w{i}", cap=8)
        ws.update_load(random_load(rng, f"w{i}"))
    for step in range(400):
        for _ in range(5):
            ws.update_load(random_load(rng, f"w{rng.randrange(64)}"))
        chain = rng.choice(chains)
        hashes = chain[:rng.randrange(1, len(chain) + 1)] + block_hashes(
            [rng.randrange(1000) for _ in range(3 * B)], B, parent_hash=chain[0])
        request = RouteRequest(hashes, len(hashes) * B - rng.randrange(B))
        expected = full.rank(request, list(ws))
        assert fast.top(request, ws, 1) == expected[:1]
        assert fast.pending._records == full.pending._records


def test_kv_events_full_ranking_from_a_worker_set_is_the_list_ranking():
    rng = random.Random(4)
    chains = [block_hashes([c] + list(range(20 * B)), B) for c in range(3)]
    index = _cluster(rng, 32, chains)
    fast = make_policy("kv_events", index=index, block_size=B, seed=0, pending_requests=0)
    full = make_policy("kv_events", index=index, block_size=B, seed=0, pending_requests=0)
    ws = WorkerSet()
    for i in range(32):
        ws.add(f"w{i}", cap=4)
        ws.update_load(random_load(rng, f"w{i}"))
    for chain in chains:
        request = RouteRequest(chain, len(chain) * B)
        assert fast.top(request, ws, None) == full.rank(request, list(ws))


def test_kv_events_breaks_a_tie_over_every_tied_worker_holders_and_idle_alike():
    index = KVIndex()
    chain = block_hashes(list(range(4 * B)), B)
    for wid in ("w1", "w5"):  # hold 2 of the 4 blocks: cheaper than the idle workers
        index.apply(KVEventBatch(wid, 0, 0, [BlockStored(chain[:2], None, 2 * B)]))
    index.apply(KVEventBatch("w9", 0, 0, [BlockStored(chain[:2], None, 2 * B)]))
    p = make_policy("kv_events", index=index, block_size=B, seed=0, pending_requests=0)
    ws = WorkerSet()
    for i in range(12):
        ws.add(f"w{i}")
    ws.update_load(WorkerLoad("w9", running=1))  # a holder, but busier: never first
    request = RouteRequest(chain, 4 * B)
    assert collections.Counter(p.top(request, ws, 1)[0] for _ in range(300)).keys() == {"w1", "w5"}
    cold = RouteRequest(block_hashes(list(range(100, 100 + 4 * B)), B), 4 * B)  # nobody holds it
    firsts = collections.Counter(p.top(cold, ws, 1)[0] for _ in range(2000))
    assert set(firsts) == {f"w{i}" for i in range(12)} - {"w9"}


@pytest.mark.parametrize("chunk_buckets, chunk_sqrt", [(1, 0), (4, 0), (64, 0), (1, 2)])
def test_chunks_keep_the_sorted_buckets_and_their_union_through_moves(monkeypatch, chunk_buckets, chunk_sqrt):
    """The chunks concatenate to the buckets by cost, each holds the union of its buckets' masks (and
    a length within bounds, for a fixed target), and cheapest_in of masks of every density (by the
    chunks: LIST_MEMBERS 0) is the brute-force cheapest members, through joins, moves between loads,
    ties and departures."""
    monkeypatch.setattr(load_order, "CHUNK_BUCKETS", chunk_buckets)
    monkeypatch.setattr(load_order, "CHUNK_SQRT", chunk_sqrt)
    monkeypatch.setattr(load_order, "LIST_MEMBERS", 0)
    rng = random.Random(6)
    num_workers = 400
    order = LoadOrder(lambda key: load_cost(key, WEIGHTS), slot_of=lambda w: int(w[1:]))
    keys: dict[str, LoadKey] = {}
    for step in range(3000):
        wid = f"w{rng.randrange(num_workers)}"
        if rng.random() < 0.05:
            key = None
        else:  # a few loads shared (tied buckets), most distinct
            key = LoadKey(float(rng.choice([0, 256, rng.randrange(10**4)])), float(rng.randrange(10**5)),
                          rng.choice([0.0, 0.5]), float(rng.randrange(4))) if rng.random() < 0.7 else LoadKey(
                          0.0, 0.0, 0.0, float(rng.randrange(3)))
        order.update(wid, key)
        if key is None:
            keys.pop(wid, None)
        else:
            keys[wid] = key
        if step % 50:
            continue
        chunks = order._chunks
        buckets = [b for chunk in chunks for b in chunk.buckets]
        assert buckets == list(order._in_order())
        assert [b.cost for b in buckets] == sorted(b.cost for b in buckets)
        assert {b.key for b in buckets} == set(keys.values())
        for chunk in chunks:
            assert list(chunk.costs) == [b.cost for b in chunk.buckets]
            assert all(b.chunk is chunk for b in chunk.buckets)
            union = 0
            for b in chunk.buckets:
                assert not union & b.mask and b.mask == sum(1 << int(w[1:]) for w in b.members)
                union |= b.mask
            assert chunk.mask == union
            if not chunk_sqrt and len(chunks) > 1:
                assert chunk_buckets // 2 <= len(chunk.buckets) <= 2 * chunk_buckets
        for density in (0.005, 0.05, 0.3, 1.0):
            members = [w for w in range(num_workers) if rng.random() < density]
            mask = sum(1 << w for w in members)
            [groups] = order.cheapest_in([mask], 1e-6)
            inside = {keys[f"w{w}"] for w in members if f"w{w}" in keys}
            if not inside:
                assert groups == []
                continue
            best = min(load_cost(k, WEIGHTS) for k in inside)
            assert [(g.cost, g.key) for g in groups] == sorted(
                (load_cost(k, WEIGHTS), k) for k in inside if load_cost(k, WEIGHTS) <= best + 1e-6)
            for g in groups:
                assert g.mask == sum(1 << w for w in members if keys.get(f"w{w}") == g.key)
