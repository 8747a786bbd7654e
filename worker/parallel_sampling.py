"""Parallel sampling (n > 1, best_of): one request, several sequences that share its prompt.

The engine makes every sequence of a request when it is added: sequence 0 runs the prompt, the
others wait as its `pending_forks`. In the step that computes the end of the prompt, the scheduler
forks them (Scheduler._fork): each takes a reference on every block of sequence 0 (the prompt is
prefilled once), starts with all prompt tokens computed, and samples its first token from the same
logits row as sequence 0 (the runner repeats the row). The partly filled last block is copied when a
sequence first writes into it while another still holds it (BlockManager.allocate_slots, copy on
write); full blocks stay shared until freed.

Seeds: sequence i of a request with `seed` samples from its own generator seeded `seed + i`, so it
equals what a request with n = 1 and seed `seed + i` gives, and sequence 0 equals the n = 1 request
with the same seed. Greedy sequences are all equal to the n = 1 output.

best_of: the request generates `best_of` sequences; the caller returns the n with the highest
cumulative logprob (sum of the sampled tokens' logprobs), as vLLM does (`rank_best_of`).

Preemption takes a whole group: sequences share blocks, so preempting one alone frees little. Each
then runs again on its own (its prompt's full blocks are found in the prefix cache).
"""

from __future__ import annotations

import dataclasses

from kvmesh.sampling_params import SamplingParams


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s parameters: its own seed (seed + index), no prompt logprobs after the
    first (they are the request's, computed once)."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


def rank_best_of(cumulative_logprobs: list[float], n: int) -> list[int]:
    """Indices of the n sequences with the highest cumulative logprob, best first (ties: lower
    index first)."""
    order = sorted(range(len(cumulative_logprobs)), key=lambda i: (-cumulative_logprobs[i], i))
    return order[:n]
