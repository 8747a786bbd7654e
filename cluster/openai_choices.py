"""n > 1 and best_of on the OpenAI API: one choice per sequence of the request.

The engine runs `best_of` (else n) sequences of one request (worker/parallel_sampling.py); their
deltas carry the sequence's `index`. Streaming: each delta becomes a chunk of the choice of that
index, with its own finish_reason (best_of is refused with stream). Whole responses: the choices in
index order; with best_of > n, the n sequences with the highest cumulative logprob, best first,
renumbered 0..n-1. Usage counts the tokens of every generated sequence, as OpenAI bills best_of.
"""

from __future__ import annotations

from kvmesh.cluster.generation import Collected
from kvmesh.cluster.openai_protocol import usage
from kvmesh.cluster.openai_responses import Shaper
from kvmesh.sampling_params import SamplingParams
from kvmesh.worker.parallel_sampling import rank_best_of


def chosen_sequences(result: Collected, params: SamplingParams) -> list[Collected]:
    sequences = [result.sequences.get(i) or Collected(per_sequence=False)
                 for i in range(params.num_sequences)]
    if params.num_sequences > params.n:
        order = rank_best_of([sum(s.logprobs) for s in sequences], params.n)
        return [sequences[i] for i in order]
    return sequences


def whole_body(shaper: Shaper, result: Collected, params: SamplingParams, kind: str, echo,
               prompt_tokens: int, cached_tokens: int) -> dict:
    body, choices = None, []
    for index, sequence in enumerate(chosen_sequences(result, params)):
        reason = sequence.last.finish_reason if sequence.last is not None else None
        body = shaper.full(sequence.text, sequence.token_ids, sequence.logprobs,
                           sequence.top_logprobs, reason, prompt_tokens, cached_tokens)
        if echo is not None:
            body = echo.apply(body, kind, result.prompt_logprobs)
        choice = body["choices"][0]
        choice["index"] = index
        choices.append(choice)
    body["choices"] = choices
    generated = sum(len(s.token_ids) for s in result.sequences.values())
    body["usage"] = usage(prompt_tokens, generated, cached_tokens)
    return body
