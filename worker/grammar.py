"""Structured outputs with xgrammar: a StructuredOutputs spec compiled for a tokenizer, a matcher per
request, and the batch's token mask.

xgrammar was chosen by measured mask cost (docs/SERVING.md, `python -m kvmesh.bench.grammar_mask`).
Compiling is the slow part (milliseconds to seconds for a big schema), so it never runs on the step
path: `GrammarCompiler.submit` compiles on its own thread, and compiled grammars are cached by the
spec (xgrammar's compiler cache, keyed by the schema / regex / grammar text). Only the per-token mask
(microseconds) runs in the step, and only for the rows that have a grammar.

JSON is generated compact (no whitespace between JSON tokens): a small model otherwise can spend its
whole budget on newlines that the grammar allows.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvmesh.structured_outputs import StructuredOutputs


class GrammarError(ValueError):
    """The spec does not compile (an invalid schema, regex or grammar); the message says why."""


class GrammarCompiler:
    """Compiles specs for one tokenizer. Thread-safe; `submit` compiles off the caller's thread.
    The last MAX_CACHED distinct specs stay compiled (a compiled grammar holds per-token tables)."""

    MAX_CACHED = 256

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 threads: int = 1):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = stop_token_ids or ([tokenizer.eos_token_id]
                                            if tokenizer.eos_token_id is not None else None)
        self._compiler = None  # built on the compile thread: reading the vocabulary takes a while
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvmesh-grammar")
        self._threads = threads
        self._futures: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()

    def _xgrammar_compiler(self):
        with self._build_lock:
            if self._compiler is None:
                self._compiler = self._build()
        return self._compiler

    def _build(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self._stop_ids)
        # no second cache inside xgrammar: ours is bounded
        return xgrammar.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar (cached), or GrammarError naming the spec's field."""
        return self.submit(spec).result()

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar; the same future for equal specs (a cache hit is done)."""
        with self._lock:
            future = self._futures.get(spec.key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, spec)
                while len(self._futures) >= self.MAX_CACHED:  # forget the oldest
                    del self._futures[next(iter(self._futures))]
                self._futures[spec.key] = future
            return future

    def _compile(self, spec: StructuredOutputs):
        kind = spec.kind
        compiler = self._xgrammar_compiler()  # on the pool's thread(s) only
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(spec.json, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(f"structured_outputs.{kind}: does not compile: {first_line}") from None
        if not self._allows_a_first_token(compiled):
            raise GrammarError(f"structured_outputs.{kind}: matches no text this model can write")
        return compiled

    def _allows_a_first_token(self, compiled) -> bool:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(vocab / 32)]
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bool(bits.flatten()[:self.vocab_size].any())

    @staticmethod
    def matcher(compiled, after_token: int | None = None) -> "GrammarMatcher":
        import xgrammar

        return GrammarMatcher(xgrammar.GrammarMatcher(compiled), after_token)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string literals are EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMatcher:
    """One request's position in its grammar; advanced by each accepted token.

    With `after_token` (SamplingParams.reasoning_end_token_id: a reasoning model's end of its
    thinking block, as vLLM applies structured outputs after the reasoning), the grammar sleeps
    until that token is sampled: no mask, nothing accepted, never terminated; the grammar's
    language starts with the token after it."""

    def __init__(self, matcher, after_token: int | None = None):
        self._matcher = matcher
        self.after_token = after_token

    @property
    def active(self) -> bool:
        return self.after_token is None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.active:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if not self.active:
            if token_id == self.after_token:
                self.after_token = None
            return True
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted the end of sequence: nothing more may follow."""
        return self.active and self._matcher.is_terminated()


def apply_grammar_masks(logits: torch.Tensor, requests, vocab_size: int) -> None:
    """Mask, in place, the tokens each row's grammar forbids; rows without a grammar are left as
    they are. logits: [N, vocab] float32, requests: N engine Requests (their `.grammar`)."""
    rows = [i for i, r in enumerate(requests)
            if getattr(r, "grammar", None) is not None and r.grammar.active]
    if not rows:
        return
    import xgrammar

    # [N, ceil(vocab / 32)] int32, all ones (allowed) where not filled; built on the host
    bitmask = xgrammar.allocate_token_bitmask(len(requests), vocab_size)
    for i in rows:
        if requests[i].num_pending:
            raise RuntimeError(f"request {requests[i].request_id}: its grammar is a token behind")
        requests[i].grammar.fill_mask(bitmask, i)
    if logits.is_cuda:  # pinned, so the copy is queued behind the forward instead of waiting for it
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows,
                                         backend="cpu" if not logits.is_cuda else "auto")
