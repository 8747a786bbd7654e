"""The FP8 (e4m3) KV cache on the CPU, with the torch backend: the store/read round trip, attention
over an FP8 pool, the engine's pool size and its tokens against a float32 / bf16 cache, and the
errors of the option. The Triton kernels' FP8 paths: test_fp8_kv_kernels.py; on a GPU:
tests/gpu/test_fp8_kv_cache_gpu.py."""

import dataclasses
import json
import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # flash_attn_reference
sys.path.insert(0, os.path.join(TESTS, "gpu"))  # attention_cases (device-agnostic helpers)
import flash_attn_reference  # noqa: E402
from attention_cases import fp8_case, make_case, reference_attention, relative_error  # noqa: E402

from kvmesh import LLM, SamplingParams  # noqa: E402
from kvmesh.bench.floor import ModelShape  # noqa: E402
from kvmesh.config import EngineConfig  # noqa: E402
from kvmesh.serve_config import parse_config  # noqa: E402
from kvmesh.worker.attention import load_backend_class, registry  # noqa: E402
from kvmesh.worker.attention.registry import BACKENDS, FP8_KV, block_size_for, choose_backend  # noqa: E402
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend, gather_context, store_kvcache_torch  # noqa: E402
from kvmesh.worker.kv_cache import FP8_E4M3_MAX, dequantize  # noqa: E402

E4M3_RELATIVE = 2.0 ** -4  # half a unit in the last place of a 3-bit mantissa
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # below 2^-6 the step is 2^-9: absolute error up to half of it
BF16_BAND = 1e-2  # a bf16 backend against the float32 reference (tests/gpu/test_attention_backends.py)
MIXED = dict(decode_ctx=[1, 9, 30], prompt_lens=[7, 1, 12], prefix_lens=[0, 5, 17])


@pytest.mark.parametrize("scale", [1.0, 0.5, 4.0])
def test_store_then_read_round_trips_within_e4m3_precision(scale):
    gen = torch.Generator().manual_seed(0)
    num_blocks, page, num_kv_heads, head_dim = 6, 4, 2, 8
    k = torch.randn(12, num_kv_heads, head_dim, generator=gen) * 30  # spans subnormals to hundreds
    v = torch.randn(12, num_kv_heads, head_dim, generator=gen) * 0.01
    k[0, 0, :3] = torch.tensor([1000.0, -1000.0, 448.0]) * scale  # beyond e4m3's range: clamped
    slots = torch.randperm(num_blocks * page, generator=gen)[:12]
    k_cache = torch.zeros(num_blocks, page, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    store_kvcache_torch(k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    table = torch.arange(num_blocks, dtype=torch.int32)
    read_k = dequantize(gather_context(k_cache, table, num_blocks * page), scale, torch.float32)[slots]
    read_v = dequantize(gather_context(v_cache, table, num_blocks * page), scale, torch.float32)[slots]
    limit = FP8_E4M3_MAX * scale
    for x, read in ((k, read_k), (v, read_v)):
        clamped = x.clamp(-limit, limit)
        bound = E4M3_RELATIVE * clamped.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
        assert bool(((read - clamped).abs() <= bound).all())
    assert read_k[0, 0, :3].tolist() == [limit, -limit, limit]
    assert not torch.isnan(read_k).any() and not torch.isnan(read_v).any()


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 2.0)])
def test_torch_backend_attends_over_the_fp8_pool(k_scale, v_scale):
    num_heads, num_kv_heads, head_dim, page = 4, 2, 16, 4
    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page=page,
                     dtype=torch.float32, device="cpu", seed=3, **MIXED)
    exact = reference_attention(case)
    fp8, solved = fp8_case(case, k_scale, v_scale)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, page, case.scale, torch.device("cpu"),
                                    torch.float32, kv_cache_dtype="fp8")
    out = backend.forward(fp8.q, fp8.k, fp8.v, fp8.k_cache, fp8.v_cache, fp8.metadata, k_scale, v_scale)
    assert relative_error(out, solved) < 1e-5  # the rounded problem, solved in float32
    assert relative_error(out, exact) < 0.05  # e4m3 rounding of every key and value: ~2-3% here
    assert fp8.k_cache.dtype == torch.float8_e4m3fn


def _engine(kv_cache_dtype, dtype="float32"):
    return LLM("random:tiny-qwen3", device="cpu", dtype=dtype, attention_backend="torch",
               kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=1 << 21, max_num_seqs=8)


def test_the_fp8_pool_holds_twice_the_blocks_of_bf16_in_the_same_memory():
    bf16, fp8 = _engine("auto", "bfloat16"), _engine("fp8", "bfloat16")
    assert fp8.engine.num_kv_blocks == 2 * bf16.engine.num_kv_blocks
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.runner.kv_cache.nbytes <= 1 << 21
    assert bf16.engine.runner.kv_cache.dtype == torch.bfloat16
    # README: FP8 K / V are stored with a per-layer scale of 1.0 (no calibration)
    runner = fp8.engine.runner
    assert runner.kv_scales == [(1.0, 1.0)] * len(runner.kv_caches) and len(runner.kv_caches) > 1


# random:tiny-qwen3 in float32 (these prompts, torch 2.13): the largest |logprob difference| of fp8 vs
# float32 KV seen was 0.006 (sampled tokens) and 0.008 (prompt tokens); 0.05 leaves room for other
# torch versions. (This random model repeats one token, so token equality is the weaker check.)
LOGPROB_TOLERANCE = 0.05


def test_fp8_kv_gives_the_same_greedy_tokens_and_logprobs_within_tolerance():
    prompts = [[(37 * i + 11 * j * j) % 509 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    outs = {kv: _engine(kv).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            for kv in ("auto", "fp8")}
    for ref, fp8 in zip(outs["auto"], outs["fp8"]):
        assert fp8.token_ids == ref.token_ids
        sampled = max(abs(a - b) for a, b in zip(ref.logprobs, fp8.logprobs))
        prompt = max(abs(a - b) for a, b in zip(ref.prompt_logprobs.logprobs[1:], fp8.prompt_logprobs.logprobs[1:]))
        assert sampled < LOGPROB_TOLERANCE and prompt < LOGPROB_TOLERANCE


def test_an_unknown_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"engine\.kv_cache_dtype"):
        parse_config({"engine": {"kv_cache_dtype": "fp16"}})
    assert parse_config({"engine": {"kv_cache_dtype": "fp8"}}).engine_config("w").kv_cache_dtype == "fp8"


def fp8_capable(name: str) -> bool:
    return "fp8_e4m3" in BACKENDS[name].kv_cache_dtypes


def accepted(name: str, *request) -> bool:
    """Whether choose_backend takes backend `name` for (block_size, head_dim, dtype, kv_cache_dtype) on a GPU."""
    try:
        choose_backend(name, "cuda", *request)
    except ValueError:
        return False
    return True


def test_flash_attn_refuses_an_fp8_cache_and_auto_skips_it(monkeypatch):
    # as on a machine where every backend's library is installed
    monkeypatch.setattr(registry, "BACKENDS", {n: dataclasses.replace(s, library=None) for n, s in BACKENDS.items()})
    assert not fp8_capable("flash_attn")  # test_each_backends_fp8_kv_line_matches_what_it_does checks this line
    takers = [n for n in BACKENDS if n != "flash_attn" and accepted(n, 256, 128, "bfloat16", "fp8")]
    assert "torch" in takers and all(fp8_capable(n) for n in takers)
    with pytest.raises(ValueError, match=r"attention_backend 'flash_attn' needs kv_cache_dtype \(engine\."
                                         r"kv_cache_dtype in a serve config\) to be one of auto, got fp8; "
                                         rf"change it or choose attention_backend {' or '.join(takers)}$"):
        choose_backend("flash_attn", "cuda", 256, 128, "bfloat16", "fp8")
    # the backends before it absent and flash_attn taking any page: then auto's first choice is flash_attn,
    # and with an FP8 cache the next FP8 one after it
    installed = registry.BACKENDS
    order = list(BACKENDS)
    for name in order[:order.index("flash_attn")]:
        monkeypatch.setitem(installed, name, dataclasses.replace(installed[name], library="kvmesh_absent"))
    monkeypatch.setitem(installed, "flash_attn", dataclasses.replace(installed["flash_attn"], block_size_multiple=1))
    assert choose_backend("auto", "cuda", 16, 128, "bfloat16", "auto") == "flash_attn"
    chosen = choose_backend("auto", "cuda", 16, 128, "bfloat16", "fp8_e4m3")
    after = [n for n in order[order.index("flash_attn") + 1:] if accepted(n, 16, 128, "bfloat16", "fp8")]
    assert chosen == after[0] and fp8_capable(chosen)


def cpu_backend_class(name: str, monkeypatch):
    """Backend `name`'s class where it runs on this CPU machine: a backend that needs no GPU, or
    flash_attn on tests/flash_attn_reference.py (flash-attn 2.8's interface and its dtype checks)."""
    spec = BACKENDS[name]
    if spec.library in CPU_STAND_INS:
        monkeypatch.setitem(sys.modules, spec.library, CPU_STAND_INS[spec.library])
    elif spec.needs_gpu or not spec.installed():
        pytest.skip(f"{name} runs on a GPU only: tests/gpu/test_fp8_kv_cache_gpu.py")
    return load_backend_class(name)


CPU_STAND_INS = {"flash_attn": flash_attn_reference}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backends_fp8_kv_line_matches_what_it_does(monkeypatch, name):
    """Each backend that runs here, made to accept an FP8 cache whatever its registry line says:
    it attends over the FP8 pool as it does over a bf16 one (within the bf16 band of the rounded
    problem's float32 reference) exactly when its line lists fp8_e4m3."""
    cls = cpu_backend_class(name, monkeypatch)
    spec, claimed = BACKENDS[name], fp8_capable(name)
    page = block_size_for(name)
    head_dim = 64 if spec.head_dims is None or 64 in spec.head_dims else spec.head_dims[0]
    dtype = "bfloat16" if "bfloat16" in spec.dtypes else spec.dtypes[0]
    case = make_case(num_heads=4, num_kv_heads=2, head_dim=head_dim, page=page, dtype=getattr(torch, dtype),
                     device="cpu", seed=11, decode_ctx=[1, 300], prompt_lens=[7, 40], prefix_lens=[0, 270])

    def attend(case, kv_cache_dtype, k_scale=1.0, v_scale=1.0):
        backend = cls(4, 2, head_dim, page, case.scale, torch.device("cpu"), getattr(torch, dtype),
                      kv_cache_dtype=kv_cache_dtype)
        backend.plan(case.metadata)
        return backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata, k_scale, v_scale)

    # the control: in the model dtype it solves the problem, so a failure below is the FP8 cache's
    assert relative_error(attend(case, "auto"), reference_attention(case)) < BF16_BAND
    monkeypatch.setitem(registry.BACKENDS, name, dataclasses.replace(spec, kv_cache_dtypes=FP8_KV))
    fp8, solved = fp8_case(case, 0.25, 2.0)
    try:
        error = relative_error(attend(fp8, "fp8", 0.25, 2.0), solved)
    except (RuntimeError, TypeError, NotImplementedError) as e:  # a kernel that refuses float8 K/V
        error, refused = float("inf"), e
    else:
        refused = None
    assert (error < BF16_BAND) == claimed, (
        f"{name}: its registry line says FP8 KV {'is' if claimed else 'is not'} supported, "
        f"but over an FP8 pool it {'refused: ' + repr(refused) if refused else f'gave relative error {error:.3g}'}")


def test_a_backend_built_directly_checks_the_kv_cache_dtype():
    with pytest.raises(ValueError, match=r"attention_backend 'torch' needs kv_cache_dtype \(engine\.kv_cache_dtype "
                                         r"in a serve config\) to be one of auto, fp8_e4m3, got e5m2"):
        TorchAttentionBackend(2, 1, 8, 4, 1.0, torch.device("cpu"), torch.float32, kv_cache_dtype="e5m2")


def test_bench_offline_and_latency_take_the_kv_cache_dtype(capsys):
    from kvmesh.cli import main

    tiny = ["--model", "random:tiny-qwen3", "--device", "cpu", "--kv-cache-dtype", "fp8", "--json"]
    assert main(["bench", "offline", *tiny, "--num-prompts", "2", "--max-input-len", "16",
                 "--max-output-len", "6", "--min-len", "4"]) == 0
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offline["kv_cache_dtype"] == "fp8" and offline["output_tokens"] > 0
    assert main(["bench", "latency", *tiny, "--prompt-len", "16", "--decode-prompt-len", "4",
                 "--output-len", "3", "--repeats", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kv_cache_dtype"] == "fp8"


def test_the_floor_counts_an_fp8_cache_at_one_byte_per_element():
    shape = dict(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4,
                 vocab_size=10, tie_word_embeddings=True)
    assert ModelShape(**shape, kv_dtype_bytes=1).kv_bytes_per_token * 2 == ModelShape(**shape).kv_bytes_per_token
    assert ModelShape(**shape, kv_dtype_bytes=1).weight_bytes == ModelShape(**shape).weight_bytes


def test_the_config_and_the_registry_name_the_same_kv_cache_dtypes():
    from kvmesh.config import KV_CACHE_DTYPES
    from kvmesh.worker.attention.registry import kv_cache_dtype_name

    registry_names = {name for spec in BACKENDS.values() for name in spec.kv_cache_dtypes}
    assert {kv_cache_dtype_name(name) for name in KV_CACHE_DTYPES} == registry_names == {"auto", "fp8_e4m3"}


def test_tensor_parallel_ranks_hold_fp8_pools_and_give_rank_1s_tokens():
    # each rank stores its KV heads in FP8; with one scale per layer the split changes no value
    prompts = [[(7 * j + i) % 500 for j in range(30)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    outs = {}
    for size in (1, 2):
        with LLM("random:tiny-qwen3", device="cpu", kv_cache_dtype="fp8", tensor_parallel_size=size,
                 kv_cache_memory_bytes=1 << 20) as llm:
            assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
            outs[size] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for one, two in zip(outs[1], outs[2]):
        assert two.token_ids == one.token_ids
        assert max(abs(a - b) for a, b in zip(one.logprobs, two.logprobs)) < 1e-4
