#!/usr/bin/env bash
# GPU call (session 6, nvidia-h200-x2): does torch.compile of the layers' work outside attention
# (engine option torch_compile, worker/compile.py) help on top of CUDA graphs and the fused kernels?
# GPU 1: greedy tokens with torch_compile against the torch backend. GPU 0: offline flash_attn and
# latency triton, without and with, alternating. Carries .fa-tgz (the minimal flash-attn build).
source bench/gpu_env.sh
(CUDA_VISIBLE_DEVICES=1 T=400 step "greedy, triton and flash_attn, with and without torch_compile" \
   python3 -m pytest -q tests/gpu/test_greedy_qwen3.py -k "not flashinfer" -p no:cacheprovider -rA 2>&1 | tail -25 > $OUT/greedy.txt) &
export CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  for tc in "" "--torch-compile"; do
    name=offline_flash_attn${tc:+_compile}_$round
    T=150 step "$name" $K bench offline --attention-backend flash_attn $tc --json > $OUT/$name.json
    python3 bench/summarize.py $OUT/$name.json | cut -c1-300 | head -2
  done
done
for tc in "" "--torch-compile"; do
  name=latency_triton${tc:+_compile}
  T=120 step "$name" $K bench latency --attention-backend triton $tc --json > $OUT/$name.json
  cat $OUT/$name.json; echo
done
wait; cat $OUT/greedy.txt
