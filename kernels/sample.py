"""Sample one token per row straight from the logits, in one launch.

The sampler's general path (worker/sampler.py) makes about a dozen float32 passes over the
[rows, vocab] logits: the cast, temperature, softmax, normalisation, the noise, the race and its
argmax. Measured on an H200 at 256 rows x 151,936 (docs/PERF.md "What limits it"): 0.89 ms a step
at temperature 0.6 against 0.19 ms greedy. This kernel reads each logit once, in its own dtype:

    token = argmax_v (logit_v / T - log(-log(u_v)))      u_v ~ Uniform(0, 1) (Philox: tl.rand)

the Gumbel-max form of the exponential race the general path runs (argmax p_v / E_v with E_v = -log
u_v is argmax log p_v - log E_v, and log p_v = logit_v / T - log Z, the same for every v). It samples
from softmax(logit / T) exactly. A row with T = 0 (`inv_temperature` 0) is greedy: the argmax of the
raw logits, the lowest id on ties, as torch.argmax. Top-k / top-p / min-p, penalties, biases, grammar
masks, logprobs and per-request seeds stay on the general path; `Sampler` decides.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_partial_kernel(logits_ptr, stride_row, inv_temp_ptr, best_ptr, best_id_ptr, seed, vocab,
                           num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the best score of its CHUNK ids and the lowest id that reaches it."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + lanes
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if inv_temp > 0:
            u = tl.rand(seed, row * vocab + cols)
            # u in [0, 1): u = 0 gives -inf (never chosen); the clamp keeps log(-log u) finite at 1
            u = tl.minimum(u, 0.99999994)
            x = x * inv_temp - tl.log(-tl.log(u))
        x = tl.where(mask, x, float("-inf"))
        better = x > best  # strict: a lane keeps its lowest id of a tie, as torch.argmax
        best = tl.where(better, x, best)
        best_id = tl.where(better & mask, cols, best_id)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where(best == top, best_id, 2147483647), axis=0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(best_id_ptr + row * num_chunks + chunk, top_id)


@triton.jit
def _sample_reduce_kernel(best_ptr, best_id_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, CHUNKS)
    mask = i < num_chunks
    best = tl.load(best_ptr + row * num_chunks + i, mask=mask, other=float("-inf"))
    best_id = tl.load(best_id_ptr + row * num_chunks + i, mask=mask, other=2147483647)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_id, 2147483647), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


CHUNK = 8192  # ids per program: 19 programs a row at a 151,936-id vocabulary


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                       chunk: int = CHUNK) -> torch.Tensor:
    """logits [N, V] (any float dtype, last dim contiguous), inv_temperature [N] float32 on the same
    device (0: greedy) -> [N] int64 token ids. `seed` (0 <= seed < 2**31) picks the Philox stream:
    the same logits, temperatures and seed give the same tokens. Two launches: each row's vocabulary
    in chunks of `chunk` ids (a multiple of 1024; rows x chunks programs, so one row alone still
    fills the GPU), then a row's chunks."""
    if chunk <= 0 or chunk % 1024:
        raise ValueError(f"chunk must be a positive multiple of 1024, got {chunk}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        num_chunks = triton.cdiv(vocab, chunk)
        best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
        best_id = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
        _sample_partial_kernel[(rows, num_chunks)](logits, logits.stride(0), inv_temperature, best, best_id,
                                                   seed, vocab, num_chunks, CHUNK=chunk, BLOCK=1024,
                                                   num_warps=4)
        _sample_reduce_kernel[(rows,)](best, best_id, out, num_chunks,
                                       CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1)
    return out
