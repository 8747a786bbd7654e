"""Parallel sampling (n > 1, best_of): the prompt is prefilled once and its blocks shared by
reference count; the partial last block is copied on write; greedy sequences equal the n = 1
output; seeded sequence i equals an n = 1 request with seed + i; best_of keeps the n sequences
with the highest cumulative logprob; a group is admitted, preempted and aborted as a whole."""

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.protocol import EngineRequest
from kvmesh.worker.block_manager import BlockManager
from kvmesh.worker.scheduler import Scheduler
from kvmesh.worker.sequence import Request

MODEL = "random:tiny-llama"
B = 4
SALT = b"parallel-test"


# ---- the scheduler and block manager, no model ------------------------------------------------

def make_group(request_id: str, prompt: list[int], n: int, max_tokens: int = 4) -> Request:
    """A request of n sequences as Engine.add_request makes it."""
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0)
    sequences = [Request(request_id, prompt, params, B, SALT) for _ in range(n)]
    for i, seq in enumerate(sequences):
        seq.index, seq.group = i, sequences
    sequences[0].pending_forks = sequences[1:]
    return sequences[0]


def group_added(prompt_len: int, n: int) -> tuple[BlockManager, Scheduler, Request]:
    """A scheduler over 16 blocks with one group added: n sequences of a prompt_len-token prompt."""
    bm = BlockManager(16, B)
    scheduler = Scheduler(bm, 64, 8)
    parent = make_group("g", list(range(prompt_len)), n=n)
    scheduler.add(parent)
    return bm, scheduler, parent


def step(scheduler: Scheduler):
    """One synchronous engine step with a model that always samples token 7."""
    output = scheduler.schedule()
    scheduler.advance(output)
    for entry in output.scheduled:
        for seq in ([entry.request, *entry.forks] if entry.samples else []):
            seq.append_token(7)
        scheduler.cache_computed_blocks(entry.request)
    return output


def test_forked_sequences_share_the_prompt_blocks_by_reference_count():
    bm, scheduler, parent = group_added(10, n=3)  # 10 tokens: blocks 0, 1 full, block 2 partial
    output = step(scheduler)
    assert [(e.request.index, e.num_new_tokens, [f.index for f in e.forks]) for e in output.scheduled] \
        == [(0, 10, [1, 2])]
    group = parent.group
    assert [s.block_ids for s in group] == [[0, 1, 2]] * 3, "one prefill, three block tables"
    assert [bm.blocks[b].ref_count for b in (0, 1, 2)] == [3, 3, 3]
    assert bm.num_free_blocks == 13
    assert [s.num_computed_tokens for s in group] == [10, 10, 10]
    assert scheduler.running == group, "a group stays contiguous, in index order"

    output = step(scheduler)  # each writes its first output token at position 10: into block 2
    assert [(e.request.index, e.num_new_tokens) for e in output.scheduled] == [(0, 1), (1, 1), (2, 1)]
    # the first two writers copy block 2; the last one holds it alone and writes in place
    assert output.blocks_to_copy == [(2, 3), (2, 4)]
    assert [s.block_ids for s in group] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    assert [bm.blocks[b].ref_count for b in (0, 1, 2, 3, 4)] == [3, 3, 1, 1, 1]


def test_a_prompt_of_whole_blocks_needs_no_copy():
    bm, scheduler, parent = group_added(8, n=2)
    step(scheduler)
    output = step(scheduler)
    assert output.blocks_to_copy == []
    assert [s.block_ids for s in parent.group] == [[0, 1, 2], [0, 1, 3]]
    assert [bm.blocks[b].ref_count for b in (0, 1)] == [2, 2]


def test_finishing_the_sequences_returns_every_block():
    bm, scheduler, parent = group_added(10, n=3)
    step(scheduler)
    step(scheduler)
    for seq in parent.group:
        scheduler.finish(seq)
    assert bm.num_free_blocks == 16 and not scheduler.running


def test_admission_counts_every_sequence_of_a_group_against_max_num_seqs():
    scheduler = Scheduler(BlockManager(32, B), 64, max_num_seqs=4)
    scheduler.add(make_group("g", list(range(5)), n=3))
    scheduler.add(Request("a", list(range(20, 25)), SamplingParams(max_tokens=4, temperature=0), B, SALT))
    scheduler.add(Request("b", list(range(30, 35)), SamplingParams(max_tokens=4, temperature=0), B, SALT))
    output = step(scheduler)
    assert [e.request.request_id for e in output.scheduled] == ["g", "a"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert len(scheduler.running) == 4


def test_out_of_blocks_the_newest_group_is_preempted_whole():
    bm = BlockManager(7, B)
    scheduler = Scheduler(bm, 64, 8)
    first = Request("a", list(range(100, 107)), SamplingParams(max_tokens=20, temperature=0), B, SALT)
    scheduler.add(first)
    scheduler.add(make_group("g", list(range(6)), n=3, max_tokens=20))
    step(scheduler)  # a: 2 blocks; g: 2 blocks shared by 3 sequences
    assert bm.num_free_blocks == 3
    for _ in range(3):
        step(scheduler)
    assert scheduler.num_preemptions == 3, "the three sequences of g, together"
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert [(r.request_id, r.index) for r in scheduler.waiting] == [("g", 0), ("g", 1), ("g", 2)]
    assert all(not r.block_ids for r in scheduler.waiting)


# ---- the engine on a tiny model ---------------------------------------------------------------

ENGINE_VARIANTS = [dict(), dict(block_size=4, max_num_batched_tokens=8),
                   dict(block_size=4, async_scheduling=True)]
VARIANT_IDS = ["default", "chunked8", "async"]


@pytest.mark.parametrize("engine_args", ENGINE_VARIANTS, ids=VARIANT_IDS)
def test_greedy_sequences_all_equal_the_n1_output(engine_args):
    llm = LLM(MODEL, **engine_args)
    ids = llm.encode("The quick brown fox jumps over")
    one = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=12, temperature=0))[0]
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(n=3, max_tokens=12, temperature=0))[0]
    assert len(out.sequences) == 3
    assert [s.token_ids for s in out.sequences] == [one.token_ids] * 3
    assert out.token_ids == one.token_ids


@pytest.mark.parametrize("engine_args", ENGINE_VARIANTS, ids=VARIANT_IDS)
def test_seeded_sequence_i_equals_a_request_with_seed_plus_i(engine_args):
    llm = LLM(MODEL, **engine_args)
    ids = llm.encode("The quick brown fox jumps over")
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=100)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    alone = [llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=10, temperature=1.0, seed=100 + i))[0].token_ids for i in range(4)]
    assert [s.token_ids for s in out.sequences] == alone
    assert len({tuple(t) for t in alone}) > 1, "different seeds sample different sequences"
    again = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert [s.token_ids for s in again.sequences] == alone, "reproducible"


def test_the_prompt_is_prefilled_once():
    """The group's prompt tokens are computed once: the forks start with them computed."""
    llm = LLM(MODEL, block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    ids = llm.encode("0123456789")  # 10 tokens: a partial last block
    engine.add_request(EngineRequest("g", ids, SamplingParams(n=3, max_tokens=5, temperature=0)))
    first = engine.scheduler.schedule()
    assert [(e.num_new_tokens, len(e.forks)) for e in first.scheduled] == [(10, 2)]
    engine.runner.execute(first)
    engine.scheduler.advance(first)
    group = engine.requests["g"].group
    assert len({tuple(s.block_ids) for s in group}) == 1


def test_best_of_returns_the_n_highest_cumulative_logprobs():
    llm = LLM(MODEL)
    ids = llm.encode("Once upon a time")
    every = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        n=5, max_tokens=8, temperature=1.0, seed=7, logprobs=0))[0].sequences
    totals = [sum(s.logprobs) for s in every]
    best = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        n=2, best_of=5, max_tokens=8, temperature=1.0, seed=7))[0]
    ranked = sorted(range(5), key=lambda i: -totals[i])[:2]
    assert [s.token_ids for s in best.sequences] == [every[i].token_ids for i in ranked]
    assert best.sequences[0].logprobs is None, "logprobs not asked: not returned"


def test_aborting_a_group_ends_every_sequence_and_frees_its_blocks():
    llm = LLM(MODEL, block_size=4)
    engine = llm.engine
    engine.add_request(EngineRequest("g", llm.encode("abcdefghij"), SamplingParams(
        n=3, max_tokens=50, temperature=1.0, ignore_eos=True)))
    deltas = engine.step() + engine.step()
    assert {d.index for d in deltas} == {0, 1, 2}
    assert all(not d.finished for d in deltas)
    engine.abort_request("g")
    deltas = engine.step()
    assert [d.finished for d in deltas] == [True]
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert "g" not in engine.requests


def test_a_sequence_that_finishes_first_does_not_finish_the_request():
    llm = LLM(MODEL)
    engine = llm.engine
    engine.add_request(EngineRequest("g", llm.encode("hello"), SamplingParams(
        n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    ends = [(d.index, d.finish_reason, d.finished) for d in deltas if d.finish_reason]
    assert sorted(ends) == [(0, "length", True), (1, "length", False)] or \
        sorted(ends) == [(0, "length", False), (1, "length", True)]
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1


@pytest.mark.parametrize("kwargs,field", [(dict(n=0), "n"), (dict(n=33), "n"),
                                          (dict(n=3, best_of=2), "best_of"), (dict(n=True), "n")])
def test_bad_n_and_best_of_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_more_sequences_than_max_num_seqs_is_refused_naming_n():
    llm = LLM(MODEL, max_num_seqs=4)
    with pytest.raises(ValueError, match="^n is 5"):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(n=5))
    with pytest.raises(ValueError, match="^best_of is 6"):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(n=2, best_of=6))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_groups_preempted_and_recomputed_give_the_same_sequences(async_scheduling):
    prompts_text = [f"prompt number {i} " + "abc " * (i + 2) for i in range(4)]
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    large = LLM(MODEL, block_size=4)
    prompts = [large.encode(p) for p in prompts_text]
    expected = [[s.token_ids for s in o.sequences]
                for o in large.generate(prompt_token_ids=prompts, sampling_params=params)]
    small = LLM(MODEL, block_size=4, kv_cache_memory_bytes=24 * 1024,  # 24 blocks = 96 tokens
                async_scheduling=async_scheduling)
    got = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [[s.token_ids for s in o.sequences] for o in got] == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == small.engine.num_kv_blocks
