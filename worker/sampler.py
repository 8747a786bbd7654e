"""Sampling: allowed_token_ids, bad_words, logit_bias and min_tokens, then penalties (vLLM's order),
temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The batch is sampled with tensor operations and one host sync (the final .tolist()). A seeded
request draws its randomness from its own generator, so its output does not depend on what else is
in the batch. Sampling uses the exponential race (argmax of p / Exp(1)), which equals multinomial
sampling and needs one random vector per row.

On a GPU, a batch whose rows ask for nothing but a temperature (no top-k / top-p / min-p, penalties,
biases, min_tokens, grammar, logprobs or per-request seed) is sampled by two Triton launches that
read the logits once, plus one chunk per sampled row (kvmesh.kernels.sample: the same distribution
by inverse CDF, one uniform per row; its Philox stream is seeded from this sampler's seed, one draw
per step).
"""

import os
import random
from dataclasses import dataclass

import torch

from kvmesh.sampling_params import SamplingParams
from kvmesh.worker.bad_words import banned_next_tokens
from kvmesh.worker.grammar import apply_grammar_masks
from kvmesh.worker.host_to_device import to_device


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of each sampled token (None when no request asked)
    top_logprobs: list[dict[int, float] | None]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt + output, presence/frequency over output (one row)."""
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


def constrain_logits(logits: torch.Tensor, requests, eos_token_ids) -> torch.Tensor:
    """A row with allowed_token_ids keeps only those logits; logit_bias added to each row's logits;
    a row's bad_words cannot be completed (worker/bad_words.py); a row with fewer than min_tokens
    output tokens cannot sample its stop_token_ids or EOS (unless ignore_eos). logits [N, V] float32, changed in place with one scatter each, on the logits'
    device."""
    vocab = logits.shape[-1]
    _keep_allowed(logits, requests)
    rows, cols, values, masked_rows, masked_cols = [], [], [], [], []
    for i, req in enumerate(requests):
        params = req.sampling_params
        if getattr(req, "bad_word_ids", None):
            for token_id in banned_next_tokens(req.bad_word_ids, req.output_token_ids):
                if token_id < vocab:
                    masked_rows.append(i), masked_cols.append(token_id)
        if params.logit_bias:
            for token_id, bias in params.logit_bias.items():
                if token_id < vocab:
                    rows.append(i), cols.append(token_id), values.append(float(bias))
        if params.min_tokens and len(req.output_token_ids) < params.min_tokens:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            for token_id in ids:
                if token_id < vocab:
                    masked_rows.append(i), masked_cols.append(token_id)
    device = logits.device
    if rows:
        logits.index_put_((to_device(rows, torch.long, device), to_device(cols, torch.long, device)),
                          to_device(values, torch.float32, device), accumulate=True)
    if masked_rows:
        logits.index_put_((to_device(masked_rows, torch.long, device),
                           to_device(masked_cols, torch.long, device)),
                          torch.tensor(float("-inf"), device=device))
    return logits


def _keep_allowed(logits: torch.Tensor, requests) -> None:
    """Rows with allowed_token_ids: every other logit -inf."""
    rows = [(i, req.sampling_params.allowed_token_ids) for i, req in enumerate(requests)
            if req.sampling_params.allowed_token_ids]
    if not rows:
        return
    vocab, device = logits.shape[-1], logits.device
    keep_rows, keep_cols = [], []
    for j, (_, ids) in enumerate(rows):
        for token_id in ids:
            if token_id < vocab:
                keep_rows.append(j), keep_cols.append(token_id)
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    keep[to_device(keep_rows, torch.long, device), to_device(keep_cols, torch.long, device)] = True
    index = to_device([i for i, _ in rows], torch.long, device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p. logits [N, V] float32 -> [N, V]."""
    device = logits.device
    temperature = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, device)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        values = torch.topk(logits, max(top_k), dim=-1).values  # [N, kmax], descending
        index = to_device([max(k - 1, 0) for k in top_k], torch.long, device).unsqueeze(1)
        kth = values.gather(1, index)
        kth = torch.where(to_device(top_k, torch.long, device).unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = to_device([p.top_p for p in params], torch.float32, device).unsqueeze(1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the top token is always kept)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


class PendingSample:
    """A step's sampled tokens on their way to the host: the device-to-host copy is queued right
    after sampling, so waiting for it later does not wait for steps launched after it."""

    def __init__(self, requests, tokens: torch.Tensor, logprobs: torch.Tensor | None,
                 top_ids: torch.Tensor | None, top_values: torch.Tensor | None):
        self.requests = requests
        self.tokens = tokens  # [N] int64 on the device: the next step reads placeholders from it
        self._host = [_to_host(t) for t in (tokens, logprobs, top_ids, top_values)]
        self._event = None
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        tokens, logprobs, top_ids, top_values = self._host
        token_list = tokens.tolist()
        if logprobs is None:
            return SampleResult(token_list, None, [None] * len(token_list))
        tops = []
        for i, req in enumerate(self.requests):
            k = req.sampling_params.logprobs or 0
            tops.append(dict(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else None)
        return SampleResult(token_list, logprobs.tolist(), tops)


def _temperature_only(p: SamplingParams, request) -> bool:
    """Whether a row needs nothing of the general path but its temperature (the fused kernel)."""
    return (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and not p.uses_penalties
            and not p.logit_bias and not p.min_tokens and not p.needs_sampled_logprobs
            and not p.allowed_token_ids and not p.bad_words
            and getattr(request, "generator", None) is None and getattr(request, "grammar", None) is None)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids=()):
        self.device = device
        self.eos_token_ids = frozenset(eos_token_ids)  # masked by min_tokens (the engine sets it)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._step_seeds = random.Random(seed)  # the fused kernel's Philox seed, one per step
        # the one-launch path for temperature-only batches; KVMESH_FUSED_SAMPLER=0 turns it off (A/B runs)
        self.fused = device.type == "cuda" and os.environ.get("KVMESH_FUSED_SAMPLER", "1") != "0"

    def sample(self, logits: torch.Tensor, requests) -> SampleResult:
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests) -> PendingSample:
        """logits: [N, vocab] for N requests (in order); one token per request, left on the device."""
        params = [r.sampling_params for r in requests]
        if self.fused and logits.is_cuda and all(_temperature_only(p, r) for p, r in zip(params, requests)):
            from kvmesh.kernels.sample import sample_from_logits
            inv_temperature = to_device([1.0 / p.temperature if p.temperature > 0 else 0.0 for p in params],
                                        torch.float32, logits.device)
            tokens = sample_from_logits(logits, inv_temperature, self._step_seeds.getrandbits(31))
            return PendingSample(requests, tokens, None, None, None)
        logits = logits.float()
        if any(p.logit_bias or p.min_tokens or p.allowed_token_ids or p.bad_words for p in params):  # before penalties, as vLLM
            logits = constrain_logits(logits, requests, self.eos_token_ids)
        for i, req in enumerate(requests):
            if params[i].uses_penalties:
                logits[i] = apply_penalties(logits[i].clone(), params[i], req.prompt_token_ids, req.output_token_ids)
        apply_grammar_masks(logits, requests, logits.shape[-1])  # structured outputs' rows only
        tokens = logits.argmax(dim=-1)  # [N]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            every_row = len(random_rows) == len(params)
            rows = None if every_row else to_device(random_rows, torch.long, logits.device)
            probs = filtered_probs(logits if every_row else logits[rows], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(random_rows) if requests[i].generator is None]
            if len(shared) == len(random_rows):
                noise.exponential_(1.0, generator=self.generator)
            elif shared:
                noise[to_device(shared, torch.long, logits.device)] = torch.empty((len(shared), probs.shape[1]), device=logits.device).exponential_(
                    1.0, generator=self.generator)
            for j, i in enumerate(random_rows):
                if requests[i].generator is not None:
                    noise[j].exponential_(1.0, generator=requests[i].generator)
            sampled = (probs / noise).argmax(dim=-1)
            if every_row:
                tokens = sampled
            else:
                tokens[rows] = sampled
        if not any(p.needs_sampled_logprobs for p in params):
            return PendingSample(requests, tokens, None, None, None)
        logp = torch.log_softmax(logits, dim=-1)  # of the model's (penalised) distribution
        sampled_logp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        kmax = max(p.logprobs or 0 for p in params)
        top_values, top_ids = torch.topk(logp, kmax, dim=-1) if kmax else (None, None)
        return PendingSample(requests, tokens, sampled_logp, top_ids, top_values)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row, for tests and tools: the same arithmetic as Sampler.sample."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits.float().unsqueeze(0), [params])[0]
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int(torch.argmax(probs / noise))
