#!/usr/bin/env bash
# GPU call (nvidia-h200): what the serving path keeps of the engine's throughput on a decode-heavy
# load (docs/PERF.md "Serving cluster", decode-heavy): one replica, 768 requests of 100-1,024 random
# prompt tokens and 100-1,024 output tokens (ignore_eos), 256 in flight, streamed through Serve's
# HTTP proxy and through the ingress replicas' direct port, against `bench offline` on 768 prompts
# drawn the same way, with the same engine settings, plain and with --text-each-step (the engine's
# per-step detokenization, which serving does and plain offline does not). Carries .whl-ray .whl-s
# (the triton backend: no flash-attn build fits beside Ray in 64 MiB). ~5 min.
# DRY=1 runs the same steps on the CPU with a tiny model and small numbers (a rehearsal here).
source bench/gpu_env.sh
if [ -n "${DRY:-}" ]; then
  export PYTHONPATH=$PWD  # no flash-attn build here: transformers would try to import it
  MODEL=random:tiny-llama; GPUS=0; N=24; C=8; LEN="16,48"
  ENGINE="device: cpu, block_size: 16, max_num_seqs: 8, kv_cache_memory_bytes: 16777216"
  OFFLINE="--device cpu --max-num-seqs 8 --max-input-len 48 --min-len 16 --max-output-len 48"
else
  MODEL=random:qwen3-0.6b; GPUS=1; N=${N:-768}; C=${C:-256}; LEN="100,1024"
  ENGINE="device: cuda, attention_backend: triton, block_size: 16, max_num_seqs: 256, max_num_batched_tokens: 16384, kv_cache_memory_bytes: 42949672960"
  OFFLINE="--attention-backend triton --block-size 16 --max-num-seqs 256"
fi
cat > /tmp/decode.yaml <<YAML
model: $MODEL
engine: {$ENGINE}
replicas: {num_replicas: 1, num_gpus: $GPUS, num_cpus: 4, max_ongoing_requests: 512, max_queued_requests: -1}
routing: {ingress_replicas: 2}
server: {stream_interval: ${SI:-4}}
YAML
cat /tmp/decode.yaml
# a fresh machine compiles the Triton kernels on its first run (s30: 23.0 s cold against 18.9 s
# after): a short run first, untimed, so that the timed ones compare
T=120 step "warm-up (Triton's compile cache)" $K bench offline --model $MODEL $OFFLINE --num-prompts 32 --json > /dev/null
T=120 step "offline, $N prompts" $K bench offline --model $MODEL $OFFLINE --num-prompts $N --json > $OUT/decode_offline.json
T=120 step "offline, text each step" $K bench offline --model $MODEL $OFFLINE --num-prompts $N --text-each-step \
  --json > $OUT/decode_offline_text.json
B="python3 -m kvmesh.bench.serve --launch=/tmp/decode.yaml --policies kv_events --workload random
   --workload-opt prompt_tokens=($LEN) --workload-opt output_tokens=($LEN) --num-requests $N --concurrency $C --sample-s 0.5"
T=150 step "served through Serve's proxy" $B --json $OUT/decode_proxy.json
T=150 step "served through the direct port" $B --direct-http-port 8124 --json $OUT/decode_direct.json
# the plain offline run again after the served ones: how far the baseline moves within the call
T=120 step "offline again, $N prompts" $K bench offline --model $MODEL $OFFLINE --num-prompts $N --json > $OUT/decode_offline_again.json
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]


def offline_result(name):  # `bench offline --json` prints its result as the last JSON line
    return json.loads([l for l in open(f"{out}/{name}.json").read().splitlines() if l.startswith("{")][-1])


offline = offline_result("decode_offline")
print(f"offline: {offline['output_tok_per_s']:,.0f} output tok/s ({offline['num_prompts']} prompts, {offline['seconds']:.2f} s)")
try:
    again = offline_result("decode_offline_again")
    print(f"offline again, after the served runs: {again['output_tok_per_s']:,.0f} output tok/s ({again['seconds']:.2f} s)")
except (OSError, IndexError, KeyError) as e:
    print(f"offline again: no result ({e!r})")
try:
    text = offline_result("decode_offline_text")
    print(f"offline, text each step (the engine's incremental detokenizer, as serving): "
          f"{text['output_tok_per_s']:,.0f} output tok/s = {text['output_tok_per_s'] / offline['output_tok_per_s']:.0%}")
except (OSError, IndexError, KeyError) as e:
    print(f"offline, text each step: no result ({e!r})")
for name in ("proxy", "direct"):
    try:
        r = next(iter(json.load(open(f"{out}/decode_{name}.json"))["results"].values()))
    except (OSError, StopIteration, KeyError) as e:
        print(f"{name}: no result ({e!r})")
        continue
    print(f"{name}: {r['output_tokens_per_s']:,.0f} output tok/s = "
          f"{r['output_tokens_per_s'] / offline['output_tok_per_s']:.0%} of offline; TTFT p50 "
          f"{r['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms; {r['ok']} of {r['requests']} answered")
    for worker, v in r.get("sampled", {}).items():  # bench serve's summary of its --sample-s samples
        print(f"  worker {worker}: {v['stepping_share']:.0%} of the sampled span inside Engine.step, "
              f"step p50 {v['step_ms_p50']:.2f} ms, {v['running_mean']:.0f} running on average")
print(f"offline: {offline['steps']:,} steps, {offline['seconds'] / offline['steps'] * 1e3:.2f} ms each")
PY
