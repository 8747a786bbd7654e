"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of each prompt token given the
ones before it, from the hidden states of the prompt positions a step computes.

Position p's hidden state predicts token p + 1, so a chunk covering positions [s, s + q) scores
prompt tokens s + 1 .. min(s + q, P - 1). Every prompt position must be computed for this, so a
request that asks takes no prefix-cache hit (block_manager.get_computed_blocks), as in vLLM; a
request recomputed after preemption scores only the tokens it has not scored yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.protocol import PromptLogprobs
from kvmesh.worker.host_to_device import to_device

ROWS_PER_SLICE = 256  # logits of a slice: [256, vocab] float32 (48 MiB at vocab 49k)


@dataclass
class PromptLogprobsChunk:
    """Scores of prompt tokens first_token .. first_token + len(logprobs) - 1 of `request`."""
    request: object
    first_token: int
    logprobs: list[float]
    ranks: list[int]
    top: list[dict[int, float] | None]


def new_prompt_logprobs() -> PromptLogprobs:
    """The scores of a request before any step: only the first token's (None)."""
    return PromptLogprobs([None], [None], [None])


def add_chunk(scores: PromptLogprobs, chunk: PromptLogprobsChunk) -> None:
    if chunk.first_token != len(scores.logprobs):
        raise RuntimeError(f"prompt logprobs out of order: have {len(scores.logprobs)} tokens, "
                           f"got a chunk starting at {chunk.first_token}")
    scores.logprobs.extend(chunk.logprobs)
    scores.ranks.extend(chunk.ranks)
    scores.top.extend(chunk.top)


def rows_to_score(scheduled) -> list[tuple[object, int, int, int]]:
    """(request, flat index of the first row, first prompt token scored, number of tokens) for each
    scheduled entry whose request asks for prompt logprobs and has unscored tokens in its chunk."""
    rows, offset = [], 0
    for entry in scheduled:
        request = entry.request
        scores = request.prompt_logprobs
        if scores is not None:
            start = request.num_computed_tokens
            first_position = max(start, len(scores.logprobs) - 1)
            end_position = min(start + entry.num_new_tokens, request.num_prompt_tokens - 1)
            if end_position > first_position:
                rows.append((request, offset + first_position - start, first_position + 1,
                             end_position - first_position))
        offset += entry.num_new_tokens
    return rows


def logit_slices(scheduled) -> list[tuple[int, int]]:
    """The row ranges of the step's hidden states score_prompt_tokens computes logits for, in its
    order (the followers of a tensor-parallel group join each of those gathers)."""
    return [(flat_start + lo, flat_start + min(count, lo + ROWS_PER_SLICE))
            for _, flat_start, _, count in rows_to_score(scheduled)
            for lo in range(0, count, ROWS_PER_SLICE)]


@torch.no_grad()
def score_prompt_tokens(model, hidden: torch.Tensor, scheduled) -> list[PromptLogprobsChunk]:
    """hidden: [num_tokens, hidden] of the step whose entries are `scheduled` (before the
    scheduler counts them computed). Synchronizes with the device (only for requests that ask)."""
    chunks = []
    for request, flat_start, first_token, count in rows_to_score(scheduled):
        k = request.sampling_params.prompt_logprobs
        targets_all = request.prompt_token_ids[first_token:first_token + count]
        logprobs, ranks, top = [], [], []
        for lo in range(0, count, ROWS_PER_SLICE):
            hi = min(count, lo + ROWS_PER_SLICE)
            logits = model.compute_logits(hidden[flat_start + lo:flat_start + hi]).float()  # [n, vocab]
            logp = torch.log_softmax(logits, dim=-1)
            targets = to_device(targets_all[lo:hi], torch.long, logp.device).unsqueeze(1)
            token_logp = logp.gather(1, targets)  # [n, 1]
            logprobs.extend(token_logp.squeeze(1).tolist())
            ranks.extend(((logp > token_logp).sum(dim=-1) + 1).tolist())
            if k:
                values, ids = torch.topk(logp, k, dim=-1)
                top.extend(dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))
            else:
                top.extend([None] * (hi - lo))
        chunks.append(PromptLogprobsChunk(request, first_token, logprobs, ranks, top))
    return chunks
