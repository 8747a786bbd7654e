"""`tool_choice: auto` calls read as the output grows, so their deltas stream as vLLM's do: a call's
first delta carries its index, id, type and name (arguments ""), the next ones the fragments of its
arguments' text as they are generated; text before a `<tool_call>` streams as content, the call
markup never does.

`CallScan` reads one JSON call object a character at a time (never re-reading what it has read:
an output of thousands of tokens costs one pass), and `AutoCalls` walks the output: content, then
Hermes / Qwen `<tool_call>` blocks, or Llama 3 JSON objects separated by `;` (optionally after
`<|python_tag|>`). A call's arguments stream as their raw text, so the fragments a client joins
are exactly the call's final `arguments`; arguments given as a JSON string are sent decoded, in
one piece, when the string is complete.

What cannot be taken back: a call's header goes once its name is complete. An output that turns
out not to be calls after that (cut short by max_tokens, or malformed later) keeps what was sent;
an output that never completed a call's name is sent as content at the end, as the whole-output
parser (tool_parser.parse_auto) answers it.
"""

from __future__ import annotations

import json

OPEN, PYTHON_TAG = "<tool_call>", "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes / OpenAI, Llama 3


class CallScan:
    """One JSON object {"name": ..., "arguments" | "parameters": ...}, fed in pieces."""

    def __init__(self):
        self.text = ""  # the object's text so far (leading whitespace included)
        self.name: str | None = None  # once its string is complete
        self.args_start: int | None = None  # where the arguments' value starts in `text`
        self.args_end: int | None = None  # where it ends, once complete
        self.done = False  # the object is closed
        self.invalid = False  # not a JSON object (or not one this scan can read)
        self._depth = 0
        self._in_string = self._escaped = False
        self._expect = "open"  # at depth 1: key | colon | value | scalar | comma
        self._key: str | None = None
        self._token_start = -1

    def feed(self, piece: str) -> int:
        """Read `piece`; returns how many of its characters belong to the object (all, until the
        object closes or turns out invalid)."""
        base, text = len(self.text), self.text + piece
        for i, ch in enumerate(piece):
            if self.done or self.invalid:
                self.text = text[:base + i]
                return i
            self._read(ch, base + i, text)
        self.text = text
        return len(piece)

    def _read(self, ch: str, pos: int, text: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 1:
                    self._token_end(pos + 1, text)
            return
        if self._expect == "open":
            if ch == "{":
                self._depth, self._expect = 1, "key"
            elif not ch.isspace():
                self.invalid = True
            return
        if self._depth > 1:  # inside a container value
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._value_end(pos + 1, text)
            return
        if self._expect == "scalar":  # a number, true, false or null at depth 1
            if ch not in ",}" and not ch.isspace():
                return
            self._value_end(pos, text)
        if ch.isspace():
            return
        if ch == '"' and self._expect in ("key", "value"):
            self._in_string, self._token_start = True, pos
            if self._expect == "value":
                self._value_start(pos)
        elif ch == ":" and self._expect == "colon":
            self._expect = "value"
        elif ch == "," and self._expect == "comma":
            self._expect = "key"
        elif ch == "}" and self._expect in ("comma", "key"):
            self._depth, self.done = 0, True
        elif self._expect == "value" and ch in "{[":
            self._depth += 1
            self._value_start(pos)
        elif self._expect == "value" and ch not in "}],:":
            self._value_start(pos)
            self._expect = "scalar"
        else:
            self.invalid = True

    def _token_end(self, end: int, text: str) -> None:
        if self._expect == "key":
            self._key, self._expect = _loads(text[self._token_start:end]), "colon"
        else:
            self._value_end(end, text)

    def _value_start(self, pos: int) -> None:
        self._token_start = pos
        if self._key in ARGUMENT_KEYS and self.args_start is None:
            self.args_start = pos

    def _value_end(self, end: int, text: str) -> None:
        if self._key == "name" and self.name is None:
            name = _loads(text[self._token_start:end])
            self.name = name if isinstance(name, str) else None
        elif self._key in ARGUMENT_KEYS and self.args_start == self._token_start:
            self.args_end = end
        self._key, self._expect = None, "comma"

    @property
    def streams_arguments(self) -> bool:
        """The arguments are an object: their raw text streams as it comes."""
        return self.args_start is not None and self.text[self.args_start] == "{"

    def arguments_so_far(self) -> str:
        return self.text[self.args_start:self.args_end] if self.streams_arguments else ""

    def final_arguments(self) -> str | None:
        """A closed object's arguments as JSON text ("{}" when it has none; None: not an object)."""
        if self.args_start is None:
            return "{}"
        if self.args_end is None:
            return None
        if self.streams_arguments:
            return self.arguments_so_far()
        value = _loads(self.text[self.args_start:self.args_end])  # a string holding the object
        return value if isinstance(value, str) and isinstance(_loads(value), dict) else None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class AutoCalls:
    """One output with `tool_choice: auto`: `feed` each text piece, `finish` once; each returns the
    chat deltas to send. `calls` are the calls sent (ToolCall, arguments as sent so far)."""

    def __init__(self, new_call):
        self._new_call = new_call  # name -> ToolCall (with its id)
        self.text = ""
        self.calls: list = []  # ToolCall
        self._sent = 0  # characters of text sent as content
        self._pos = 0  # characters of text read by the call parser
        self._mode = "start"  # start | content | hermes | json | call | junk
        self._after_call = "hermes"  # the mode after a call's object: hermes or json
        self._needs_separator = False  # json: a ";" before the next call
        self._scan: CallScan | None = None
        self._scan_call = None  # the ToolCall of the object being read, once its name came

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        out: list[dict] = []
        while getattr(self, "_" + self._mode)(out):
            pass
        return out

    def finish(self) -> list[dict]:
        """What is left to send once the output ended: with no call sent, the text not sent yet
        as content (the whole-output parser reads no call in it either)."""
        if self.calls:
            return []
        rest = self.text[self._sent:]
        self._sent = len(self.text)
        return [{"content": rest}] if rest else []

    def _read_call_at(self, pos: int) -> None:
        """Go on in `call` mode: a call's JSON object starts at `pos`."""
        self._pos, self._mode = pos, "call"
        self._scan, self._scan_call = CallScan(), None

    # ---- modes: each reads from self._pos and returns whether to go on --------------------------

    def _start(self, out) -> bool:
        head = self.text.lstrip()
        if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
            return False  # nothing yet, or maybe the start of <|python_tag|>
        skipped = len(self.text) - len(head)
        if head.startswith(PYTHON_TAG):
            self._pos, self._mode, self._after_call = skipped + len(PYTHON_TAG), "json", "json"
        elif head.startswith("{"):
            self._pos, self._mode, self._after_call = skipped, "json", "json"
        else:
            self._mode = "content"
        return True

    def _content(self, out) -> bool:
        text, start = self.text, self._sent
        found = text.find(OPEN, start)
        end = found if found >= 0 else len(text)
        if found < 0:  # keep back a tail that may be the start of "<tool_call>"
            for k in range(min(len(OPEN) - 1, len(text) - start), 0, -1):
                if OPEN.startswith(text[-k:]):
                    end = len(text) - k
                    break
        if end > start:
            out.append({"content": text[start:end]})
            self._sent = end
        if found < 0:
            return False
        self._read_call_at(found + len(OPEN))
        return True

    def _hermes(self, out) -> bool:
        """Between blocks: the next `<tool_call>` (text between and after blocks is not content,
        as parse_auto reads it)."""
        found = self.text.find(OPEN, self._pos)
        if found < 0:
            return False
        self._read_call_at(found + len(OPEN))
        return True

    def _json(self, out) -> bool:
        rest = self.text[self._pos:]
        stripped = rest.lstrip()
        if not stripped:
            return False
        self._pos += len(rest) - len(stripped)
        if self._needs_separator:
            if stripped[0] != ";":
                self._mode = "junk"
                return False
            self._pos, self._needs_separator = self._pos + 1, False
            return True
        if stripped[0] != "{":
            self._mode = "junk"
            return False
        self._read_call_at(self._pos)
        return True

    def _call(self, out) -> bool:
        scan = self._scan
        self._pos += scan.feed(self.text[self._pos:])
        if scan.invalid:
            self._mode = "junk"
            return False
        if self._scan_call is None and scan.name is not None:
            self._scan_call = self._new_call(scan.name)
            self.calls.append(self._scan_call)
            out.append({"tool_calls": [{"index": len(self.calls) - 1, **self._scan_call.body()}]})
        call = self._scan_call
        if call is not None:
            fragment = scan.arguments_so_far()[len(call.arguments):]
            if scan.done and not scan.streams_arguments:
                fragment = scan.final_arguments() or ""
            if fragment:
                call.arguments += fragment
                out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                            "function": {"arguments": fragment}}]})
        if not scan.done:
            return False
        if call is None:  # an object with no name is no call
            self._mode = "junk"
            return False
        self._mode = self._after_call
        self._needs_separator = self._after_call == "json"
        return True

    def _junk(self, out) -> bool:
        return False
