#!/usr/bin/env bash
# One GPU call of the checks issue 17 asks for (nvidia-h200; carry .whl-fi .whl-x .fi-cache):
#   bash bench/gpu_check.sh tests     every test in tests/gpu, the least-verified first (greedy per
#                                     backend, FP8 weights, FP8 KV), a per-test log in $OUT/gpu_tests.log
#                                     and a count of outcomes last; flashinfer's JIT cache saved to $OUT
#   bash bench/gpu_check.sh offline   nano-vllm's workload, one run at a time: triton and flashinfer,
#                                     bf16 / FP8 KV / FP8 weights (RUNS="backend kv weights;..." picks);
#                                     a summary line per run and its logprob difference against bf16;
#                                     MODEL=... another model, ARGS="..." more options for every run,
#                                     TAG=name keeps the runs in $OUT/name (one tag per model)
# Carrying .fa-src (../shared/device/flash_attn_src.sh) builds flash-attn first (~100 s) and saves the
# build as $OUT/fa.tgz, which a later call carries as .fa-tgz/fa.tgz instead.
source bench/gpu_env.sh
nvidia-smi -L >&2
case "${1:-tests}" in
  tests)
    T=${T:-540} step "tests/gpu" python3 -m pytest -v -s -rA -p no:cacheprovider --durations=25 \
      ${TESTS:-tests/gpu/test_greedy_qwen3.py tests/gpu/test_fp8_weights_gpu.py tests/gpu/test_fp8_kv_cache_gpu.py \
      tests/gpu/test_fused_sampler.py tests/gpu/test_fused_moe_gpu.py tests/gpu/test_attention_backends.py \
      tests/gpu/test_fused_kernels.py tests/gpu/test_grammar_mask_gpu.py tests/gpu/test_parallel_sampling_gpu.py \
      tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_sampler_masks_gpu.py} > $OUT/gpu_tests.log 2>&1
    (cd /tmp && tar czf $OUT/fi_cache.tgz fi 2>/dev/null)
    grep -E "^(FAILED|ERROR)|fp8 vs bf16|diverges|max \|" $OUT/gpu_tests.log | cut -c1-300 | head -40
    grep -E "slowest|^[0-9.]+s (call|setup)" $OUT/gpu_tests.log | head -26
    tail -3 $OUT/gpu_tests.log
    echo "outcomes: $(grep -cE ' PASSED' $OUT/gpu_tests.log) passed, $(grep -cE ' FAILED' $OUT/gpu_tests.log) failed," \
         "$(grep -cE ' SKIPPED' $OUT/gpu_tests.log) skipped, $(grep -cE ' ERROR' $OUT/gpu_tests.log) errors" ;;
  offline)  # each run also scores the first 32 prompts for `bench logprob-diff` against bf16
    [ -n "${TAG:-}" ] && OUT=$OUT/$TAG && mkdir -p $OUT
    IFS=';' read -ra runs <<< "${RUNS:-triton auto -;flashinfer auto -;flashinfer fp8 -;flashinfer auto fp8}"
    for run in "${runs[@]}"; do
      set -- $run; q=(); [ "$3" = fp8 ] && q=(--quantization fp8)
      name=offline_$1_kv$2_w$3
      T=${T:-150} step "$name" $K bench offline --model ${MODEL:-random:qwen3-0.6b} --attention-backend $1 \
        --kv-cache-dtype $2 "${q[@]}" ${ARGS:-} \
        --logprobs-out $OUT/$name.logprobs.json --json > $OUT/$name.json
    done
    for f in $OUT/offline_*kv*_w*.json; do
      case $f in *.logprobs.json) continue;; esac
      echo "$(basename $f): $(python3 bench/summarize.py $f | cut -d: -f2- | cut -c1-230 | head -1)"
      python3 bench/summarize.py $f | grep "window of" | cut -c1-700
      base=$(echo "$f" | sed 's/_kv[^_]*_w[^_]*\.json$/_kvauto_w-.logprobs.json/')
      [ -f "$base" ] && [ "$base" != "${f%.json}.logprobs.json" ] && $K bench logprob-diff "$base" "${f%.json}.logprobs.json"
    done ;;
esac
