"""ModelRunner.warm_up_prompt_steps (run by an engine on CUDA as it starts, so that its first long
prompts compile no kernel: tests/gpu/test_prompt_warm_up_gpu.py): it stores no KV and changes no output.
Here on the CPU, where the engine does not run it by itself."""

import torch

from kvmesh import LLM, SamplingParams


def test_the_prompt_warm_up_stores_no_kv_and_changes_no_output():
    llm = LLM(model="random:tiny-qwen3", device="cpu", max_model_len=2048, max_num_batched_tokens=2048)
    runner = llm.engine.runner
    prompts = [[(7 * i + j) % 500 for j in range(40 + 9 * i)] for i in range(3)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)]
    cache = runner.kv_cache.clone()
    assert runner.warm_up_prompt_steps(2048) == [(0, 2048), (1, 17)]  # the others: past 2,048 tokens a step
    assert runner.warm_up_prompt_steps(4096) == [(0, 2048), (1, 2048), (1, 17)]  # 2,049: past the model's limit
    assert torch.equal(runner.kv_cache, cache)
    assert runner.warm_up_prompt_steps(16) == []
    assert llm.engine.block_manager.reset_prefix_cache()  # computed again, from the KV pool the warm-up left
    after = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)]
    assert after == before
