"""prompt_logprobs: each prompt token's log-probability given the tokens before it equals
transformers' log_softmax of the same model, however the engine chunks, caches and preempts."""

import pytest
import torch

from kvmesh import LLM, SamplingParams
from tests.unit.reference import hf_model_like

TOLERANCE = 2e-4  # float32 on the CPU: the engine's attention vs transformers' eager attention


@torch.no_grad()
def hf_prompt_logprobs(model, prompt_ids: list[int]) -> torch.Tensor:
    """[P-1, vocab]: row i is the distribution of prompt token i + 1."""
    logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(out, reference: torch.Tensor, k: int) -> None:
    ids = out.prompt_token_ids
    scores = out.prompt_logprobs
    assert len(scores.logprobs) == len(ids) == len(scores.ranks) == len(scores.top)
    assert scores.logprobs[0] is None and scores.ranks[0] is None and scores.top[0] is None
    expected = reference.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    got = torch.tensor(scores.logprobs[1:])
    assert torch.allclose(got, expected, atol=TOLERANCE), (got - expected).abs().max()
    for i in range(1, len(ids)):
        row = reference[i - 1]
        # a rank can differ only where two logits are within the tolerance of each other
        strictly_above = int((row > row[ids[i]] + TOLERANCE).sum()) + 1
        within = int((row >= row[ids[i]] - TOLERANCE).sum())
        assert strictly_above <= scores.ranks[i] <= within
        if k:
            top_values, _ = torch.topk(row, k)
            assert len(scores.top[i]) == k
            assert torch.allclose(torch.tensor(sorted(scores.top[i].values(), reverse=True)),
                                  top_values, atol=TOLERANCE)
            for token, value in scores.top[i].items():
                assert abs(row[token].item() - value) < TOLERANCE


PROMPTS = ["The quick brown fox jumps over the lazy dog because it was in a hurry to get home.",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11"]


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(max_num_batched_tokens=8, block_size=4),  # chunked prefill: scored chunk by chunk
    dict(max_num_batched_tokens=8, block_size=4, async_scheduling=True),
], ids=["whole", "chunked8", "async_chunked8"])
def test_prompt_logprobs_equal_transformers_log_softmax(engine_args):
    llm = LLM("random:tiny-llama", **engine_args)
    reference_model = hf_model_like(llm)
    prompts = [llm.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=5)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for out, ids in zip(outs, prompts):
        check_against_reference(out, hf_prompt_logprobs(reference_model, ids), k=5)


def test_prompt_logprobs_bypass_the_prefix_cache_and_stay_the_same():
    llm = LLM("random:tiny-llama", block_size=4)
    ids = llm.encode(PROMPTS[0])
    plain = SamplingParams(max_tokens=2, temperature=0)
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    first = llm.generate(prompt_token_ids=[ids], sampling_params=scored)[0]
    warm = llm.generate(prompt_token_ids=[ids], sampling_params=plain)[0]
    assert warm.num_cached_tokens > 0, "the prompt's blocks are cached"
    again = llm.generate(prompt_token_ids=[ids], sampling_params=scored)[0]
    assert again.num_cached_tokens == 0, "every position is computed again to be scored"
    assert again.prompt_logprobs.logprobs == pytest.approx(first.prompt_logprobs.logprobs, abs=1e-5)
    assert again.prompt_logprobs.top == [None] * len(ids), "prompt_logprobs=0: no alternatives"
    assert warm.prompt_logprobs is None, "not asked: not computed"


def test_prompt_logprobs_survive_preemption():
    """A pool that holds about one request: requests are preempted and recomputed; the scores of
    tokens already scored are not repeated."""
    base = LLM("random:tiny-llama")
    prompts = [base.encode(p) for p in PROMPTS] * 2
    reference_model = hf_model_like(base)
    bytes_per_token = base.engine.model_config.kv_bytes_per_token * 4
    pool = (max(len(p) for p in prompts) + 40) * bytes_per_token
    llm = LLM("random:tiny-llama", block_size=4, max_num_batched_tokens=8, kv_cache_memory_bytes=pool)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, ids in zip(outs, prompts):
        check_against_reference(out, hf_prompt_logprobs(reference_model, ids), k=2)


@pytest.mark.slow
def test_default_model_prompt_logprobs_equal_transformers():
    llm = LLM()
    ids = llm.encode("The capital of France is Paris. The capital of Germany is Berlin.")
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    check_against_reference(out, hf_prompt_logprobs(hf_model_like(llm), ids), k=3)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
