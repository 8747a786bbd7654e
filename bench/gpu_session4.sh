#!/usr/bin/env bash
# GPU call 4 (lead): async scheduling. Greedy test; flash_attn with nano-vllm in the same run, async
# on and off; flashinfer async; latency. Carries .whl-fi .whl-x .fa-bin .fi-cache (docs/PERF.md "Setup").
source bench/gpu_env.sh  # wheels, caches, PYTHONPATH, $OUT, $K, step()
T=100 step "offline flash_attn async + nano-vllm" $K bench offline --attention-backend flash_attn --peer nano-vllm --json > $OUT/offline_flash_attn_async.json
python3 bench/summarize.py $OUT/offline_flash_attn_async.json | cut -c1-400 | head -4
T=45 step "offline flash_attn sync" $K bench offline --attention-backend flash_attn --no-async-scheduling --json > $OUT/offline_flash_attn_sync.json
python3 bench/summarize.py $OUT/offline_flash_attn_sync.json | cut -c1-300 | head -2
T=80 step "greedy (async on by default on CUDA)" python3 -m pytest -q tests/gpu/test_greedy_qwen3.py -p no:cacheprovider -s 2>&1 | tail -12
T=50 step "offline flashinfer async" $K bench offline --attention-backend flashinfer --json > $OUT/offline_flashinfer_async.json
python3 bench/summarize.py $OUT/offline_flashinfer_async.json | cut -c1-300 | head -2
T=30 step "latency triton" $K bench latency --attention-backend triton --json > $OUT/latency_triton.json; cat $OUT/latency_triton.json | head -c 600
ls -la $OUT
