# Sourced at the start of every GPU call (bash bench/gpu_*.sh): installs what the call carried and
# sets the environment. Carried folders, each optional (docs/PERF.md "Setup"):
#   .whl-ray  Ray + Serve wheels       (../shared/device/wheels.sh ray .whl-ray)
#   .whl-fi   flashinfer wheels        (../shared/device/wheels.sh flashinfer .whl-fi)
#   .whl-x    xxhash, httptools, nano-vllm-fork, and xgrammar with pydantic for the grammar tests
#             (EXTRA="xxhash httptools nano-vllm-fork xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5
#              annotated-types==0.8.0 typing-inspection==0.4.5" ../shared/device/wheels.sh extra .whl-x)
#   .whl-s    beside .whl-ray for serving: what the ingress and workers import that the device lacks
#             (EXTRA="xxhash httptools grpcio-health-checking==1.85.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2" ../shared/device/wheels.sh extra .whl-s)
#   .fa-bin   the minimal flash-attn build, or .fa-tgz/fa.tgz (the same, gzipped, to fit beside Ray)
#   .fi-cache flashinfer's JIT cache
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi MAX_JOBS=16
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device/KINDS.md
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
_wheels=$(ls .whl-ray/*.whl .whl-s/*.whl .whl-fi/*.whl .whl-x/*.whl 2>/dev/null)
if [ -n "$_wheels" ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $_wheels || exit 1
fi
[ -f .fa-tgz/fa.tgz ] && tar xzf .fa-tgz/fa.tgz -C /tmp
[ -d .fi-cache ] && (cd /tmp && cat "$OLDPWD"/.fi-cache/fi_cache.tgz.* | tar xzf -) 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$PWD/.fa-bin:/tmp/fab  # .fa-tgz/fa.tgz unpacks to /tmp/fab
if [ -d .fa-src ] && [ ! -d /tmp/fab/flash_attn ]; then  # build flash-attn here once, keep it in $OUT
  _fa=$(python3 .fa-src/build.py .fa-src) && mkdir -p /tmp/fab && cp "${_fa%%:*}"/flash_attn_2_cuda*.so /tmp/fab/ \
    && cp -r .fa-src/flash_attn /tmp/fab/ && tar czf "$OUT/fa.tgz" -C /tmp fab
fi
K="python3 -m kvmesh.cli"
# step NAME CMD...: run CMD under `timeout $T` (default 200 s), print its exit status and seconds
step() { local t0=$(date +%s); echo "== $1" >&2; shift; timeout "${T:-200}" "$@"; echo "== rc $? in $(( $(date +%s) - t0 )) s" >&2; }  # status on stderr: stdout may be a JSON file
