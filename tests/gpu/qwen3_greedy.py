"""Greedy runs of a random-weight Qwen3-0.6B-shaped model on the GPU, the model-level comparisons of
test_greedy_qwen3.py and test_fp8_kv_cache_gpu.py: one engine per run, freed before the next."""

import gc

import torch

from kvmesh import LLM, SamplingParams

MODEL = "random:qwen3-0.6b"
PROMPTS = [[(17 * i + 3 * j) % 10000 for j in range(n)] for i, n in enumerate((5, 77, 300, 1000))]


def generate_greedy(backend: str, prompts=PROMPTS, max_tokens: int = 64, block_size: int = 16,
                    kv_cache_dtype: str = "auto", torch_compile: bool = False,
                    logprobs: int | None = None, prompt_logprobs: int | None = None):
    """MODEL's greedy outputs for `prompts` (ignore_eos: max_tokens each) with attention `backend`."""
    llm = LLM(model=MODEL, device="cuda", attention_backend=backend, block_size=block_size,
              kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=2 << 30, max_model_len=2048,
              max_num_seqs=8, torch_compile=torch_compile)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs
