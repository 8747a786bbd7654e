"""The fused MoE kernel's token->expert alignment (plain torch) exactly, and the kernel itself under
Triton's interpreter (TRITON_INTERPRET=1 runs it on the CPU with numpy) against the torch reference
path, float32. On the GPU, tests/gpu/test_fused_moe_gpu.py checks the compiled kernel in bf16."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from kvmesh.kernels.fused_moe import align_pairs

ROOT = Path(__file__).resolve().parents[2]


def test_pairs_are_sorted_by_expert_and_each_run_padded_to_the_block():
    expert_ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5: experts 2, 0, 2, 3, 0, 2
    sorted_pairs, block_expert, num_padded = align_pairs(expert_ids, num_experts=5, block_m=4)
    pad = 6  # the sentinel: the number of pairs
    # expert 0: pairs 1, 4; expert 1: none; expert 2: pairs 0, 2, 5; expert 3: pair 3; expert 4: none
    assert num_padded.tolist() == [12]
    assert sorted_pairs[:12].tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert (sorted_pairs[12:] == pad).all()  # room for the worst case, never used here
    assert sorted_pairs.numel() == 6 + 5 * 3 + 3  # P + min(E, P) * (block - 1), rounded up to a block
    assert block_expert[:3].tolist() == [0, 2, 3]


def test_every_pair_appears_once_in_a_block_of_its_expert():
    generator = torch.Generator().manual_seed(0)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(37)])  # [37, 4]
    sorted_pairs, block_expert, num_padded = align_pairs(expert_ids, num_experts=16, block_m=16)
    used = sorted_pairs[:num_padded.item()]
    real = used[used < 37 * 4]
    assert sorted(real.tolist()) == list(range(37 * 4))
    blocks = used.view(-1, 16)
    for block, expert in zip(blocks, block_expert.tolist()):
        for pair in block[block < 37 * 4].tolist():
            assert expert_ids.flatten()[pair] == expert


INTERPRETED = r"""
import torch
from kvmesh.kernels.fused_moe import fused_moe
from kvmesh.worker.layers.moe import moe_reference

torch.manual_seed(0)
cases = [  # (tokens, experts, top_k, hidden, expert width)
    (1, 8, 2, 64, 32),      # one decode token
    (37, 8, 2, 64, 40),     # widths that are not multiples of the tiles
    (70, 4, 3, 96, 24),     # many tokens per expert: larger row blocks
    (9, 16, 1, 32, 16),     # top-1, most experts idle
    (100, 2, 2, 32, 150),   # over 64 tokens per expert: the widest tiles
]
for tokens, experts, top_k, hidden, inter in cases:
    x = torch.randn(tokens, hidden)
    gate_up = torch.randn(experts, 2 * inter, hidden) * 0.1
    down = torch.randn(experts, hidden, inter) * 0.1
    probs = torch.softmax(torch.randn(tokens, experts), dim=-1)
    weights, expert_ids = probs.topk(top_k, dim=-1)
    out = fused_moe(x, gate_up, down, weights, expert_ids)
    ref = moe_reference(x, gate_up, down, weights, expert_ids)
    err = (out - ref).abs().max().item()
    assert err < 1e-5, (tokens, experts, top_k, err)
skewed = torch.zeros(5, 2, dtype=torch.int64)  # every token to expert 0 and 1
skewed[:, 1] = 1
x = torch.randn(5, 32)
gate_up, down = torch.randn(4, 32, 32) * 0.1, torch.randn(4, 32, 16) * 0.1
weights = torch.full((5, 2), 0.5)
assert (fused_moe(x, gate_up, down, weights, skewed) - moe_reference(x, gate_up, down, weights, skewed)).abs().max() < 1e-5
print("ok")
"""


def test_kernel_under_the_triton_interpreter_matches_the_torch_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")  # read when the kernel is defined: a fresh process
    result = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
