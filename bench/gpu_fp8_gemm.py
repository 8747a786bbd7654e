"""FP8 linear-layer timings on the GPU machine: at Qwen3-8B's and Qwen3-0.6B's shapes and a range of
token counts, bf16 `x @ W^T` against the engine's FP8 path (per-token quantizer + row-wise
`torch._scaled_mm`, timed eagerly: its quantizer's Python launch bounds it here, not under the
engine's CUDA graphs, where the quantizer takes ~4 us of GPU time a layer), the row-wise GEMM alone,
and a tensor-wise `_scaled_mm` (one scale per operand) alone. Each time is the median of `triton.testing.do_bench` over weight copies rotated so that no
shape runs from L2; weight-read TB/s is the layer's weight bytes over that time. Prints a table;
writes JSON to argv[1] if given.
Run: PYTHONPATH=. python3 bench/gpu_fp8_gemm.py $OUT/fp8_gemm.json"""

import json
import sys

import torch
import triton

from kvmesh.worker.layers.fp8 import fp8_linear, quantize_per_tensor, quantize_per_token, row_scale

SHAPES = {"8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 24576), "8b down": (12288, 4096),
          "0.6b gate_up": (1024, 6144)}
TOKENS = (1, 8, 32, 128, 200, 256, 512)
L2_BYTES = 64 << 20


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        copies = max(1, -(-2 * L2_BYTES // (k * n)))  # rotate so that bf16 copies are twice L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_per_tensor(w) for w in weights]
        rows_scales = [row_scale(s, n) for _, s in fp8]
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_per_token(x)
            xq_t, xs_t = quantize_per_tensor(x)
            ref = x.float() @ weights[0].float().t()
            err = lambda y: ((y.float() - ref).norm() / ref.norm()).item()
            i = [0]

            def pick():
                i[0] = (i[0] + 1) % copies
                return i[0]

            t = {
                "bf16": median_us(lambda: x @ weights[pick()].t()),
                "fp8 path, eager": median_us(lambda: fp8_linear(x, fp8[(j := pick())][0], rows_scales[j])),
                "row-wise GEMM": median_us(lambda: torch._scaled_mm(
                    xq, fp8[(j := pick())][0].t(), scale_a=xs, scale_b=rows_scales[j], out_dtype=torch.bfloat16)),
                "tensor-wise GEMM": median_us(lambda: torch._scaled_mm(
                    xq_t, fp8[(j := pick())][0].t(), scale_a=xs_t, scale_b=fp8[j][1], out_dtype=torch.bfloat16)),
            }
            errors = {"bf16": err(x @ weights[0].t()), "row-wise": err(fp8_linear(x, fp8[0][0], rows_scales[0])),
                      "tensor-wise": err(torch._scaled_mm(xq_t, fp8[0][0].t(), scale_a=xs_t, scale_b=fp8[0][1],
                                                          out_dtype=torch.bfloat16))}
            rows.append(dict(shape=name, k=k, n=n, tokens=m, us=t, relative_error=errors,
                             weight_tb_s={v: k * n * (2 if v == "bf16" else 1) / (us * 1e-6) / 1e12
                                          for v, us in t.items()}))
        del weights, fp8, rows_scales
    print(f"{'shape':14s} {'tokens':>6s} " + " ".join(f"{v:>22s}" for v in rows[0]["us"]) + "   rel. error bf16/row/tensor")
    for r in rows:
        cells = " ".join(f"{r['us'][v]:9.1f} us {r['weight_tb_s'][v]:5.2f} TB/s" for v in r["us"])
        e = r["relative_error"]
        print(f"{r['shape']:14s} {r['tokens']:6d} {cells}   {e['bf16']:.4f}/{e['row-wise']:.4f}/{e['tensor-wise']:.4f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
