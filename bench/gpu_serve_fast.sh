#!/usr/bin/env bash
# GPU call (session 6, nvidia-h200-x2): the tenants runs with Ray Serve's throughput-optimized mode
# (now the default of a local `kvmesh serve`, cluster/launcher.py) and server.stream_interval 4:
# an open-loop sweep of offered rates per policy (one cluster per policy, rates in increasing order),
# the closed loop on 2 replicas and on 1 (scaling). ~8 min. Carries .whl-ray .whl-s .fa-tgz.
# Knobs: SEED (trace seed, default 1), RATES, DIRECT (a port: use the direct HTTP port), SWEEP_ONLY=1.
source bench/gpu_env.sh
source bench/gpu_serve_config.sh
# DIRECT=8124: send the requests to the ingress replicas' own port (server.direct_http_port)
B="python3 -m kvmesh.bench.serve --cpu-split --sample-s 1${DIRECT:+ --direct-http-port $DIRECT}"
T=330 step "tenants, 2 replicas, open-loop sweep ${RATES:-40 52 64 76} req/s" $B --launch=/tmp/gpu2.yaml \
    --policies kv_events,round_robin --rate ${RATES:-40 52 64 76} --num-requests 1200 $TEN --seed ${SEED:-1} \
    --plot $OUT/fast_sweep${SEED:+_seed$SEED}${DIRECT:+_direct}.png --json $OUT/fast_sweep${SEED:+_seed$SEED}${DIRECT:+_direct}.json
[ -n "${SWEEP_ONLY:-}" ] && exit 0
T=150 step "tenants, 2 replicas, closed loop 128" $B --launch=/tmp/gpu2.yaml \
    --policies kv_events,round_robin --concurrency 128 --num-requests 1200 $TEN --json $OUT/fast_closed2.json
T=80 step "tenants, 1 replica, closed loop 64" $B --launch=/tmp/gpu1.yaml \
    --policies kv_events --concurrency 64 --num-requests 600 $TEN --json $OUT/fast_closed1.json
