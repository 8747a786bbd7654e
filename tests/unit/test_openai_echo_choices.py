"""The OpenAI shapes of echo, prompt_logprobs and best_of, from engine outputs (no Ray)."""

from kvmesh.cluster.openai_echo import Echo
from kvmesh.protocol import PromptLogprobs
from kvmesh.worker.parallel_sampling import rank_best_of, sequence_params
from kvmesh.sampling_params import SamplingParams

TEXT = {1: "Hel", 2: "lo", 3: " you", 9: "!"}
SCORES = PromptLogprobs(logprobs=[None, -1.5, -0.25], ranks=[None, 3, 1],
                        top=[None, {9: -0.5, 3: -1.0}, {3: -0.25, 9: -2.0}])


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion():
    echo = Echo(True, "Hello you", [1, 2, 3], TEXT.get, logprobs=1, prompt_logprobs=None)
    completion = {"tokens": ["!"], "token_logprobs": [-0.7], "top_logprobs": [{"!": -0.7}],
                  "text_offset": [0]}
    body = {"choices": [{"index": 0, "text": "!", "logprobs": completion}]}
    choice = echo.apply(body, "completion", SCORES)["choices"][0]
    assert choice["text"] == "Hello you!"
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo", " you", "!"], "token_logprobs": [None, -1.5, -0.25, -0.7],
        # top-1 alternatives, and the prompt token itself (as a sampled token is listed)
        "top_logprobs": [None, {"!": -0.5, "lo": -1.5}, {" you": -0.25}, {"!": -0.7}],
        "text_offset": [0, 3, 5, 9]}
    assert "prompt_logprobs" not in choice


def test_vllm_prompt_logprobs_list_the_token_and_the_top_k_with_ranks():
    echo = Echo(False, "Hello you", [1, 2, 3], TEXT.get, logprobs=None, prompt_logprobs=1)
    body = echo.apply({"choices": [{"index": 0, "text": "x", "logprobs": None}]}, "completion", SCORES)
    assert body["choices"][0]["text"] == "x"
    assert body["choices"][0]["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -1.5, "rank": 3, "decoded_token": "lo"},
         "9": {"logprob": -0.5, "rank": 1, "decoded_token": "!"}},
        {"3": {"logprob": -0.25, "rank": 1, "decoded_token": " you"}}]
    chat = echo.apply({"choices": [{"index": 0}]}, "chat", SCORES)
    assert len(chat["prompt_logprobs"]) == 3


def test_best_of_ranks_by_cumulative_logprob_ties_by_index():
    assert rank_best_of([-3.0, -1.0, -2.0, -1.0], 3) == [1, 3, 2]


def test_sequence_i_gets_seed_plus_i_and_no_prompt_logprobs():
    params = SamplingParams(n=3, seed=2**63 - 1, prompt_logprobs=2)
    assert sequence_params(params, 0) is params
    assert (sequence_params(params, 1).seed, sequence_params(params, 1).prompt_logprobs) == (0, None)
    assert sequence_params(SamplingParams(n=2), 1).seed is None


def test_stream_chunks_carry_their_sequence_index_and_echo_goes_first_per_choice():
    from kvmesh.cluster.openai_choices import StreamChoices
    from kvmesh.cluster.openai_responses import Shaper
    from kvmesh.protocol import TokenDelta

    shaper = Shaper("completion", "cmpl-1", "m", 0, TEXT.get, top_logprobs=None)
    echo = Echo(True, "Hello you", [1, 2, 3], TEXT.get, logprobs=None, prompt_logprobs=None)
    choices = StreamChoices(shaper, False, echo, num_choices=2)
    assert choices.role_chunks() == []  # completions have no role chunk
    deltas = [TokenDelta("r", [9], "!", index=0, prompt_logprobs=SCORES, more_sequences=True),
              TokenDelta("r", [3], " you", index=1, more_sequences=True),
              TokenDelta("r", [9], "!", index=1, finish_reason="length", more_sequences=True),
              TokenDelta("r", [3], " you", index=0, finish_reason="length")]
    sent = [c["choices"][0] for d in deltas for c in choices.chunks(d)]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in sent] == [
        (0, "Hello you", None), (0, "!", None), (1, "Hello you", None), (1, " you", None),
        (1, "!", "length"), (0, " you", "length")]
    assert choices.offsets == {0: len("Hello you! you"), 1: len("Hello you you!")}


def test_chat_role_chunks_one_per_choice():
    from kvmesh.cluster.openai_choices import StreamChoices
    from kvmesh.cluster.openai_responses import Shaper

    choices = StreamChoices(Shaper("chat", "c", "m", 0, TEXT.get, None), False, None, num_choices=3)
    assert [c["choices"][0]["index"] for c in choices.role_chunks()] == [0, 1, 2]
