"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of token ids so each step costs O(window), and a character
split across tokens (UTF-8 multi-byte) is held back until it is complete. With stop strings, the
last (longest stop - 1) characters are held back until they cannot start a match (none when the
stop string is kept in the output: include_stop_str_in_output).
"""

REPLACEMENT_CHAR = "\ufffd"


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
        self.token_ids: list[int] = list(prompt_token_ids[-6:])  # context for the first tokens
        # token_ids[prefix_offset:read_offset] decodes to text already emitted
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all output text decoded so far (including held back characters)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Feed sampled tokens; returns the matched stop string if one was found (the text is then
        cut before it, or after it with include_stop_str_in_output). check_stop False: before
        min_tokens, where stop strings do not stop."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.token_ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
                new_text = full_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
                start = max(0, len(self.text) - self.search_back)
                self.text += new_text
                if self.stop and check_stop:
                    match = self._find_stop(start)
                    if match is not None:
                        return match
        return None

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
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.token_ids[self.prefix_offset:])
            self.text += full_text[len(prefix_text):]
            self.read_offset = len(self.token_ids)
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
