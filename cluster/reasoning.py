"""Reasoning models' output split into `reasoning` and `content` (vLLM's `--reasoning-parser`;
kvmesh's `server.reasoning_parser`).

Both parsers read the thinking block `<think> ... </think>` that Qwen3, QwQ and DeepSeek-R1 write,
its markers single tokens of the model's vocabulary (a tokenizer without them is refused at start):
- `qwen3`: the output is reasoning from a leading `<think>` up to `</think>`; an output that does
  not open with `<think>` is all content (Qwen3 answering without thinking);
- `deepseek_r1`: the output starts inside the block (R1's template opens it in the prompt): all
  of it up to `</think>` is reasoning (a leading `<think>` is dropped), all of it when the block
  never closes (cut short by max_tokens).
Either way the prompt decides first, as vLLM's serving layer does: a prompt whose last marker is
`</think>` (Qwen3's `enable_thinking: false` writes an empty block) leaves the output all content,
and one whose last marker is `<think>` (a template that opens the block itself) starts the output
inside it. The markers themselves are in neither field; the text between them is kept as written.

Structured outputs follow vLLM too: with a reasoning parser the grammar constrains only what comes
after `</think>` (SamplingParams.reasoning_end_token_id; worker/grammar.py), unless the prompt's
reasoning has ended already or `server.structured_outputs_in_reasoning` is on (vLLM's
`enable_in_reasoning`), in which case it constrains the whole output, markers included.

Streaming: `ReasoningStream.feed` returns each piece's (reasoning, content) parts as soon as they
are known; text that may be the start of a marker is held back until the next piece (or `finish`)
shows what it is, so the parts joined are what `split` gives the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start_id: int
    end_id: int

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer) -> "ReasoningParser":
        if name not in PARSERS:
            raise ValueError(f"server.reasoning_parser: {name!r} is not one of {', '.join(PARSERS)}")
        ids = [_single_token(tokenizer, marker) for marker in (START, END)]
        if None in ids:
            missing = [m for m, i in zip((START, END), ids) if i is None]
            raise ValueError(f"server.reasoning_parser: {name} reads {START} ... {END}, but this model's "
                             f"tokenizer has no single token for {' or '.join(missing)}")
        return cls(name, *ids)

    def _last_marker(self, prompt_ids) -> int | None:
        for token in reversed(prompt_ids):
            if token in (self.start_id, self.end_id):
                return token
        return None

    def grammar_waits(self, prompt_ids) -> bool:
        """Whether structured outputs wait for `</think>`: unless the prompt's reasoning ended."""
        return self._last_marker(prompt_ids) != self.end_id

    def opening(self, prompt_ids) -> tuple[str, str]:
        """An output's first state after this prompt, and the state it takes when it does not
        open with <think> (ReasoningStream's arguments): the prompt is read once per request."""
        last = self._last_marker(prompt_ids)
        if last == self.end_id:
            return "content", "content"
        in_block = last == self.start_id or self.name == "deepseek_r1"
        return "opening", "reasoning" if in_block else "content"

    def stream(self, prompt_ids) -> "ReasoningStream":
        return ReasoningStream(*self.opening(prompt_ids))

    def split(self, text: str, prompt_ids) -> tuple[str | None, str | None]:
        """A whole output's (reasoning, content); reasoning None when the output has no block,
        content None when nothing follows it."""
        return self.stream(prompt_ids).whole(text)


class ReasoningStream:
    """One output's pieces read in order. States: `opening` (the output's first characters, which
    may be `<think>`), `reasoning`, `content`."""

    def __init__(self, state: str, without_start: str = "content"):
        self.state = state
        self.without_start = without_start  # the state an output not opening with <think> is in
        self.entered_reasoning = state == "reasoning"
        self._held = ""  # text that may be the start of a marker

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) of this piece, either possibly ""."""
        text, self._held = self._held + piece, ""
        reasoning = content = ""
        if self.state == "opening":
            if text.startswith(START):
                self.state, text = "reasoning", text[len(START):]
            elif START.startswith(text):  # too short to tell yet
                self._held = text
                return "", ""
            else:
                self.state = self.without_start
            self.entered_reasoning = self.state == "reasoning"
        if self.state == "reasoning":
            end = text.find(END)
            if end >= 0:
                reasoning, text, self.state = text[:end], text[end + len(END):], "content"
            else:
                keep = _partial_suffix(text, END)
                reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, once the output has ended."""
        held, self._held = self._held, ""
        if self.state == "opening":
            self.state = self.without_start
            self.entered_reasoning = self.state == "reasoning"
        return (held, "") if self.state == "reasoning" else ("", held)

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A whole output read at once (a fresh stream's only piece), joined."""
        return self.joined([self.feed(text), self.finish()])

    def joined(self, parts) -> tuple[str | None, str | None]:
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        return (reasoning if self.entered_reasoning else None), (content or None)


def delta_fields(reasoning: str, content: str) -> dict:
    """A chat chunk's delta for these parts: each field only when it has text."""
    delta = {}
    if reasoning:
        delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    return delta


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _single_token(tokenizer, marker: str) -> int | None:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ChatReasoning:
    """A chat request's answers read by the server's parser: the whole of each, or its pieces as
    they stream (one ReasoningStream per choice: n > 1). `include`: the request's
    include_reasoning; false, the reasoning parts are dropped (the content is the same)."""

    def __init__(self, parser: ReasoningParser, prompt_ids, include: bool = True):
        self.opening = parser.opening(prompt_ids)  # the same for every choice
        self.include = include
        self._streams: dict[int, ReasoningStream] = {}

    def whole(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = ReasoningStream(*self.opening).whole(text)
        return (reasoning if self.include else None), content

    def piece(self, index: int, text: str, ended: bool) -> tuple[str, str]:
        """Choice `index`'s next piece as (reasoning, content); `ended`: its last, which also
        releases what was held back."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ReasoningStream(*self.opening)
        reasoning, content = stream.feed(text)
        if ended:
            more = stream.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return (reasoning if self.include else ""), content

    def pieces(self, index: int, text: str, ended: bool) -> tuple[list[dict], str]:
        """`piece` as a streamed chat's delta pieces: the reasoning's (none when it has no text),
        and the content's text, which the caller reads on (for tool calls, or as content)."""
        reasoning, content = self.piece(index, text, ended)
        return ([{"reasoning": reasoning}] if reasoning else []), content
