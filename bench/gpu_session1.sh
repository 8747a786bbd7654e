#!/usr/bin/env bash
# GPU call 1: kernel/backends correctness (tests/gpu) and kernel timings; carries .whl-fi .whl-x .fa-src.
# Writes logs under $OUT and the built flash-attn + flashinfer JIT caches for later calls.
source bench/gpu_env.sh  # wheels, caches, PYTHONPATH, $OUT, $K, step()
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
(python3 .fa-src/build.py .fa-src > /tmp/fa_path 2> /tmp/fa_build.log) & FA=$!
t0=$(date +%s)
timeout 240 python3 -m pytest -q -x tests/gpu -k "triton" -p no:cacheprovider 2>&1 | tail -25 > $OUT/test_triton.log
echo "triton tests $(( $(date +%s) - t0 )) s"; tail -3 $OUT/test_triton.log
wait $FA; cat /tmp/fa_build.log | tail -3; export PYTHONPATH=$PYTHONPATH:$(tail -1 /tmp/fa_path)
t0=$(date +%s)
timeout 330 python3 -m pytest -q tests/gpu -k "flashinfer or flash_attn" -p no:cacheprovider 2>&1 | tail -40 > $OUT/test_fi_fa.log
echo "fi/fa tests $(( $(date +%s) - t0 )) s"; tail -5 $OUT/test_fi_fa.log
timeout 120 python3 bench/gpu_kernels.py $OUT/kernels.json 2>&1 | tail -40
(cd /tmp && tar czf $OUT/fa_build.tgz fa-build/*.so 2>/dev/null; tar czf - fi | split -b 15m - $OUT/fi_cache.tgz.)
ls -la $OUT; du -sh /tmp/fi
