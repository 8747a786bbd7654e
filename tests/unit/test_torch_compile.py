"""The `torch_compile` engine option (worker/compile.py) on the CPU: inductor compiles each layer's
work outside attention, and the engine gives the same greedy tokens, with the same log-probabilities
to float32 rounding, as the uncompiled engine; over prompt chunks, prefix-cache hits, single-token
and batched decode steps. (On the GPU, the same under CUDA graphs: tests/gpu/test_greedy_qwen3.py.)"""

import math

from torch._dynamo.utils import counters

from kvmesh import LLM, SamplingParams

MODEL = "random:tiny-qwen3"  # has Qwen3's q/k norms, so both compiled regions hold every op kind
SHARED = [(7 * j) % 500 + 3 for j in range(40)]
PROMPTS = [SHARED + [11, 12, 13], SHARED + [21, 22], [5, 6, 7], list(range(100, 170))]


def generate(**engine_args):
    # a small step budget splits the long prompts into chunks; the shared prefix hits the cache
    llm = LLM(MODEL, block_size=4, max_num_batched_tokens=32, **engine_args)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    first = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)
    rest = llm.generate(prompt_token_ids=PROMPTS[1:], sampling_params=params, use_tqdm=False)
    return first + rest


def test_compiled_layers_give_the_uncompiled_tokens():
    expected = generate()
    graphs_before = counters["stats"]["unique_graphs"]
    got = generate(torch_compile=True)
    assert counters["stats"]["unique_graphs"] > graphs_before  # inductor really compiled the regions
    assert got[1].num_cached_tokens > 0
    for want, out in zip(expected, got):
        assert out.token_ids == want.token_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(out.logprobs, want.logprobs))
