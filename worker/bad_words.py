"""vLLM's `bad_words`: words a request's output may not contain.

Each word is tokenized as it stands and with one leading space (how it reads inside a sentence),
the second kept when it tokenizes to as many tokens as the first but starts with another one
(vLLM's rule, so that both "word" and " word" are caught where the tokenizer marks word starts).
At each step the last token of a word is masked if the output so far ends with the word's other
tokens; a one-token word is masked always. Only the output counts, not the prompt (vLLM's).
"""

from __future__ import annotations


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def banned_next_tokens(word_ids: list[list[int]], output_ids: list[int]) -> set[int]:
    """The tokens that would complete a bad word after `output_ids`."""
    banned = set()
    for ids in word_ids:
        before = ids[:-1]
        if not before or (len(output_ids) >= len(before) and output_ids[-len(before):] == before):
            banned.add(ids[-1])
    return banned
