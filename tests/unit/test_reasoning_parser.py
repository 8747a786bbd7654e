"""cluster/reasoning.py: a reasoning model's output split into reasoning and content, whole and
streamed (docs/SERVING.md "Reasoning models")."""

import pytest

from kvmesh.cluster.reasoning import ReasoningParser
from kvmesh.worker.presets import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer(512)  # <think> = 259, </think> = 260
QWEN3 = ReasoningParser.for_tokenizer("qwen3", TOKENIZER)
R1 = ReasoningParser.for_tokenizer("deepseek_r1", TOKENIZER)
PLAIN = TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
THINKING_OFF = PLAIN + TOKENIZER.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
OPENED = PLAIN + TOKENIZER.encode("<think>\n", add_special_tokens=False)

CASES = [
    # parser, prompt, output, (reasoning, content)
    (QWEN3, PLAIN, "<think>\nsome thought\n</think>\n\nThe answer.", ("\nsome thought\n", "\n\nThe answer.")),
    (QWEN3, PLAIN, "The answer, no thinking.", (None, "The answer, no thinking.")),
    (QWEN3, PLAIN, "<think>cut short by max_tokens", ("cut short by max_tokens", None)),
    (QWEN3, PLAIN, "<think></think>", ("", None)),
    (QWEN3, PLAIN, "<thin", (None, "<thin")),  # a marker's start that never completes
    (QWEN3, PLAIN, " <think>x</think>y", (None, " <think>x</think>y")),  # only a leading marker opens
    (QWEN3, THINKING_OFF, "<think>not a block: the prompt closed it</think>z",
     (None, "<think>not a block: the prompt closed it</think>z")),
    (QWEN3, OPENED, "thought</think>answer", ("thought", "answer")),
    (R1, PLAIN, "thought</think>answer", ("thought", "answer")),
    (R1, PLAIN, "<think>thought</think>answer", ("thought", "answer")),
    (R1, PLAIN, "never closed", ("never closed", None)),
    (R1, PLAIN, "a</think>b</think>c", ("a", "b</think>c")),  # only the first end closes the block
    (R1, PLAIN, "x</thin", ("x</thin", None)),
    (R1, THINKING_OFF, "all content", (None, "all content")),
]


@pytest.mark.parametrize("parser, prompt, output, expected", CASES)
def test_a_whole_output_splits_into_reasoning_and_content(parser, prompt, output, expected):
    assert parser.split(output, prompt) == expected


@pytest.mark.parametrize("parser, prompt, output, expected", CASES)
def test_streamed_at_every_split_the_parts_join_to_the_whole_split(parser, prompt, output, expected):
    """However the text is cut into pieces (a marker split across two deltas included), the
    streamed parts join to the whole output's split, and no marker text leaks into either."""
    for cuts in [(i,) for i in range(len(output) + 1)] + [(i, i + 1) for i in range(len(output))]:
        stream = parser.stream(prompt)
        bounds = [0, *cuts, len(output)]
        parts = [stream.feed(output[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts.append(stream.finish())
        assert stream.joined(parts) == expected, cuts


def test_a_streamed_reasoning_piece_goes_out_before_the_block_ends():
    stream = QWEN3.stream(PLAIN)
    assert stream.feed("<think>") == ("", "")
    assert stream.feed("first ") == ("first ", "")
    assert stream.feed("second </") == ("second ", "")  # "</" may start </think>: held
    assert stream.feed("think>\n\nAn") == ("", "\n\nAn")
    assert stream.feed("swer") == ("", "swer")
    assert stream.finish() == ("", "")


def test_structured_outputs_wait_for_the_end_of_thinking_unless_the_prompt_ended_it():
    assert QWEN3.grammar_waits(PLAIN) and QWEN3.grammar_waits(OPENED) and R1.grammar_waits(PLAIN)
    assert not QWEN3.grammar_waits(THINKING_OFF) and not R1.grammar_waits(THINKING_OFF)


def test_a_tokenizer_without_the_markers_as_single_tokens_is_refused_naming_the_setting():
    from kvmesh.worker.loader import load_tokenizer

    smollm2, _ = load_tokenizer("smollm2")  # the default model: no thinking block
    with pytest.raises(ValueError, match=r"server.reasoning_parser: qwen3 reads <think> \.\.\. </think>, "
                                         r"but this model's tokenizer has no single token for <think> or </think>"):
        ReasoningParser.for_tokenizer("qwen3", smollm2)
    with pytest.raises(ValueError, match="server.reasoning_parser: 'granite' is not one of qwen3, deepseek_r1"):
        ReasoningParser.for_tokenizer("granite", TOKENIZER)
