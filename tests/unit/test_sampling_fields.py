"""vLLM's per-request sampling fields on the engine of a tiny random model (the same batched
sampler code runs on CPU and GPU tensors): logit_bias, min_tokens, stop_token_ids,
include_stop_str_in_output, skip_special_tokens and stop_reason. A large logit_bias makes a random
model's next token certain, so each behaviour is asserted exactly."""

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.worker.sampler import constrain_logits

MODEL = "random:tiny-llama"  # byte tokenizer: id 65 is "A", 257 "<|im_start|>", 258 EOS "<|im_end|>"
A, IM_START, EOS = 65, 257, 258


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    return LLM(MODEL, async_scheduling=request.param)


def run(llm, **kwargs):
    params = SamplingParams(temperature=0, **{"max_tokens": 8, **kwargs})
    return llm.generate(prompt_token_ids=[[10, 20, 30]], sampling_params=params, use_tqdm=False)[0]


def test_logit_bias_adds_to_the_logits(llm):
    plain = run(llm)
    assert plain.token_ids != [A] * 8
    assert run(llm, logit_bias={A: 100}).token_ids == [A] * 8
    assert A not in run(llm, logit_bias={t: -100 for t in plain.token_ids}).token_ids[:1]


def test_eos_stops_with_no_stop_reason_and_min_tokens_holds_it_back(llm):
    out = run(llm, logit_bias={EOS: 100})
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([EOS], "stop", None)
    out = run(llm, logit_bias={EOS: 100}, min_tokens=5)
    assert len(out.token_ids) == 6 and EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
    assert out.finish_reason == "stop"
    out = run(llm, logit_bias={EOS: 100}, min_tokens=5, ignore_eos=True)
    assert out.token_ids == [EOS] * 8 and out.finish_reason == "length"


def test_stop_token_ids_stop_with_the_id_as_stop_reason(llm):
    out = run(llm, logit_bias={A: 100}, stop_token_ids=[A])
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([A], "", "stop", A)
    out = run(llm, logit_bias={A: 100}, stop_token_ids=[A], include_stop_str_in_output=True)
    assert (out.text, out.stop_reason) == ("A", A)
    out = run(llm, logit_bias={A: 100}, stop_token_ids=[A], min_tokens=3)
    # A is masked for the first 3 tokens, then the 4th is A and stops
    assert len(out.token_ids) == 4 and A not in out.token_ids[:3] and out.token_ids[3] == A
    assert out.stop_reason == A


def test_stop_strings_give_stop_reason_and_can_be_kept(llm):
    out = run(llm, logit_bias={A: 100}, stop=["AAA"])
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", "AAA")
    out = run(llm, logit_bias={A: 100}, stop=["AAA"], include_stop_str_in_output=True)
    assert (out.text, out.stop_reason) == ("AAA", "AAA")
    out = run(llm, logit_bias={A: 100}, stop=["A"], min_tokens=4)  # not before the 4th token
    assert (out.text, len(out.token_ids), out.stop_reason) == ("AAA", 4, "A")


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    assert run(llm, logit_bias={IM_START: 100}, max_tokens=2).text == ""
    kept = run(llm, logit_bias={IM_START: 100}, max_tokens=2, skip_special_tokens=False)
    assert kept.text == "<|im_start|><|im_start|>"


def test_a_biased_row_leaves_the_rest_of_the_batch_alone(llm):
    prompts = [[10, 20, 30], [40, 50, 60]]
    plain = SamplingParams(temperature=0, max_tokens=6)
    alone = llm.generate(prompt_token_ids=prompts[1:], sampling_params=plain, use_tqdm=False)
    mixed = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=[
        SamplingParams(temperature=0, max_tokens=6, logit_bias={A: 100}, min_tokens=2), plain])
    assert mixed[0].token_ids == [A] * 6
    assert mixed[1].token_ids == alone[0].token_ids


class Row:
    def __init__(self, params, num_output):
        self.sampling_params, self.output_token_ids = params, [0] * num_output


def test_bias_and_min_tokens_mask_on_fixed_logits():
    logits = torch.zeros(3, 8)
    rows = [Row(SamplingParams(logit_bias={1: 2.5, 2: -1.0}), 0),
            Row(SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[3]), 1),
            Row(SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[3]), 2)]
    out = constrain_logits(logits, rows, eos_token_ids={7})
    assert out[0].tolist() == [0, 2.5, -1.0, 0, 0, 0, 0, 0]
    assert out[1, 3] == float("-inf") and out[1, 7] == float("-inf") and out[1, :3].eq(0).all()
    assert out[2].eq(0).all()  # min_tokens reached: nothing masked


@pytest.mark.parametrize("kwargs,field", [
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),  # at most 64
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),  # at most 300
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_bad_values_name_the_field_and_the_limit(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids_are_refused_by_the_engine(llm):
    for kwargs, field in (({"logit_bias": {512: 1}}, "logit_bias"),
                          ({"stop_token_ids": [600]}, "stop_token_ids")):
        with pytest.raises(ValueError, match=f"{field} must be token ids in \\[0, 512\\)"):
            run(llm, **kwargs)


def test_allowed_token_ids_are_the_only_ones_sampled(llm):
    """vLLM's allowed_token_ids: every other logit is -inf, whatever logit_bias or temperature."""
    allowed = [A, 66, 67]
    params = SamplingParams(allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=32)
    out = llm.generate(prompt_token_ids=[[10, 20, 30]], sampling_params=params, use_tqdm=False)[0]
    assert len(out.token_ids) == 32 and set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    # a bias towards a token not allowed does not bring it back
    assert run(llm, allowed_token_ids=[66], logit_bias={A: 100}).token_ids == [66] * 8
    # greedy: the most likely of the allowed
    plain = run(llm)
    assert run(llm, allowed_token_ids=[plain.token_ids[0], A]).token_ids[0] == plain.token_ids[0]


@pytest.mark.parametrize("value,message", [([], "non-empty"), ([-1], "non-negative"), ("A", "non-empty")])
def test_allowed_token_ids_must_be_a_non_empty_list_of_ids(value, message):
    with pytest.raises(ValueError, match=rf"^allowed_token_ids must be .*{message}"):
        SamplingParams(allowed_token_ids=value)


def test_allowed_token_ids_beyond_the_vocabulary_are_refused_by_the_engine(llm):
    with pytest.raises(ValueError, match="allowed_token_ids must be token ids in"):
        run(llm, allowed_token_ids=[10 ** 7])


def test_bad_words_are_never_completed(llm):
    """vLLM's bad_words: a one-token word is never sampled; a longer word's last token is masked
    once the output ends with the others (here "AA": A is the likeliest, B next, so the output
    alternates instead of repeating A)."""
    nudged = {A: 100, 66: 99}
    assert run(llm, logit_bias=nudged).token_ids == [A] * 8
    assert run(llm, logit_bias=nudged, bad_words=["A"]).token_ids == [66] * 8
    assert run(llm, logit_bias=nudged, bad_words=["AA"]).token_ids == [A, 66] * 4
    assert run(llm, logit_bias=nudged, bad_words=["AB"]).token_ids == [A] * 8  # never ends with A, B


def test_bad_word_tokens_are_the_word_and_its_spaced_form_where_it_tokenizes_alike():
    from kvmesh.worker.bad_words import bad_word_token_ids, banned_next_tokens
    from kvmesh.worker.loader import load_tokenizer

    tokenizer = load_tokenizer(MODEL)[0]  # bytes: " A" is two tokens, so only "A" is kept
    assert bad_word_token_ids(tokenizer, ["A", " AB"]) == [[A], [A, 66]]
    assert banned_next_tokens([[A], [A, 66]], [1, 2]) == {A}
    assert banned_next_tokens([[A], [A, 66]], [1, A]) == {A, 66}


@pytest.mark.parametrize("value", [[""], ["   "], "A", ["x" * 257], ["w"] * 129])
def test_bad_words_must_be_a_short_list_of_words(value):
    with pytest.raises(ValueError, match=r"^bad_words must be"):
        SamplingParams(bad_words=value)
