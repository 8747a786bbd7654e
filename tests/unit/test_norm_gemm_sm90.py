"""The norm-and-GEMM kernels' shipped tiles (kvmesh.kernels.norm_gemm.CONFIGS) compiled for an H100 /
H200 on this CPU machine (tests/triton_aot.py): each form (qkv, gate_up with SiLU-and-mul, the
rotation form with a bf16 and an FP8 cache) at Qwen3-0.6B's shapes compiles, pipelines its loads
(asynchronous copies into shared memory), fits the shared memory and spills no register. The
interpreter tests (test_norm_gemm_kernel.py) check what the kernels compute; this checks what the GPU
would run. Triton's version here may differ from the GPU machine's."""

import pytest

from kvmesh.kernels import norm_gemm as ng
from tests.triton_aot import SHARED_LIMIT, compile_sm90, ptxas

pytestmark = pytest.mark.skipif(ptxas() is None, reason="this Triton has no bundled ptxas")

BF = "*bf16"
GEMM_TYPES = {**{a: BF for a in ("x_ptr", "res_ptr", "norm_w_ptr", "w_ptr", "bias_ptr", "out_ptr", "total_ptr")},
              "M": "i32", "N": "i32", "eps": "fp32"}
ROTATE_TYPES = {**{a: BF for a in ("x_ptr", "res_ptr", "norm_w_ptr", "w_ptr", "bias_ptr", "q_out", "total_ptr",
                                   "wq_ptr", "wk_ptr", "k_cache", "v_cache")},
                "positions": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_mapping": "*i64",
                "k_inv_scale": "fp32", "v_inv_scale": "fp32", "M": "i32", "num_q_heads": "i32",
                "num_kv_heads": "i32", "eps": "fp32", "head_eps": "fp32"}


def compile_form(form: str, config):
    block_m, block_n, block_k, warps, stages = config
    if form in ("qkv", "gate_up"):
        constexprs = dict(K=1024, HAS_RESIDUAL=True, HAS_BIAS=False, SILU=form == "gate_up", WIDEN=False,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        return compile_sm90(ng._norm_gemm_kernel, GEMM_TYPES, constexprs, warps, stages, multiples_of_16=("N",))
    fp8 = form == "rotate_fp8"
    types = dict(ROTATE_TYPES, **({"k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"} if fp8 else {}))
    constexprs = dict(K=1024, HALF=64, HAS_RESIDUAL=True, HAS_BIAS=False, HEAD_NORM=True, FP8=fp8,
                      FP8_MAX=448.0, WIDEN=False, BLOCK_M=block_m, BLOCK_K=block_k)
    return compile_sm90(ng._norm_qkv_rotate_kernel, types, constexprs, warps, stages)


@pytest.mark.parametrize("config", ng.CONFIGS)
@pytest.mark.parametrize("form", ["qkv", "gate_up", "rotate", "rotate_fp8"])
def test_shipped_tiles_compile_for_sm90_within_shared_memory_and_without_spills(form, config):
    compiled = compile_form(form, config)
    assert compiled.shared <= SHARED_LIMIT, compiled
    assert compiled.spill_bytes == 0, compiled


def test_the_loads_are_pipelined_when_compiled_as_the_jit_specializes():
    """Without the JIT's alignment facts, Triton keeps every load synchronous (no shared-memory stages:
    a memory-bound GEMM would wait out each load's latency); with them the weight tiles stream."""
    import triton
    from triton.compiler import ASTSource

    from tests.triton_aot import SM90

    block_m, block_n, block_k, warps, stages = ng.CONFIGS[0]
    constexprs = dict(K=1024, HAS_RESIDUAL=True, HAS_BIAS=False, SILU=False, WIDEN=False,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    fn = ng._norm_gemm_kernel
    signature = {a: "constexpr" if a in constexprs else GEMM_TYPES[a] for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in constexprs and (GEMM_TYPES[a].startswith("*") or a == "N")}
    counts = {}
    for aligned in (False, True):
        src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs if aligned else {})
        kernel = triton.compile(src, target=SM90, options={"num_warps": warps, "num_stages": stages})
        counts[aligned] = kernel.asm["ttgir"].count("async_copy_global_to_local")
    assert counts[False] == 0 and counts[True] > 0, counts
