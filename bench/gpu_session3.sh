#!/usr/bin/env bash
# GPU call 3: fused kernels + vectorised prepare; nano-vllm peer. Carries .whl-fi .whl-x .fa-bin .fi-cache.
source bench/gpu_env.sh  # wheels, caches, PYTHONPATH, $OUT, $K, step()
T=150 step "offline triton" $K bench offline --attention-backend triton --profile-step 600 --profile-trace $OUT/trace_triton.json --json > $OUT/offline_triton.json
python3 bench/summarize.py $OUT/offline_triton.json | cut -c1-250 | head -30
T=240 step "offline flashinfer + nano-vllm" $K bench offline --attention-backend flashinfer --peer nano-vllm --json > $OUT/offline_flashinfer.json
python3 bench/summarize.py $OUT/offline_flashinfer.json | cut -c1-400 | head -4
T=60 step "latency triton" $K bench latency --attention-backend triton
T=60 step "latency flashinfer" $K bench latency --attention-backend flashinfer
T=90 step "greedy + fused kernel tests" python3 -m pytest -q tests/gpu/test_fused_kernels.py tests/gpu/test_greedy_qwen3.py -p no:cacheprovider -s 2>&1 | tail -12
T=100 step "offline flash_attn" $K bench offline --attention-backend flash_attn --json > $OUT/offline_flash_attn.json
python3 bench/summarize.py $OUT/offline_flash_attn.json | cut -c1-250 | head -2
gzip -f $OUT/trace_triton.json; ls -la $OUT
