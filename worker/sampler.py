"""Sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Each request samples from its own row. A seeded request draws its randomness from its own
generator, so its output does not depend on what else is in the batch. Sampling uses the
exponential-race trick (argmax of p / Exp(1)), which equals multinomial sampling and needs one
random vector per row.
"""

from dataclasses import dataclass

import torch

from kvmesh.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of each sampled token (None when no request asked)
    top_logprobs: list[dict[int, float] | None]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt + output, presence/frequency over output."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device, dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids = torch.tensor(output_ids, device=logits.device, dtype=torch.long)
        counts = torch.zeros_like(logits).scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (one row, float32)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest set whose mass reaches top_p (the top token is always kept)
        drop_sorted = (cumulative - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int(torch.argmax(probs / noise))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests) -> SampleResult:
        """logits: [N, vocab] for N requests (in order); returns one token per request."""
        logits = logits.float()
        token_ids: list[int] = []
        want_logprobs = any(r.sampling_params.logprobs is not None for r in requests)
        logprobs, tops = [], []
        for i, req in enumerate(requests):
            params = req.sampling_params
            row = logits[i]
            if params.uses_penalties:
                row = apply_penalties(row.clone(), params, req.prompt_token_ids, req.output_token_ids)
            token = sample_row(row, params, req.generator or self.generator)
            token_ids.append(token)
            if want_logprobs:
                logp = torch.log_softmax(logits[i], dim=-1)  # of the model's distribution
                logprobs.append(float(logp[token]))
                top = None
                if params.logprobs:
                    values, ids = torch.topk(logp, params.logprobs)
                    top = dict(zip(ids.tolist(), values.tolist()))
                tops.append(top)
        return SampleResult(token_ids, logprobs if want_logprobs else None,
                            tops if want_logprobs else [None] * len(requests))
