"""Greedy output equals transformers' greedy generate, token for token, however the engine
batches, chunks and caches."""

import pytest

from kvmesh import LLM, SamplingParams
from tests.unit.reference import hf_greedy, hf_model_like

MAX_NEW = 32

RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Paris is the capital of",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
]


def engine_variants(base: LLM, prompts: list[list[int]], combined: bool = False):
    """(name, engine kwargs) of the ways the engine must give the same tokens. `combined`: the same
    settings in two engines instead of five (each engine covers two or three of them), for a model
    whose engines are slow to run; the random presets run every variant on its own."""
    # A pool that holds about three of the longest requests: the batch must preempt and recompute.
    bytes_per_token = base.engine.model_config.kv_bytes_per_token * 4  # float32 on the CPU
    small_pool = 3 * (max(len(p) for p in prompts) + MAX_NEW) * bytes_per_token
    if combined:
        return [
            ("chunked16_small_blocks_no_cache",
             dict(max_num_batched_tokens=16, block_size=4, enable_prefix_caching=False)),
            # chunks of 32 still preempt here (16 admit the prompts too slowly to fill the pool)
            ("async_chunked32_small_pool", dict(max_num_batched_tokens=32, block_size=4, async_scheduling=True,
                                                kv_cache_memory_bytes=small_pool)),
        ]
    return [
        ("batched", dict()),
        ("chunked16", dict(max_num_batched_tokens=16)),
        ("small_blocks_no_cache", dict(block_size=4, enable_prefix_caching=False)),
        # async scheduling launches each step before the previous step's tokens reach the host
        ("async_chunked16", dict(max_num_batched_tokens=16, async_scheduling=True)),
        ("async_small_pool", dict(block_size=4, async_scheduling=True, kv_cache_memory_bytes=small_pool)),
    ]


def prompt_ids_for(llm: LLM) -> list[list[int]]:
    ids = [llm.encode(p) for p in RAW_PROMPTS]
    if getattr(llm.tokenizer, "chat_template", None):
        ids += [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return ids


# With `combined`, "each prompt alone" runs on a short raw prompt, the longest raw prompt (85 tokens)
# and the first chat prompt; the default engine then runs every prompt batched, most of them cold.
ALONE = (0, 3, len(RAW_PROMPTS))


def check_model(model: str, num_prompts: int | None = None, combined: bool = False):
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    base = LLM(model)
    prompts = prompt_ids_for(base)[:num_prompts]
    reference = hf_model_like(base)
    expected = [hf_greedy(reference, ids, MAX_NEW) for ids in prompts]

    alone_idx = [i for i in ALONE if i < len(prompts)] if combined else range(len(prompts))
    alone = [base.generate(prompt_token_ids=[prompts[i]], sampling_params=greedy)[0].token_ids for i in alone_idx]
    assert alone == [expected[i] for i in alone_idx], "each prompt alone"
    if combined:  # the "batched" variant, on the base engine: the prompts not run alone are cold
        got = [o.token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=greedy)]
        assert got == expected, "batched"

    for name, kwargs in engine_variants(base, prompts, combined):
        llm = LLM(model, **kwargs)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
        assert got == expected, name
        if combined and "small_pool" in name:
            assert llm.engine.scheduler.num_preemptions > 0, f"{name} preempts"

    # Prefix-cache hits: the same prompts again, and again interleaved with their own prefixes.
    outs = base.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in outs] == expected, "second pass over a warm prefix cache"
    assert sum(o.num_cached_tokens for o in outs) > 0, "the second pass hits the prefix cache"
    return base, prompts, expected


@pytest.mark.slow
def test_default_smollm2_matches_transformers():
    base, prompts, expected = check_model("smollm2-135m-instruct", combined=True)
    assert len(prompts) == 8
    assert all(len(e) > 0 for e in expected)


# every tiny preset (docs/CONTRIBUTING.md: a new architecture's preset is added here;
# test_contributing_steps.py checks that none is missing)
TRANSFORMERS_PRESETS = ["tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-llama3", "tiny-qwen3-moe", "tiny-mixtral"]


@pytest.mark.parametrize("preset", TRANSFORMERS_PRESETS)
def test_random_presets_match_transformers(preset):
    base, prompts, expected = check_model(f"random:{preset}")
    assert all(len(e) == MAX_NEW for e in expected if 258 not in e)


def test_shared_prefix_hits_give_same_tokens():
    llm = LLM("random:tiny-qwen3", block_size=4)
    reference = hf_model_like(llm)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    stem = llm.encode("A long shared system prompt that many users send first. ")
    prompts = [stem + llm.encode(s) for s in ("Hi", "Hello there", "What?", "Tell me more")]
    expected = [hf_greedy(reference, ids, 12) for ids in prompts]
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=greedy)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=greedy)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= (len(stem) // 4) * 4 - 4 for o in rest)
