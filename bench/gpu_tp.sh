#!/usr/bin/env bash
# GPU call (nvidia-h200-x2; issue 17 point 1): tensor parallelism on 2 GPUs. The GPU test (TP=2
# greedy vs TP=1 on a Qwen3-8B-shaped model, tests/gpu/test_tensor_parallel_gpu.py), then TP=1 vs
# TP=2 throughput on nano-vllm's workload and TPOT at concurrency 1, on the same shape. Carries
# nothing (the triton backend); add .whl-fi for flashinfer.
source bench/gpu_env.sh
T=590 step "TP=2 vs TP=1 greedy (CUDA graphs, eager)" \
  python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tensor_parallel_gpu.py 2>&1 | tail -20
for tp in 1 2; do
  T=400 step "offline qwen3-8b tp=$tp" $K bench offline --model random:qwen3-8b --tensor-parallel-size $tp \
    --attention-backend triton --json > $OUT/offline_8b_tp$tp.json
  python3 bench/summarize.py $OUT/offline_8b_tp$tp.json | cut -c1-300 | head -2
  T=300 step "latency qwen3-8b tp=$tp" $K bench latency --model random:qwen3-8b --tensor-parallel-size $tp \
    --attention-backend triton --json > $OUT/latency_8b_tp$tp.json
  cat $OUT/latency_8b_tp$tp.json; echo
done
