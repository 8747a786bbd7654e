"""The engine core: synchronous and single-threaded. step() = schedule -> execute -> update."""

import concurrent.futures
import gc
import logging
import os
import random
import time

import torch

from kvmesh.config import EngineConfig
from kvmesh.hashing import model_salt, tenant_salt
from kvmesh.sampling_params import SamplingParams
from kvmesh.protocol import (EngineRequest, KVEventBatch, KVSnapshot, TokenDelta, WorkerLoad,
                             check_prompt_size)
from kvmesh.worker.bad_words import bad_word_token_ids
from kvmesh.worker.block_manager import BlockManager
from kvmesh.worker.detokenizer import IncrementalDetokenizer
from kvmesh.worker.kv_cache import kv_cache_torch_dtype
from kvmesh.worker.kv_sizing import num_kv_blocks
from kvmesh.worker.model_builder import build_model, model_config_for, resolve_device_dtype
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.parallel_sampling import sequence_params
from kvmesh.worker.prompt_logprobs import add_chunk, new_prompt_logprobs
from kvmesh.worker.scheduler import Scheduler
from kvmesh.worker.sequence import Request
from kvmesh.worker import tensor_parallel
from kvmesh.worker.tensor_parallel import SINGLE

logger = logging.getLogger("kvmesh.engine")

# Whether an engine on CUDA moves every object alive once it is built into the garbage collector's
# permanent generation (gc.freeze, as vLLM does after its start-up); KVMESH_GC_FREEZE=0: not (A/B runs).
# The objects made later (requests, steps) are collected as before; an engine itself is freed by
# reference counting when dropped (tests/gpu/test_prompt_warm_up_gpu.py).
GC_FREEZE = os.environ.get("KVMESH_GC_FREEZE", "1") != "0"


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = False):
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.tp, self._followers = SINGLE, None
        try:
            if config.tensor_parallel_size > 1:
                self._start_tensor_parallel()
            loaded = build_model(config.model, self.device, self.dtype, config.seed, progress=progress, tp=self.tp,
                                 quantization=config.quantization)
            self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
            self.model_name = loaded.name
            self.model_path = loaded.path
            self.eos_token_ids = set(loaded.eos_token_ids)
            self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                     self.model_config.max_position_embeddings)
            self.block_size = config.block_size
            self.hash_salt = model_salt(self.model_name)
            num_blocks = num_kv_blocks(config, self.model_config, self.device, self.kv_cache_dtype, self.tp)
            self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
            self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                       self.max_model_len, config.scheduling_policy)
            self.runner = ModelRunner(self.model, self.model_config, num_blocks, config.block_size,
                                      self.device, self.dtype, config.attention_backend, config.seed,
                                      self.max_model_len, enforce_eager=config.enforce_eager,
                                      max_num_seqs=config.max_num_seqs, torch_compile=config.torch_compile,
                                      kv_cache_dtype=config.kv_cache_dtype, tp=self.tp,
                                      max_num_batched_tokens=config.max_num_batched_tokens)
        except BaseException:
            self._abandon_tensor_parallel()
            raise
        self.runner.sampler.eos_token_ids = frozenset(self.eos_token_ids)  # masked by min_tokens
        self.requests: dict[str, Request] = {}
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._in_flight = None  # (SchedulerOutput, PendingSample | None) launched, not yet processed
        self._finished_out: list[TokenDelta] = []  # deltas of aborted/failed requests, returned by the next step
        self.epoch = random.SystemRandom().getrandbits(62)
        # Structured outputs: requests whose grammar is compiling (off the step path), in order.
        self._grammars = None  # worker.grammar.GrammarCompiler, made on first use
        self._awaiting_grammar: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        self._next_seq = 0
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprob token strings)
        if self.device.type == "cuda" and GC_FREEZE:
            # Python's cyclic collector out of what the imports and this engine made: a full
            # collection scans all of it on the step loop (~170-300 ms on nvidia-h200, docs/PERF.md),
            # while the GPU, one step ahead of the host, waits
            gc.collect()
            gc.freeze()

    # ---- sizing ------------------------------------------------------------------------------

    def _start_tensor_parallel(self) -> None:
        """Check the model splits, start ranks 1..N-1 (worker/tp_followers.py) and join them as
        rank 0 (this process holds the scheduler and samples)."""
        from kvmesh.worker.tp_followers import Followers

        size = self.config.tensor_parallel_size
        tensor_parallel.check_tensor_parallel(model_config_for(self.config.model), size, self.device,
                                              self.config.torch_compile)
        rendezvous = tensor_parallel.rendezvous_file()
        self._followers = Followers(self.config, rendezvous, torch.get_num_threads())
        self.device = tensor_parallel.rank_device(self.device, 0)
        self.tp = tensor_parallel.init_group(0, size, rendezvous, self.device)

    def _abandon_tensor_parallel(self) -> None:
        """This rank failed to start: end the others (blocked in a collective) and leave the group."""
        if self._followers is None:
            return
        for process in self._followers.processes:
            process.kill()
        self._followers.join()
        self._followers = None
        tensor_parallel.destroy_group()

    def close(self) -> None:
        """Stop the tensor-parallel followers and leave the group (nothing to do without them)."""
        if self._followers is None:
            return
        followers, self._followers = self._followers, None
        if followers.alive():
            self.runner.stop_followers()
        followers.join()
        tensor_parallel.destroy_group()

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    # ---- requests ----------------------------------------------------------------------------

    def validate_request(self, request: EngineRequest) -> None:
        """Raise ValueError naming the field and the limit if the engine cannot run `request`."""
        ids = request.prompt_token_ids
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        check_prompt_size(len(ids), self.max_model_len)
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        needed = self.block_manager.blocks_needed(len(ids) + 1)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"prompt is {len(ids)} tokens; the KV pool holds "
                             f"{self.block_manager.num_blocks * self.block_size} tokens "
                             f"({self.block_manager.num_blocks} blocks of {self.block_size})")
        if request.block_hashes is not None:
            self._check_block_hashes(request)
        priority = request.priority
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
            raise ValueError(f"priority must be an integer (a 64-bit one), got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority is {priority}; this engine schedules first come, first served "
                             "(scheduling_policy 'fcfs'): start it with scheduling_policy 'priority'")
        if not isinstance(request.sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a kvmesh.SamplingParams")
        request.sampling_params.validate()
        num_sequences = request.sampling_params.num_sequences
        if num_sequences > self.config.max_num_seqs:
            name = "best_of" if request.sampling_params.best_of else "n"
            raise ValueError(f"{name} is {num_sequences}; this engine runs at most "
                             f"{self.config.max_num_seqs} sequences at once (max_num_seqs)")
        params = request.sampling_params
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("reasoning_end_token_id", [] if params.reasoning_end_token_id is None
                                                     else [params.reasoning_end_token_id])):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} must be token ids in [0, {vocab}), got {max(ids)}")

    def _check_block_hashes(self, request: EngineRequest) -> None:
        """Hashes computed by the caller are used as they are, so they must be this engine's cut."""
        if request.hash_block_size != self.block_size:
            raise ValueError(f"block_hashes were cut at hash_block_size {request.hash_block_size}; "
                             f"this engine's block_size is {self.block_size}")
        num_full = len(request.prompt_token_ids) // self.block_size
        if len(request.block_hashes) != num_full:
            raise ValueError(f"block_hashes has {len(request.block_hashes)} hashes; the prompt has "
                             f"{num_full} full blocks of {self.block_size} tokens")

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request; raises ValueError naming the field and the limit."""
        self.validate_request(request)
        req = self._new_sequence(request, 0)
        if request.sampling_params.num_sequences > 1:  # worker/parallel_sampling.py
            req.pending_forks = [self._new_sequence(request, i)
                                 for i in range(1, request.sampling_params.num_sequences)]
            req.group = [req, *req.pending_forks]
            for child in req.pending_forks:
                child.group = req.group
        if req.sampling_params.prompt_logprobs is not None:
            req.prompt_logprobs = new_prompt_logprobs()
        self.requests[req.request_id] = req
        if req.sampling_params.structured_outputs is not None:  # queued once its grammar compiles
            future = self.grammar_compiler.submit(req.sampling_params.structured_outputs)
            self._awaiting_grammar[req.request_id] = (req, future)
            return
        self.scheduler.add(req)

    def _new_sequence(self, request: EngineRequest, index: int) -> Request:
        ids, params = request.prompt_token_ids, sequence_params(request.sampling_params, index)
        req = Request(request.request_id, ids, params, self.block_size,
                      tenant_salt(self.hash_salt, request.cache_salt),
                      request.arrival_time or time.time(), request.prompt, request.block_hashes)
        req.index = index
        req.priority = request.priority
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        if params.bad_words:
            req.bad_word_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        if request.stream_text or params.stop:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                     params.skip_special_tokens,
                                                     params.include_stop_str_in_output)
        return req

    @property
    def grammar_compiler(self):
        if self._grammars is None:
            from kvmesh.worker.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             stop_token_ids=sorted(self.eos_token_ids))
        return self._grammars

    def _admit_compiled(self) -> list[TokenDelta]:
        """Queue the requests whose grammar has compiled; end those whose grammar did not. With
        nothing else to run, wait a little for a compile rather than spin."""
        if not self._awaiting_grammar:
            return []
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            concurrent.futures.wait([f for _, f in self._awaiting_grammar.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        deltas = []
        for request_id, (req, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            if future.exception() is not None:
                self._finish(req, "error")
                delta = self._delta(req, [], None)
                delta.error = f"invalid_request: {future.exception()}"
                deltas.append(delta)
                continue
            # n > 1: each sequence its own matcher. The sequences fork off the request before any
            # token is sampled (worker/parallel_sampling.py), so a fresh matcher is the clone of
            # the request's at the fork point.
            for member in req.group or [req]:
                member.grammar = self.grammar_compiler.matcher(
                    future.result(), req.sampling_params.reasoning_end_token_id)
            self.scheduler.add(req)
        return deltas

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        self._awaiting_grammar.pop(request_id, None)
        aborted = [m for m in req.group or [req] if not m.is_finished]  # forked or not
        for member in aborted:
            self._finish(member, "abort")
        self._finished_out.append(self._delta(aborted[-1], [], None))

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._finished_out)
                or self._in_flight is not None or bool(self._awaiting_grammar))

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """Schedule -> execute -> update. With async scheduling, step N is launched before step
        N-1's sampled tokens are processed on the host (they feed step N on the device), so the
        host's bookkeeping overlaps the GPU's work; outputs then arrive one call later."""
        deltas, self._finished_out = self._finished_out, []
        deltas.extend(self._admit_compiled())
        # A grammar's mask needs the previous token accepted, as penalties need it counted and
        # bad_words need it read.
        overlap = self.async_scheduling and not any(
            r.sampling_params.uses_penalties or r.grammar is not None or r.sampling_params.bad_words
            for r in self.scheduler.running)
        if self._in_flight is not None and not overlap:
            deltas.extend(self._process(*self._in_flight))
            self._in_flight = None
        output = self.scheduler.schedule()
        if not output.is_empty:
            scheduled_at = time.time()
            for entry in output.scheduled:  # the end of its queue time (vLLM's queued interval)
                if entry.request.scheduled_time is None:
                    entry.request.scheduled_time = scheduled_at
        launched = None
        if not output.is_empty:
            previous_samples = self._in_flight[1] if self._in_flight is not None else None
            launched = self.runner.execute(output, previous_samples)
            for chunk in self.runner.take_prompt_logprobs():
                add_chunk(chunk.request.prompt_logprobs, chunk)
            self.scheduler.advance(output)
            if launched is not None:
                for row, req in enumerate(launched.requests):
                    req.append_placeholder(row)
        previous = self._in_flight
        self._in_flight = None if output.is_empty else (output, launched)
        if previous is not None:
            deltas.extend(self._process(*previous))
        if self._in_flight is not None and not overlap:
            deltas.extend(self._process(*self._in_flight))
            self._in_flight = None
        if output.is_empty and previous is None:
            deltas.extend(self._fail_unschedulable())
        return deltas

    def _process(self, output, samples) -> list[TokenDelta]:
        """Apply a launched step's results: resolve sampled tokens, cache full blocks, finish."""
        deltas = []
        if samples is not None:
            result = samples.result()
            now = time.time()
            for i, req in enumerate(samples.requests):
                if req.is_finished:
                    continue  # aborted, or ended by an earlier token while this one was in flight
                token = result.token_ids[i]
                req.resolve_placeholder(token)
                if req.grammar is not None and not req.grammar.accept(token):
                    # a masked sampler cannot pick a refused token; if it ever does, say so
                    logger.error("request %s: its grammar refused token %d", req.request_id, token)
                    self._finish(req, "error")
                    deltas.append(self._delta(req, [token], None))
                    # the request's grammar led where no token fits: a 400 if nothing was sent yet
                    deltas[-1].error = (f"invalid_request: structured_outputs: the grammar allows no "
                                        f"token after {req.num_resolved_output_tokens - 1} tokens")
                    continue
                if req.first_token_time is None:
                    req.first_token_time = now
                logprob = top = None
                if result.logprobs is not None:
                    logprob, top = result.logprobs[i], result.top_logprobs[i]
                    req.logprobs.append(logprob)
                    req.top_logprobs.append(top)
                self.scheduler.cache_computed_blocks(req)
                finish = self._check_finish(req, token)
                if finish is not None:
                    self._finish(req, finish)
                deltas.append(self._delta(req, [token], logprob, top, sampled_at=now))
        for entry in output.scheduled:
            if not entry.samples:
                self.scheduler.cache_computed_blocks(entry.request)
        return deltas

    def _check_finish(self, req: Request, token: int) -> str | None:
        """The finish reason after `token`, or None; a stop sets req.stop_reason (vLLM's: the stop
        string or stop token id, None for EOS). Before min_tokens nothing but the length stops."""
        params = req.sampling_params
        detok = req.detokenizer
        before_min = req.num_resolved_output_tokens <= params.min_tokens - 1
        if not before_min:
            stop_token = token in params.stop_token_ids
            if stop_token or (not params.ignore_eos and token in self.eos_token_ids):
                req.stop_reason = token if stop_token else None
                if detok is not None and params.include_stop_str_in_output:
                    detok.add_tokens([token], check_stop=False)
                return "stop"
        if req.grammar is not None and req.grammar.is_terminated:
            return "stop"  # the grammar is complete: nothing more may follow, even with ignore_eos
        stop = detok.add_tokens([token], check_stop=not before_min) if detok is not None else None
        if stop is not None:
            req.stop_reason = stop
            return "stop"
        num_tokens = req.num_tokens - req.num_pending
        if req.num_resolved_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        req.drop_placeholders()
        req.finish_reason = reason
        req.finish_time = time.time()
        self.scheduler.finish(req)
        if req.group is None or all(member.is_finished for member in req.group):
            del self.requests[req.request_id]

    def _fail_unschedulable(self) -> list[TokenDelta]:
        """With nothing running, a waiting request that still does not fit never will: end it."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler.waiting[0]
        for member in req.group or []:  # the request's other sequences end with it
            if member is not req and not member.is_finished:
                self._finish(member, "length" if member.output_token_ids else "error")
        self._finish(req, "length" if req.output_token_ids else "error")
        logger.warning("request %s needs more KV blocks than the pool has (%d); ended",
                       req.request_id, self.block_manager.num_blocks)
        delta = self._delta(req, [], None)
        if req.finish_reason == "error":
            delta.error = f"the request needs more than the {self.block_manager.num_blocks} KV blocks of the pool"
        return [delta]

    def _delta(self, req: Request, token_ids: list[int], logprob, top=None,
               sampled_at: float | None = None) -> TokenDelta:
        text = req.detokenizer.take_delta(final=req.is_finished) if req.detokenizer is not None else ""
        prompt_logprobs = None
        if req.prompt_logprobs is not None and token_ids and not req.prompt_logprobs_sent:
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        token_texts = None
        # the texts a logprobs answer shows: only for a request that asked (a batch computes the
        # sampled logprobs of every row when one row needs them, e.g. to rank best_of)
        asked = logprob is not None and req.sampling_params.logprobs is not None
        if asked or prompt_logprobs is not None:
            token_texts = self._texts_of(token_ids if asked else [], top if asked else None,
                                         req.prompt_token_ids if prompt_logprobs is not None else None,
                                         prompt_logprobs)
        return TokenDelta(
            request_id=req.request_id, token_ids=token_ids, text=text,
            finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0, num_output_tokens=req.num_resolved_output_tokens,
            logprobs=[logprob] if logprob is not None else None,
            top_logprobs=[top] if top is not None else None,
            first_token_time=req.first_token_time, arrival_time=req.arrival_time,
            prompt_logprobs=prompt_logprobs, index=req.index,
            more_sequences=req.group is not None and any(not m.is_finished for m in req.group),
            stop_reason=req.stop_reason, scheduled_time=req.scheduled_time,
            token_times=[sampled_at] * len(token_ids) if sampled_at is not None else None,
            token_texts=token_texts)

    def _texts_of(self, token_ids, top, prompt_ids, prompt_logprobs) -> dict[int, str]:
        """The text of each token a logprobs answer names: the sampled tokens, their top
        alternatives, and with prompt_logprobs the prompt's tokens and theirs. This process owns the
        tokenizer's decoding (the output text too); the ingress only looks these up."""
        ids = set(token_ids)
        if top:
            ids.update(top)
        if prompt_logprobs is not None:
            ids.update(prompt_ids)
            for alternatives in prompt_logprobs.top:
                if alternatives:
                    ids.update(alternatives)
        return {t: self.token_text(t) for t in ids}

    def token_text(self, token_id: int) -> str:
        """One token's text alone (special tokens kept, as vLLM's logprob tokens), cached by id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- state for the router ----------------------------------------------------------------

    def get_load(self) -> WorkerLoad:
        running = self.scheduler.running
        waiting = self.scheduler.waiting
        return WorkerLoad(
            worker_id=self.config.worker_id, running=len(running), waiting=len(waiting),
            waiting_prefill_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting)
            + sum(r.num_tokens - r.num_computed_tokens - 1 for r in running if r.num_tokens - r.num_computed_tokens > 1),
            running_decode_tokens=sum(r.num_tokens for r in running),
            kv_free_blocks=self.block_manager.num_free_blocks,
            kv_total_blocks=self.block_manager.num_blocks, healthy=True, timestamp=time.time())

    def take_kv_events(self) -> KVEventBatch | None:
        events = self.block_manager.take_events()
        if not events:
            return None
        batch = KVEventBatch(self.config.worker_id, self.epoch, self._next_seq, events, time.time())
        self._next_seq += 1
        return batch

    def kv_snapshot(self) -> KVSnapshot:
        """Cached hashes as of the last batch taken; replaying pending events on it is harmless."""
        return KVSnapshot(self.config.worker_id, self.epoch, self._next_seq - 1,
                          self.block_manager.cached_hashes(), self.block_size)

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
