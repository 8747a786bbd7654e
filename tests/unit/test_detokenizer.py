"""The incremental detokenizer's Rust path (tokenizers' DecodeStream) gives the text, deltas and stop
matches of the Python path (two `tokenizer.decode` calls a token), token by token, on the project's
tokenizers; where the two could differ the Python path runs (worker/detokenizer.py)."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from kvmesh.worker.detokenizer import IncrementalDetokenizer
from kvmesh.worker.loader import load_tokenizer


def python_path(*args, **kwargs) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(*args, **kwargs)
    detok._stream = None  # the reference: the window decoded by tokenizer.decode
    return detok


def run(detok: IncrementalDetokenizer, tokens: list[int]) -> list:
    steps = []
    for token in tokens:
        stop = detok.add_tokens([token])
        steps.append((stop, detok.take_delta(final=stop is not None)))
        if stop is not None:
            break
    else:
        steps.append((None, detok.take_delta(final=True)))
    return steps


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "random:qwen3-0.6b", "random:tiny-llama"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_rust_path_equals_python_path_token_by_token(model, skip_special_tokens):
    tokenizer, _ = load_tokenizer(model)
    rng = random.Random(7)
    specials = list(tokenizer.all_special_ids)
    for trial in range(6):
        # random ids (byte pieces that end inside a character among them) and special tokens
        tokens = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tokenizer))
                  for _ in range(150)]
        prompt = tokenizer.encode(f"prompt {trial}: ünïcödé 世界", add_special_tokens=False)
        reference = run(python_path(tokenizer, prompt, [], skip_special_tokens), tokens)
        text = "".join(delta for _, delta in reference)
        # stop strings taken from the text itself, so that some match across token boundaries
        stop = [] if trial % 2 == 0 else [text[len(text) // 3:len(text) // 3 + 4], "\n\n"]
        if stop:
            reference = run(python_path(tokenizer, prompt, stop, skip_special_tokens), tokens)
        rust = IncrementalDetokenizer(tokenizer, prompt, stop, skip_special_tokens)
        assert rust._stream is not None  # the Rust path is the one that ran
        assert run(rust, tokens) == reference
        if stop:
            assert reference[-1][0] is not None  # a stop string matched


def test_tokenizer_that_cleans_up_spaces_decodes_in_python():
    vocab = {piece: i for i, piece in enumerate(["a", "b", ",", " "])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert tokenizer.decode([1, 3, 2, 0]) == "b,a"  # " ," cleaned up, which DecodeStream does not do
    assert IncrementalDetokenizer(tokenizer, [0], [])._stream is None


def test_window_whose_text_does_not_extend_goes_on_in_python():
    # "a" then "b" decode to "X" (a decoder that rewrites across tokens): the longer window's text
    # does not start with the shorter one's, which tokenizers' DecodeStream refuses
    vocab = {piece: i for i, piece in enumerate("abcd")}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    tokens = [0, 1, 2, 0, 1, 3, 2, 2]
    detok = IncrementalDetokenizer(tokenizer, [2], [])
    assert detok._stream is not None
    steps = run(detok, tokens)
    assert detok._stream is None  # switched to Python decoding
    assert steps == run(python_path(tokenizer, [2], []), tokens)


def test_prompt_ending_inside_a_character_decodes_in_python():
    tokenizer, _ = load_tokenizer("random:tiny-llama")  # one token a byte
    prompt = tokenizer.encode("ok 世", add_special_tokens=False)[:-1]  # 世's last byte missing
    assert IncrementalDetokenizer(tokenizer, prompt, [])._stream is None
    whole = IncrementalDetokenizer(tokenizer, prompt[:-2], [])
    assert whole._stream is not None
