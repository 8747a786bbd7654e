"""Sampling filters on fixed logits, seeded reproducibility, stop strings and incremental
detokenization across token boundaries."""

import math

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.worker.detokenizer import IncrementalDetokenizer
from kvmesh.worker.presets import build_byte_tokenizer
from kvmesh.worker.sampler import apply_penalties, filtered_probs, sample_row

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def support(params: SamplingParams) -> list[int]:
    return torch.nonzero(filtered_probs(LOGITS.clone().unsqueeze(0), [params])[0]).flatten().tolist()


def test_top_k_keeps_the_k_largest():
    assert support(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert support(SamplingParams(temperature=1.0, top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert support(SamplingParams(temperature=1.0, top_p=0.5)) == [0]
    assert support(SamplingParams(temperature=1.0, top_p=0.6)) == [0, 1]
    assert support(SamplingParams(temperature=1.0, top_p=0.85)) == [0, 1, 2]
    probs = filtered_probs(LOGITS.clone().unsqueeze(0), [SamplingParams(temperature=1.0, top_p=0.85)])[0]
    assert math.isclose(float(probs[0]), 0.5 / 0.85, rel_tol=1e-5)


def test_min_p_drops_tokens_below_fraction_of_the_top():
    assert support(SamplingParams(temperature=1.0, min_p=0.3)) == [0, 1, 2]  # 0.15 >= 0.3 * 0.5
    assert support(SamplingParams(temperature=1.0, min_p=0.5)) == [0]


def test_temperature_sharpens_and_greedy_is_argmax():
    cold = filtered_probs(LOGITS.clone().unsqueeze(0), [SamplingParams(temperature=0.5)])[0]
    assert math.isclose(float(cold[0]), 0.25 / (0.25 + 0.04 + 0.0225 + 0.01 + 0.0025), rel_tol=1e-5)
    assert sample_row(LOGITS.clone(), SamplingParams(temperature=0), None) == 0


def test_batched_filters_equal_each_row_alone():
    batch = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=1.3, min_p=0.1), SamplingParams(temperature=1.0, top_k=20, top_p=0.5)]
    together = filtered_probs(batch.clone(), params)
    for i, p in enumerate(params):
        assert torch.allclose(together[i], filtered_probs(batch[i:i + 1].clone(), [p])[0], atol=1e-7)


def test_seeded_samples_repeat_and_follow_the_distribution():
    params = SamplingParams(temperature=1.0)
    draws = [sample_row(LOGITS.clone(), params, torch.Generator().manual_seed(s)) for s in range(4000)]
    again = [sample_row(LOGITS.clone(), params, torch.Generator().manual_seed(s)) for s in range(4000)]
    assert draws == again
    freq = [draws.count(i) / len(draws) for i in range(5)]
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, [0.5, 0.2, 0.15, 0.1, 0.05]))


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    out = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [], [2, 2])
    assert out.tolist() == [2.0, -2.0, 0.0, 0.5]


TOKENIZER = build_byte_tokenizer(512)  # one token per byte: every multi-byte character spans tokens


def feed(detok: IncrementalDetokenizer, text: str) -> tuple[list[str], str | None]:
    deltas, stop = [], None
    for token in TOKENIZER.encode(text):
        stop = detok.add_tokens([token])
        deltas.append(detok.take_delta(final=stop is not None))
        if stop is not None:
            break
    return deltas, stop


def test_multibyte_characters_are_never_split():
    detok = IncrementalDetokenizer(TOKENIZER, [10, 11], stop=[])
    deltas, _ = feed(detok, "héllo 世界 🚀!")
    assert "".join(deltas) == "héllo 世界 🚀!"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[deltas.index("世") - 1] == "" and deltas[deltas.index("世") - 2] == ""


def test_stop_string_across_tokens_is_cut_and_never_shown():
    detok = IncrementalDetokenizer(TOKENIZER, [10], stop=["STOP", "\n\n"])
    deltas, stop = feed(detok, "hello STOP world")
    assert stop == "STOP"
    assert "".join(deltas) == "hello "
    assert not any("S" in d for d in deltas)  # the held-back prefix of the match was never emitted


def test_held_back_text_is_released_when_it_cannot_match():
    detok = IncrementalDetokenizer(TOKENIZER, [10], stop=["STOP"])
    deltas, stop = feed(detok, "a STOw")
    assert stop is None
    assert "".join(deltas) + detok.take_delta(final=True) == "a STOw"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_stop_strings_and_stop_token_ids(async_scheduling):
    from kvmesh import LLM

    llm = LLM("random:tiny-llama", async_scheduling=async_scheduling)
    free = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=24, temperature=0))[0]
    assert len(free.token_ids) == 24
    # stop on the 6th generated token id
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        max_tokens=24, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    # a stop string made of the text of two consecutive tokens in the middle
    text = free.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        max_tokens=24, temperature=0, stop=[needle]))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(needle)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprobs_of_sampled_tokens(async_scheduling):
    from kvmesh import LLM

    llm = LLM("random:tiny-qwen3", async_scheduling=async_scheduling)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=5, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert max(top, key=top.get) == token  # greedy: the sampled token is the most likely
        assert math.isclose(top[token], lp, rel_tol=1e-5)


def test_batch_text_equals_streamed_text():
    from kvmesh import LLM

    llm = LLM("random:tiny-llama")
    ids = llm.encode("streamed or not, the same text: ünïcödé ")
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5)
    batch = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    streamed = "".join(d.text for d in llm.stream(ids, params))
    assert batch.text == streamed and len(batch.token_ids) == 40


def test_output_ending_inside_a_character_is_flushed():
    detok = IncrementalDetokenizer(TOKENIZER, [10], stop=[])
    ids = TOKENIZER.encode("ok 世")[:-1]  # the last byte of 世 never arrives
    deltas = []
    for token in ids:
        detok.add_tokens([token])
        deltas.append(detok.take_delta(final=False))
    tail = detok.take_delta(final=True)
    assert "".join(deltas) == "ok " and tail == TOKENIZER.decode(ids)[3:] and tail


@pytest.mark.parametrize("fields,request_has", [
    ({"top_k": 5}, {}), ({"top_p": 0.9}, {}), ({"min_p": 0.1}, {}), ({"repetition_penalty": 1.1}, {}),
    ({"presence_penalty": 0.5}, {}), ({"frequency_penalty": 0.5}, {}), ({"logit_bias": {3: 1.0}}, {}),
    ({"min_tokens": 2}, {}), ({"logprobs": 1}, {}), ({"n": 1, "best_of": 2}, {}),
    ({"seed": 7}, {"generator": torch.Generator()}), ({}, {"grammar": object()}),
])
def test_rows_asking_more_than_a_temperature_keep_the_general_path(fields, request_has):
    # PERF.md: top-k / top-p / min-p, penalties, biases, a grammar, logprobs or an own seed
    from types import SimpleNamespace

    from kvmesh.worker.sampler import _temperature_only

    plain = SimpleNamespace(generator=None, grammar=None)
    assert _temperature_only(SamplingParams(temperature=0.6, max_tokens=8), plain)
    request = SimpleNamespace(**{**vars(plain), **request_has})
    assert not _temperature_only(SamplingParams(temperature=0.6, max_tokens=8, **fields), request)
