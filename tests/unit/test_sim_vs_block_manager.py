"""The simulator's KV cache emits the same events as the worker's real BlockManager.

Both are driven through the same request lifecycle (look up the cached prefix, take it and reserve
the rest, cache the computed full blocks, release last block first) on the same pool size, and must
produce identical BlockStored / BlockRemoved sequences.
"""

import numpy as np

from kvmesh.hashing import block_hashes
from kvmesh.router.sim.cache import SimKVCache
from kvmesh.worker.block_manager import BlockManager

B = 4
POOL = 12


def run_real(requests):
    bm = BlockManager(POOL, B)
    events = []
    for tokens in requests:
        hashes = block_hashes(tokens, B)
        hits = bm.find_cached_prefix(tokens, hashes)
        bm.acquire(hits)
        new = bm.allocate(bm.blocks_needed(len(tokens)) - len(hits))
        table = hits + new
        bm.cache_blocks(table, hashes, tokens, start_block=len(hits))
        bm.release(table)
        events += bm.take_events()
    return events


def run_sim(requests):
    cache = SimKVCache(POOL, B)
    events = []
    for tokens in requests:
        hashes = block_hashes(tokens, B)
        limit = (len(tokens) - 1) // B
        hit = cache.match(hashes[:limit], limit)
        total = -(-len(tokens) // B)
        assert cache.allocate(hashes[:hit], total - hit)
        held = hashes[:hit] + cache.commit(hashes[hit:], hashes[hit - 1] if hit else None)
        cache.release(held, total - len(held))
        events += cache.take_events()
    return events


def test_same_events_as_the_block_manager_on_shared_prefixes_and_eviction():
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 50, 4 * B).tolist() for _ in range(3)]
    requests = []
    for i in range(40):
        prefix = prefixes[int(rng.integers(3))]
        suffix = rng.integers(0, 50, int(rng.integers(1, 3 * B))).tolist()
        requests.append(prefix + suffix if i % 5 else rng.integers(0, 50, 7 * B + 1).tolist())
    real, sim = run_real(requests), run_sim(requests)
    assert any(type(e).__name__ == "BlockRemoved" for e in real)  # the pool did evict
    assert sim == real
