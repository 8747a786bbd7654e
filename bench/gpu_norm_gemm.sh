#!/usr/bin/env bash
# GPU call (nvidia-h200): the norm-and-GEMM kernel (kernels/norm_gemm.py; docs/PERF.md "What limits
# it", issue 17 point 5). In order: its GPU tests and the fused-kernel tests beside it; its time
# against the launches it replaces (bench/gpu_kernels.py --norm-gemm: the shipped tiles and a sweep);
# then the offline run alternating KVMESH_NORM_GEMM_MAX_TOKENS=256 with 0, twice each, after an
# untimed warm-up (a fresh machine's first run compiles Triton's kernels). Carries .fa-src (built
# here, ~2 min, kept in $OUT/fa.tgz for the next call: carry .fa-tgz then) or .fa-tgz; without
# flash-attn the offline runs use the triton backend. ~9 min with the build, ~7 without.
# Predicted: two norm launches and the SiLU launch fewer a layer (3 x ~3 us with their gaps) against
# a Triton GEMM ~1 us slower than cuBLAS at 256 rows (s18): the decode fit's fixed part 1.45-1.5 ms
# down to ~1.25-1.3 ms a step, the run ~0.15-0.25 s shorter.
source bench/gpu_env.sh
BACKEND=flash_attn
python3 -c "import flash_attn" 2>/dev/null || BACKEND=triton
OFFLINE="--attention-backend $BACKEND --step-times --json"
T=400 step "GPU tests: norm_gemm, fused kernels" python3 -m pytest -q -x tests/gpu/test_norm_gemm_gpu.py \
  tests/gpu/test_fused_kernels.py
T=300 step "kernel: separate launches against one" python3 bench/gpu_kernels.py --norm-gemm "$OUT/norm_gemm.json"
T=120 step "warm-up (Triton's compile cache), both forms" bash -c \
  "$K bench offline --attention-backend $BACKEND --num-prompts 64 > /dev/null && \
   KVMESH_NORM_GEMM_MAX_TOKENS=256 $K bench offline --attention-backend $BACKEND --num-prompts 64 > /dev/null"
for i in 1 2; do
  T=60 step "offline, separate launches ($i)" $K bench offline $OFFLINE > "$OUT/offline_norm_gemm0_$i.json"
  KVMESH_NORM_GEMM_MAX_TOKENS=256 T=60 step "offline, norm + GEMM in one launch ($i)" \
    $K bench offline $OFFLINE > "$OUT/offline_norm_gemm256_$i.json"
done
echo "== summary ($BACKEND)"
python3 bench/summarize.py "$OUT"/offline_norm_gemm*.json
