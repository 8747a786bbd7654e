"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of token ids so each step costs O(window), and a character
split across tokens (UTF-8 multi-byte) is held back until it is complete. With stop strings, the
last (longest stop - 1) characters are held back until they cannot start a match (none when the
stop string is kept in the output: include_stop_str_in_output).

With a fast (Rust) tokenizer the window is decoded by tokenizers' `DecodeStream`, the same
algorithm without two Python-level `decode` calls a token (PERF.md "Where output text is decoded":
1.7 against 6.1 us a token); the text is the same, so where it could differ it is not used: a
tokenizer that cleans up spaces after decoding (`clean_up_tokenization_spaces`), a prompt whose last
tokens end inside a character, or a window whose longer text does not extend the shorter one's
(tokenizers raises; that request goes on in Python).
"""

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6  # prompt tokens decoded before the first output token (its leading space)


def decode_stream(tokenizer, context: list[int], skip_special_tokens: bool):
    """(DecodeStream, the Rust tokenizer) for a tokenizer whose text it reproduces, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
        return None  # a prompt ending inside a character: DecodeStream would repeat the prompt's text
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens), backend
    except TypeError:  # a tokenizers whose DecodeStream takes no ids= (the prompt's context)
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        # a match can start this many characters before the new text
        self.search_back = max((len(s) for s in stop), default=1) - 1
        self.holdback = 0 if include_stop_str_in_output else self.search_back
        self.token_ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])  # the first tokens' context
        # token_ids[prefix_offset:read_offset] decodes to text already emitted
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all output text decoded so far (including held back characters)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        self._stream = decode_stream(tokenizer, self.token_ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Feed sampled tokens; returns the matched stop string if one was found (the text is then
        cut before it, or after it with include_stop_str_in_output). check_stop False: before
        min_tokens, where stop strings do not stop."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            new_text = self._new_text(token_id)
            if new_text is not None:
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
                start = max(0, len(self.text) - self.search_back)
                self.text += new_text
                if self.stop and check_stop:
                    match = self._find_stop(start)
                    if match is not None:
                        return match
        return None

    def _new_text(self, token_id: int) -> str | None:
        """The text the window gains with its last token, None while that ends inside a character."""
        if self._stream is not None:
            stream, backend = self._stream
            try:
                return stream.step(backend, token_id)
            except Exception:  # tokenizers' InvalidPrefix; the window's state is ours as well
                self._stream = None
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            return full_text[len(prefix_text):]
        return None

    def _window_texts(self) -> tuple[str, str]:
        """The window's text up to read_offset (already emitted) and with every token after it."""
        return (self._decode(self.token_ids[self.prefix_offset:self.read_offset]),
                self._decode(self.token_ids[self.prefix_offset:]))

    def _find_stop(self, search_from: int) -> str | None:
        best = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        self.stopped = True
        return best[1]

    def take_delta(self, final: bool) -> str:
        """Text ready to return: everything on finish, else all but the held back tail."""
        if final and not self.stopped and self.read_offset < len(self.token_ids):
            # the output ended inside an incomplete character: emit what decoding gives for it
            prefix_text, full_text = self._window_texts()
            self.text += full_text[len(prefix_text):]
            self.read_offset = len(self.token_ids)
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
