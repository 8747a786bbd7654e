#!/usr/bin/env bash
# GPU call 3: fused kernels + vectorised prepare; nano-vllm peer. Carries .whl-fi .whl-x .fa-bin .fi-cache.
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-fi/*.whl .whl-x/*.whl || exit 1
(cd /tmp && cat $OLDPWD/.fi-cache/fi_cache.tgz.* | tar xzf -) 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/.fa-bin
K="python3 -m kvmesh.cli"
step() { local t0=$(date +%s); echo "== $1"; shift; timeout ${T:-200} "$@"; echo "== rc $? in $(( $(date +%s) - t0 )) s"; }
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
