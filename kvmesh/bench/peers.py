"""Peers for `kvmesh bench offline --peer`: nano-vllm (PyPI nano-vllm-fork, needs flash-attn) and
transformers' own continuous batching (`generate_batch`, paged|sdpa), each run on the same workload
in a child process (so each finds the GPU's memory free) on a Qwen3-0.6B-shaped directory of
random bf16 weights that this module writes once.

Child: python -m kvmesh.bench.peers NAME WORKLOAD.json MODEL_DIR -> one JSON line on stdout.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

PEER_PRESET = "qwen3-0.6b"


def write_random_model_dir(path: str, preset: str = PEER_PRESET, seed: int = 0) -> str:
    """config.json + model.safetensors (random bf16) + a tokenizer over the whole vocab."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from kvmesh.worker.presets import build_byte_tokenizer, hf_config_for

    config = hf_config_for(preset)
    config.dtype = torch.bfloat16  # saved as "dtype"; nano-vllm reads it back as torch_dtype
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    build_byte_tokenizer(config.vocab_size).save_pretrained(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def run_peer(name: str, workload, args) -> dict:
    """Run a peer in a child process; returns its measurements or {"error": ...}. The peer gets the
    benchmark's model shape when that is a `random:` preset (random weights of its own), else
    Qwen3-0.6B's."""
    model = getattr(args, "model", "") or ""
    preset = model.split(":", 1)[1] if model.startswith("random:") else PEER_PRESET
    model_dir = os.environ.get("KVMESH_PEER_MODEL_DIR",
                               os.path.join(tempfile.gettempdir(), f"kvmesh-peer-{preset}"))
    write_random_model_dir(model_dir, preset)
    from kvmesh.worker.presets import hf_config_for
    prompts, max_tokens = workload.prompts_for_vocab(hf_config_for(preset).vocab_size), workload.max_tokens
    if name == "transformers" and args.peer_num_prompts:
        prompts, max_tokens = prompts[:args.peer_num_prompts], max_tokens[:args.peer_num_prompts]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": max_tokens, "temperature": workload.temperature}, f)
        spec = f.name
    print(f"running peer {name} on {len(prompts)} prompts ...", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "kvmesh.bench.peers", name, spec, model_dir],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.unlink(spec)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip()[-1500:] or "no output"}
    return json.loads(lines[-1])


def _nano_vllm(spec: dict, model_dir: str) -> dict:
    import nanovllm.models.qwen3 as qwen3

    original = qwen3.get_rope

    def get_rope(*a, **k):  # transformers 5 reports the default rope as a dict; nano-vllm asserts None
        k["rope_scaling"] = None
        return original(*a, **k)

    qwen3.get_rope = get_rope
    from nanovllm import LLM, SamplingParams

    llm = LLM(model_dir, enforce_eager=False, max_model_len=4096)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # nano-vllm's own warm-up
    params = [SamplingParams(temperature=spec["temperature"], ignore_eos=True, max_tokens=m) for m in spec["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(spec["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return _result("nano-vllm", spec, seconds, sum(len(o["token_ids"]) for o in outs))


def _transformers(spec: dict, model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="paged|sdpa").to("cuda" if cuda else "cpu").eval()
    # generate_batch takes one generation config for all prompts: each gets the workload's mean
    # max_tokens (the same total within rounding); throughput counts the tokens actually made.
    mean_tokens = round(sum(spec["max_tokens"]) / len(spec["max_tokens"]))
    config = GenerationConfig(max_new_tokens=mean_tokens, do_sample=True, temperature=spec["temperature"],
                              eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[spec["prompts"][0][:16]], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0))
    start = time.perf_counter()
    outs = model.generate_batch(inputs=spec["prompts"], generation_config=config)
    seconds = time.perf_counter() - start
    made = sum(len(o.generated_tokens) for o in outs.values())
    if not made:  # generate_batch reports a failed request as an empty one
        raise RuntimeError(f"transformers generate_batch produced no tokens for {len(outs)} requests")
    return _result("transformers generate_batch (paged|sdpa)", spec, seconds, made, mean_tokens)


def _result(engine, spec, seconds, output_tokens, max_tokens_each=None) -> dict:
    prompt_tokens = sum(len(p) for p in spec["prompts"])
    out = {"engine": engine, "num_prompts": len(spec["prompts"]), "seconds": seconds, "output_tokens": output_tokens,
           "output_tok_per_s": output_tokens / seconds, "total_tok_per_s": (output_tokens + prompt_tokens) / seconds}
    if max_tokens_each is not None:
        out["max_tokens_each"] = max_tokens_each
    return out


if __name__ == "__main__":
    peer, spec_path, model_dir = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    fn = {"nano-vllm": _nano_vllm, "transformers": _transformers}[peer]
    print(json.dumps(fn(spec, model_dir)), flush=True)
