"""Strings a tokenizer cannot take. JSON may carry unpaired UTF-16 surrogates ("\\ud800"), which
Python decodes into a str that no UTF-8 codec (and no Hugging Face tokenizer) accepts; the ingress
refuses them up front, naming the field, instead of failing inside the tokenizer with a 500."""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")
_TEXT_OR_CONTAINER = (str, dict, list)


def lone_surrogate_path(value) -> str | None:
    """The dotted path (as OpenAI's `param`) of the first string holding a surrogate, or None.
    Iterative: a JSON body may nest deeper than Python's recursion limit."""
    stack = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "body"
            continue
        if isinstance(item, dict):
            children = list(item.items())
        elif isinstance(item, list):
            # numbers hold no text: a prompt of token ids is thousands of them, and a path and a
            # tuple each cost the ingress milliseconds per request
            children = [(i, c) for i, c in enumerate(item) if isinstance(c, _TEXT_OR_CONTAINER)]
        else:
            continue
        for key, child in reversed(children):
            if isinstance(key, str) and _SURROGATE.search(key):
                return path or "body"
            stack.append((child, f"{path}.{key}" if path else str(key)))
    return None
