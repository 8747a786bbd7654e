"""Engine behaviour on tiny random models: preemption, aborts, KV events, loads, bad input."""

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.hashing import block_hashes, model_salt
from kvmesh.protocol import BlockStored, EngineRequest

MODEL = "random:tiny-llama"  # 2 layers, 1 KV head of 16: a block of 4 tokens is 1 KiB in float32


def prompts(llm, n=6):
    return [llm.encode(f"prompt number {i} " + "abc " * (i + 2)) for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_with_tiny_pool_gives_same_outputs_as_large_pool(async_scheduling):
    params = SamplingParams(max_tokens=16, temperature=0)
    large = LLM(MODEL, block_size=4)
    small = LLM(MODEL, block_size=4, kv_cache_memory_bytes=16 * 1024,  # 16 blocks = 64 tokens
                async_scheduling=async_scheduling)
    assert small.engine.num_kv_blocks == 16
    ps = prompts(large)
    expected = [o.token_ids for o in large.generate(prompt_token_ids=ps, sampling_params=params)]
    got = small.generate(prompt_token_ids=ps, sampling_params=params)
    assert [o.token_ids for o in got] == expected
    assert all(o.finish_reason == "length" for o in got)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == 16  # everything returned


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_sampling_is_independent_of_the_batch(async_scheduling):
    llm = LLM(MODEL, async_scheduling=async_scheduling)
    ps = prompts(llm, 4)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate(prompt_token_ids=ps[:1], sampling_params=seeded)[0].token_ids
    mixed = [seeded] + [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(3)]
    batched = llm.generate(prompt_token_ids=ps, sampling_params=mixed)[0].token_ids
    assert alone == batched
    other = llm.generate(prompt_token_ids=ps[:1], sampling_params=SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, seed=99))[0].token_ids
    assert other != alone


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_at_any_point_frees_all_blocks(async_scheduling):
    llm = LLM(MODEL, block_size=4, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    engine = llm.engine
    total = engine.num_kv_blocks
    ids = prompts(llm, 3)
    for i, p in enumerate(ids):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0)))
    deltas = []
    engine.abort_request("r2")  # still waiting
    deltas += engine.step()  # r0 partly prefilled (chunked to 8 tokens)
    assert engine.requests["r0"].num_computed_tokens == 8
    engine.abort_request("r0")  # mid-prefill
    for _ in range(6):
        deltas += engine.step()
    assert engine.requests["r1"].num_output_tokens > 0
    engine.abort_request("r1")  # decoding
    while engine.has_unfinished_requests():
        deltas += engine.step()
    finals = {d.request_id: d.finish_reason for d in deltas if d.finished}
    assert finals == {"r0": "abort", "r1": "abort", "r2": "abort"}
    assert engine.block_manager.num_free_blocks == total
    assert engine.get_load().running == 0 and engine.get_load().waiting == 0


def test_kv_events_use_the_router_hash_and_are_numbered():
    llm = LLM(MODEL, block_size=4)
    engine = llm.engine
    ids = llm.encode("exactly twelve tokens!")[:12]
    assert len(ids) == 12
    llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=2, temperature=0))
    batches = []
    while (b := engine.take_kv_events()) is not None:
        batches.append(b)
    assert [b.seq for b in batches] == [0]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == block_hashes(ids, 4, salt=model_salt(engine.model_name))
    snap = engine.kv_snapshot()
    assert snap.seq == 0 and set(snap.block_hashes) == set(hashes) and snap.epoch == batches[0].epoch


def test_the_engine_caches_a_prompt_under_the_block_hashes_its_caller_sent():
    """The ingress hashes each prompt to route it; the engine keeps those hashes instead of hashing
    again (sent with another salt here, so that using them shows in the KV events)."""
    llm = LLM(MODEL, block_size=4)
    engine = llm.engine
    ids = list(range(1, 13))
    sent = block_hashes(ids, 4, salt=b"hashed-by-the-ingress")
    assert sent != block_hashes(ids, 4, salt=model_salt(engine.model_name))
    engine.add_request(EngineRequest("r", ids, SamplingParams(max_tokens=1), block_hashes=sent,
                                     hash_block_size=4))
    while engine.has_unfinished_requests():
        engine.step()
    stored = [h for e in engine.take_kv_events().events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == sent


def test_block_hashes_of_another_cut_are_refused_naming_the_field():
    engine = LLM(MODEL, block_size=4).engine
    ids = list(range(1, 13))
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="hash_block_size 8; this engine's block_size is 4"):
        engine.add_request(EngineRequest("a", ids, params, block_hashes=block_hashes(ids, 8), hash_block_size=8))
    with pytest.raises(ValueError, match="block_hashes has 2 hashes; the prompt has 3 full blocks of 4"):
        engine.add_request(EngineRequest("b", ids, params, block_hashes=block_hashes(ids[:8], 4), hash_block_size=4))
    assert not engine.requests


def test_load_reports_waiting_and_kv_usage():
    llm = LLM(MODEL, block_size=4, max_num_seqs=1)
    engine = llm.engine
    for i, p in enumerate(prompts(llm, 3)):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=4)))
    engine.step()
    load = engine.get_load()
    assert (load.running, load.waiting) == (1, 2)
    assert load.waiting_prefill_tokens == sum(len(p) for p in prompts(llm, 3)[1:])
    assert load.kv_free_blocks < load.kv_total_blocks


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_other_requests_carry_on():
    llm = LLM(MODEL, block_size=4, max_model_len=64, kv_cache_memory_bytes=32 * 1024)
    engine = llm.engine
    engine.add_request(EngineRequest("good", llm.encode("hello"), SamplingParams(max_tokens=4, temperature=0)))
    with pytest.raises(ValueError, match="at least 1 token"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="limit is 63"):
        llm.generate(prompt_token_ids=[[1] * 64])
    with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 512\)"):
        llm.generate(prompt_token_ids=[[1, 99999]])
    small = LLM(MODEL, block_size=4, kv_cache_memory_bytes=4 * 1024)  # 4 blocks = 16 tokens
    with pytest.raises(ValueError, match="KV pool holds 16 tokens"):
        small.generate(prompt_token_ids=[[1] * 20])
    # a batch with one bad prompt queues none of them
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[1, 2, 3], []])
    assert set(engine.requests) == {"good"}
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    assert [d.finish_reason for d in deltas if d.finished] == ["length"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_outgrows_the_whole_pool_alone_ends_with_length(async_scheduling):
    # preempting it frees nothing another request holds: it would never fit again (RELIABILITY.md)
    small = LLM(MODEL, block_size=4, kv_cache_memory_bytes=4 * 1024,  # 4 blocks = 16 tokens
                async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    [out] = small.generate(prompt_token_ids=[[1] * 10], sampling_params=params)
    assert (out.finish_reason, len(out.token_ids)) == ("length", 7)  # 16 tokens held, the 7th sampled
    assert small.engine.block_manager.num_free_blocks == 4
    [after] = small.generate(prompt_token_ids=[[2] * 5], sampling_params=SamplingParams(max_tokens=3))
    assert len(after.token_ids) == 3  # the engine keeps serving


def test_unknown_and_corrupt_models_are_clear(tmp_path):
    with pytest.raises(ValueError, match="model: 'no/such/model'"):
        LLM("no/such/model")
    with pytest.raises(ValueError, match="unknown preset"):
        LLM("random:nope")
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read"):
        LLM(str(tmp_path))


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="max_batch"):
        LLM(MODEL, max_batch=3)


def test_an_engine_on_the_cpu_leaves_the_garbage_collector_as_it_was():
    """Only an engine on CUDA freezes the collector once built (worker/engine.py GC_FREEZE; the GPU
    test checks it and that a dropped engine is still freed): on the CPU nothing is frozen."""
    import gc

    from kvmesh.worker import engine

    assert engine.GC_FREEZE  # on by default
    frozen = gc.get_freeze_count()
    LLM(model="random:tiny-qwen3", device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert gc.get_freeze_count() == frozen


# ---- scheduling_policy "priority" (vLLM's) ---------------------------------------------------

def finish_order(llm, requests: list[EngineRequest]) -> list[str]:
    for request in requests:
        llm.engine.add_request(request)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [d.request_id for d in llm.engine.step() if d.finished]
    return order


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_policy_runs_the_lowest_priority_value_first(async_scheduling):
    llm = LLM(MODEL, max_num_seqs=1, scheduling_policy="priority", async_scheduling=async_scheduling)
    ids = prompts(llm, 5)
    params = SamplingParams(max_tokens=3, temperature=0)
    ranks = {"p5": 5, "p0-first": 0, "m3": -3, "p0-second": 0, "p9": 9}
    order = finish_order(llm, [EngineRequest(name, ids[i], params, priority=rank)
                               for i, (name, rank) in enumerate(ranks.items())])
    assert order == ["m3", "p0-first", "p0-second", "p5", "p9"]
    # the same requests under fcfs finish in arrival order
    fcfs = LLM(MODEL, max_num_seqs=1, async_scheduling=async_scheduling)
    assert finish_order(fcfs, [EngineRequest(name, ids[i], params) for i, name in enumerate(ranks)]) == list(ranks)


def test_priority_policy_outputs_equal_fcfs_outputs_and_keep_the_prompts_order():
    params = SamplingParams(max_tokens=8, temperature=0)
    fcfs = LLM(MODEL, max_num_seqs=2)
    ps = prompts(fcfs)
    expected = [o.token_ids for o in fcfs.generate(prompt_token_ids=ps, sampling_params=params)]
    by_priority = LLM(MODEL, max_num_seqs=2, scheduling_policy="priority")
    got = by_priority.generate(prompt_token_ids=ps, sampling_params=params, priority=[3, 1, 2, 0, 5, 4])
    assert [o.token_ids for o in got] == expected


def test_priority_is_refused_under_fcfs_and_checked_under_priority():
    llm = LLM(MODEL)
    ids = prompts(llm, 2)
    with pytest.raises(ValueError, match=r"priority is 2; this engine schedules first come, first served "
                                         r"\(scheduling_policy 'fcfs'\)"):
        llm.generate(prompt_token_ids=ids[:1], priority=[2])
    assert llm.generate(prompt_token_ids=ids[:1], priority=[0], use_tqdm=False)[0].token_ids
    by_priority = LLM(MODEL, scheduling_policy="priority")
    for bad in (1.5, "1", True, 2**63):
        with pytest.raises(ValueError, match="priority must be an integer"):
            by_priority.generate(prompt_token_ids=ids[:1], priority=[bad])
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        by_priority.generate(prompt_token_ids=ids, priority=[1])
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        LLM(MODEL, scheduling_policy="lifo")
    assert not by_priority.engine.has_unfinished_requests()  # nothing half-queued
