"""Block manager: exact block ids, LRU eviction order, reference counts, revival, events."""

from kvmesh.hashing import block_hashes
from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored
from kvmesh.worker.block_manager import BlockManager

B = 4


def tokens(start, n):
    return list(range(start, start + n))


def cache_sequence(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """Allocate and cache all full blocks of a sequence, as the scheduler does after computing it."""
    hashes = block_hashes(token_ids, B)
    ids = bm.allocate(bm.blocks_needed(len(token_ids)))
    bm.cache_blocks(ids[:len(hashes)], hashes, token_ids, 0)
    return ids


def test_allocate_takes_lowest_free_ids_in_order():
    bm = BlockManager(8, B)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    assert bm.num_free_blocks == 3


def test_cached_prefix_found_and_capped_to_leave_one_token():
    bm = BlockManager(8, B)
    seq = tokens(100, 12)  # three full blocks
    ids = cache_sequence(bm, seq)
    assert ids == [0, 1, 2]
    hashes = block_hashes(seq, B)
    # the whole prompt is cached, but the last token must be computed: only 2 blocks hit
    assert bm.find_cached_prefix(seq, hashes) == [0, 1]
    longer = seq + [7, 7]
    assert bm.find_cached_prefix(longer, block_hashes(longer, B)) == [0, 1, 2]
    other = tokens(500, 12)
    assert bm.find_cached_prefix(other, block_hashes(other, B)) == []


def test_reference_counts_and_revival_from_free_list():
    bm = BlockManager(6, B)
    seq = tokens(0, 9)
    ids = cache_sequence(bm, seq)  # blocks 0,1 full and cached; 2 partial
    bm.release(ids)
    assert bm.num_free_blocks == 6
    assert all(bm.blocks[i].ref_count == 0 for i in ids)
    hits = bm.find_cached_prefix(seq, block_hashes(seq, B))
    assert hits == [0, 1]
    bm.acquire(hits)  # revived: off the free list, ref 1
    assert bm.num_free_blocks == 4
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.acquire(hits)  # a second sharer
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    bm.release(hits)
    assert bm.num_free_blocks == 4  # still held once


def test_eviction_order_uncached_first_then_lru_tail_before_prefix():
    bm = BlockManager(6, B)
    seq_a, seq_b = tokens(0, 10), tokens(100, 8)
    a = cache_sequence(bm, seq_a)  # [0,1] cached, [2] partial (nothing cached)
    b = cache_sequence(bm, seq_b)  # [3,4] cached
    assert (a, b) == ([0, 1, 2], [3, 4])
    bm.release(a)  # freed in reverse: 2 (uncached: to the front), then 1, then 0
    bm.release(b)  # then 4, then 3
    bm.take_events()
    # never-cached blocks go first (2 moved to the front, then 5), then the LRU of cached ones
    assert bm.allocate(2) == [2, 5]
    assert bm.take_events() == []
    ha, hb = block_hashes(seq_a, B), block_hashes(seq_b, B)
    assert bm.allocate(1) == [1]  # a's tail block before its prefix
    assert bm.take_events() == [BlockRemoved(block_hashes=[ha[1]])]
    assert bm.allocate(3) == [0, 4, 3]
    assert bm.take_events() == [BlockRemoved(block_hashes=[ha[0], hb[1], hb[0]])]
    assert bm.cached_hashes() == []


def test_stored_events_carry_router_hashes_and_parents():
    bm = BlockManager(8, B)
    seq = tokens(0, 12)
    hashes = block_hashes(seq, B, salt=b"m")
    ids = bm.allocate(3)
    bm.cache_blocks(ids[:1], hashes[:1], seq, 0)
    bm.cache_blocks(ids, hashes, seq, 1)
    assert bm.take_events() == [
        BlockStored(block_hashes=[hashes[0]], parent_hash=None, num_tokens=4),
        BlockStored(block_hashes=hashes[1:], parent_hash=hashes[0], num_tokens=8),
    ]


def test_duplicate_content_is_cached_once():
    bm = BlockManager(8, B)
    seq = tokens(0, 8)
    cache_sequence(bm, seq)
    bm.take_events()
    second = cache_sequence(bm, seq)  # computed again concurrently: not registered twice
    assert second == [2, 3]
    assert bm.take_events() == []
    assert bm.blocks[2].block_hash is None


def test_hash_collision_is_a_miss():
    bm = BlockManager(8, B)
    seq = tokens(0, 8)
    cache_sequence(bm, seq)
    forged = tokens(50, 8) + [1]
    # pretend another prompt hashes the same as `seq` (a collision): token check rejects it
    assert bm.find_cached_prefix(forged, block_hashes(seq, B)) == []


def test_reset_prefix_cache_emits_all_cleared():
    bm = BlockManager(8, B)
    ids = cache_sequence(bm, tokens(0, 8))
    assert not bm.reset_prefix_cache()  # a running sequence still holds cached blocks
    bm.release(ids)
    bm.take_events()
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllCleared()]
    assert bm.cached_hashes() == []
