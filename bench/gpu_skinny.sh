#!/usr/bin/env bash
# GPU call (nvidia-h200): kernels/skinny_gemm.py, a decode GEMM that loads its weights while the
# kernel before it runs (docs/PERF.md "What limits it"). Parts, in order, any subset:
#   tests    tests/gpu/test_skinny_gemm_gpu.py and the fused kernels' GPU tests (~3 min)
#   kernels  bench/gpu_kernels.py --skinny: each GEMM after its feeding kernel, L2 flushed (~3 min)
#   offline  bench offline, alternating KVMESH_SKINNY_GEMM=0 / 1 (max rows 128) / 1 (max rows 256),
#            twice, after an untimed warm-up of each (~6 min)
# Run: bash bench/gpu_skinny.sh tests kernels   then   bash bench/gpu_skinny.sh offline
# carrying [".fa-tgz"] (flash-attn, built once from .fa-src).
source bench/gpu_env.sh
parts=${*:-tests kernels offline}
for part in $parts; do
  case $part in
    tests)
      T=400 step "GPU tests" python3 -m pytest -q -x tests/gpu/test_skinny_gemm_gpu.py tests/gpu/test_fused_kernels.py \
        2>&1 | tail -15 ;;
    kernels)
      T=400 step "kernel against cuBLAS" python3 bench/gpu_kernels.py --skinny "$OUT/skinny.json" ;;
    offline)
      O="$K bench offline --attention-backend flash_attn --step-times --json"
      for arm in "0 128" "1 128" "1 256"; do set -- $arm
        KVMESH_SKINNY_GEMM=$1 KVMESH_SKINNY_GEMM_MAX_ROWS=$2 T=120 step "warm-up $1 $2" $O --num-prompts 32 > /dev/null
      done
      for i in 1 2; do
        for arm in "0 128" "1 128" "1 256"; do set -- $arm
          KVMESH_SKINNY_GEMM=$1 KVMESH_SKINNY_GEMM_MAX_ROWS=$2 T=150 step "offline skinny=$1 rows=$2 run $i" \
            $O > "$OUT/offline_skinny$1_rows$2_$i.json"
        done
      done
      for f in "$OUT"/offline_skinny*.json; do echo "$(basename "$f"): $(python3 bench/summarize.py "$f" | head -3 | tr '\n' ' ')"; done ;;
  esac
done
