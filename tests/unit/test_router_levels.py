"""Holder levels (KVIndex.levels), the load order's groups of a mask (LoadOrder.cheapest_in,
pick_in) and the kv_events choice made from them: checked against brute force and against the
choice as it was made before levels (every holder listed and costed, LoadOrder.cheapest with the
holders excluded), which is kept here as the reference: same seed, same choices, ties included."""

import collections
import random

import numpy as np
import pytest

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored, KVEventBatch, WorkerLoad
from kvmesh.router import CostWeights, KVIndex, RouteRequest, WorkerSet, make_policy
from kvmesh.router import load_order as load_order_module
from kvmesh.router.cost import load_cost, worker_cost, worker_costs
from kvmesh.router.index import bit_positions
from kvmesh.router.load_order import LoadKey, LoadOrder
from kvmesh.router.policies.kv_events import TIE_SLACK, in_flight_credit

B = 16
WEIGHTS = CostWeights()


def test_levels_group_the_overlap_by_length_in_its_order():
    rng = random.Random(0)
    hashes = block_hashes(list(range(30 * B)), B)
    index = KVIndex()
    for w in range(300):
        n = rng.choice([0, 3, 3, 10, 30, rng.randrange(31)])
        if n:
            index.apply(KVEventBatch(f"w{w}", 0, 0, [BlockStored(hashes[:n], None, n * B)]))
    for query in (hashes, hashes[:5], hashes[2:], hashes[:1], []):
        levels = index.levels(query)
        assert [n for n, _ in levels] == sorted({n for n, _ in levels})
        assert all(mask for _, mask in levels)
        listed = [(index.worker_at(slot), n) for n, mask in levels for slot in bit_positions(mask)]
        assert listed == list(index.overlap(query).items())  # same answer, same order
        union = 0
        for _, mask in levels:
            assert not union & mask  # disjoint
            union |= mask


def test_bit_positions_lists_the_set_bits_lowest_first():
    rng = random.Random(1)
    for _ in range(300):
        mask = rng.getrandbits(rng.randrange(1, 5000)) & rng.getrandbits(5000)
        assert bit_positions(mask) == [i for i in range(mask.bit_length()) if mask >> i & 1]
    for count in range(200):  # every way by its number of bits: cleared one by one, found in text, numpy
        slots = sorted(rng.sample(range(4096), count))
        assert bit_positions(sum(1 << s for s in slots)) == slots


def test_worker_cost_is_worker_costs_bit_for_bit():
    rng = random.Random(2)
    ws = WorkerSet()
    for i in range(200):
        ws.add(f"w{i}")
        ws.update_load(_load(rng, f"w{i}"))
    cols = ws.columns()
    cached = np.array([rng.choice([0, 16, 31, 4096]) for _ in range(200)], dtype=np.float64)
    for weights in (WEIGHTS, CostWeights(running_decode=0.0, kv_pressure=3.3, outstanding=0.0)):
        expected = worker_costs(5000, cached, cols, weights).tolist()
        got = [worker_cost(5000, int(cached[i]), _key(cols, i), weights) for i in range(200)]
        assert got == expected


# LoadOrder's (LIST_MEMBERS, CHUNK_BUCKETS, CHUNK_SQRT): by the chunks always, in one chunk / chunks of
# 1-2 buckets / as tuned; each by its size with chunks of 2-4 and 3-6 buckets; listed always
WAYS = [(0, 10**6, 0), (0, 1, 0), (0, 64, 2), (5, 2, 0), (5, 3, 0), (10**6, 64, 2)]


def _set_ways(monkeypatch, way):
    for name, value in zip(("LIST_MEMBERS", "CHUNK_BUCKETS", "CHUNK_SQRT"), way):
        monkeypatch.setattr(load_order_module, name, value)


@pytest.mark.parametrize("way", WAYS)
def test_cheapest_in_is_the_first_buckets_holding_a_member_of_each_mask(monkeypatch, way):
    _set_ways(monkeypatch, way)
    rng = random.Random(3)
    index = KVIndex()
    ws = WorkerSet()
    order = LoadOrder(lambda key: load_cost(key, WEIGHTS), slot_of=index.slot)
    ws.watch(order)
    for step in range(1500):
        wid = f"w{rng.randrange(60)}"
        if wid not in ws:
            ws.add(wid, cap=rng.choice([None, 4]))
        elif rng.random() < 0.03:
            ws.remove(wid)
            index.remove_worker(wid)
        else:
            ws.update_load(_load(rng, wid, few=True))
        keys = {w: order.key_of(w) for w in ws.ids if order.key_of(w) is not None}
        assert order.mask == sum(1 << index.slot(w) for w in keys)
        masks = [rng.getrandbits(64) for _ in range(3)]
        for mask, groups in zip(masks, order.cheapest_in(masks, TIE_SLACK)):
            inside = {w: k for w, k in keys.items() if mask >> index.slot(w) & 1}
            if not inside:
                assert groups == []
                continue
            costs = {k: load_cost(k, WEIGHTS) for k in inside.values()}
            best = min(costs.values())
            expected = sorted((c, k) for k, c in costs.items() if c <= best + TIE_SLACK)
            assert [(g.cost, g.key) for g in groups] == expected
            for g in groups:
                members = {w for w, k in inside.items() if k == g.key}
                assert g.mask == sum(1 << index.slot(w) for w in members)
                # pick_in: the bucket's order with the rest excluded, as pick
                excluded = [w for w, k in keys.items() if k == g.key and w not in members]
                bucket = load_order_module.Bucket(g.cost, g.key, order.members_of(g.key))
                assert [order.pick_in(g, i) for i in range(len(members))] == [
                    order.pick(bucket, i, excluded) for i in range(len(members))]


def _load(rng: random.Random, wid: str, few: bool = False) -> WorkerLoad:
    if few:  # few distinct loads: buckets shared, costs tied
        return WorkerLoad(wid, running=rng.randrange(3), waiting=rng.randrange(2),
                          waiting_prefill_tokens=rng.choice([0, 256]), kv_free_blocks=rng.choice([1000, 500]),
                          kv_total_blocks=1000, healthy=rng.random() > 0.05)
    return WorkerLoad(wid, running=rng.randrange(6), waiting=rng.randrange(3),
                      waiting_prefill_tokens=rng.randrange(5000), running_decode_tokens=rng.randrange(10**6),
                      kv_free_blocks=rng.randrange(1000), kv_total_blocks=1000, healthy=rng.random() > 0.05)


def _key(cols, i) -> LoadKey:
    return LoadKey(float(cols.waiting_prefill_tokens[i]), float(cols.running_decode_tokens[i]),
                   float(cols.kv_usage[i]), float(cols.outstanding[i]))


# ---- the choice before levels, as the reference ---------------------------------------------------

class ListingChoice:
    """kv_events' choice before holder levels (git 786df4a, `_choose`): every eligible holder listed
    and costed, the load order's cheapest buckets with the holders excluded; ties over holders (in
    overlap order), the worker with the prefix in flight, then the buckets' members."""

    def __init__(self, policy):
        self.p = policy
        self.order = LoadOrder(lambda key: load_cost(key, policy.weights))

    def top1(self, request: RouteRequest, ws: WorkerSet) -> str | None:
        p, cols = self.p, ws.columns()
        held, overlaps = p._holdings(request, cols)
        in_flight = p._in_flight(request, cols, overlaps)
        eligible = cols.eligible
        scored = {row: tokens for row, tokens in held.items() if eligible[row]}
        if in_flight is not None and eligible[in_flight[0]]:
            scored.setdefault(in_flight[0], 0.0)
        excluded = [cols.ids[row] for row in scored]
        buckets = self.order.cheapest(excluded, TIE_SLACK)
        rows = list(scored) + [cols.row(bucket.members[0]) for bucket, _ in buckets]
        if not rows:
            return None
        cached = np.zeros(len(rows))
        cached[:len(scored)] = list(scored.values())
        longest = max(held.values(), default=0.0) + (
            in_flight[1] if in_flight is not None and eligible[in_flight[0]] else 0)
        weights = p.weights_for(request.num_prompt_tokens, longest)
        cost = worker_costs(request.num_prompt_tokens, cached, cols, weights, np.array(rows)).tolist()
        if in_flight is not None and in_flight[0] in scored:
            cost[list(scored).index(in_flight[0])] -= in_flight_credit(weights, in_flight[2]) * in_flight[1]
        best_cost = min(cost)
        tied = [row for row, c in zip(rows, cost[:len(scored)]) if c == best_cost]
        tied_buckets = [(b, n) for (b, n), c in zip(buckets, cost[len(scored):]) if c == best_cost]
        num_tied = len(tied) + sum(n for _, n in tied_buckets)
        pick = int(p._rng.integers(num_tied)) if num_tied > 1 else 0
        if pick < len(tied):
            best = tied[pick]
        else:
            pick -= len(tied)
            for bucket, n in tied_buckets:
                if pick < n:
                    best = cols.row(self.order.pick(bucket, pick, excluded))
                    break
                pick -= n
        if held and p.weights.stay_margin > 0:
            costs = dict(zip(rows, cost))
            costs.setdefault(best, best_cost)
            stay = p._holder_that_stays(costs, held, eligible, best, request.num_prompt_tokens)
            if stay is not None:
                best = stay
        wid = cols.ids[best]
        p.pending.record(request.block_hashes, overlaps.get(wid, 0), wid)
        return wid


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("few_loads", [True, False])
def test_kv_events_choice_by_levels_is_the_listing_choice_on_random_states(monkeypatch, way, few_loads):
    """One index, two policies with one seed: the levels choice and the listing reference make the
    same choices, ties (few distinct loads) and hysteresis and in-flight credit included, and keep
    the same pending records."""
    _set_ways(monkeypatch, way)
    rng = random.Random(5)
    # chains 0-5 held up to their end, 6-7 only their first 5 blocks, 8-9 by nobody: the last two
    # kinds give prefixes in flight (on a holder of the longest prefix, and on a worker holding none)
    chains = [block_hashes([c] + list(range(40 * B)), B) for c in range(10)]
    index = KVIndex()
    seqs = collections.Counter()
    num_workers = 96
    for i in range(num_workers):
        for c in rng.sample(range(8), 3 if i % 2 else 1):
            chain = chains[c] if c < 6 else chains[c][:5]
            n = rng.choice([0, 5, 5, 20, 40, rng.randrange(41)]) if c < 6 else rng.randrange(6)
            index.apply(KVEventBatch(f"w{i}", 0, seqs[i], [BlockStored(chain[:n], None, n * B)]))
            seqs[i] += 1
    fast = make_policy("kv_events", index=index, block_size=B, seed=0)
    reference = ListingChoice(make_policy("kv_events", index=index, block_size=B, seed=0))
    ws = WorkerSet()
    ws.watch(reference.order)
    for i in range(num_workers):
        ws.add(f"w{i}", cap=6)
        ws.update_load(_load(rng, f"w{i}", few_loads))
    choices = collections.Counter()
    for step in range(500):
        for _ in range(5):
            ws.update_load(_load(rng, f"w{rng.randrange(num_workers)}", few_loads))
        chain = rng.choice(chains)
        hashes = chain[:rng.randrange(1, len(chain) + 1)] + block_hashes(
            [rng.randrange(1000) for _ in range(rng.choice([0, 3]) * B)], B, parent_hash=chain[0])
        request = RouteRequest(hashes, len(hashes) * B - rng.randrange(B))
        expected = reference.top1(request, ws)
        assert fast.top(request, ws, 1) == [expected]
        assert fast.pending._records == reference.p.pending._records
        choices[expected] += 1
    assert len(choices) > 20  # the cases spread over the workers, not one answer
