"""Benchmark workloads.

nano-vllm's benchmark (bench.py), reproduced exactly: Python's `random.seed(0)`; 256 prompts, each
of randint(100, 1024) tokens drawn as randint(0, 10000); then for each a max_tokens of
randint(100, 1024); temperature 0.6, ignore_eos. Its output totals 133,966 tokens, which checks that
the workload is the same one.

A prefill-heavy workload beside it (`shared_prefix_workload`): a few long shared system prompts,
each request one of them plus its own suffix, short outputs: what the prefix cache and the prefill
kernels carry.
"""

import random
from dataclasses import dataclass

NANO_VLLM_OUTPUT_TOKENS = 133_966
NANO_VLLM_PROMPT_TOKENS = 142_827


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float = 0.6

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def prompts_for_vocab(self, vocab_size: int) -> list[list[int]]:
        """The prompts as a model of `vocab_size` tokens takes them: nano-vllm's ids (up to 10,000)
        folded into a tiny preset's vocabulary, unchanged for any real one."""
        if vocab_size > 10000:
            return self.prompts
        return [[t % vocab_size for t in p] for p in self.prompts]


def nano_vllm_workload(num_prompts: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                       min_len: int = 100, vocab_limit: int = 10000, seed: int = 0) -> Workload:
    """The draws happen in nano-vllm's order (all prompts, then all output lengths)."""
    rng = random.Random(seed)  # the same stream as random.seed(seed) + module functions
    prompts = [[rng.randint(0, vocab_limit) for _ in range(rng.randint(min_len, max_input_len))]
               for _ in range(num_prompts)]
    max_tokens = [rng.randint(min_len, max_output_len) for _ in range(num_prompts)]
    return Workload(prompts, max_tokens)


def shared_prefix_workload(num_prompts: int = 256, prefix_len: int = 4096, num_prefixes: int = 8,
                           min_suffix: int = 100, max_suffix: int = 1024, max_output: int = 64,
                           vocab_limit: int = 10000, seed: int = 0) -> Workload:
    """Request i: system prompt i % num_prefixes (prefix_len tokens) + a suffix of randint(min_suffix,
    max_suffix) tokens; max_tokens randint(min(16, max_output), max_output); ids in [0, vocab_limit]."""
    rng = random.Random(seed)
    prefixes = [[rng.randint(0, vocab_limit) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + [rng.randint(0, vocab_limit)
                                             for _ in range(rng.randint(min_suffix, max_suffix))]
               for i in range(num_prompts)]
    max_tokens = [rng.randint(min(16, max_output), max_output) for _ in range(num_prompts)]
    return Workload(prompts, max_tokens)
