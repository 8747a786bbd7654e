#!/usr/bin/env bash
# GPU call (nvidia-h200-x2): the serving cluster, 2 GPU replicas of the Qwen3-0.6B shape (random
# weights, flash_attn, block 256), `kvmesh bench serve` on the tenants workload, kv_events against
# round_robin: first closed loop (saturation throughput of each policy), then open loop at 80% of
# round_robin's saturated request rate, the same trace for both. Carries .whl-ray .whl-s .fa-tgz.
#   PART=scaling: the 1-replica runs and multiturn (issue 8) instead.
# DRY=1 runs the same steps on the CPU with a tiny model and small numbers (a rehearsal here).
source bench/gpu_env.sh
PART=${PART:-tenants}
python3 -c "import ray, torch; print('ray', ray.__version__, 'gpus', torch.cuda.device_count())" || exit 1
if [ -n "${DRY:-}" ]; then
  export PYTHONPATH=$PWD  # no flash-attn build here: transformers would try to import it
  MODEL=random:tiny-llama ENGINE="device: cpu, block_size: 16, max_num_seqs: 16, kv_cache_memory_bytes: 4194304"
  GPUS=0 CPUS=1 N=24 C=8 SYS=256 TEN=8 SUF="16 64" OUTT="8 16" MT="system_tokens=64 first_message_tokens=(32,64) message_tokens=(16,32) output_tokens=(4,8) turns=(2,3) think_time_s=0.2"
else
  MODEL=random:qwen3-0.6b
  ENGINE="device: cuda, attention_backend: flash_attn, block_size: 256, max_num_seqs: 128, max_num_batched_tokens: 8192, kv_cache_memory_bytes: 21474836480"
  GPUS=1 CPUS=4 N=1200 C=128 SYS=4096 TEN=128 SUF="64 512" OUTT="16 128" MT="turns=(2,6) think_time_s=0.5 output_tokens=(32,256)"
fi
config() {  # config FILE REPLICAS
  cat > "$1" <<YAML
model: $MODEL
engine: {$ENGINE}
replicas: {num_replicas: $2, num_gpus: $GPUS, num_cpus: $CPUS, max_ongoing_requests: 256, max_queued_requests: -1}
routing: {ingress_replicas: 2}
YAML
}
config /tmp/gpu2.yaml 2; config /tmp/gpu1.yaml 1; cat /tmp/gpu2.yaml
B="python3 -m kvmesh.bench.serve"
TEN_ARGS="--num-tenants $TEN --system-tokens $SYS --suffix-tokens $SUF --output-tokens $OUTT"
MT_ARGS=$(for o in $MT; do printf -- "--workload-opt %s " "$o"; done)
if [ "$PART" = tenants ]; then
  T=250 step "tenants, 2 replicas, closed loop $C" $B --launch=/tmp/gpu2.yaml --policies kv_events,round_robin \
      --concurrency $C --num-requests $N $TEN_ARGS --json $OUT/serve_tenants_closed.json
  RATE=$(python3 -c "import json; r=json.load(open('$OUT/serve_tenants_closed.json'))['results']; print(round(0.8*min(v['requests_per_s'] for v in r.values()), 1))")
  echo "open-loop rate: $RATE req/s"
  T=280 step "tenants, 2 replicas, open loop $RATE req/s" $B --launch=/tmp/gpu2.yaml --policies kv_events,round_robin \
      --rate $RATE --num-requests $N $TEN_ARGS --seed 1 --json $OUT/serve_tenants_open.json
else
  T=150 step "tenants, 1 replica, closed loop $((C/2))" $B --launch=/tmp/gpu1.yaml --policies kv_events \
      --concurrency $((C/2)) --num-requests $((N/2)) $TEN_ARGS --json $OUT/serve_tenants_closed_1.json
  T=200 step "multiturn, 1 replica, closed loop $((C/2))" $B --launch=/tmp/gpu1.yaml --policies kv_events \
      --workload multiturn $MT_ARGS --concurrency $((C/2)) --num-requests $((N/2)) --json $OUT/serve_multiturn_closed_1.json
  T=300 step "multiturn, 2 replicas, closed loop $C" $B --launch=/tmp/gpu2.yaml --policies kv_events,round_robin \
      --workload multiturn $MT_ARGS --concurrency $C --num-requests $N --json $OUT/serve_multiturn_closed.json
fi
ls -la $OUT
