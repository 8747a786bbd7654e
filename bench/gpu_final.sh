#!/usr/bin/env bash
# One GPU call (~4-5 min) not yet run: the corrected greedy test, then flash_attn (block 256) and
# flashinfer at block 256 with nano-vllm in the same run. Carry .whl-fi .whl-x .fa-bin .fi-cache
# (see docs/PERF.md "Setup").
source bench/gpu_env.sh  # wheels, caches, PYTHONPATH, $OUT, $K, step()
T=90 step "greedy" python3 -m pytest -q tests/gpu/test_greedy_qwen3.py -p no:cacheprovider -s 2>&1 | tail -12
T=200 step "offline flash_attn + nano-vllm" $K bench offline --attention-backend flash_attn --peer nano-vllm --json > $OUT/offline_flash_attn.json
python3 bench/summarize.py $OUT/offline_flash_attn.json | cut -c1-400 | head -3
T=100 step "offline flashinfer block 256" $K bench offline --attention-backend flashinfer --block-size 256 --json > $OUT/offline_flashinfer_256.json
python3 bench/summarize.py $OUT/offline_flashinfer_256.json | cut -c1-300 | head -2
