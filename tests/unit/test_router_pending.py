"""PendingPrefixes: the requests a router has just sent to a worker, before its events show them."""

import pytest

from kvmesh.hashing import block_hashes
from kvmesh.router.pending import PendingPrefixes

B = 4
BASE = list(range(10 * B))
H = block_hashes(BASE, B)  # 10 chained blocks


def sibling(shared_blocks: int, total_blocks: int = 10) -> list[int]:
    """A prompt sharing the first `shared_blocks` blocks with BASE, then different."""
    tokens = BASE[:shared_blocks * B] + [999] * ((total_blocks - shared_blocks) * B)
    return block_hashes(tokens, B)


def test_continuation_is_the_shared_length_from_the_recorded_start():
    pending = PendingPrefixes()
    pending.record(H, 0, "w0")
    for shared in (1, 2, 5, 9, 10):
        assert pending.continuation(sibling(shared), 0) == ("w0", shared, False)
    assert pending.continuation(H[:3], 0) == ("w0", 3, False)  # a shorter prompt, all of it in flight
    assert pending.continuation(sibling(0), 0) == (None, 0, False)


def test_a_record_starts_where_the_index_stops():
    pending = PendingPrefixes()
    pending.record(H, 4, "w1")  # w1 holds blocks 0-3 per the index; 4-9 are in flight
    assert pending.continuation(sibling(7), 4) == ("w1", 3, False)
    assert pending.continuation(H, 0) == (None, 0, False)  # no record starts at block 0
    assert pending.continuation(H, 10) == (None, 0, False)  # nothing past the end
    pending.record(H, 10, "w2")  # nothing to compute: nothing recorded
    assert len(pending) == 1


def test_the_latest_request_from_the_same_start_wins():
    pending = PendingPrefixes()
    pending.record(H, 0, "w0")
    pending.record(sibling(6), 0, "w1")
    assert pending.continuation(H, 0) == ("w1", 6, False)


def test_bounded_to_the_most_recent_requests():
    pending = PendingPrefixes(max_requests=2)
    chains = [block_hashes([k] * 2 * B, B) for k in range(3)]
    for k, chain in enumerate(chains):
        pending.record(chain, 0, f"w{k}")
    assert len(pending) == 2
    assert pending.continuation(chains[0], 0) == (None, 0, False)
    assert pending.continuation(chains[2], 0) == ("w2", 2, False)


def test_forget_worker_drops_only_its_records():
    pending = PendingPrefixes()
    pending.record(H, 0, "w0")
    other = block_hashes([5] * 2 * B, B)
    pending.record(other, 0, "w1")
    pending.forget_worker("w0")
    assert len(pending) == 1 and pending.continuation(other, 0) == ("w1", 2, False)


def test_rejects_an_empty_bound():
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        PendingPrefixes(0)
