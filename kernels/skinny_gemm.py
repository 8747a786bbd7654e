"""A GEMM for decode steps (y = x @ w.T, x: [M, K] with M <= a few hundred rows, w: [N, K] bf16) that
loads its weights before it waits for the kernel before it.

A decode step's four GEMMs a layer read ~31 MB of weights that the attention kernel has pushed out
of L2, and each waits for the small kernel before it (a norm, SiLU-and-mul, the attention's split
merge) to finish before its first load. Here each program owns a tile of BLOCK_N output columns
over one slice of K (split K) and loads that weight tile into registers first. Launched with
programmatic dependent launch (`launch_pdl`, Hopper and later), the program does that while the
kernel before it still runs (that kernel lets it start early: `launch_next()` below), and only then
waits (`gdc_wait`) for its input rows. The split-K partial sums go to a float32 workspace; the last
program of a column tile to arrive (an atomic count) adds them in split order, so the result does not
depend on which program finished first, writes the bf16 tile and resets the count for the next launch.

Safety of the early start: before its wait a program reads only the weight, which no kernel writes
during a step; everything it writes (partials, counts, the output) comes after the wait, which returns
once the kernel before it has completed and its memory is visible. That kernel itself starts only
after everything before it completed (it is not launched with PDL), so what the GEMM reads after the
wait is there. The workspace and counts are shared by every launch on a device: the engine runs one
stream, and two of these GEMMs are never adjacent (a Triton kernel sits between each pair).

KVMESH_SKINNY_GEMM=1 turns it on for the decoder's bf16 linear layers of at most
KVMESH_SKINNY_GEMM_MAX_ROWS rows (default 128) on devices of compute capability 9.0 and above;
off by default until measured (docs/PERF.md). Off, the early-start instruction is not compiled into
the kernels before it either.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("KVMESH_SKINNY_GEMM", "0") == "1"
MAX_ROWS = int(os.environ.get("KVMESH_SKINNY_GEMM_MAX_ROWS", "128"))


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLICE_K: tl.constexpr,
                        SPLIT: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * SLICE_K + tl.arange(0, SLICE_K)
    n_mask = offs_n < N
    # The weight tile first: nothing of this step writes it (the module docstring's safety argument).
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=n_mask[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    w_t = tl.trans(w)  # [SLICE_K, BLOCK_N]
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=m_mask[:, None],
                    other=0.0)
        acc = tl.dot(x, w_t)  # float32 [BLOCK_M, BLOCK_N]
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT == 1:
            tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc, mask=mask)
    if SPLIT > 1:
        tl.debug_barrier()  # every thread's partials stored before the count says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last of the tile's programs: add the partials in split order
            for m0 in range(0, M, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask = (offs_m < M)[:, None] & n_mask[None, :]
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):
                    total += tl.load(part_ptr + (s * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :],
                                     mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                         total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(count_ptr + pid_n, 0)  # ready for the next launch


def default_config(m: int, n: int, k: int) -> dict:
    """Tiles for an [m, k] x [k, n] product: column tiles of 32, K slices of 256 (a program's weight
    tile is 16 KB), row chunks of up to 64, unpipelined (one stage: ~48 KB of shared memory)."""
    slice_k = 256 if k % 256 == 0 else k
    return dict(block_n=32, slice_k=slice_k, block_m=min(64, max(16, triton.next_power_of_2(m))), num_warps=4,
                num_stages=1)


class _Buffers:
    """Per device: the float32 partials (grown, never shrunk: a captured CUDA graph keeps using the
    buffer it was captured with, so earlier ones are kept) and the per-tile arrival counts."""

    def __init__(self, device: torch.device):
        self.counts = torch.zeros(1 << 16, dtype=torch.int32, device=device)
        self.parts: list[torch.Tensor] = [torch.empty(1 << 20, dtype=torch.float32, device=device)]

    def partials(self, numel: int) -> torch.Tensor:
        if self.parts[-1].numel() < numel:
            self.parts.append(torch.empty(numel, dtype=torch.float32, device=self.counts.device))
        return self.parts[-1]


_buffers: dict[torch.device, _Buffers] = {}


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, pdl: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """x: [M, K] (unit stride along K), w: [N, K] contiguous, the same dtype -> [M, N] in that dtype,
    accumulated in float32. pdl: launch with programmatic dependent launch (default: use_pdl)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.is_contiguous() and x.stride(1) == 1, (x.shape, x.stride(), w.shape)
    cfg = config or default_config(m, n, k)
    block_n, slice_k = cfg["block_n"], cfg["slice_k"]
    if k % slice_k:
        raise ValueError(f"skinny_gemm: K {k} is not a multiple of slice_k {slice_k}")
    split = k // slice_k
    tiles = triton.cdiv(n, block_n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    pdl = use_pdl(x.device) if pdl is None else pdl
    buffers = _buffers.get(x.device)
    if buffers is None:
        buffers = _buffers[x.device] = _Buffers(x.device)
    if tiles > buffers.counts.numel():
        raise ValueError(f"skinny_gemm: {tiles} column tiles, at most {buffers.counts.numel()}")
    part = buffers.partials(split * m * n) if split > 1 else y
    _skinny_gemm_kernel[(tiles, split)](x, w, y, part, buffers.counts, m, n, k, x.stride(0), y.stride(0),
                                        BLOCK_M=cfg["block_m"], BLOCK_N=block_n, SLICE_K=slice_k, SPLIT=split,
                                        PDL=pdl, num_warps=cfg["num_warps"],
                                        num_stages=cfg.get("num_stages", 1), **({"launch_pdl": True} if pdl else {}))
    return y


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the decoder's linear layer runs skinny_gemm for this input (KVMESH_SKINNY_GEMM=1)."""
    return (ENABLED and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and x.stride(1) == 1 and w.is_contiguous() and x.is_cuda
            and _sm90(x.device) and os.environ.get("TRITON_INTERPRET") != "1"
            and not torch.compiler.is_compiling())  # torch.compile keeps F.linear


def use_pdl(device: torch.device) -> bool:
    """Whether skinny_gemm launches with programmatic dependent launch on `device` (Hopper and later)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and _sm90(device)


def launch_next(device: torch.device) -> bool:
    """Whether the kernels before a skinny_gemm (add + RMSNorm, SiLU-and-mul, the decode split merge)
    let the kernel after them start early (`gdc_launch_dependents` at their start; a no-op for a
    kernel after them not launched with PDL)."""
    return ENABLED and use_pdl(device)


_capabilities: dict[int, bool] = {}


def _sm90(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _capabilities[index]
