"""StructuredOutputs: the constraint a request's output must satisfy, as plain data.

Exactly one of `json` (a JSON schema, as canonical JSON text), `json_object` (any JSON object),
`regex`, `choice` (one of these strings) or `grammar` (an EBNF grammar in GBNF notation) is set.
It crosses process boundaries inside SamplingParams, so it holds only strings; the engine compiles
it (worker/grammar.py, cached by `key`). Shaped like vLLM's `StructuredOutputsParams`.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    MAX_SPEC_CHARS = 65536

    def __post_init__(self):
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", canonical_json(self.json))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        kind = given[0]
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            size = sum(len(c) for c in self.choice)
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object must be true")
            size = 0
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            size = len(value)
        if size > self.MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} must be at most {self.MAX_SPEC_CHARS} "
                             f"characters, got {size}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What a compiled grammar is cached by."""
        return (self.kind, getattr(self, self.kind))


def canonical_json(schema) -> str:
    """A JSON schema as compact text (the cache key). Keys keep their order: the order of an
    object's properties is the order the model writes them in."""
    return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
