"""SamplingParams: how one request is sampled. Plain data; validated on construction."""

from dataclasses import dataclass, field

from kvmesh.structured_outputs import StructuredOutputs


@dataclass
class SamplingParams:
    """Per-request sampling settings, shaped like vLLM's.

    temperature 0 means greedy. `seed` makes a request's samples independent of the batch it runs
    in. `stop` strings end the output before the match (the match is not returned); `logprobs`
    returns the log-probability of each sampled token (and the top-`logprobs` alternatives).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: the log-probability of each prompt token given the ones before it, with the top
    # `prompt_logprobs` alternatives (the first token has none). Computed without the prefix cache.
    prompt_logprobs: int | None = None
    # Parallel sampling (worker/parallel_sampling.py): `best_of` sequences (default n) share the
    # prompt's KV blocks; the n with the highest cumulative logprob are returned. Sequence i draws
    # from seed + i when a seed is given.
    best_of: int | None = None
    # vLLM's: EOS and stop_token_ids cannot be sampled (and stop strings do not stop) before
    # min_tokens output tokens; logit_bias is added to the logits (token id -> bias in [-100, 100]);
    # include_stop_str_in_output keeps the stop string (or stop token's text) in the output text;
    # skip_special_tokens drops special tokens from the output text.
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids can be sampled (every other logit is -inf)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words that cannot be generated (worker/bad_words.py: a word's last token is masked
    # once the output ends with the tokens before it)
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match this (JSON schema, regex, choice, grammar): the sampler masks every
    # token the grammar does not allow (worker/grammar.py); the request ends when it is complete.
    structured_outputs: StructuredOutputs | None = None
    # A reasoning model's end-of-thinking token (`</think>`): structured_outputs then constrains
    # only what follows it, as vLLM applies structured outputs after the reasoning. The server
    # sets it from server.reasoning_parser (cluster/reasoning.py); None: from the first token.
    reasoning_end_token_id: int | None = None

    MAX_SEQUENCES = 32
    MAX_STOP_STRINGS = 64
    MAX_STOP_TOKEN_IDS = 64
    MAX_LOGIT_BIAS = 300
    MAX_ALLOWED_TOKEN_IDS = 1 << 18
    MAX_BAD_WORDS = 128
    MAX_BAD_WORD_CHARS = 256
    MAX_STOP_STRING_CHARS = 512
    MAX_LOGPROBS = 20

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def fail(name, limit, value):
            raise ValueError(f"{name} must be {limit}, got {value!r}")

        if not _is_int(self.n) or not 1 <= self.n <= self.MAX_SEQUENCES:
            fail("n", f"in [1, {self.MAX_SEQUENCES}]", self.n)
        if self.best_of is not None and (not _is_int(self.best_of)
                                         or not self.n <= self.best_of <= self.MAX_SEQUENCES):
            fail("best_of", f"in [n, {self.MAX_SEQUENCES}] (n is {self.n})", self.best_of)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", ">= 1", self.max_tokens)
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "in [0, 100]", self.temperature)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", ">= 0 (0 or -1 disables it)", self.top_k)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            fail("seed", "an integer in [0, 2**63)", self.seed)
        if len(self.stop) > self.MAX_STOP_STRINGS:
            fail("stop", f"at most {self.MAX_STOP_STRINGS} strings", f"{len(self.stop)} strings")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= self.MAX_STOP_STRING_CHARS:
                fail("stop", f"non-empty strings of at most {self.MAX_STOP_STRING_CHARS} characters", s)
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"at most {self.MAX_STOP_TOKEN_IDS} ids", f"{len(self.stop_token_ids)} ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                fail("stop_token_ids", "non-negative integers", t)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", f"in [0, max_tokens ({self.max_tokens})]", self.min_tokens)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > self.MAX_LOGIT_BIAS:
                fail("logit_bias", f"a map of at most {self.MAX_LOGIT_BIAS} token ids", "a larger map")
            for t, bias in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    fail("logit_bias", "keyed by non-negative token ids", t)
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    fail("logit_bias", "values in [-100, 100]", bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not 0 < len(ids) <= self.MAX_ALLOWED_TOKEN_IDS:
                fail("allowed_token_ids", f"a non-empty list of at most {self.MAX_ALLOWED_TOKEN_IDS} token ids",
                     f"{len(ids) if isinstance(ids, list) else type(ids).__name__}")
            for t in ids:
                if not _is_int(t) or t < 0:
                    fail("allowed_token_ids", "non-negative token ids", t)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list) or len(words) > self.MAX_BAD_WORDS:
                fail("bad_words", f"a list of at most {self.MAX_BAD_WORDS} strings",
                     f"{len(words) if isinstance(words, list) else type(words).__name__}")
            for w in words:
                if not isinstance(w, str) or not 0 < len(w.strip()) <= self.MAX_BAD_WORD_CHARS:
                    fail("bad_words", f"words of 1 to {self.MAX_BAD_WORD_CHARS} characters", w)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a boolean", getattr(self, name))
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            fail("logprobs", f"in [0, {self.MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            fail("prompt_logprobs", f"in [0, {self.MAX_LOGPROBS}]", self.prompt_logprobs)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", "in (0, 10]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                fail(name, "in [-2, 2]", value)
        if self.reasoning_end_token_id is not None and (not _is_int(self.reasoning_end_token_id)
                                                        or self.reasoning_end_token_id < 0):
            fail("reasoning_end_token_id", "a token id (an integer >= 0)", self.reasoning_end_token_id)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                fail("structured_outputs", "a kvmesh.StructuredOutputs", self.structured_outputs)
            self.structured_outputs.validate()

    @property
    def num_sequences(self) -> int:
        """Sequences generated: best_of, else n."""
        return self.best_of or self.n

    @property
    def needs_sampled_logprobs(self) -> bool:
        """The sampler computes each sampled token's logprob: asked, or to rank best_of."""
        return self.logprobs is not None or self.num_sequences > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
