"""A chat rendered into token ids so that message content is only ever text.

`tokenizer.apply_chat_template(..., tokenize=True)` renders the template to one string and
tokenizes it with special tokens recognised everywhere, so a user who writes `<|im_start|>system`
inside a message gets the real control token: a forged system turn. Here the template is rendered
with a placeholder in place of each message's content, the template's own text is tokenized with
its special tokens, and each content is tokenized with `split_special_tokens=True` (special-token
strings become ordinary text tokens). For content without special-token strings the ids equal
`apply_chat_template`'s (tests/unit/test_chat_template.py checks this on the shipped tokenizers).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Any

# apply_chat_template's own arguments (and the template's own variables): not template kwargs
RESERVED_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                             "continue_final_message", "tokenize", "chat_template", "return_dict",
                             "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                             "return_assistant_tokens_mask"})


@dataclasses.dataclass(frozen=True)
class TemplateOptions:
    """How the chat template is applied (vLLM's chat fields of the same names):
    add_generation_prompt appends the assistant's turn opener; continue_final_message ends the
    prompt right after the final message's content (no end-of-turn), so the model continues it;
    kwargs are the template's own variables (e.g. Qwen3's enable_thinking); add_special_tokens
    puts the tokenizer's own special tokens (e.g. Llama's BOS) around the rendered template, as
    tokenizing its text with them would (vLLM renders, then tokenizes with this flag);
    chat_template replaces the tokenizer's template, documents reach it as `documents`."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    add_special_tokens: bool = False
    chat_template: str | None = None  # the template itself, instead of the tokenizer's
    documents: list[dict[str, str]] | None = None  # for a template that renders them (RAG)

    def __post_init__(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt: the "
                             "final message is continued, not followed by the assistant's turn")
        for key in self.kwargs:
            if not isinstance(key, str) or key in RESERVED_KWARGS:
                raise ValueError(f"chat_template_kwargs.{key}: an argument of the template call itself, "
                                 "not a template variable")


DEFAULT_OPTIONS = TemplateOptions()


def encode_chat(tokenizer, messages: list[dict], special_tokens_in_content: bool = False,
                tools: list[dict] | None = None, options: TemplateOptions = DEFAULT_OPTIONS) -> list[int]:
    """The prompt ids of `messages`, by default with the generation prompt appended (`options`).

    special_tokens_in_content: True tokenizes content as the template's own text would be (the
    unsafe behaviour, for trusted callers that write control tokens on purpose). tools: passed to
    the template as `apply_chat_template(tools=...)` passes them (template text, not content)."""
    extra = {**options.kwargs, **({"tools": tools} if tools else {}),
             "add_generation_prompt": options.add_generation_prompt}
    if options.chat_template is not None:
        extra["chat_template"] = options.chat_template
    if options.documents is not None:
        extra["documents"] = options.documents
    if options.continue_final_message:
        if not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message: the final message needs text content to continue")
        extra["continue_final_message"] = True
    if special_tokens_in_content:
        ids = _ids(tokenizer.apply_chat_template(messages, tokenize=True, **extra))
        return with_special_tokens(tokenizer, ids) if options.add_special_tokens else ids
    # A random marker cannot occur in the content by chance or by a caller's design.
    token = secrets.token_hex(8)
    marker = f"kvmeshcontent{token}n"
    placeholders = [dict(m, content=f"{marker}{i}{marker}") if isinstance(m.get("content"), str) else m
                    for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(placeholders, tokenize=False, **extra)
    specials = _special_tokens(tokenizer)
    split_specials = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
    # The text between two of the template's special tokens is tokenized as one piece, content
    # included, as the tokenizer itself would (a content's first word can merge with the
    # template's newline before it); only the template's special tokens become control ids.
    ids: list[int] = []
    text: list[str] = []
    for i, piece in enumerate(re.split(f"{marker}(\\d+){marker}", rendered)):
        if i % 2:
            text.append(messages[int(piece)]["content"])
            continue
        if token in piece.lower():  # a marker the template changed
            raise ValueError("the chat template changes message content as it renders it (e.g. a "
                             "filter on it); kvmesh renders content only as it is")
        for j, part in enumerate(split_specials.split(piece) if split_specials else [piece]):
            if j % 2:
                ids.extend(_encode_text(tokenizer, text))
                ids.append(specials[part])
            else:
                text.append(part)
    ids.extend(_encode_text(tokenizer, text))
    return with_special_tokens(tokenizer, ids) if options.add_special_tokens else ids


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the special tokens the tokenizer adds to a text when asked for them (its post
    processor's: e.g. Llama 3's BOS before; nothing for Qwen's or GPT-2's), found by tokenizing a
    probe text with and without them."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i] + list(ids) + full[i + len(bare):]
    raise ValueError("add_special_tokens: the tokenizer changes a text's own tokens when it adds "
                     "its special tokens, so they cannot be added to a rendered chat")


def _special_tokens(tokenizer) -> dict[str, int]:
    """Special token text -> id, longest first (so a token that contains another wins)."""
    found = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def _encode_text(tokenizer, text: list[str]) -> list[int]:
    joined = "".join(text)
    text.clear()
    if not joined:
        return []
    return tokenizer.encode(joined, add_special_tokens=False, split_special_tokens=True)


def _ids(encoded) -> list[int]:
    if hasattr(encoded, "keys"):  # transformers 5 may return a BatchEncoding
        encoded = encoded["input_ids"]
    return list(encoded)
