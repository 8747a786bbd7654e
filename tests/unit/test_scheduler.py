"""The scheduler driven with no model: admission, chunked prefill, preemption, prefix hits, block ids.

Each step runs as the engine runs it synchronously (Engine.step with async scheduling off): schedule,
count the scheduled tokens as computed, give each request that samples one token, register full
blocks, finish requests that reached max_tokens. A plan is (request id, tokens computed, samples?)
per scheduled request, in the order the runner receives them.
"""

import pytest

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockRemoved
from kvmesh.sampling_params import SamplingParams
from kvmesh.worker.block_manager import BlockManager
from kvmesh.worker.scheduler import Scheduler
from kvmesh.worker.sequence import Request, RequestStatus

B = 4
SALT = b"scheduler-test"
SAMPLED_TOKEN = 1


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int = 1) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, temperature=0), B, SALT)


def make_scheduler(num_blocks: int = 16, max_num_batched_tokens: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, B), max_num_batched_tokens, max_num_seqs)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_step(scheduler: Scheduler) -> list[tuple[str, int, bool]]:
    output = scheduler.schedule()
    scheduler.advance(output)
    for entry in output.scheduled:
        request = entry.request
        if entry.samples:
            request.append_token(SAMPLED_TOKEN)
        scheduler.cache_computed_blocks(request)
        if entry.samples and request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish(request)
    return [(e.request.request_id, e.num_new_tokens, e.samples) for e in output.scheduled]


def run_to_completion(scheduler: Scheduler, max_steps: int = 100) -> list[list[tuple[str, int, bool]]]:
    plans = []
    while scheduler.has_unfinished():
        assert len(plans) < max_steps, "the scheduler made no progress"
        plans.append(run_step(scheduler))
    return plans


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


# ---- admission -------------------------------------------------------------------------------

def test_admission_stops_at_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for i, name in enumerate("abc"):
        scheduler.add(make_request(name, tokens(10 * i, 5)))
    assert run_step(scheduler) == [("a", 5, True), ("b", 5, True)]
    assert waiting_ids(scheduler) == ["c"]


def test_admission_fills_the_token_budget_in_arrival_order_and_chunks_the_last():
    scheduler = make_scheduler(max_num_batched_tokens=12)
    for i, name in enumerate("abcd"):
        scheduler.add(make_request(name, tokens(10 * i, 5)))
    assert run_step(scheduler) == [("a", 5, True), ("b", 5, True), ("c", 2, False)]
    assert waiting_ids(scheduler) == ["d"]


def test_a_request_waits_while_the_pool_lacks_blocks_for_its_chunk():
    scheduler = make_scheduler(num_blocks=3)
    scheduler.add(make_request("a", tokens(0, 9), max_tokens=2))  # 3 blocks: the whole pool
    scheduler.add(make_request("b", tokens(100, 3)))
    assert run_step(scheduler) == [("a", 9, True)]
    assert waiting_ids(scheduler) == ["b"]
    assert run_to_completion(scheduler) == [[("a", 1, True)], [("b", 3, True)]]


# ---- chunked prefill -------------------------------------------------------------------------

def test_a_long_prompt_is_chunked_at_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("a", tokens(0, 20), max_tokens=2))
    assert run_to_completion(scheduler) == [
        [("a", 8, False)], [("a", 8, False)], [("a", 4, True)], [("a", 1, True)]]


def test_decodes_take_the_budget_first_then_a_prompt_chunk_takes_the_rest():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("a", tokens(0, 4), max_tokens=3))
    assert run_step(scheduler) == [("a", 4, True)]
    scheduler.add(make_request("b", tokens(100, 20)))
    assert run_to_completion(scheduler) == [
        [("a", 1, True), ("b", 7, False)], [("a", 1, True), ("b", 7, False)], [("b", 6, True)]]


# ---- preemption ------------------------------------------------------------------------------

def two_requests_filling_a_four_block_pool() -> tuple[Scheduler, Request, Request]:
    """a and b hold blocks [0, 1] and [2, 3], each 8 computed tokens and 9 known: a's next decode
    needs a fifth block."""
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_request("a", tokens(0, 7), max_tokens=4), make_request("b", tokens(100, 7), max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    assert run_step(scheduler) == [("a", 7, True), ("b", 7, True)]
    assert run_step(scheduler) == [("a", 1, True), ("b", 1, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    return scheduler, a, b


def test_out_of_blocks_the_newest_running_request_is_preempted_and_its_blocks_freed():
    scheduler, a, b = two_requests_filling_a_four_block_pool()
    assert run_step(scheduler) == [("a", 1, True)]
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, [], 0, 1)
    assert waiting_ids(scheduler) == ["b"]
    assert a.block_ids == [0, 1, 3]  # b's blocks were freed last block first: 3 is reused first


def test_a_preempted_request_is_recomputed_from_its_cached_prefix_and_finishes():
    scheduler, a, b = two_requests_filling_a_four_block_pool()
    plans = run_to_completion(scheduler)
    # b's 9 known tokens: its first block (still cached) is hit, the other 5 are recomputed
    assert plans == [[("a", 1, True)], [("a", 1, True)], [("b", 5, True)], [("b", 1, True)]]
    assert (a.num_output_tokens, b.num_output_tokens) == (4, 4)
    assert scheduler.num_preemptions == 1
    assert scheduler.block_manager.num_free_blocks == 4


def test_a_request_that_cannot_grow_alone_preempts_itself_and_nothing_is_scheduled():
    scheduler = make_scheduler(num_blocks=2)
    a = make_request("a", tokens(0, 7), max_tokens=4)
    scheduler.add(a)
    run_step(scheduler)
    run_step(scheduler)  # 8 tokens computed, 9 known: the next decode needs a third block
    assert run_step(scheduler) == []
    assert (a.status, a.block_ids, waiting_ids(scheduler)) == (RequestStatus.WAITING, [], ["a"])


# ---- prefix hits -----------------------------------------------------------------------------

def test_a_request_sharing_a_running_prefix_gets_its_cached_blocks():
    scheduler = make_scheduler()
    a = make_request("a", tokens(0, 12), max_tokens=5)
    scheduler.add(a)
    run_step(scheduler)  # a's 3 full prompt blocks are computed and cached
    b = make_request("b", tokens(0, 8) + [90, 91, 92], max_tokens=2)
    scheduler.add(b)
    assert run_step(scheduler) == [("a", 1, True), ("b", 3, True)]
    assert b.block_ids == [a.block_ids[0], a.block_ids[1], 4]
    assert b.num_cached_tokens == 8


def test_a_prefix_hit_leaves_at_least_one_prompt_token_to_compute():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", tokens(0, 12)))
    run_to_completion(scheduler)  # blocks 0, 1, 2 cached, then freed
    b = make_request("b", tokens(0, 12), max_tokens=2)  # the whole prompt is cached
    scheduler.add(b)
    assert run_step(scheduler) == [("b", 4, True)]  # 2 of the 3 blocks hit: the last token's logits are needed
    assert (b.block_ids, b.num_cached_tokens) == ([0, 1, 3], 8)


def test_no_prefix_hit_with_prefix_caching_off():
    scheduler = Scheduler(BlockManager(16, B, enable_prefix_caching=False), 64, 8)
    scheduler.add(make_request("a", tokens(0, 12)))
    run_to_completion(scheduler)
    b = make_request("b", tokens(0, 12))
    scheduler.add(b)
    assert run_step(scheduler) == [("b", 12, True)]
    assert b.num_cached_tokens == 0


def test_reviving_a_free_cached_prefix_counts_against_the_free_blocks():
    scheduler = make_scheduler(num_blocks=4)
    prompt = tokens(0, 5)
    scheduler.add(make_request("a", prompt))
    run_to_completion(scheduler)  # block 0 cached and free
    scheduler.add(make_request("z", tokens(100, 9), max_tokens=2))
    run_step(scheduler)  # z holds blocks 1, 2, 3: only the cached block 0 is free
    scheduler.add(make_request("c", prompt))  # hits block 0 and needs one more: 2 blocks, 1 free
    assert run_to_completion(scheduler) == [[("z", 1, True)], [("c", 1, True)]]


# ---- exact block ids and eviction order ------------------------------------------------------

def test_new_blocks_come_never_cached_first_then_lru_cached_tail_before_prefix():
    scheduler = make_scheduler(num_blocks=6)
    prompt_a = tokens(0, 9)
    scheduler.add(make_request("a", prompt_a))
    run_to_completion(scheduler)  # blocks [0, 1] cached, [2] partial; freed 2 (to the front), 1, 0
    scheduler.block_manager.take_events()
    b = make_request("b", tokens(100, 17), max_tokens=2)
    scheduler.add(b)
    run_step(scheduler)
    assert b.block_ids == [2, 3, 4, 5, 1]
    removed = [e for e in scheduler.block_manager.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=[block_hashes(prompt_a, B, SALT)[1]])]


def test_after_eviction_only_the_surviving_prefix_hits():
    scheduler = make_scheduler(num_blocks=6)
    scheduler.add(make_request("a", tokens(0, 9)))
    run_to_completion(scheduler)
    scheduler.add(make_request("b", tokens(100, 17)))  # evicts a's second block, keeps its first
    run_to_completion(scheduler)  # b freed: 1 (partial, to the front), then 5, 4, 3, 2
    c = make_request("c", tokens(0, 9), max_tokens=2)
    scheduler.add(c)
    assert run_step(scheduler) == [("c", 5, True)]
    assert c.block_ids == [0, 1, 5]  # 0 revived; then the never-cached 1 and the LRU cached 5


# ---- the priority policy ---------------------------------------------------------------------

def make_priority_scheduler(num_blocks: int = 16, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, B), 64, max_num_seqs, policy="priority")


def prioritized(request_id: str, priority: int, prompt: list[int], max_tokens: int = 1) -> Request:
    request = make_request(request_id, prompt, max_tokens)
    request.priority = priority
    return request


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority, got 'lifo'"):
        Scheduler(BlockManager(4, B), 64, 8, policy="lifo")


def test_fcfs_admits_in_arrival_order_whatever_the_priorities():
    scheduler = make_scheduler(max_num_seqs=1)
    for name, priority in (("a", 5), ("b", -1), ("c", 0)):
        scheduler.add(prioritized(name, priority, tokens(0, 3)))
    assert [step[0][0] for step in run_to_completion(scheduler)] == ["a", "b", "c"]


def test_priority_admits_the_lowest_value_first_and_arrival_breaks_ties():
    scheduler = make_priority_scheduler(max_num_seqs=1)
    for name, priority in (("a", 5), ("b", 0), ("c", -2), ("d", 0), ("e", 5), ("f", -2)):
        scheduler.add(prioritized(name, priority, tokens(10 * len(name), 3)))
    assert waiting_ids(scheduler) == ["c", "f", "b", "d", "a", "e"]
    assert [step[0][0] for step in run_to_completion(scheduler)] == ["c", "f", "b", "d", "a", "e"]


def test_a_later_urgent_request_is_admitted_before_earlier_waiting_ones_but_preempts_no_one():
    scheduler = make_priority_scheduler(max_num_seqs=1)
    scheduler.add(prioritized("slow", 3, tokens(0, 3), max_tokens=3))
    scheduler.add(prioritized("queued", 3, tokens(10, 3)))
    assert run_step(scheduler) == [("slow", 3, True)]
    scheduler.add(prioritized("urgent", -1, tokens(20, 3)))
    # the running request keeps its slot; the urgent one goes ahead of the one queued before it
    assert waiting_ids(scheduler) == ["urgent", "queued"]
    plans = run_to_completion(scheduler)
    assert [step[0][0] for step in plans] == ["slow", "slow", "urgent", "queued"]


def test_out_of_blocks_the_lowest_priority_running_request_is_preempted_not_the_newest():
    scheduler = make_priority_scheduler(num_blocks=4)
    a = prioritized("a", 7, tokens(0, 7), max_tokens=5)  # admitted first, the lowest priority
    b = prioritized("b", 1, tokens(100, 7), max_tokens=4)
    scheduler.add(a)
    assert run_step(scheduler) == [("a", 7, True)]
    scheduler.add(b)
    assert run_step(scheduler) == [("a", 1, True), ("b", 7, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    # a's decode needs a fifth block: a gives way (fcfs would preempt b, the newest)
    assert run_step(scheduler) == [("b", 1, True)]
    assert (a.status, a.block_ids, a.num_preemptions, b.num_preemptions) == (RequestStatus.WAITING, [], 1, 0)
    run_to_completion(scheduler)
    assert (a.num_output_tokens, b.num_output_tokens, scheduler.num_preemptions) == (5, 4, 1)


def test_a_preempted_request_goes_back_to_its_place_in_the_priority_order():
    scheduler = make_priority_scheduler(num_blocks=4, max_num_seqs=2)
    a = prioritized("a", 7, tokens(0, 7), max_tokens=4)
    b = prioritized("b", 1, tokens(100, 7), max_tokens=4)
    scheduler.add(a)
    run_step(scheduler)
    scheduler.add(b)
    run_step(scheduler)
    scheduler.add(prioritized("late-urgent", 0, tokens(200, 3)))
    scheduler.add(prioritized("late-lax", 9, tokens(300, 3)))
    run_step(scheduler)  # a preempted
    assert waiting_ids(scheduler) == ["late-urgent", "a", "late-lax"]


def test_priority_with_equal_priorities_schedules_exactly_as_fcfs():
    def plans(scheduler):
        for i in range(6):
            scheduler.add(prioritized(f"r{i}", 0, tokens(50 * i, 5 + i), max_tokens=3 + i))
        return run_to_completion(scheduler)

    assert plans(make_priority_scheduler(num_blocks=10, max_num_seqs=3)) == \
        plans(Scheduler(BlockManager(10, B), 64, 3))


def test_a_victim_scheduled_earlier_in_the_step_is_taken_back_and_the_urgent_request_runs():
    scheduler = make_priority_scheduler(num_blocks=4)
    lax = prioritized("lax", 5, tokens(0, 5), max_tokens=5)  # admitted first: first in the running list
    urgent = prioritized("urgent", 0, tokens(100, 7), max_tokens=4)
    scheduler.add(lax)
    assert run_step(scheduler) == [("lax", 5, True)]
    scheduler.add(urgent)
    assert run_step(scheduler) == [("lax", 1, True), ("urgent", 7, True)]
    assert run_step(scheduler) == [("lax", 1, True), ("urgent", 1, True)]
    # lax's next token still fits its two blocks and is scheduled first; urgent's needs a fifth
    # block: lax, the lowest priority, is taken back out of this step and preempted
    assert run_step(scheduler) == [("urgent", 1, True)]
    assert (lax.status, lax.block_ids, lax.num_preemptions, urgent.num_preemptions) == (
        RequestStatus.WAITING, [], 1, 0)
    run_to_completion(scheduler)
    assert (lax.num_output_tokens, urgent.num_output_tokens) == (5, 4)
