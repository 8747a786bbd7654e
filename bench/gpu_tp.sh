#!/usr/bin/env bash
# GPU calls (nvidia-h200-x2; issue 17 point 1): tensor parallelism on 2 GPUs, in two calls of
# under 10 minutes each:
#   bash bench/gpu_tp.sh test    TP=2 vs TP=1 greedy on a Qwen3-8B-shaped model, CUDA graphs and
#                                eager (tests/gpu/test_tensor_parallel_gpu.py)
#   bash bench/gpu_tp.sh bench   TP=1 vs TP=2 on the same shape: nano-vllm's workload (output tok/s;
#                                the floor printed is one GPU's) and TPOT at concurrency 1
# Carries nothing (the triton backend); add .whl-fi and BACKEND=flashinfer for flashinfer.
source bench/gpu_env.sh
BACKEND=${BACKEND:-triton}
case "${1:-test}" in
  test)
    T=590 step "TP=2 vs TP=1 greedy (CUDA graphs, eager)" \
      python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tensor_parallel_gpu.py 2>&1 | tail -20 ;;
  bench)
    for tp in 1 2; do
      T=200 step "offline qwen3-8b tp=$tp" $K bench offline --model random:qwen3-8b --tensor-parallel-size $tp \
        --attention-backend $BACKEND --json > $OUT/offline_8b_tp$tp.json
      python3 bench/summarize.py $OUT/offline_8b_tp$tp.json | cut -c1-300 | head -2
      T=90 step "latency qwen3-8b tp=$tp" $K bench latency --model random:qwen3-8b --tensor-parallel-size $tp \
        --attention-backend $BACKEND --json > $OUT/latency_8b_tp$tp.json
      cat $OUT/latency_8b_tp$tp.json; echo
    done ;;
esac
