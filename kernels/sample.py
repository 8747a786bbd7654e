"""Sample one token per row straight from the logits, in two launches.

The sampler's general path (worker/sampler.py) makes about a dozen float32 passes over the
[rows, vocab] logits: the cast, temperature, softmax, normalisation, the noise, the race and its
argmax. Measured on an H200 at 256 rows x 151,936 (docs/PERF.md "What limits it"): 0.89 ms a step
at temperature 0.6 against 0.19 ms greedy. These kernels read each logit once, in its own dtype
(a sampled row re-reads the one chunk it picks), and draw one uniform per row (inverse CDF over
softmax(logit / T), exact up to float32 sums):

1. per (row, chunk of ids): m = max_v logit_v / T and the chunk's mass sum_v exp(logit_v / T - m);
2. per row: u ~ Uniform(0, 1) (Philox: tl.rand); the chunk where the running share of the row's
   mass first passes u, then, re-reading that one chunk, the id where its running mass passes what
   is left.

(The kernel before drew a uniform for every logit, Gumbel-max: a Philox draw and two logs per logit
made sampled rows compute-bound, ~195 us at 256 rows against ~30 greedy; docs/PERF.md.) A row with
T = 0 (`inv_temperature` 0) is greedy: the argmax of the raw logits, the lowest id on ties, as
torch.argmax. Top-k / top-p / min-p, penalties, biases, grammar masks, logprobs and per-request
seeds stay on the general path; `Sampler` decides.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_partial_kernel(logits_ptr, stride_row, inv_temp_ptr, top_ptr, top_id_ptr, mass_ptr, vocab,
                           num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk), over its CHUNK ids. Greedy row: the best logit and the lowest id that
    reaches it. Sampled row: m = the largest logit / T and mass = sum_v exp(logit_v / T - m), each
    lane keeping its own running maximum and rescaling its sum when it grows (online softmax)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    if inv_temp > 0:
        mass = tl.zeros([BLOCK], tl.float32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + lanes
            mask = cols < vocab
            y = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
            y = tl.where(mask, y, float("-inf"))
            grown = tl.maximum(best, y)
            # -inf - -inf is nan: a lane with no mass yet has nothing to rescale, an id of -inf adds none
            mass = tl.where(best == float("-inf"), 0.0, mass * tl.exp(best - grown)) \
                + tl.where(y == float("-inf"), 0.0, tl.exp(y - grown))
            best = grown
        top = tl.max(best, axis=0)
        total = tl.sum(tl.where(best == float("-inf"), 0.0, mass * tl.exp(best - top)), axis=0)
        tl.store(top_ptr + row * num_chunks + chunk, top)
        tl.store(mass_ptr + row * num_chunks + chunk, total)
    else:
        best_id = tl.full([BLOCK], 2147483647, tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + lanes
            mask = cols < vocab
            x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            better = x > best  # strict: a lane keeps its lowest id of a tie, as torch.argmax
            best = tl.where(better, x, best)
            best_id = tl.where(better & mask, cols, best_id)
        top = tl.max(best, axis=0)
        tl.store(top_ptr + row * num_chunks + chunk, top)
        tl.store(top_id_ptr + row * num_chunks + chunk, tl.min(tl.where(best == top, best_id, 2147483647), axis=0))


# Not specialized on the seed (a new one each step): Triton would compile a second form the first
# time a seed divisible by 16 came, inside a run (~0.26 s on a fresh nvidia-h200, 2026-12-04 s24
# call 3: the longest wait of the device in the offline run's first tenth).
@triton.jit(do_not_specialize=["seed"])
def _sample_pick_kernel(logits_ptr, stride_row, inv_temp_ptr, top_ptr, top_id_ptr, mass_ptr, out_ptr, seed,
                        vocab, num_chunks, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """Program per row. Greedy: the best chunk's id (the lowest of a tie). Sampled: one uniform u per
    row; the chunk whose running share of the row's mass first passes u, then inside it the id whose
    running mass first passes what is left (inverse CDF over softmax(logit / T))."""
    row = tl.program_id(0)
    inv_temp = tl.load(inv_temp_ptr + row)
    i = tl.arange(0, CHUNKS)
    valid = i < num_chunks
    top = tl.load(top_ptr + row * num_chunks + i, mask=valid, other=float("-inf"))
    if inv_temp > 0:
        mass = tl.load(mass_ptr + row * num_chunks + i, mask=valid, other=0.0)
        peak = tl.max(top, axis=0)
        weight = tl.where(top == float("-inf"), 0.0, mass * tl.exp(top - peak))  # each chunk's mass
        u = tl.rand(seed, row)  # in [0, 1)
        target = u * tl.sum(weight, axis=0)
        running = tl.cumsum(weight, axis=0)
        # the first chunk whose running mass passes the target; rounding past the end: the last with mass
        chunk = tl.min(tl.where((running > target) & valid, i, CHUNKS), axis=0)
        chunk = tl.where(chunk == CHUNKS, tl.max(tl.where(weight > 0, i, 0), axis=0), chunk)
        left = target - tl.sum(tl.where(i < chunk, weight, 0.0), axis=0)
        m = tl.max(tl.where(i == chunk, top, float("-inf")), axis=0)
        left = left / tl.exp(m - peak)  # in the chunk's own units: exp(logit / T - m)
        lanes = tl.arange(0, BLOCK)
        carried = 0.0
        first = 2147483647
        last = 0
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + lanes
            mask = cols < vocab
            y = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
            e = tl.where(mask & (y > float("-inf")), tl.exp(y - m), 0.0)
            passed = (tl.cumsum(e, axis=0) + carried > left) & (e > 0)
            first = tl.minimum(first, tl.min(tl.where(passed, cols, 2147483647), axis=0))
            last = tl.maximum(last, tl.max(tl.where(e > 0, cols, 0), axis=0))
            carried += tl.sum(e, axis=0)
        token = tl.where(first == 2147483647, last, first)  # rounding past the chunk's end: its last id with mass
    else:
        best_id = tl.load(top_id_ptr + row * num_chunks + i, mask=valid, other=2147483647)
        token = tl.min(tl.where(top == tl.max(top, axis=0), best_id, 2147483647), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


CHUNK = 8192  # ids per program: 19 programs a row at a 151,936-id vocabulary


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                       chunk: int = CHUNK) -> torch.Tensor:
    """logits [N, V] (any float dtype, last dim contiguous), inv_temperature [N] float32 on the same
    device (0: greedy) -> [N] int64 token ids. `seed` (0 <= seed < 2**31) picks the Philox stream:
    the same logits, temperatures and seed give the same tokens. Two launches: each row's vocabulary
    in chunks of `chunk` ids (a multiple of 1024; rows x chunks programs, so one row alone still
    fills the GPU), then per row its chunks and, for a sampled row, the one chunk it picks."""
    if chunk <= 0 or chunk % 1024:
        raise ValueError(f"chunk must be a positive multiple of 1024, got {chunk}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        num_chunks = triton.cdiv(vocab, chunk)
        top = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
        top_id = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
        mass = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
        _sample_partial_kernel[(rows, num_chunks)](logits, logits.stride(0), inv_temperature, top, top_id, mass,
                                                   vocab, num_chunks, CHUNK=chunk, BLOCK=1024, num_warps=4)
        _sample_pick_kernel[(rows,)](logits, logits.stride(0), inv_temperature, top, top_id, mass, out, seed,
                                     vocab, num_chunks, CHUNK=chunk, CHUNKS=triton.next_power_of_2(num_chunks),
                                     BLOCK=1024, num_warps=4)
    return out
