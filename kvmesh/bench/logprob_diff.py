"""`kvmesh bench logprob-diff A B`: how far two `kvmesh bench offline --logprobs-out` files are apart,
token by token (e.g. bf16 against FP8 weights or an FP8 KV cache on the same prompts)."""

import json


def add_arguments(p) -> None:
    p.add_argument("a", help="a --logprobs-out file (the reference, e.g. bf16)")
    p.add_argument("b", help="another, of the same model and prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line")


def compare(a: dict, b: dict) -> dict:
    """max / mean / p99 of |logprob_a - logprob_b| over every scored prompt token; a ValueError when
    the two files did not score the same prompts of the same model."""
    if a["model"] != b["model"] or a["prompt_lengths"] != b["prompt_lengths"]:
        raise ValueError(f"the files scored different runs: model {a['model']} / {b['model']}, "
                         f"{len(a['prompt_lengths'])} / {len(b['prompt_lengths'])} prompts")
    diffs = sorted(abs(x - y) for xs, ys in zip(a["prompt_logprobs"], b["prompt_logprobs"]) for x, y in zip(xs, ys))
    if not diffs:
        raise ValueError("the files hold no scored tokens")
    side = {k: (a[k], b[k]) for k in ("attention_backend", "kv_cache_dtype", "quantization")}
    return {"model": a["model"], "prompts": len(a["prompt_lengths"]), "tokens": len(diffs),
            "max_abs_diff": diffs[-1], "mean_abs_diff": sum(diffs) / len(diffs),
            "p99_abs_diff": diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))], "runs": side}


def run(args) -> int:
    with open(args.a) as f, open(args.b) as g:
        result = compare(json.load(f), json.load(g))
    if args.json:
        print(json.dumps(result))
    else:
        runs = ", ".join(f"{k} {x} / {y}" for k, (x, y) in result["runs"].items() if x != y) or "same settings"
        print(f"{result['model']}: {result['tokens']} prompt tokens of {result['prompts']} prompts ({runs}): "
              f"|logprob difference| max {result['max_abs_diff']:.4f}, p99 {result['p99_abs_diff']:.4f}, "
              f"mean {result['mean_abs_diff']:.4f} nats")
    return 0
