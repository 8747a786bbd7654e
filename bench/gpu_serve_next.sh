#!/usr/bin/env bash
# GPU call (nvidia-h200-x2): the tenants runs of
# bench/gpu_serve.sh and gpu_serve_sweep.sh again with larger streamed chunks (server.stream_interval,
# default here 4), with the CPU split of the cluster's processes and per-worker preemptions, to see
# (1) whether the ~45 req/s frontend ceiling moves, (2) what happens to kv_events at 40 req/s.
# ~9 min. Carries .whl-ray .whl-s .fa-tgz (docs/PERF.md "Setup").
source bench/gpu_env.sh
source bench/gpu_serve_config.sh
B="python3 -m kvmesh.bench.serve --cpu-split"
# most telling first: the open-loop rates (kv_events was worse at 40 req/s with stream_interval 1)
for RATE in ${RATES:-40}; do
  T=200 step "tenants, 2 replicas, open loop $RATE req/s, stream_interval $SI" $B --launch=/tmp/gpu2.yaml \
      --policies kv_events,round_robin --rate $RATE --num-requests 1200 $TEN --seed 1 --json $OUT/si${SI}_open$RATE.json
done
T=200 step "tenants, 2 replicas, closed loop 128, stream_interval $SI" $B --launch=/tmp/gpu2.yaml \
    --policies kv_events,round_robin --concurrency 128 --num-requests 1200 $TEN --json $OUT/si${SI}_closed2.json
[ -n "${SKIP_CLOSED1:-}" ] || T=100 step "tenants, 1 replica, closed loop 64, stream_interval $SI" $B --launch=/tmp/gpu1.yaml \
    --policies kv_events --concurrency 64 --num-requests 600 $TEN --json $OUT/si${SI}_closed1.json
