"""Attention kernel timings on the GPU machine: each backend's paged decode and prefill against the
measured copy bandwidth and matmul rate. Prints a table; writes JSON to argv[1] if given.
Run: PYTHONPATH=. python3 bench/gpu_kernels.py $OUT/kernels.json
     PYTHONPATH=. python3 bench/gpu_kernels.py --fa-splits $OUT/fa_splits.json   flash-attn's decode
       over batch sizes and num_splits (0: its heuristic), the block table as wide as the engine's
       (max_model_len 4096 / page 256), timed as CUDA-graph replays"""

import importlib.util
import json
import sys

import torch
import triton

sys.path.insert(0, "tests/gpu")
from attention_cases import make_case, reference_attention, relative_error  # noqa: E402

from kvmesh.bench.floor import measure_ceilings  # noqa: E402


def backend(name, h, hkv, d, page, scale):
    if name == "triton":
        from kvmesh.worker.attention.triton_backend import TritonAttentionBackend as cls
    elif name == "flashinfer":
        from kvmesh.worker.attention.flashinfer_backend import FlashInferAttentionBackend as cls
    else:
        from kvmesh.worker.attention.flash_attn_backend import FlashAttnAttentionBackend as cls
    return cls(h, hkv, d, page, scale, torch.device("cuda"), torch.bfloat16)


def time_attention(name, case, h, hkv, d, page):
    try:
        return _time_attention(name, case, h, hkv, d, page)
    except Exception as e:  # one backend failing must not hide the others' numbers
        print(f"{name} page {page}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return float("nan"), float("nan")


def _time_attention(name, case, h, hkv, d, page):
    b = backend(name, h, hkv, d, page, case.scale)
    b.plan(case.metadata)
    out = b.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata)
    err = relative_error(out, reference_attention(case))
    ms = triton.testing.do_bench(
        lambda: b.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata),
        warmup=50, rep=300, return_mode="median")
    return ms, err


def main():
    ceilings = measure_ceilings(torch.device("cuda"))
    rows, results = [], {"ceilings": ceilings}
    bw, rate = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    h, hkv, d = 16, 8, 128
    available = ["triton"] + [n for n in ("flashinfer", "flash_attn") if importlib.util.find_spec(n)]
    decode_cases = [("decode 64x1024", 64, 1024), ("decode 256x600", 256, 600), ("decode 1x1024", 1, 1024),
                    ("decode 4x8192", 4, 8192)]
    for label, batch, ctx in decode_cases:
        for name in available:
            for page in ([16, 256] if name != "flash_attn" else [256]):
                case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=[ctx] * batch,
                                 prompt_lens=[], prefix_lens=[])
                ms, err = time_attention(name, case, h, hkv, d, page)
                kv_bytes = batch * ctx * hkv * d * 2 * 2
                rows.append((label, name, page, ms * 1e3, kv_bytes / (ms * 1e-3) / 1e12, kv_bytes / (ms * 1e-3) / bw, err))
    for label, batch, new, cached in [("prefill 64x256 on 768", 64, 256, 768), ("prefill 4x2048 fresh", 4, 2048, 0)]:
        for name in available:
            page = 256 if name == "flash_attn" else 16
            case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=[],
                             prompt_lens=[new] * batch, prefix_lens=[cached] * batch)
            ms, err = time_attention(name, case, h, hkv, d, page)
            # causal: each new token attends to cached + its position (+1)
            flops = 4 * h * d * batch * sum(cached + i + 1 for i in range(new))
            rows.append((label, name, page, ms * 1e3, flops / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / rate, err))
    results["rows"] = [dict(zip(("case", "backend", "page", "us", "TBps_or_TFLOPs", "of_ceiling", "rel_err"), r))
                       for r in rows]
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    print(f"{'case':24s} {'backend':10s} {'page':>4s} {'us':>9s} {'TB/s|TF/s':>9s} {'ceil%':>6s} {'relerr':>8s}")
    for r in rows:
        print(f"{r[0]:24s} {r[1]:10s} {r[2]:4d} {r[3]:9.1f} {r[4]:9.2f} {100 * r[5]:5.0f}% {r[6]:8.1e}", flush=True)


def fa_splits():
    """Decode time of flash_attn_with_kvcache by batch, context and num_splits, the engine's shape."""
    from flash_attn import flash_attn_with_kvcache

    bw = measure_ceilings(torch.device("cuda"))["copy_bytes_per_s"]
    h, hkv, d, page, width = 16, 8, 128, 256, 16
    rows = []
    for ctx in (700, 1400):
        for batch in (8, 16, 32, 64, 96, 128, 192, 256):
            case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=[ctx] * batch,
                             prompt_lens=[], prefix_lens=[])
            m = case.metadata
            table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            table[:, :m.block_tables.shape[1]] = m.block_tables
            q = case.q.unsqueeze(1)
            kv_bytes = batch * ctx * hkv * d * 2 * 2
            for splits in (0, 1, 2, 3, 4, 6, 8, 12, 16):
                def run():
                    return flash_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=m.seq_lens,
                                                   block_table=table, softmax_scale=case.scale, causal=True,
                                                   num_splits=splits)
                ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
                rows.append(dict(ctx=ctx, batch=batch, splits=splits, us=ms * 1e3,
                                 of_copy=kv_bytes / (ms * 1e-3) / bw))
            case_rows = [r for r in rows if r["ctx"] == ctx and r["batch"] == batch]  # splits 0 first
            best = min(case_rows, key=lambda r: r["us"])
            line = " ".join(f"{r['splits']}:{r['us']:.0f}" for r in case_rows)
            print(f"ctx {ctx:5d} batch {batch:4d}  splits:us {line}  best {best['splits']} "
                  f"({best['of_copy']:.0%} of copy; heuristic {case_rows[0]['of_copy']:.0%})", flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump({"copy_bytes_per_s": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    fa_splits() if sys.argv[1:2] == ["--fa-splits"] else main()
