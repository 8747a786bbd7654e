"""KVIndex: applies numbered event batches, resyncs on gaps and restarts, stays bounded."""

from kvmesh.hashing import block_hashes
from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot
from kvmesh.router.index import KVIndex

B = 16
PROMPT = list(range(5 * B))  # 5 full blocks
H = block_hashes(PROMPT, B)


def stored(hashes, parent_hash=None):
    return BlockStored(block_hashes=list(hashes), parent_hash=parent_hash, num_tokens=len(hashes) * B)


def batch(worker, seq, *events, epoch=0):
    return KVEventBatch(worker_id=worker, epoch=epoch, seq=seq, events=list(events))


def test_stored_blocks_give_leading_overlap_per_worker():
    index = KVIndex()
    assert index.apply(batch("a", 0, stored(H[:3])))
    assert index.apply(batch("b", 0, stored(H)))
    assert index.overlap(H) == {"a": 3, "b": 5}
    assert index.num_blocks == 5


def test_overlap_counts_only_leading_blocks():
    index = KVIndex()
    index.apply(batch("a", 0, stored([H[0], H[2], H[3]])))
    assert index.overlap(H) == {"a": 1}
    assert index.overlap(H[1:]) == {}


def test_overlap_restricted_to_given_workers():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H)))
    index.apply(batch("b", 0, stored(H[:2])))
    assert index.overlap(H, worker_ids=["b", "zz"]) == {"b": 2}


def test_removed_and_cleared_blocks_leave_the_index():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H)))
    index.apply(batch("b", 0, stored(H[:2])))
    assert index.apply(batch("a", 1, BlockRemoved([H[3], H[4]])))
    assert index.overlap(H) == {"a": 3, "b": 2}
    assert index.apply(batch("b", 1, AllCleared()))
    assert index.overlap(H) == {"a": 3}
    assert index.num_blocks == 3


def test_a_gap_drops_the_worker_and_asks_for_a_snapshot_then_replays_later_batches():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H[:2])))
    assert not index.apply(batch("a", 2, stored(H[2:3])))  # seq 1 was lost
    assert index.overlap(H) == {}
    assert index.awaiting_snapshot("a")
    assert index.apply(batch("a", 3, stored(H[3:4])))  # kept while the snapshot is on its way
    assert index.apply_snapshot(KVSnapshot(worker_id="a", epoch=0, seq=2, block_hashes=H[:3]))
    assert index.overlap(H) == {"a": 4}
    assert not index.awaiting_snapshot("a")
    assert index.num_resyncs == 1


def test_a_restart_is_a_new_epoch_and_needs_a_snapshot():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H)))
    assert not index.apply(batch("a", 0, stored(H[:1]), epoch=1))
    assert index.overlap(H) == {}
    assert index.apply_snapshot(KVSnapshot(worker_id="a", epoch=1, seq=0, block_hashes=H[:1]))
    assert index.overlap(H) == {"a": 1}
    assert index.apply(batch("a", 1, stored(H[1:2]), epoch=1))
    assert index.overlap(H) == {"a": 2}


def test_duplicate_or_stale_batches_are_ignored():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H[:2])))
    index.apply(batch("a", 1, BlockRemoved([H[1]])))
    assert index.apply(batch("a", 1, BlockRemoved([H[0]])))  # seq 1 again: already applied
    assert index.overlap(H) == {"a": 1}


def test_a_worker_first_seen_mid_stream_needs_a_snapshot():
    index = KVIndex()
    assert not index.apply(batch("a", 7, stored(H[:1])))
    assert index.apply(batch("a", 8, stored(H[1:2])))  # snapshot already asked for: no second ask
    assert index.apply_snapshot(KVSnapshot(worker_id="a", epoch=0, seq=7, block_hashes=H[:1]))
    assert index.overlap(H) == {"a": 2}


def test_up_to_1024_batches_wait_for_a_snapshot_and_the_rest_ask_for_another():
    """docs/ROUTING.md: after a gap the index keeps 1,024 batches (the one that showed it and those
    after) to replay past the snapshot; a batch beyond them is a gap again."""
    hashes = block_hashes(list(range(1200 * B)), B)
    index = KVIndex()
    index.apply(batch("a", 0, stored(hashes[:1])))
    assert not index.apply(batch("a", 2, stored(hashes[2:3])))  # seq 1 lost
    for seq in range(3, 1100):
        assert index.apply(batch("a", seq, stored(hashes[seq:seq + 1])))  # buffered, no second ask
    assert index.apply_snapshot(KVSnapshot(worker_id="a", epoch=0, seq=1, block_hashes=hashes[:2]))
    assert index.worker_blocks("a") == set(hashes[:1026])  # the snapshot, then seqs 2..1025
    assert not index.apply(batch("a", 1100, stored(hashes[1100:1101])))  # 1026.. were not kept
    assert index.awaiting_snapshot("a")


def test_a_snapshot_that_leaves_a_gap_asks_again():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H[:1])))
    assert not index.apply(batch("a", 5, stored(H[1:2])))
    assert not index.apply_snapshot(KVSnapshot(worker_id="a", epoch=0, seq=3, block_hashes=H[:1]))
    assert index.awaiting_snapshot("a")
    assert index.apply_snapshot(KVSnapshot(worker_id="a", epoch=0, seq=4, block_hashes=H[:1]))
    assert index.overlap(H) == {"a": 2}


def test_memory_bound_drops_least_recently_stored_first():
    index = KVIndex(max_blocks=3)
    index.apply(batch("a", 0, stored(H[:3])))
    index.apply(batch("b", 0, stored([H[0]])))  # H[0] stored again: now the most recent
    index.apply(batch("a", 1, stored([H[3]])))  # over the bound: H[1] is the oldest
    assert index.num_blocks == 3
    assert index.num_evicted == 1
    assert index.holders(H[1]) == []
    assert index.worker_blocks("a") == {H[0], H[2], H[3]}
    assert index.overlap(H) == {"a": 1, "b": 1}


def test_remove_worker_drops_only_its_blocks_and_frees_its_slot():
    index = KVIndex()
    index.apply(batch("a", 0, stored(H)))
    index.apply(batch("b", 0, stored(H[:2])))
    index.remove_worker("a")
    assert index.overlap(H) == {"b": 2}
    assert index.num_blocks == 2
    index.apply(batch("c", 0, stored(H[:1])))  # reuses a's slot: no stale bits
    assert index.overlap(H) == {"b": 2, "c": 1}
    assert index.worker_ids == ["b", "c"]


def test_approx_bytes_grows_with_blocks():
    index = KVIndex()
    empty = index.approx_bytes()
    index.apply(batch("a", 0, stored(block_hashes(list(range(1600)), B))))
    assert index.approx_bytes() > empty + 100 * 40


def test_overlap_matches_a_brute_force_count_on_random_holdings():
    import random
    rng = random.Random(0)
    hashes = block_hashes(list(range(40 * B)), B)
    index = KVIndex()
    holdings = {}
    for w in range(12):
        held = {h for h in hashes if rng.random() < 0.9} if w % 3 else set(hashes[:rng.randrange(40)])
        holdings[f"w{w}"] = held
        index.apply(batch(f"w{w}", 0, stored(sorted(held))))
    for trial in range(50):
        query = hashes[:rng.randrange(1, 41)]
        assert index.overlap(query) == _reference_overlap(holdings, query)


def test_a_chain_stored_by_the_same_workers_shares_one_run():
    # 600 workers: masks are multi-digit ints, one run (and mask) per stretch with the same holders,
    # not per block: the walk looks up one block per run, and the index stores far fewer ints.
    index = KVIndex()
    for k in range(600):
        index.add_worker(f"w{k}")
    index.apply(batch("w599", 0, stored(H)))
    index.apply(batch("w300", 0, stored(H)))
    index.apply(batch("w7", 0, stored(H[:3])))
    runs = [index._blocks[h] for h in H]
    assert runs[0] is runs[1] is runs[2] and runs[3] is runs[4] and runs[2] is not runs[3]
    assert [list(runs[0].hashes), list(runs[3].hashes)] == [H[:3], H[3:]]
    assert index.overlap(H) == {"w599": 5, "w300": 5, "w7": 3}
    index.apply(batch("w300", 1, BlockRemoved(block_hashes=list(H))))  # removal keeps them shared
    runs = [index._blocks[h] for h in H]
    assert runs[0] is runs[1] is runs[2] and runs[3] is runs[4]
    assert index.overlap(H) == {"w599": 5, "w7": 3}


def test_a_part_of_a_run_stored_or_removed_splits_it_and_the_walk_still_counts_per_block():
    index = KVIndex()
    chain = block_hashes(list(range(12 * B)), B)
    index.apply(batch("a", 0, stored(chain)))
    index.apply(batch("b", 0, stored(chain[:8])))
    index.apply(batch("a", 1, BlockRemoved(block_hashes=chain[4:6])))  # a hole in a's chain
    assert [list(index._blocks[h].hashes) for h in (chain[0], chain[4], chain[6], chain[8])] == [
        chain[:4], chain[4:6], chain[6:8], chain[8:]]
    assert index.overlap(chain) == {"a": 4, "b": 8}
    assert index.overlap(chain[6:]) == {"a": 6, "b": 2}  # a prompt may start inside a run


def test_a_chain_continued_by_its_only_holder_extends_its_run():
    """A conversation's turns, stored by one worker in an event each, are one run (one lookup for
    the walk); a block held by another worker too, or a parent that is not a run's last block,
    starts a new run. The walk's answers are per block either way."""
    index = KVIndex()
    chain = block_hashes(list(range(12 * B)), B)
    index.apply(batch("a", 0, stored(chain[:4])))
    index.apply(batch("a", 1, stored(chain[4:7], chain[3])))  # the next turn, by its parent
    index.apply(batch("a", 2, stored(chain[7:9], chain[6]), stored(chain[9:10], chain[8])))
    assert list(index._blocks[chain[0]].hashes) == chain[:10]
    index.apply(batch("b", 0, stored(chain[:2])))  # shared now: a's later blocks start a new run
    index.apply(batch("a", 3, stored(chain[10:11], chain[9])))
    assert list(index._blocks[chain[2]].hashes) == chain[2:11]
    index.apply(batch("b", 1, stored(chain[2:3], chain[1])))  # b's block is a's run's first: no merge
    assert list(index._blocks[chain[2]].hashes) == chain[2:3]
    assert list(index._blocks[chain[3]].hashes) == chain[3:11]
    assert index.overlap(chain) == {"b": 3, "a": 11}


def _reference_overlap(holdings: dict[str, set[int]], query: list[int]) -> dict[str, int]:
    expected = {}
    for wid, held in holdings.items():
        n = 0
        while n < len(query) and query[n] in held:
            n += 1
        if n:
            expected[wid] = n
    return expected


def test_runs_stay_consistent_under_random_stores_removals_evictions_and_snapshots():
    """Every hash maps to a run that lists it and holds exactly its holders' bits, and the walk
    equals a per-block count, after any mix of chain stores, partial removals, clears, snapshots,
    worker removals and LRU evictions."""
    import random
    rng = random.Random(1)
    chains = [block_hashes([c] * 3 + list(range(30 * B)), B) for c in range(4)]
    index = KVIndex(max_blocks=90)
    seqs: dict[str, int] = {}
    for step in range(600):
        wid = f"w{rng.randrange(6)}"
        chain = rng.choice(chains)
        lo = rng.randrange(len(chain))
        hi = rng.randrange(lo, len(chain)) + 1
        kind = rng.random()
        if kind < 0.02:
            index.remove_worker(wid)
            seqs.pop(wid, None)
            continue
        if kind < 0.05:
            seq = seqs.get(wid, 0)
            snap = sorted(rng.sample(chain, 10))
            index.apply(batch(wid, seq + 5, stored(chain[:1])))  # a gap: resync from the snapshot
            assert index.apply_snapshot(KVSnapshot(wid, 0, seq + 5, snap))
            seqs[wid] = seq + 6
            continue
        event = (stored(chain[:hi]) if kind < 0.4 else stored(chain[lo:hi], chain[lo - 1] if lo else None)
                 if kind < 0.6 else BlockRemoved(block_hashes=chain[lo:hi]) if kind < 0.97 else AllCleared())
        assert index.apply(batch(wid, seqs.get(wid, 0), event))
        seqs[wid] = seqs.get(wid, 0) + 1
        holdings = {w: index.worker_blocks(w) for w in index.worker_ids}
        for h, run in index._blocks.items():
            assert h in run.hashes and all(index._blocks[x] is run for x in run.hashes)
            assert set(index.holders(h)) == {w for w, held in holdings.items() if h in held}
        for query in (chain, chain[lo:], rng.choice(chains)[:hi]):
            assert index.overlap(query) == _reference_overlap(holdings, query)
