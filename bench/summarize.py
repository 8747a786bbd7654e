"""Print the headline numbers of a `kvmesh bench offline --json` file (and its profile)."""
import json
import sys

for path in sys.argv[1:]:
    try:
        with open(path) as f:
            r = json.loads([line for line in f.read().splitlines() if line.startswith("{")][-1])
    except Exception as e:
        print(f"{path}: no result ({e})")
        continue
    print(f"{path}: backend {r['attention_backend']} graphs {r['cuda_graphs']}: {r['seconds']:.2f} s, "
          f"{r['output_tok_per_s']:.0f} out tok/s, {r['total_tok_per_s']:.0f} total tok/s, floor {r['floor_seconds']:.2f} s "
          f"= {r['floor_ratio']:.3f}; steps {r['steps']}, host outside execute {r['host_seconds_outside_execute']:.2f} s, "
          f"execute {r['execute_seconds']:.2f} s; copy {r['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"mm {r['matmul_flops_per_s'] / 1e12:.0f} TF/s")
    for name, p in r.get("peers", {}).items():
        print(f"  peer {name}: {p}")
    if r.get("profile"):
        print(r["profile"])
    t = r.get("step_times")
    if t and "fixed_ms" in t:
        print(f"  decode step = {t['fixed_ms']:.3f} ms + {t['per_seq_us']:.2f} us/seq + {t['per_kv_token_ns']:.3f} "
              f"ns/KV token (r2 {t['r2']:.3f}, {t['decode_steps']} steps {t['decode_ms']:.0f} ms; fixed "
              f"{t['fixed_share_of_decode']:.0%}); other steps {t['other_steps']} {t['other_ms']:.0f} ms")
    if r.get("profile_window"):
        w = r["profile_window"]
        print(f"  window of {w['steps']} steps: GPU busy {w['gpu_busy_ms']:.1f} of {w['wall_ms']:.1f} ms "
              f"({w['gpu_busy_fraction']:.1%}); by tenth of its span "
              + " ".join(f"{b:.0%}" for b in w.get("gpu_busy_by_tenth", [])) + "; " + "; ".join(f"{ms:.1f} ms {name[:50]}" for name, ms
                                                               in list(w["kernel_ms_by_name"].items())[:8]))
        if "short_gap_ms" in w:
            print(f"  idle: {w['short_gap_ms']:.1f} ms in {w['short_gaps']} gaps under 20 us, {w['long_gap_ms']:.1f} ms "
                  "in longer ones; short gaps before: " + "; ".join(
                      f"{ms:.1f} ms {name[:50]}" for name, ms in list(w["short_gap_ms_before"].items())[:8]))
