#!/usr/bin/env bash
# GPU call (nvidia-h200-x2), after bench/gpu_serve.sh: open-loop tenants at rates near round_robin's
# saturation (it reached 36.6 req/s closed loop; kv_events 40.4), same trace for both policies, and
# the 1-replica closed loop for the scaling efficiency (issue 8). Carries .whl-ray .whl-s .fa-tgz.
source bench/gpu_env.sh
MODEL=random:qwen3-0.6b
ENGINE="device: cuda, attention_backend: flash_attn, block_size: 256, max_num_seqs: 128, max_num_batched_tokens: 8192, kv_cache_memory_bytes: 21474836480"
for n in 1 2; do cat > /tmp/gpu$n.yaml <<YAML
model: $MODEL
engine: {$ENGINE}
replicas: {num_replicas: $n, num_gpus: 1, num_cpus: 4, max_ongoing_requests: 256, max_queued_requests: -1}
routing: {ingress_replicas: 2}
YAML
done
B="python3 -m kvmesh.bench.serve"
TEN_ARGS="--num-tenants 128 --system-tokens 4096 --suffix-tokens 64 512 --output-tokens 16 128"
for RATE in ${RATES:-36 40}; do
  T=200 step "tenants, 2 replicas, open loop $RATE req/s" $B --launch=/tmp/gpu2.yaml --policies kv_events,round_robin \
      --rate $RATE --num-requests 1200 $TEN_ARGS --seed 1 --json $OUT/serve_tenants_open_$RATE.json
done
T=150 step "tenants, 1 replica, closed loop 64" $B --launch=/tmp/gpu1.yaml --policies kv_events \
    --concurrency 64 --num-requests 600 $TEN_ARGS --json $OUT/serve_tenants_closed_1.json
