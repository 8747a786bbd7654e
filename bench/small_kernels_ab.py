"""One-off (session 38): a decode step's rotation and split-merge launches at the offline run's
shape, as CUDA-graph replays, by heads a program (rotation) and warps a program (merge).
Prints one JSON line. Delete once its numbers are in docs/PERF.md."""

import json

import torch

from kvmesh.kernels import paged_decode, rotary
from kvmesh.worker.layers import rotary as rotary_layer
from kvmesh.worker.presets import hf_config_for


def replay_us(fn, reps: int = 200) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * 20)


def main():
    out = {}
    emb = rotary_layer.RotaryEmbedding(hf_config_for("qwen3-0.6b"), 128, 4096).cuda()
    heads, kv_heads = 16, 8
    for tokens in (8, 64, 256):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 128, dtype=torch.bfloat16, device="cuda")
        q = qkv[:, :heads * 128].view(tokens, heads, 128)
        k = qkv[:, heads * 128:(heads + kv_heads) * 128].view(tokens, kv_heads, 128)
        v = qkv[:, (heads + kv_heads) * 128:].view(tokens, kv_heads, 128)
        positions = torch.randint(0, 4096, (tokens,), device="cuda")
        slots = torch.randperm(4096 * 16, device="cuda")[:tokens]
        cache = [torch.zeros(4096, 16, kv_heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        norm = (torch.randn(128, dtype=torch.bfloat16, device="cuda"),
                torch.randn(128, dtype=torch.bfloat16, device="cuda"), 1e-6)
        for rows in (0, 2, 4, 8):
            out[f"rotary_t{tokens}_rows{rows}_us"] = round(replay_us(
                lambda: rotary._launch(positions, q, k, emb.cos, emb.sin, norm=norm,
                                       store=(v, *cache, slots, 1.0, 1.0), rows=rows)), 2)
    for seqs in (8, 64, 256):
        for splits in (2, 3):
            part_out = torch.randn(seqs * heads * splits, 128, dtype=torch.float32, device="cuda")
            part_lse = torch.randn(seqs * heads * splits, dtype=torch.float32, device="cuda")
            o = torch.empty(seqs, heads, 128, dtype=torch.bfloat16, device="cuda")
            seq_lens = torch.full((seqs,), 512 * splits - 7, dtype=torch.int32, device="cuda")
            for warps in (1, 2, 4):
                def merge():
                    paged_decode._merge_splits_kernel[(seqs, heads)](
                        part_out, part_lse, o, seq_lens, splits, o.stride(0), o.stride(1),
                        NUM_SPLITS=0, SPLITS_P2=1, HEAD_DIM=128, CHUNK=512, num_warps=warps)
                out[f"merge_s{seqs}_x{splits}_w{warps}_us"] = round(replay_us(merge), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
