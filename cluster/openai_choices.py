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
from kvmesh.cluster.reasoning import delta_fields
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
               prompt_tokens: int, cached_tokens: int, prompt_ids: list[int] | None = None) -> dict:
    """A whole response: one choice per returned sequence (n = 1: the one), echo applied; with
    return_token_ids the prompt's ids too (`prompt_ids`: on a chat response, on each completion
    choice, as vLLM puts them)."""
    body, choices = None, []
    for index, sequence in enumerate(chosen_sequences(result, params)):
        reason = sequence.last.finish_reason if sequence.last is not None else None
        body = shaper.full(sequence.text, sequence.token_ids, sequence.logprobs,
                           sequence.top_logprobs, reason, prompt_tokens, cached_tokens,
                           sequence.last.stop_reason if sequence.last is not None else None)
        if echo is not None:
            body = echo.apply(body, kind, result.prompt_logprobs)
        choice = body["choices"][0]
        choice["index"] = index
        if shaper.return_token_ids and kind != "chat":
            choice["prompt_token_ids"] = list(prompt_ids or [])
        choices.append(choice)
    body["choices"] = choices
    if shaper.return_token_ids and kind == "chat":
        body["prompt_token_ids"] = list(prompt_ids or [])
    generated = sum(len(s.token_ids) for s in result.sequences.values())
    body["usage"] = usage(prompt_tokens, generated, cached_tokens)
    return body


class StreamChoices:
    """The SSE chunks of a stream: each delta is a chunk of the choice of its sequence's index;
    with echo, the prompt goes first in a chunk of its own (per choice); prompt_logprobs ride on
    choice 0's first chunk (at the top of a chat chunk, in the choice of a completion's)."""

    def __init__(self, shaper: Shaper, include_usage: bool, echo, num_choices: int,
                 index_base: int = 0, prompt_ids: list[int] | None = None, reasoning=None):
        """`index_base`: the first choice's index (prompt i of several: i * n, as vLLM).
        `prompt_ids`: with return_token_ids, on the stream's first chunk (chat: its first role
        chunk) or each completion choice's first chunk. `reasoning`: a chat's
        cluster.reasoning.ChatReasoning (server.reasoning_parser): each delta's text goes out as
        its `reasoning` and `content` parts, each only when it has text."""
        self.reasoning = reasoning
        self.shaper, self.include_usage, self.echo = shaper, include_usage, echo
        self.num_choices, self.index_base = num_choices, index_base
        self.prompt_ids = list(prompt_ids or [])
        self.offsets: dict[int, int] = {}  # text sent so far per choice (completions' text_offset)
        self.scores = None  # the prompt's logprobs: on the request's first delta with a token

    def role_chunks(self) -> list[dict]:
        chunks = []
        for index in range(self.num_choices):
            role = self.shaper.role_chunk(self.include_usage)
            if role is not None:
                role["choices"][0]["index"] = self.index_base + index
                if self.shaper.return_token_ids and not chunks and self.index_base == 0:
                    role["prompt_token_ids"] = self.prompt_ids
                chunks.append(role)
        return chunks

    def chunks(self, delta, usage_so_far: dict | None = None) -> list[dict]:
        """`usage_so_far`: stream_options.continuous_usage_stats' usage on the delta's chunk."""
        shaper, echo, out = self.shaper, self.echo, []
        self.scores = self.scores or delta.prompt_logprobs
        first = delta.index not in self.offsets
        offset = self.offsets.get(delta.index, 0)
        if echo is not None and first and echo.echo:
            echoed = echo.first_chunk(self.scores)
            if echoed is not None:
                echoed["index"] = self.index_base + delta.index
                out.append(shaper._chunk([echoed], None, self.include_usage))
            offset = len(echo.prompt_text)
        chunk = shaper.delta_chunk(delta.text, delta.token_ids, delta.logprobs, delta.top_logprobs,
                                   delta.finish_reason, offset, self.include_usage,
                                   delta.stop_reason, usage_so_far)
        chunk["choices"][0]["index"] = self.index_base + delta.index
        if self.reasoning is not None:
            parts = self.reasoning.piece(delta.index, delta.text, delta.finish_reason is not None)
            chunk["choices"][0]["delta"] = delta_fields(*parts)
        if echo is not None and first and not echo.echo and delta.index == 0:
            if shaper.kind == "chat":
                chunk["prompt_logprobs"] = echo.vllm_list(self.scores)
            else:
                chunk["choices"][0]["prompt_logprobs"] = echo.vllm_list(self.scores)
        out.append(chunk)
        if first and shaper.return_token_ids and shaper.kind != "chat":  # on the choice's first chunk
            out[0]["choices"][0]["prompt_token_ids"] = self.prompt_ids
        self.offsets[delta.index] = offset + len(delta.text)
        return out
