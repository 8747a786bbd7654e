# Sourced by the GPU serving calls after bench/gpu_env.sh: writes /tmp/gpu1.yaml and /tmp/gpu2.yaml
# (1 and 2 H200 replicas of the Qwen3-0.6B shape, flash_attn block 256, a 20 GiB KV pool each, two
# ingress replicas, stream_interval $SI, default 4) and sets TEN, the tenants workload's flags
# (docs/PERF.md "Serving cluster").
SI=${SI:-4}
ENGINE="device: cuda, attention_backend: flash_attn, block_size: 256, max_num_seqs: 128, max_num_batched_tokens: 8192, kv_cache_memory_bytes: 21474836480"
for n in 1 2; do cat > /tmp/gpu$n.yaml <<YAML
model: random:qwen3-0.6b
engine: {$ENGINE}
replicas: {num_replicas: $n, num_gpus: 1, num_cpus: 4, max_ongoing_requests: 256, max_queued_requests: -1}
routing: {ingress_replicas: 2}
server: {stream_interval: $SI}
YAML
done
TEN="--num-tenants 128 --system-tokens 4096 --suffix-tokens 64 512 --output-tokens 16 128"
