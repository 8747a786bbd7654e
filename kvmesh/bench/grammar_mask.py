"""`python -m kvmesh.bench.grammar_mask`: what a grammar costs per generated token on the CPU, for
each installed grammar library (xgrammar, llguidance), with a model's tokenizer and a JSON schema.

For each library: the schema's compile time (no cache), then a walk along the tokens of a valid
document: at each token the next-token mask is computed (the step-path cost) and the token accepted.
Prints one JSON line per library. How kvmesh chose its library (docs/SERVING.md) rests on this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["mathematics", "engines", "poetry of science", "notes"],
            "address": {"city": "London", "zip": "12345"}, "active": True}


def _summary(name: str, compile_s: float, per_token_s: list[float], vocab: int) -> dict:
    per_token_s = sorted(per_token_s)
    return {"library": name, "vocab": vocab, "tokens": len(per_token_s),
            "compile_ms": compile_s * 1e3,
            "mask_us_mean": statistics.fmean(per_token_s) * 1e6,
            "mask_us_p50": per_token_s[len(per_token_s) // 2] * 1e6,
            "mask_us_p99": per_token_s[min(len(per_token_s) - 1, int(len(per_token_s) * 0.99))] * 1e6}


def measure_xgrammar(tokenizer, vocab: int, token_ids: list[int], repeats: int) -> dict:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    start = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(repeats):
        matcher = xgrammar.GrammarMatcher(compiled)
        for t in token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - start)
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")
    return _summary("xgrammar", compile_s, times, vocab)


def measure_llguidance(tokenizer, vocab: int, token_ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    first = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    if first.is_error():
        raise RuntimeError(first.get_error())
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(lltok, grammar)
        for t in token_ids:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - start)
            if not matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}: {matcher.get_error()}")
    return _summary("llguidance", compile_s, times, vocab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer")
    p.add_argument("--repeats", type=int, default=5, help="walks along the document")
    args = p.parse_args(argv)
    import torch

    from kvmesh.worker.loader import load_tokenizer

    torch.set_num_threads(1)
    tokenizer, _ = load_tokenizer(args.model)
    vocab = len(tokenizer)
    text = json.dumps(DOCUMENT)
    token_ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    for fn in (measure_xgrammar, measure_llguidance):
        try:
            print(json.dumps(fn(tokenizer, vocab, token_ids, args.repeats)))
        except ImportError as e:
            print(json.dumps({"library": fn.__name__.split("_", 1)[1], "error": repr(e)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
