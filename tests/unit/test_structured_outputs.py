"""Structured outputs without Ray: the spec, the grammar compiler and its errors, the batch mask
(only the constrained rows are masked), and generation on the default model under a JSON schema,
a choice and a regex, alone and mixed in one batch with unconstrained requests."""

import json
import re

import jsonschema
import pytest
import torch

from kvmesh import LLM, SamplingParams, StructuredOutputs
from kvmesh.worker.grammar import GrammarCompiler, GrammarError, apply_grammar_masks
from kvmesh.worker.presets import build_byte_tokenizer

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer"},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}


# ---- the spec ----------------------------------------------------------------------------------

def test_spec_needs_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a+", choice=("a",))
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=("a", ""))


def test_a_schema_keeps_its_key_order_the_order_the_model_writes():
    spec = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.kind == "json" and spec.json == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert spec.key == ("json", spec.json)


def test_sampling_params_refuse_a_spec_of_the_wrong_type():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


# ---- compiling and masking -------------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_compiler():
    tokenizer = build_byte_tokenizer(512)
    return tokenizer, GrammarCompiler(tokenizer, 512, stop_token_ids=[tokenizer.eos_token_id])


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputs(json='{"type": "nonsense"}'), "structured_outputs.json"),
    (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputs(regex="[^\\s\\S]"), "structured_outputs.regex"),  # compiles, matches nothing
])
def test_a_spec_that_does_not_compile_names_its_field(byte_compiler, spec, field):
    _, compiler = byte_compiler
    with pytest.raises(GrammarError, match=re.escape(field)):
        compiler.compile(spec)


def test_equal_specs_are_compiled_once(byte_compiler):
    _, compiler = byte_compiler
    spec = StructuredOutputs(regex="[0-9]{3}")
    assert compiler.submit(spec) is compiler.submit(StructuredOutputs(regex="[0-9]{3}"))


class _Row:
    def __init__(self, grammar=None):
        self.grammar, self.num_pending, self.request_id = grammar, 0, "r"


def test_the_mask_touches_only_the_rows_with_a_grammar(byte_compiler):
    tokenizer, compiler = byte_compiler
    matcher = compiler.matcher(compiler.compile(StructuredOutputs(choice=("yes", "no"))))
    logits = torch.zeros(3, 512)
    apply_grammar_masks(logits, [_Row(), _Row(matcher), _Row()], 512)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    allowed = torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()
    assert sorted(tokenizer.decode([t]) for t in allowed) == ["n", "y"]


def test_a_choice_ends_when_complete_and_accepts_only_eos_there(byte_compiler):
    tokenizer, compiler = byte_compiler
    matcher = compiler.matcher(compiler.compile(StructuredOutputs(choice=("no",))))
    for t in tokenizer.encode("no", add_special_tokens=False):
        assert matcher.accept(t)
    logits = torch.zeros(1, 512)
    apply_grammar_masks(logits, [_Row(matcher)], 512)
    assert torch.nonzero(torch.isfinite(logits[0])).flatten().tolist() == [tokenizer.eos_token_id]
    assert not matcher.is_terminated
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated


# ---- generation on the default model ----------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def chat(text):
    return [{"role": "user", "content": text}]


def greedy_chat(llm, text: str, structured: StructuredOutputs, max_tokens: int):
    """The greedy answer to one user message under `structured`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=structured)
    return llm.chat(chat(text), params, use_tqdm=False)[0]


@pytest.mark.slow
def test_greedy_generation_under_a_json_schema_is_schema_valid(llm):
    out = greedy_chat(llm, "Give the city, population and whether it is a capital, for Paris, as JSON.",
                      StructuredOutputs(json=SCHEMA), max_tokens=80)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert "\n" not in out.text  # JSON is generated on one line: no indentation to loop on


@pytest.mark.slow
def test_a_choice_gives_one_of_the_choices_and_unconstrained_rows_are_unchanged(llm):
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.chat(chat("Tell me about the sea."), free, use_tqdm=False)[0].text
    choice = SamplingParams(max_tokens=12, temperature=0,
                            structured_outputs=StructuredOutputs(choice=["Paris", "Lyon", "Nice"]))
    regex = SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                           structured_outputs=StructuredOutputs(regex="[0-9]{3}-[0-9]{4}"))
    outs = llm.chat([chat("What is the capital of France?"), chat("Tell me about the sea."),
                     chat("Give me a phone number.")], [choice, free, regex], use_tqdm=False)
    assert outs[0].text in ("Paris", "Lyon", "Nice") and outs[0].finish_reason == "stop"
    assert outs[1].text == alone
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", outs[2].text) and outs[2].finish_reason == "stop"


@pytest.mark.slow
def test_json_object_gives_an_object(llm):
    out = greedy_chat(llm, "Answer in JSON: what is the capital of France?",
                      StructuredOutputs(json_object=True), max_tokens=60)
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.slow
def test_an_invalid_schema_is_refused_before_anything_runs(llm):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="(a"))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["hello"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_with_async_scheduling_a_constrained_batch_is_stepped_without_overlap():
    """The mask needs the previous token accepted: the engine processes each step before the next
    while a row has a grammar (the mask would raise if a token were still in flight)."""
    tiny = LLM("random:tiny-llama", device="cpu", async_scheduling=True)
    choice = SamplingParams(max_tokens=20, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputs(choice=["alpha", "beta", "gamma"]))
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = tiny.generate(prompt_token_ids=[list(range(30)), list(range(40)), list(range(50))],
                         sampling_params=[free, choice, choice], use_tqdm=False)
    assert len(outs[0].token_ids) == 12
    assert {outs[1].text, outs[2].text} <= {"alpha", "beta", "gamma"}


def test_the_cache_keeps_the_last_specs_only(byte_compiler, monkeypatch):
    _, compiler = byte_compiler
    monkeypatch.setattr(compiler, "MAX_CACHED", 2)
    first = compiler.submit(StructuredOutputs(regex="a"))
    compiler.submit(StructuredOutputs(regex="b"))
    compiler.submit(StructuredOutputs(regex="c"))
    assert compiler.submit(StructuredOutputs(regex="c")).result() is not None
    assert compiler.submit(StructuredOutputs(regex="a")) is not first  # compiled again


def test_a_request_aborted_while_its_grammar_compiles_ends_as_aborted():
    from kvmesh.protocol import EngineRequest
    from kvmesh.worker.engine import Engine
    from kvmesh.config import EngineConfig

    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu"))
    spec = StructuredOutputs(json={"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i}}}$"} for i in range(1, 40)}})
    engine.add_request(EngineRequest("slow", list(range(20)), SamplingParams(
        max_tokens=4, structured_outputs=spec)))
    engine.add_request(EngineRequest("free", list(range(20)), SamplingParams(max_tokens=4)))
    engine.abort_request("slow")
    deltas = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        deltas += engine.step()
    ends = {d.request_id: d.finish_reason for d in deltas if d.finished}
    assert ends == {"slow": "abort", "free": "length"}


def test_a_grammar_that_leads_nowhere_ends_its_request_as_invalid():
    """`a` then nothing: the first token is allowed, the next row has no allowed token at all."""
    from kvmesh.protocol import EngineRequest
    from kvmesh.worker.engine import Engine
    from kvmesh.config import EngineConfig

    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu"))
    engine.add_request(EngineRequest("dead", list(range(20)), SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(regex="a[^\\s\\S]"))))
    deltas = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        deltas += engine.step()
    assert deltas[0].text == "a"
    assert deltas[-1].finish_reason == "error"
    assert deltas[-1].error == ("invalid_request: structured_outputs: the grammar allows no token "
                                "after 1 tokens")


def test_a_completed_grammar_stops_its_request_even_with_ignore_eos():
    """docs/SERVING.md: once the grammar is complete nothing more may follow, ignore_eos or not."""
    from kvmesh.protocol import EngineRequest
    from kvmesh.worker.engine import Engine
    from kvmesh.config import EngineConfig

    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu"))
    engine.add_request(EngineRequest("ab", list(range(20)), SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, structured_outputs=StructuredOutputs(regex="ab"))))
    deltas = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        deltas += engine.step()
    assert "".join(d.text for d in deltas) == "ab"
    assert deltas[-1].finish_reason == "stop"
    assert sum(len(d.token_ids) for d in deltas) < 8


@pytest.mark.slow
def test_n3_under_a_json_schema_gives_three_schema_valid_sequences(llm):
    """Each forked sequence has its own grammar state: three different samples, each valid."""
    params = SamplingParams(n=3, max_tokens=80, temperature=1.0, seed=5,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    out = llm.chat(chat("Give the city, population and whether it is a capital, for Paris, as JSON."),
                   params, use_tqdm=False)[0]
    assert len(out.sequences) == 3
    for sequence in out.sequences:
        assert sequence.finish_reason == "stop"
        jsonschema.validate(json.loads(sequence.text), SCHEMA)
    assert len({s.text for s in out.sequences}) > 1  # sampled apart, not one state shared


def test_a_grammar_after_the_end_of_thinking_sleeps_until_that_token_is_sampled():
    """SamplingParams.reasoning_end_token_id (set by a server with a reasoning parser,
    cluster/reasoning.py): the grammar constrains only the tokens after </think> (id 260 in the
    presets' byte tokenizer), and not at all while it is not sampled."""
    tiny = LLM("random:tiny-qwen3", device="cpu")
    regex = StructuredOutputs(regex="[a-c]{4}")

    def tokens(**kwargs):
        params = SamplingParams(max_tokens=10, temperature=0, structured_outputs=regex,
                                reasoning_end_token_id=260, **kwargs)
        return tiny.generate(["Name three letters."], params, use_tqdm=False)[0]

    ended = tokens(logit_bias={260: 100})  # </think> first, then the grammar holds the rest
    assert ended.token_ids[0] == 260 and re.fullmatch("</think>[a-c]{4}", ended.text), ended.text
    assert ended.finish_reason == "stop"  # the grammar completed
    free = tokens(logit_bias={260: -100})
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    assert not re.fullmatch("[a-c]*", free.text)  # ten unconstrained tokens
    with pytest.raises(ValueError, match=r"reasoning_end_token_id must be token ids in \[0, 512\)"):
        tiny.generate(["x"], SamplingParams(structured_outputs=regex, reasoning_end_token_id=512))
