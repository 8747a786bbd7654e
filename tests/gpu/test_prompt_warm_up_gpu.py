"""An engine on CUDA runs prompt steps when it starts (ModelRunner.warm_up_prompt_steps): the first
prompts a server gets, long or short, alone or beside decodes, compile no Triton kernel of the
forward pass (Triton specializes integer arguments on divisibility by 16; the rotation has a form of
its own for steps of MANY_TOKENS tokens or more; the triton backend's prefill one for prompts of up
to 32 tokens)."""

import gc
import importlib
import importlib.util
import pkgutil

import pytest
import torch

import kvmesh.kernels
from kvmesh import LLM, SamplingParams
from kvmesh.worker.attention.registry import backend_spec, block_size_for

pytestmark = pytest.mark.gpu


def compiled_forms() -> dict[str, int]:
    """Each Triton kernel of kvmesh.kernels: how many compiled forms it holds, over devices."""
    from triton.runtime.jit import JITFunction

    forms = {}
    for info in pkgutil.iter_modules(kvmesh.kernels.__path__):
        module = importlib.import_module(f"kvmesh.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = obj
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):  # autotuner, heuristics
                fn = fn.fn
            if isinstance(fn, JITFunction) and fn.__module__ == module.__name__:
                forms[f"{info.name}.{name}"] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return forms


@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_the_first_prompts_compile_no_kernel_of_the_forward(backend):
    library = backend_spec(backend).library
    if library is not None and importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed here")
    llm = LLM(model="random:qwen3-0.6b", device="cuda", attention_backend=backend,
              block_size=block_size_for(backend), kv_cache_memory_bytes=4 << 30, max_model_len=4096,
              max_num_batched_tokens=4096, max_num_seqs=8)
    # every kernel but the sampler's (compiled by a first request of any length) and those this
    # model does not use (FP8, MoE): a prompt-only kernel never compiled at start counts too
    before = {name: n for name, n in compiled_forms().items()
              if not name.startswith(("sample.", "fp8_quant.", "fused_moe."))}
    assert before["rotary._rotary_kernel"] > 0, before
    prompts = [[(13 * i + j) % 5000 for j in range(n)] for i, n in enumerate((2048, 2100, 3001, 4000))]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2, temperature=0),
                 use_tqdm=False)
    for lengths in ((5, 77, 300), (31,)):  # the second: a step of one prompt of at most 32 tokens
        short = [[(11 * i + j) % 5000 for j in range(n)] for i, n in enumerate(lengths)]
        llm.generate(prompt_token_ids=short, sampling_params=SamplingParams(max_tokens=3, temperature=0),
                     use_tqdm=False)
    after = compiled_forms()
    grown = {name: (n, after[name]) for name, n in before.items() if after[name] != n}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert not grown, f"compiled during the first prompts: {grown}"


def test_an_engine_on_cuda_freezes_what_it_made_and_is_freed_when_dropped():
    """Engine.__init__ on CUDA ends with gc.freeze() (KVMESH_GC_FREEZE): the collector's scans skip
    the imports' and the engine's objects from then on. A frozen object in a reference cycle would
    never be freed, so the engine must go by reference counting alone: dropped, its KV pool's memory
    comes back without a collection."""
    import weakref

    gc.collect()
    llm = LLM(model="random:qwen3-0.6b", device="cuda", attention_backend="triton", block_size=16,
              kv_cache_memory_bytes=2 << 30, max_model_len=2048, max_num_seqs=16)
    assert gc.get_freeze_count() > 0
    llm.generate(prompt_token_ids=[[(5 * i + j) % 5000 for j in range(50 + i)] for i in range(16)],
                 sampling_params=SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True), use_tqdm=False)
    engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
    allocated = torch.cuda.memory_allocated()
    gc.disable()  # no collection may free it
    try:
        del llm
        freed = engine() is None and pool() is None
        dropped = allocated - torch.cuda.memory_allocated()
    finally:
        gc.enable()
    gc.unfreeze()
    assert freed and dropped >= 2 << 30, dropped
