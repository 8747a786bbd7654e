"""Fused MoE kernel timings on the GPU machine: one Qwen3-30B-A3B MoE layer (128 experts, 8 per token,
hidden 2048, expert width 768, bf16) at several token counts, the fused Triton kernel against the torch
path (one GEMM pair per expert in use), with the kernel's achieved TFLOP/s and weight bandwidth next to
the measured copy bandwidth and matmul rate. Prints a table; writes JSON to argv[1] if given.
Run: PYTHONPATH=. python3 bench/gpu_moe.py $OUT/moe.json"""

import json
import sys

import torch
import triton

from kvmesh.bench.floor import measure_ceilings
from kvmesh.kernels.fused_moe import fused_moe
from kvmesh.worker.layers.moe import moe_reference

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = [1, 8, 32, 128, 256, 512, 2048, 8192]


def main():
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, generator=gen) / HIDDEN ** 0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device=device, generator=gen) / INTER ** 0.5).bfloat16()
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device=device, generator=gen).bfloat16()
        probs = torch.softmax(torch.randn(tokens, EXPERTS, device=device, generator=gen), dim=-1)
        weights, expert_ids = probs.topk(TOP_K, dim=-1)
        weights = weights.bfloat16()
        fused_ms = triton.testing.do_bench(lambda: fused_moe(x, gate_up, down, weights, expert_ids))
        torch_ms = triton.testing.do_bench(lambda: moe_reference(x, gate_up, down, weights, expert_ids))
        touched = int(torch.unique(expert_ids).numel())
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        weight_bytes = touched * 3 * HIDDEN * INTER * 2
        rows.append(dict(tokens=tokens, experts_touched=touched, fused_ms=fused_ms, torch_ms=torch_ms,
                         fused_tflops=flops / fused_ms / 1e9, fused_weight_tb_s=weight_bytes / fused_ms / 1e9,
                         speedup_vs_torch=torch_ms / fused_ms))
    print(f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    print(f"{'tokens':>7} {'experts':>7} {'fused ms':>9} {'torch ms':>9} {'TFLOP/s':>8} {'weights TB/s':>12} {'x torch':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['experts_touched']:>7} {r['fused_ms']:>9.3f} {r['torch_ms']:>9.3f} "
              f"{r['fused_tflops']:>8.1f} {r['fused_weight_tb_s']:>12.2f} {r['speedup_vs_torch']:>8.1f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(ceilings=ceilings, shape=dict(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN,
                                                         inter=INTER), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
