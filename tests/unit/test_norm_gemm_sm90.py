"""The norm-and-GEMM kernels' shipped tiles (kvmesh.kernels.norm_gemm.CONFIGS) compiled for an H100 /
H200 on this CPU machine (tests/triton_aot.py): each form (qkv, gate_up with SiLU-and-mul, the
rotation form with a bf16 and an FP8 cache) at Qwen3-0.6B's shapes, at the rows each tile serves,
compiles, pipelines its loads (asynchronous copies into shared memory), fits the shared memory and
spills no register. The interpreter tests (test_norm_gemm_kernel.py) check what the kernels compute;
this checks what the GPU would run. Triton's version here may differ from the GPU machine's."""

import pytest
import torch

from kvmesh.kernels import norm_gemm as ng
from tests.triton_aot import SHARED_LIMIT, captured_launches, compile_sm90, unsupported

pytestmark = pytest.mark.skipif(unsupported() is not None, reason=str(unsupported()))

BF = torch.bfloat16
HIDDEN, H, HKV, D, INTER = 1024, 16, 8, 128, 3072  # Qwen3-0.6B


def launch(form: str, rows: int, config):
    x, residual = torch.randn(rows, HIDDEN, dtype=BF), torch.randn(rows, HIDDEN, dtype=BF)
    norm_weight = torch.ones(HIDDEN, dtype=BF)
    if form in ("qkv", "gate_up"):
        weight = torch.randn(2 * INTER if form == "gate_up" else (H + 2 * HKV) * D, HIDDEN, dtype=BF)
        return ng.norm_gemm(x, residual, norm_weight, 1e-6, weight, silu=form == "gate_up", config=config)
    cache_dtype = torch.float8_e4m3fn if form == "rotate_fp8" else BF
    caches = [torch.zeros(4, 16, HKV, D, dtype=cache_dtype) for _ in range(2)]
    head_norm = (torch.ones(D, dtype=BF), torch.ones(D, dtype=BF), 1e-6)
    return ng.norm_qkv_rotate_store(x, residual, norm_weight, 1e-6, torch.randn((H + 2 * HKV) * D, HIDDEN, dtype=BF),
                                    None, H, HKV, torch.zeros(rows, dtype=torch.int64), torch.ones(64, D // 2),
                                    torch.zeros(64, D // 2), *caches, torch.zeros(rows, dtype=torch.int64),
                                    head_norm=head_norm, config=config)


@pytest.mark.parametrize("rows,config", list(zip((16, 32, 64, 128, 256), ng.CONFIGS)))
@pytest.mark.parametrize("form", ["qkv", "gate_up", "rotate", "rotate_fp8"])
def test_shipped_tiles_compile_for_sm90_pipelined_within_shared_memory_and_without_spills(
        monkeypatch, form, rows, config):
    monkeypatch.setattr(ng, "_widen", lambda x: x.dtype == torch.float32)  # the GPU's choice for bf16
    with captured_launches() as launches:
        launch(form, rows, config)
    (compiled,) = [compile_sm90(one) for one in launches]
    assert compiled.shared <= SHARED_LIMIT, compiled
    assert compiled.spill_bytes == 0, compiled
    assert compiled.async_copies > 0, compiled
