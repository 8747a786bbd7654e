#!/usr/bin/env bash
# GPU calls (nvidia-h200): the norm-and-GEMM kernels (kernels/norm_gemm.py; docs/PERF.md "What limits
# it", issue 17 point 5). Parts, in the order given (default: all three, more than one call's 10 min:
# run `tests` in one call, carrying .fa-src, and `kernels offline` in the next, carrying .fa-tgz):
#   tests    the kernels' GPU tests (greedy runs on flash_attn and triton) and the fused-kernel tests
#            beside them (~5-6 min, and ~2 min to build flash-attn from .fa-src, kept in $OUT/fa.tgz)
#   kernels  bench/gpu_kernels.py --norm-gemm: the launches they replace against one, tiles swept (~3 min)
#   offline  the offline run alternating, twice each after an untimed warm-up of each form (a fresh
#            machine's first run compiles Triton's kernels): separate launches
#            (KVMESH_NORM_GEMM_MAX_TOKENS=0), the norms joined to their GEMMs (=256,
#            KVMESH_NORM_GEMM_ROTATE=0), and the qkv launch also rotating and storing K / V (=256) (~4-5 min)
# Without flash-attn the offline runs use the triton backend.
# DRY=1 rehearses the offline part on the CPU with a tiny model (the switches do nothing there).
# Predicted: four launches fewer a layer (two norms, SiLU-and-mul, the rotation; ~3 us each with
# their gaps) against Triton GEMMs up to ~1 us slower than cuBLAS at 256 rows (s18): the decode fit's
# fixed part from ~1.46 to ~1.1-1.2 ms a step, the run 0.2-0.35 s shorter (0.72-0.74 of the floor).
source bench/gpu_env.sh
BACKEND=flash_attn
python3 -c "import flash_attn" 2>/dev/null || BACKEND=triton
ENGINE="--attention-backend $BACKEND"
if [ -n "${DRY:-}" ]; then
  export PYTHONPATH=$PWD
  ENGINE="--model random:tiny-llama --device cpu --max-num-seqs 8 --max-input-len 48 --min-len 16 --max-output-len 48"
fi
OFFLINE="$ENGINE --step-times --json${DRY:+ --num-prompts 32}"
for part in ${@:-tests kernels offline}; do
  case $part in
    tests)
      T=480 step "GPU tests: norm_gemm, fused kernels" python3 -m pytest -q tests/gpu/test_norm_gemm_gpu.py \
        tests/gpu/test_fused_kernels.py ;;
    kernels)
      T=300 step "kernels: separate launches against one" python3 bench/gpu_kernels.py --norm-gemm "$OUT/norm_gemm.json" ;;
    offline)
      arms=("0 1" "256 0" "256 1")  # KVMESH_NORM_GEMM_MAX_TOKENS, KVMESH_NORM_GEMM_ROTATE
      for arm in "${arms[@]}"; do
        set -- $arm
        KVMESH_NORM_GEMM_MAX_TOKENS=$1 KVMESH_NORM_GEMM_ROTATE=$2 T=90 step "warm-up $1 $2" \
          $K bench offline $ENGINE --num-prompts 64 > /dev/null
      done
      for i in 1 2; do
        for arm in "${arms[@]}"; do
          set -- $arm
          KVMESH_NORM_GEMM_MAX_TOKENS=$1 KVMESH_NORM_GEMM_ROTATE=$2 T=60 step "offline, tokens $1 rotate $2 ($i)" \
            $K bench offline $OFFLINE > "$OUT/offline_ng$1_rot$2_$i.json"
        done
      done
      echo "== summary ($BACKEND)"
      python3 bench/summarize.py "$OUT"/offline_ng*.json ;;
    *) echo "unknown part $part (tests, kernels, offline)" >&2; exit 2 ;;
  esac
done
