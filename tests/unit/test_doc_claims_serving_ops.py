"""docs/SERVING.md from "Structured outputs and tool calls" to the end, without Ray: behaviours the
doc states that no other unit test would catch if they stopped being true.

- structured outputs: every spelling of a constraint and the field an error names, the refused
  vLLM options, `guided_decoding_backend`, `strict`, EBNF grammars, xgrammar pinned;
- tool calls: `auto` is the default with tools, `parallel_tool_calls: false` is not enforced with
  `auto`;
- faults: a non-streaming request is re-run from the start, the stall defaults, the hub's restarts;
- autoscaling: the SLO policies' half-target rule; the simulator's start delay, billing, ingress
  queue and "SLO met";
- `kvmesh bench serve`: one cluster per policy for a rate sweep, `--sample-s`'s per-worker summary.
"""

import asyncio
import re
import tomllib
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.cluster.openai_protocol import ApiError, ChatCompletionRequest
from kvmesh.cluster.structured_request import UNSUPPORTED_OPTIONS, parse_structured
from kvmesh.structured_outputs import StructuredOutputs

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


# ---- structured outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("fields, kind, param", [
    ({"structured_outputs": {"json": {"type": "object"}}}, "json", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"guided_json": {"type": "object"}}, "json", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", "guided_grammar"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_structured_outputs_kind_and_each_older_guided_name_is_one_constraint(fields, kind, param):
    """`structured_outputs: {json | regex | choice | grammar | json_object}`; `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar` (older names): as `structured_outputs.*`."""
    structured = parse_structured(chat(**fields))
    assert (structured.spec.kind, structured.param) == (kind, param)


@pytest.mark.parametrize("option", ["structural_tag", "whitespace_pattern", "disable_any_whitespace",
                                    "disable_fallback", "disable_additional_properties"])
def test_each_vllm_structured_outputs_option_kvmesh_lacks_is_a_400_naming_it(option):
    """`structured_outputs.structural_tag`, `whitespace_pattern`, `disable_any_whitespace`,
    `disable_fallback`, `disable_additional_properties`: 400 naming the field."""
    value = " " if option in ("whitespace_pattern", "structural_tag") else True
    with pytest.raises(ApiError) as e:
        parse_structured(chat(structured_outputs={"regex": "a", option: value}))
    assert (e.value.status, e.value.param) == (400, f"structured_outputs.{option}")
    assert set(UNSUPPORTED_OPTIONS) == {"structural_tag", "whitespace_pattern", "disable_any_whitespace",
                                        "disable_fallback", "disable_additional_properties"}


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_guided_decoding_backend_auto_or_xgrammar_is_accepted(backend):
    """`guided_decoding_backend`: `auto` or `xgrammar`; anything else is a 400."""
    assert parse_structured(chat(guided_regex="a", guided_decoding_backend=backend)).spec.regex == "a"


@pytest.mark.parametrize("backend", ["outlines", "guidance", "lm-format-enforcer"])
def test_another_guided_decoding_backend_is_a_400_naming_it(backend):
    """`guided_decoding_backend`: ... anything else is a 400."""
    with pytest.raises(ApiError) as e:
        parse_structured(chat(guided_regex="a", guided_decoding_backend=backend))
    assert (e.value.status, e.value.param) == (400, "guided_decoding_backend")


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_name_and_strict_are_accepted_and_the_schema_is_enforced_whatever_strict_says(strict):
    """`response_format: {"type": "json_schema", ...}`: `name`, `strict` are accepted; the schema
    is always enforced."""
    body = {"name": "city", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    if strict is not None:
        body["strict"] = strict
    structured = parse_structured(chat(response_format={"type": "json_schema", "json_schema": body}))
    assert structured.spec.kind == "json" and '"city"' in structured.spec.json


def test_a_grammar_is_ebnf_as_xgrammar_reads_it_and_constrains_the_tokens():
    """`grammar` is EBNF (GBNF) as xgrammar reads it: character classes, repetition, alternatives
    and rule references compile, and the mask allows exactly what the grammar does."""
    from kvmesh.worker.grammar import GrammarCompiler
    from kvmesh.worker.presets import build_byte_tokenizer

    tokenizer = build_byte_tokenizer(512)
    compiler = GrammarCompiler(tokenizer, 512, stop_token_ids=[tokenizer.eos_token_id])
    grammar = 'root ::= answer "!"\nanswer ::= "yes" | "no" | [0-9]+'
    compiled = compiler.compile(StructuredOutputs(grammar=grammar))
    import xgrammar

    def accepts(text: str) -> bool:
        return xgrammar.GrammarMatcher(compiled).accept_string(text)

    assert accepts("yes!") and accepts("no!") and accepts("2024!")
    assert not accepts("maybe") and not accepts("yes?") and not accepts("!")


def test_xgrammar_is_pinned_in_pyproject():
    """The grammar library is xgrammar (pinned in pyproject)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.fullmatch(r"xgrammar==[0-9][0-9.]*", d.replace(" ", "")) for d in deps), deps


# ---- tool calls ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TWO_HERMES_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def tools_request(**fields):
    return SimpleNamespace(**{"tools": [WEATHER], "tool_choice": None, "parallel_tool_calls": None,
                              **fields})


def test_auto_is_the_tool_choice_when_tools_are_given_without_one():
    """`tool_choice: "auto"` (the default with tools): parsed, no output constraint."""
    from kvmesh.cluster.tool_calls import forced_structure, parse_tools

    request = parse_tools(tools_request())
    assert request.choice == "auto" and request.parses_output
    assert forced_structure(request) is None


def test_parallel_tool_calls_false_is_not_enforced_with_auto():
    """`parallel_tool_calls: false`: at most one call with `required`; not enforced with `auto`."""
    from kvmesh.cluster.tool_calls import forced_structure, parse_tools
    from kvmesh.cluster.tool_parser import ToolStream, parse_output

    request = parse_tools(tools_request(parallel_tool_calls=False))
    assert forced_structure(request) is None
    _, calls = parse_output(TWO_HERMES_CALLS, request)
    assert [c.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']
    stream = ToolStream(request)
    deltas = stream.feed(TWO_HERMES_CALLS) + stream.finish()
    assert len(stream.calls) == 2 and {tc["index"] for d in deltas for tc in d.get("tool_calls", [])} == {0, 1}


def test_tools_are_rendered_with_tool_choice_none():
    """`tool_choice: "none"`: tools rendered, output not parsed."""
    from kvmesh.cluster.openai_protocol import ChatMessage, chat_prompt_text
    from kvmesh.cluster.tool_calls import parse_tools, render_chat
    from kvmesh.worker.presets import build_byte_tokenizer

    request = parse_tools(tools_request(tool_choice="none"))
    assert not request.parses_output
    messages = [ChatMessage.model_validate(m) for m in MESSAGES]
    tokenizer = build_byte_tokenizer(512)  # its template knows no tools: the Hermes block
    out, _ = render_chat(messages, chat_prompt_text(messages), request, tokenizer)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]


# ---- faults -------------------------------------------------------------------------------------

def test_a_non_streaming_request_whose_worker_died_after_tokens_is_run_again_from_the_start():
    """"non-streaming requests have shown the client nothing, so they are always re-run from the
    start": the answer holds the second run's tokens only."""
    import ray

    from kvmesh.cluster.generation import collect
    from kvmesh.cluster.messages import RoutedRequest
    from kvmesh.protocol import TokenDelta
    from kvmesh.sampling_params import SamplingParams
    from handle_support import Handle

    def delta(ids, reason=None):
        return TokenDelta("r", ids, "".join(f"<{i}>" for i in ids), finish_reason=reason)

    handle = Handle([delta([5]), delta([6]), ray.exceptions.ActorDiedError()],
                    [delta([7]), delta([8], "length")])
    routed = RoutedRequest("r", [1, 2, 3], SamplingParams(max_tokens=2))
    out = asyncio.run(collect(handle, routed))
    assert out.token_ids == [7, 8] and out.text == "<7><8>" and out.last.finish_reason == "length"
    assert routed.attempt == 1


def test_the_stall_timeouts_default_to_3_s_and_60_s():
    """`replicas.engine_stall_timeout_s` (default 3 s); `KVMESH_STALL_TIMEOUT_S` (default 60 s)."""
    import os
    import subprocess
    import sys

    from kvmesh.serve_config import parse_config

    assert parse_config({"model": "random:tiny-llama"}).replicas.engine_stall_timeout_s == 3.0
    read = "from kvmesh.cluster.worker import STALL_TIMEOUT_S; print(STALL_TIMEOUT_S)"
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_STALL_TIMEOUT_S"}
    for value, expected in ((None, "60.0"), ("7", "7.0")):
        run_env = env if value is None else {**env, "KVMESH_STALL_TIMEOUT_S": value}
        out = subprocess.run([sys.executable, "-c", read], env=run_env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        assert out.strip().splitlines()[-1] == expected


def test_the_hub_restarts_on_failure_without_limit():
    """The hub restarts on failure (`max_restarts=-1`)."""
    from kvmesh.cluster.event_hub import KVEventHub

    assert KVEventHub._default_options["max_restarts"] == -1


# ---- autoscaling --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy_name, metric, target_kw", [
    ("ttft_slo", "TTFT_P90", "ttft_p90_target_s"), ("itl_slo", "ITL_P90", "itl_p90_target_s")])
def test_slo_policies_go_down_to_the_replicas_requests_need_only_under_half_the_target(
        policy_name, metric, target_kw):
    """`ttft_slo` / `itl_slo`: ... under half of it, down to the replicas the requests need at
    `target_ongoing_requests` (0 when idle); between half and the target the count holds."""
    from ray.serve.config import AutoscalingConfig

    from kvmesh.cluster import autoscaling
    from kvmesh.cluster.serve_policy import ServePolicy
    from kvmesh.serve_config import AutoscalingSection

    section = AutoscalingSection(enabled=True, policy=policy_name, min_replicas=0, max_replicas=8,
                                 target_ongoing_requests=4, **{target_kw: 1.0})

    def decide(figure, requests, start=4):
        serve = ServePolicy(autoscaling.build_policy(section), AutoscalingConfig(
            min_replicas=0, max_replicas=8, upscale_delay_s=0, downscale_delay_s=0,
            downscale_to_zero_delay_s=0))
        name = getattr(autoscaling, metric)
        return serve.decide(1000.0, start, start, requests, 0.0, {name: [figure] * start})

    assert decide(0.49, 6.0) == 2  # ceil(6 / 4)
    assert decide(0.51, 6.0) == 4  # inside the target, over half of it: hold
    assert decide(1.0, 6.0) == 4
    assert decide(0.0, 0.0, start=1) == 0  # idle: 0


# ---- the autoscaling simulator ------------------------------------------------------------------

def _sim(policy="queue", min_replicas=0, max_replicas=1, fixed=None, **options):
    from kvmesh.cluster.autoscale_sim import AutoscaleSim, AutoscaleSimConfig
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.serve_config import AutoscalingSection

    sim_fields = {k: options.pop(k) for k in ("startup_s", "tick_s", "max_ongoing_requests") if k in options}
    section = AutoscalingSection(enabled=True, policy=policy, min_replicas=min_replicas,
                                 max_replicas=max_replicas,
                                 upscale_delay_s=0, downscale_delay_s=100, window_s=5,
                                 target_ongoing_requests=1, **options)
    return AutoscaleSim(SimConfig(num_workers=2), AutoscaleSimConfig(section, **sim_fields), fixed)


def _workload(arrivals, output_tokens=(32, 32)):
    from kvmesh.router.sim.workloads import make_workload

    workload = make_workload("random", len(arrivals), output_tokens=output_tokens, prompt_tokens=(64, 64))
    for request, t in zip(workload.requests, arrivals):
        request.arrival = t
    return workload


def test_sim_a_new_replica_serves_startup_s_after_the_decision_and_is_billed_from_it():
    """"A new replica serves `startup_s` after the decision and is billed from it"; "TTFT is from
    arrival at the ingress"."""
    sim = _sim(startup_s=5.0, tick_s=1.0)
    report = sim.run(_workload([10.0]))  # from zero replicas: decided at the tick at 10 s
    (replica,) = sim.replicas
    assert (replica.billed_from, replica.ready_at) == (10.0, 15.0)
    assert 5.0 <= report["ttft_p50_s"] < 5.5  # the start, then a prefill
    assert report["replica_hours"] == pytest.approx((report["duration_s"] - 10.0) / 3600)


def test_sim_slo_met_is_the_fraction_of_requests_with_ttft_at_most_the_target_of_1_s():
    """""SLO met" is the fraction of requests with TTFT at most `ttft_p90_target_s` (1 s)"."""
    from kvmesh.serve_config import AutoscalingSection

    assert AutoscalingSection().ttft_p90_target_s == 1.0
    slow = _sim(startup_s=5.0).run(_workload([10.0]))  # TTFT 5 s
    assert slow["slo_attainment"] == 0.0
    assert _sim(startup_s=5.0, ttft_p90_target_s=4.9).run(_workload([10.0]))["slo_attainment"] == 0.0
    assert _sim(startup_s=5.0, ttft_p90_target_s=5.1).run(_workload([10.0]))["slo_attainment"] == 1.0
    fixed = _sim(fixed=1).run(_workload([0.0, 0.0]))  # both served at once: within 1 s
    assert fixed["slo_attainment"] == 1.0


def test_sim_requests_wait_at_the_ingress_beyond_max_ongoing_requests_per_replica():
    """"requests wait at the ingress beyond `max_ongoing_requests` per replica"."""
    one_slot = _sim(fixed=1, max_ongoing_requests=1)
    one_slot.run(_workload([0.0, 0.0, 0.0]))
    jobs = sorted(one_slot.replicas[0].done, key=lambda j: j.first_token_time)
    for earlier, later in zip(jobs, jobs[1:]):  # each starts only once the one before it ended
        assert later.first_token_time > earlier.finish_time
    batched = _sim(fixed=1, max_ongoing_requests=8)
    batched.run(_workload([0.0, 0.0, 0.0]))
    jobs = list(batched.replicas[0].done)
    assert max(j.first_token_time for j in jobs) < min(j.finish_time for j in jobs)


# ---- kvmesh bench serve -------------------------------------------------------------------------

def _bench_args(*argv):
    import argparse

    from kvmesh.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_rate_sweep_runs_every_rate_on_one_cluster_per_policy(monkeypatch, capsys):
    """"`--rate R1 R2 ...` sweeps offered rates on one cluster per policy"."""
    import kvmesh.cluster.local as local
    from kvmesh.bench import serve

    launches, runs = [], []

    @contextmanager
    def fake_cluster(args):
        launches.append(args)
        yield SimpleNamespace(http_url=f"http://cluster-{len(launches)}", proc=SimpleNamespace(pid=0))

    def fake_bench_url(url, args, rate=None):
        runs.append((url, rate))
        return {"ok": 1, "requests": 1, **{k: 0.0 for k in (
            "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s",
            "output_tokens_per_s", "prefix_hit_rate")}}

    monkeypatch.setattr(local, "LocalCluster", fake_cluster)
    monkeypatch.setattr(serve, "bench_url", fake_bench_url)
    assert serve.run(_bench_args("--launch", "--replicas 1", "--policies", "kv_events,round_robin",
                                 "--rate", "2", "4", "8")) == 0
    assert [a[-1] for a in launches] == ["kv_events", "round_robin"]
    assert runs == [(f"http://cluster-{i}", r) for i in (1, 2) for r in (2.0, 4.0, 8.0)]


def test_sample_s_adds_samples_to_the_json_and_prints_each_workers_p50_and_max(monkeypatch, capsys, tmp_path):
    """"`--sample-s S` ... adds `samples` to the JSON and prints a p50 / max line per worker"."""
    import json

    from kvmesh.bench import serve

    samples = [{"t": t, "workers": {w: {"running": r, "waiting": q, "kv_used": 0.1, "steps": 10 * t,
                                        "step_seconds": 0.01 * t * (2 if w == "w2" else 1)}
                                    for w, r, q in (("w1", 2 + t, t), ("w2", 5, 1))}}
               for t in range(4)]

    def fake_bench_url(url, args, rate=None):
        return {"ok": 1, "requests": 1, "samples": samples, "sampled": serve.sample_summary(samples),
                **{k: 0.0 for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s",
                                    "itl_p99_s", "output_tokens_per_s", "prefix_hit_rate")}}

    monkeypatch.setattr(serve, "bench_url", fake_bench_url)
    out_json = tmp_path / "r.json"
    assert serve.run(_bench_args("--url", "http://x", "--rate", "1", "--sample-s", "0.5",
                                 "--json", str(out_json))) == 0
    assert json.loads(out_json.read_text())["results"]["served"]["samples"] == samples
    printed = [line for line in capsys.readouterr().out.splitlines() if "(p50/max)" in line]
    for worker, line in (("w1", "w1: running 4/5, waiting max 3, step 1.0/1.0 ms"),
                         ("w2", "w2: running 5/5, waiting max 1, step 2.0/2.0 ms")):
        assert any(line in p for p in printed), (worker, printed)


class _Loop:
    def __init__(self, stalled_s: float, alive: bool = True):
        self.stalled_s, self.alive = stalled_s, alive

    def is_alive(self):
        return self.alive

    def failure_message(self):
        return "engine process died"

    def stalled_for(self):
        return self.stalled_s


@pytest.mark.parametrize("stalled_past_limit_s, alive, fails", [
    (None, True, False), (-1.0, True, False), (1.0, True, True), (None, False, True)])
def test_the_health_check_fails_when_the_engine_died_or_one_step_passed_the_stall_timeout(
        stalled_past_limit_s, alive, fails):
    """"An engine ... that dies: ... its health check fails (Serve replaces the replica)"; "One
    step running longer than `KVMESH_STALL_TIMEOUT_S` (default 60 s) fails the health check too"."""
    from kvmesh.cluster.worker import STALL_TIMEOUT_S, KVWorker

    stalled_s = 0.0 if stalled_past_limit_s is None else STALL_TIMEOUT_S + stalled_past_limit_s
    worker = SimpleNamespace(loop=_Loop(stalled_s, alive), worker_id="w1")
    if fails:
        with pytest.raises(RuntimeError):
            asyncio.run(KVWorker.check_health(worker))
    else:
        asyncio.run(KVWorker.check_health(worker))


def test_a_request_waits_out_of_the_batch_while_its_grammar_compiles_and_the_batch_keeps_stepping(
        monkeypatch):
    """"the request waits out of the batch until its grammar is ready, and the batch keeps
    stepping"."""
    import threading

    from kvmesh.config import EngineConfig
    from kvmesh.protocol import EngineRequest
    from kvmesh.sampling_params import SamplingParams
    from kvmesh.worker import grammar
    from kvmesh.worker.engine import Engine

    release = threading.Event()
    compile_for_real = grammar.GrammarCompiler._compile

    def held_compile(self, spec):
        assert release.wait(60)
        return compile_for_real(self, spec)

    monkeypatch.setattr(grammar.GrammarCompiler, "_compile", held_compile)
    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu"))
    engine.add_request(EngineRequest("constrained", list(range(20)), SamplingParams(
        max_tokens=4, temperature=0, structured_outputs=StructuredOutputs(choice=["ab", "cd"]))))
    engine.add_request(EngineRequest("free", list(range(20)), SamplingParams(max_tokens=4)))
    deltas = []
    for _ in range(4):  # while the grammar is held: the free request runs to its end alone
        deltas += engine.step()
    assert sum(len(d.token_ids) for d in deltas if d.request_id == "free") == 4
    assert not any(d.request_id == "constrained" for d in deltas)
    release.set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        deltas += engine.step()
    constrained = [d for d in deltas if d.request_id == "constrained"]
    assert "".join(d.text for d in constrained) in ("ab", "cd")
    assert constrained[-1].finish_reason == "stop"
