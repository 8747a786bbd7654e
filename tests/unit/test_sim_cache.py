"""SimKVCache: the block manager's prefix-cache rules and the exact events they emit."""

from kvmesh.protocol import BlockRemoved, BlockStored
from kvmesh.router.sim.cache import SimKVCache


def test_committed_blocks_are_stored_in_chain_order_and_matched():
    cache = SimKVCache(capacity_blocks=8, block_size=16)
    assert cache.allocate([], 3)
    assert cache.commit([11, 12, 13], parent_hash=None) == [11, 12, 13]
    assert cache.take_events() == [BlockStored([11, 12, 13], None, 48)]
    assert cache.match([11, 12, 99], max_blocks=10) == 2
    assert cache.match([11, 12, 13], max_blocks=1) == 1
    assert cache.num_free == 5


def test_released_blocks_stay_cached_and_are_revived_by_a_hit():
    cache = SimKVCache(capacity_blocks=4, block_size=16)
    cache.allocate([], 2)
    held = cache.commit([1, 2], None)
    cache.release(held, 0)
    assert cache.num_free == 4 and cache.match([1, 2], 10) == 2
    assert cache.allocate([1, 2], 1)  # revive both, one new block
    assert cache.refs == {1: 1, 2: 1} and cache.private == 1
    assert cache.take_events() == [BlockStored([1, 2], None, 32)]  # no removal: nothing evicted


def test_eviction_reuses_the_least_recent_free_block_last_block_first():
    cache = SimKVCache(capacity_blocks=4, block_size=16)
    cache.allocate([], 3)
    cache.release(cache.commit([1, 2, 3], None), 0)  # freed 3, 2, 1: 3 is reused first
    cache.take_events()
    assert cache.allocate([], 2)  # one blank block + one eviction
    assert cache.take_events() == [BlockRemoved([3])]
    assert cache.match([1, 2, 3], 10) == 2


def test_allocation_that_does_not_fit_changes_nothing():
    cache = SimKVCache(capacity_blocks=4, block_size=16)
    cache.allocate([], 2)
    cache.commit([1, 2], None)
    assert not cache.allocate([], 3)
    assert cache.private == 0 and cache.refs == {1: 1, 2: 1} and cache.num_free == 2


def test_a_block_computed_twice_keeps_one_cached_copy():
    cache = SimKVCache(capacity_blocks=8, block_size=16)
    cache.allocate([], 2)
    cache.allocate([], 2)
    assert cache.commit([1, 2], None) == [1, 2]
    assert cache.commit([1, 2], None) == []  # the duplicate stays private
    assert cache.private == 2
    cache.release([1, 2], 0)
    cache.release([], 2)
    assert cache.num_free == 8 and list(cache.free_cached) == [2, 1]


def test_a_run_broken_by_an_already_cached_block_is_stored_as_two_events():
    cache = SimKVCache(capacity_blocks=8, block_size=16)
    cache.allocate([], 1)
    cache.commit([2], parent_hash=1)
    cache.take_events()
    cache.allocate([], 4)
    assert cache.commit([1, 2, 3, 4], parent_hash=None) == [1, 3, 4]
    assert cache.take_events() == [BlockStored([1], None, 16), BlockStored([3, 4], 2, 32)]
