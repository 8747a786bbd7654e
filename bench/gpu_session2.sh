#!/usr/bin/env bash
# GPU call 2: engine benchmarks. Carries .whl-fi .whl-x .fa-bin .fi-cache (see docs/PERF.md).
source bench/gpu_env.sh  # wheels, caches, PYTHONPATH, $OUT, $K, step()
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import flash_attn, flashinfer; print('flash_attn', flash_attn.__version__, 'flashinfer', flashinfer.__version__)"
T=150 step "flashinfer prefill tests" python3 -m pytest -q -x tests/gpu/test_attention_backends.py -k "flashinfer and (prefill or mixed)" -p no:cacheprovider 2>&1 | tail -4
T=150 step "offline triton" $K bench offline --attention-backend triton --profile-step 600 --json > $OUT/offline_triton.json; python3 bench/summarize.py $OUT/offline_triton.json
T=150 step "offline flashinfer" $K bench offline --attention-backend flashinfer --profile-step 600 --json > $OUT/offline_flashinfer.json; python3 bench/summarize.py $OUT/offline_flashinfer.json
T=60 step "latency triton" $K bench latency --attention-backend triton
T=60 step "latency flashinfer" $K bench latency --attention-backend flashinfer
T=120 step "greedy" python3 -m pytest -q -x tests/gpu/test_greedy_qwen3.py -p no:cacheprovider -s 2>&1 | tail -8
T=90 step "kernels" python3 bench/gpu_kernels.py $OUT/kernels.json
(cd /tmp && tar czf - fi | split -b 15m - $OUT/fi_cache.tgz.)
ls -la $OUT
