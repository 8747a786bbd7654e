#!/usr/bin/env bash
# GPU call (lead, session 5): greedy tokens of every backend against torch on GPU 0 while GPU 1 runs
# the offline benchmark with flashinfer and triton (async scheduling on). Carries .whl-fi .whl-x .fi-cache
# (and the flash-attn build left by the serve calls in /tmp/.fa-bin, or .fa-bin).
source bench/gpu_env.sh
(CUDA_VISIBLE_DEVICES=0 T=330 step "greedy, every backend" python3 -m pytest -q tests/gpu/test_greedy_qwen3.py -p no:cacheprovider -rA 2>&1 | tail -25 > $OUT/greedy.txt) &
export CUDA_VISIBLE_DEVICES=1
T=150 step "offline flashinfer async" $K bench offline --attention-backend flashinfer --json > $OUT/offline_flashinfer_async.json
python3 bench/summarize.py $OUT/offline_flashinfer_async.json | cut -c1-300 | head -2
T=90 step "offline triton async" $K bench offline --attention-backend triton --json > $OUT/offline_triton_async.json
python3 bench/summarize.py $OUT/offline_triton_async.json | cut -c1-300 | head -2
wait; cat $OUT/greedy.txt
