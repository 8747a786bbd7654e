"""The offline API, shaped like vLLM's:

    llm = LLM()                                         # the default model
    outs = llm.generate(["prompt", ...], SamplingParams(max_tokens=32, temperature=0))
    outs = llm.generate(prompt_token_ids=[[...]], sampling_params=...)
    outs = llm.chat([{"role": "user", "content": "..."}], sampling_params)

    with LLM("random:qwen3-0.6b", tensor_parallel_size=2) as llm:   # split over 2 GPUs (or 2 CPU
        ...                                                         # processes with device="cpu")
"""

import dataclasses
import itertools
import sys
from collections.abc import Iterator, Sequence

from kvmesh.config import EngineConfig
from kvmesh.protocol import EngineRequest, RequestOutput, TokenDelta
from kvmesh.sampling_params import SamplingParams
from kvmesh.worker.chat_template import TemplateOptions, encode_chat
from kvmesh.worker.engine import Engine
from kvmesh.worker.parallel_sampling import rank_best_of


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        unknown = sorted(set(engine_args) - set(EngineConfig.field_names()))
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}; "
                            f"known: {', '.join(EngineConfig.field_names())}")
        config = EngineConfig(**({"model": model} if model else {}), **engine_args)
        self.engine = Engine(config, progress=sys.stderr.isatty())
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks (if any); the process of a closed LLM may then
        build another with tensor_parallel_size > 1."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- prompts -----------------------------------------------------------------------------

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids, with the tokenizer's special tokens (e.g. Llama's BOS) unless
        add_special_tokens is False: as vLLM's LLM.generate and /v1/completions tokenize it."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None,
                            chat_template: str | None = None) -> list[int]:
        """The prompt ids of a conversation (vLLM's LLM.chat options: the assistant's turn opened,
        or the final message continued; the template's own variables, e.g. enable_thinking; a
        Jinja template of the caller's instead of the tokenizer's)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"model {self.engine.model_name!r} has no chat template")
        options = TemplateOptions(add_generation_prompt, continue_final_message, dict(chat_template_kwargs or {}),
                                  chat_template=chat_template)
        return encode_chat(self.tokenizer, messages, options=options)  # content is text: no forged turns

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """`priority` (vLLM's): one per prompt, lower first, for an engine built with
        scheduling_policy="priority"; the outputs keep the prompts' order either way."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            token_lists = [self.encode(p) for p in texts]
        else:
            texts = [None] * len(prompt_token_ids)
            token_lists = [list(ids) for ids in prompt_token_ids]
        return self._run(texts, token_lists, sampling_params, use_tqdm, priority)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; the template options
        as apply_chat_template's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.apply_chat_template(c, add_generation_prompt, continue_final_message,
                                                chat_template_kwargs, chat_template) for c in conversations]
        texts = [self.tokenizer.decode(ids) for ids in token_lists]
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
               prompt: str | None = None) -> Iterator[TokenDelta]:
        """Yield one request's deltas as the engine produces them (used by `kvmesh generate`)."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(EngineRequest(request_id, list(prompt_token_ids),
                                              sampling_params or SamplingParams(), prompt=prompt))
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        yield delta
                        if delta.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _run(self, texts, token_lists, sampling_params, use_tqdm, priority=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(token_lists))
        if len(params) != len(token_lists):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(token_lists)} prompts")
        priorities = [0] * len(token_lists) if priority is None else list(priority)
        if len(priorities) != len(token_lists):
            raise ValueError(f"priority has {len(priorities)} entries for {len(token_lists)} prompts")
        # Validate every request before queueing any, so a bad one leaves nothing half-done.
        requests = []
        for text, ids, p, rank in zip(texts, token_lists, params, priorities):
            requests.append(EngineRequest(f"req-{next(self._ids)}", ids, p, prompt=text,
                                          stream_text=_needs_text_on_the_step(p), priority=rank))
        for r in requests:
            self.engine.validate_request(r)
            if r.sampling_params.structured_outputs is not None:  # a bad schema raises here
                self.engine.grammar_compiler.compile(r.sampling_params.structured_outputs)
        outputs: dict[str, RequestOutput] = {}
        sequences: dict[tuple[str, int], RequestOutput] = {}
        for r in requests:
            self.engine.add_request(r)
            outputs[r.request_id] = RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, "", [], None)
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="generating", unit=" req", file=sys.stderr,
                       disable=not sys.stderr.isatty())
        try:
            pending = len(requests)
            while pending:
                for delta in self.engine.step():
                    out = outputs.get(delta.request_id)
                    if out is None:
                        continue
                    if delta.index:  # sequence i > 0 of a request with n > 1
                        out = sequences.setdefault((delta.request_id, delta.index), RequestOutput(
                            out.request_id, out.prompt, out.prompt_token_ids, "", [], None))
                    out.text += delta.text
                    out.token_ids.extend(delta.token_ids)
                    out.num_cached_tokens = delta.num_cached_tokens
                    out.prompt_logprobs = out.prompt_logprobs or delta.prompt_logprobs
                    if delta.logprobs is not None:
                        out.logprobs = (out.logprobs or []) + delta.logprobs
                        out.top_logprobs = (out.top_logprobs or []) + (delta.top_logprobs or [None])
                    if delta.finish_reason is not None:
                        out.finish_reason = delta.finish_reason
                        out.stop_reason = delta.stop_reason
                        out.arrival_time = delta.arrival_time
                        out.first_token_time = delta.first_token_time
                    if delta.finished:
                        pending -= 1
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for r in requests:
                self.engine.abort_request(r.request_id)  # no-op for finished ones
        results = []
        for r in requests:
            params = r.sampling_params
            seqs = [outputs[r.request_id]] + [sequences.get((r.request_id, i)) or RequestOutput(
                r.request_id, r.prompt, r.prompt_token_ids, "", [], None) for i in range(1, params.num_sequences)]
            if not r.stream_text:
                for out in seqs:
                    out.text = self._decode_output(out.token_ids, params, out.finish_reason)
            results.append(self._choose(seqs, params))
        return results

    @staticmethod
    def _choose(seqs: list[RequestOutput], params: SamplingParams) -> RequestOutput:
        """n > 1: the n sequences (best_of: the n best by cumulative logprob) on the first one."""
        if len(seqs) == 1:
            return seqs[0]
        order = rank_best_of([sum(s.logprobs or []) for s in seqs], params.n) if params.best_of else range(params.n)
        chosen = [seqs[i] for i in order]
        for s in chosen:
            s.prompt_logprobs = seqs[0].prompt_logprobs
            if params.logprobs is None:
                s.logprobs = s.top_logprobs = None  # computed only to rank best_of
        return dataclasses.replace(chosen[0], sequences=chosen)

    def _decode_output(self, token_ids: list[int], params: SamplingParams, finish_reason) -> str:
        """The whole output's text at once (a stop token id is not part of the text)."""
        if finish_reason == "stop" and token_ids and token_ids[-1] in params.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _needs_text_on_the_step(params: SamplingParams) -> bool:
    """Stop strings, a kept stop string and kept special tokens need the engine's incremental
    detokenizer; other outputs are decoded once at the end."""
    return bool(params.stop) or params.include_stop_str_in_output or not params.skip_special_tokens
