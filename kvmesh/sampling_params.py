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
    # The output must match this (JSON schema, regex, choice, grammar): the sampler masks every
    # token the grammar does not allow (worker/grammar.py); the request ends when it is complete.
    structured_outputs: StructuredOutputs | None = None

    MAX_STOP_STRINGS = 64
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

        if self.n != 1:
            fail("n", "1 (only one completion per request is supported)", self.n)
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
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                fail("stop_token_ids", "non-negative integers", t)
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            fail("logprobs", f"in [0, {self.MAX_LOGPROBS}]", self.logprobs)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", "in (0, 10]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                fail(name, "in [-2, 2]", value)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                fail("structured_outputs", "a kvmesh.StructuredOutputs", self.structured_outputs)
            self.structured_outputs.validate()

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
