#!/usr/bin/env bash
# GPU calls (nvidia-h200-x2; issue 17 point 1): tensor parallelism on 2 GPUs, in calls of under
# 10 minutes each (each rank draws the 8B model's random weights on its CPU: ~1-2 min per engine):
#   bash bench/gpu_tp.sh test    TP=2 vs TP=1 greedy on a Qwen3-8B-shaped model, under CUDA graphs
#                                (the all-reduce captured; tests/gpu/test_tensor_parallel_gpu.py)
#   bash bench/gpu_tp.sh eager   the same without CUDA graphs (tells a capture problem from a TP one)
#   bash bench/gpu_tp.sh bench 1, then bench 2: TP=1 and TP=2 on the same shape: nano-vllm's
#                                workload (output tok/s; the floor printed is one GPU's) and TPOT at
#                                concurrency 1
# Carries nothing (the triton backend); add .whl-fi and BACKEND=flashinfer for flashinfer.
source bench/gpu_env.sh
BACKEND=${BACKEND:-triton}
case "${1:-test}" in
  test|eager)
    [ "$1" = eager ] && K_EXPR=eager || K_EXPR=graphs
    T=590 step "TP=2 vs TP=1 greedy ($1)" \
      python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tensor_parallel_gpu.py -k "$K_EXPR" 2>&1 | tail -20 ;;
  bench)
    for tp in ${2:-1}; do
      T=330 step "offline qwen3-8b tp=$tp" $K bench offline --model random:qwen3-8b --tensor-parallel-size $tp \
        --attention-backend $BACKEND --json > $OUT/offline_8b_tp$tp.json
      python3 bench/summarize.py $OUT/offline_8b_tp$tp.json | cut -c1-300 | head -2
      T=180 step "latency qwen3-8b tp=$tp" $K bench latency --model random:qwen3-8b --tensor-parallel-size $tp \
        --attention-backend $BACKEND --json > $OUT/latency_8b_tp$tp.json
      cat $OUT/latency_8b_tp$tp.json; echo
    done ;;
esac
