"""Programmatic dependent launch (kvmesh.kernels.pdl): off on the CPU and under the interpreter; where
it is on, each decode-path kernel waits for the kernel before it (griddepcontrol.wait in its code)
and without it does not. The kernels are compiled here for an H100 / H200 (sm_90) without a GPU;
their results with PDL on are checked on the GPU by tests/gpu/test_fused_kernels.py (KVMESH_PDL=1)."""

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvmesh.kernels import pdl, rms_norm, rotary, sample, silu_and_mul  # noqa: E402

KERNELS = {
    "rms_norm": (rms_norm._rms_norm_kernel,
                 dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", stride_outer="i32", stride_inner="i32",
                      num_inner="i32", eps="fp32"), dict(D=1024, BLOCK_D=1024)),
    "add_rms_norm": (rms_norm._add_rms_norm_kernel,
                     dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sum_ptr="*bf16", eps="fp32"),
                     dict(D=1024, BLOCK_D=1024)),
    "silu_and_mul": (silu_and_mul._silu_and_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16", stride_x="i32"),
                     dict(I=3072, BLOCK=1024)),
    "rotary": (rotary._rotary_kernel,
               dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", q_out="*bf16", k_out="*bf16", wq_ptr="*bf16",
                    wk_ptr="*bf16", positions="*i64", cos_ptr="*fp32", sin_ptr="*fp32", k_cache="*bf16",
                    v_cache="*bf16", slot_mapping="*i64", k_inv_scale="fp32", v_inv_scale="fp32",
                    stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32", stride_vt="i32",
                    stride_vh="i32", num_q_heads="i32", num_k_heads="i32", eps="fp32"),
               dict(HALF=64, BLOCK=64, NORM=True, STORE=True, FP8=False, FP8_MAX=448.0)),
    "sample_partial": (sample._sample_partial_kernel,
                       dict(logits_ptr="*bf16", stride_row="i32", inv_temp_ptr="*fp32", best_ptr="*fp32",
                            best_id_ptr="*i32", seed="i32", vocab="i32", num_chunks="i32"),
                       dict(CHUNK=8192, BLOCK=1024)),
    "sample_reduce": (sample._sample_reduce_kernel,
                      dict(best_ptr="*fp32", best_id_ptr="*i32", out_ptr="*i64", num_chunks="i32"), dict(CHUNKS=32)),
}


def ptx(name: str, on: bool) -> str:
    fn, args, constants = KERNELS[name]
    constants = dict(constants, PDL=on)
    signature = dict(args, **{k: "constexpr" for k in constants})
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"launch_pdl": on})
    assert compiled.metadata.launch_pdl == on
    return compiled.asm["ptx"]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_kernel_waits_for_the_one_before_it_only_with_pdl(name):
    assert "griddepcontrol.wait" in ptx(name, True)
    assert "griddepcontrol.wait" not in ptx(name, False)
    # none lets the kernel after it start early (the module's safety argument rests on that)
    assert "griddepcontrol.launch_dependents" not in ptx(name, True)


def test_off_without_a_gpu_and_by_the_variable(monkeypatch):
    assert not pdl.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.use_pdl(torch.device("cuda", 0))  # never asks the (absent) device
