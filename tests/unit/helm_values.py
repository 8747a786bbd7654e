"""Value sets the chart tests render: the defaults and the ways operators are expected to deploy."""

VALUE_SETS = {
    "defaults": {},
    # Autoscaled on KV pressure over two GPU types, with Prometheus and Grafana wired up.
    "autoscaling-two-gpu-types": {
        "kvmesh": {
            "model": "/models/Qwen3-8B",
            "engine": {"dtype": "bfloat16", "max_model_len": 8192, "attention_backend": "flashinfer"},
            "replicas": {"num_replicas": 2, "num_gpus": 1, "max_ongoing_requests": 128},
            "routing": {"policy": "kv_events", "ingress_replicas": 2},
            "autoscaling": {"enabled": True, "policy": "kv_pressure", "min_replicas": 2, "max_replicas": 12,
                            "kv_free_threshold": 0.15},
        },
        "worker": {"replicas": 2, "minReplicas": 2, "maxReplicas": 8, "gpusPerPod": 1,
                   "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                   "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                   "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]},
        "additionalWorkerGroups": {
            "h200": {"replicas": 0, "minReplicas": 0, "maxReplicas": 4, "gpusPerPod": 1,
                     "rayStartParams": {"resources": '"{\\"H200\\": 1}"'},
                     "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}},
            "spare": {"disabled": True, "replicas": 0, "minReplicas": 0, "maxReplicas": 1},
        },
        "rayAuth": {"secretName": "kvmesh-ray-token"},
        "service": {"http": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}},
    },
    # A CPU-only smoke deployment: random weights, no GPUs, HTTP only, proxies on the head only.
    "cpu-only": {
        "kvmesh": {
            "model": "random:tiny-llama",
            "engine": {"device": "cpu", "dtype": "float32", "attention_backend": "torch"},
            "replicas": {"num_replicas": 2, "num_gpus": 0, "num_cpus": 1, "resources": {"kvmesh_worker": 1}},
            "routing": {"policy": "round_robin"},
            "server": {"api_keys": ["sk-test"], "grpc_port": 0},
        },
        "serve": {"proxyLocation": "HeadOnly", "grpcMaxMessageBytes": 1048576},
        "worker": {"groupName": "cpu", "gpusPerPod": 0, "tolerations": [],
                   "rayStartParams": {"resources": '"{\\"kvmesh_worker\\": 1}"', "num-cpus": 2},
                   "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}},
        "head": {"resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "1", "memory": "4Gi"}}},
    },
    # Renamed resources and non-default ports.
    "names-and-ports": {
        "fullnameOverride": "llm",
        "kvmesh": {"server": {"http_port": 8100, "grpc_port": 9100}, "routing": {"policy": "prefix_approx"}},
        "service": {"http": {"port": 80}, "grpc": {"port": 443}},
        "image": {"repository": "registry.example.com/kvmesh", "tag": "0.1.0-cu130"},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "kvmesh",
        "commonLabels": {"team": "inference"},
    },
    # What a production install adds: a model from the hub on a shared cache volume, fetched before
    # Ray starts, gated by a token; probes that wait for long model loads; scheduling knobs; PDBs;
    # GCS fault tolerance on external Redis; an authenticated ServiceMonitor; an extra object.
    "production": {
        "kvmesh": {
            "model": "Qwen/Qwen3-8B",
            "replicas": {"num_replicas": 4, "num_gpus": 1},
            "server": {"auth_metrics": True},
        },
        "worker": {"replicas": 2, "minReplicas": 2, "maxReplicas": 4, "gpusPerPod": 2,
                   "startupProbe": {"exec": {"command": ["bash", "-c", "wget -qO- 127.0.0.1:52365/api/local_raylet_healthz"]},
                                    "periodSeconds": 10, "failureThreshold": 120},
                   "readinessProbe": {"exec": {"command": ["bash", "-c", "wget -qO- 127.0.0.1:52365/api/local_raylet_healthz"]},
                                      "periodSeconds": 5, "timeoutSeconds": 2},
                   "envFrom": [{"configMapRef": {"name": "kvmesh-extra-env"}}],
                   "initContainers": [{"name": "nvidia-check", "image": "busybox:1.36", "command": ["true"]}],
                   "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                                  "whenUnsatisfiable": "ScheduleAnyway",
                                                  "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}],
                   "priorityClassName": "inference-high", "runtimeClassName": "nvidia",
                   "podSecurityContext": {"fsGroup": 1000}},
        "head": {"priorityClassName": "inference-high", "livenessProbe": {"tcpSocket": {"port": 6379}, "periodSeconds": 10}},
        "modelCache": {"enabled": True, "size": "500Gi", "storageClassName": "filestore", "prefetch": True},
        "huggingface": {"endpoint": "https://hub.example.internal", "tokenSecret": {"name": "hf-token"}},
        "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis-master.llm.svc:6379",
                              "redisPasswordSecret": {"name": "redis-password"}},
        "podDisruptionBudget": {"enabled": True},
        "apiKeysSecret": {"name": "kvmesh-api-keys"},
        "metrics": {"serviceMonitor": {"enabled": True, "bearerTokenSecret": {"name": "kvmesh-prometheus-key"}}},
        "extraObjects": [{"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "kvmesh-extra-env", "labels": {"release": "{{ .Release.Name }}"}},
                          "data": {"NCCL_DEBUG": "WARN"}}],
    },
}

# Values that must be refused, and a fragment of the message that must explain why.
BAD_VALUES = {
    "replicas-not-a-number": ({"kvmesh": {"replicas": {"num_replicas": "two"}}},
                              "/kvmesh/replicas/num_replicas': got string, want integer"),
    "no-model": ({"kvmesh": {"model": None}}, "missing property 'model'"),
    "empty-model": ({"kvmesh": {"model": ""}}, "/kvmesh/model': minLength"),
    "unknown-policy": ({"kvmesh": {"routing": {"policy": "random"}}}, "/kvmesh/routing/policy': value must be one of"),
    "misspelled-key": ({"kvmesh": {"engnie": {}}}, "additional properties 'engnie' not allowed"),
    "port-out-of-range": ({"kvmesh": {"server": {"http_port": 70000}}}, "/kvmesh/server/http_port': maximum"),
    "port-collides-with-ray": ({"kvmesh": {"server": {"grpc_port": 8265}}},
                               "kvmesh.server.grpc_port=8265 is already used by the Ray dashboard"),
    "same-http-and-grpc-port": ({"kvmesh": {"server": {"grpc_port": 8000}}}, "they need different ports"),
    "min-above-max-replicas": ({"kvmesh": {"autoscaling": {"enabled": True, "min_replicas": 5, "max_replicas": 2}}},
                               "min_replicas (5) is above max_replicas (2)"),
    "group-min-above-max": ({"worker": {"minReplicas": 5, "maxReplicas": 4}}, "minReplicas (5) is above maxReplicas (4)"),
    "gpu-replicas-without-gpu-group": ({"worker": {"gpusPerPod": 0}}, "no worker group requests GPUs"),
    "unknown-ray-auth-mode": ({"rayAuth": {"mode": "on"}}, "/rayAuth/mode': value must be one of 'token', 'disabled'"),
    "ray-auth-secret-with-auth-off": ({"rayAuth": {"mode": "disabled", "secretName": "kvmesh-ray-token"}},
                                      "rayAuth.secretName is kvmesh-ray-token but rayAuth.mode is disabled"),
    "ray-auth-secret-not-a-name": ({"rayAuth": {"secretName": "Ray Token"}}, "/rayAuth/secretName': 'Ray Token' does not match pattern"),
    "ray-auth-env-overridden": ({"additionalWorkerGroups": {"h200": {"replicas": 0, "minReplicas": 0, "maxReplicas": 1,
                                                                     "env": [{"name": "RAY_AUTH_MODE", "value": "disabled"}]}}},
                                "additionalWorkerGroups.h200.env sets RAY_AUTH_MODE, which the chart sets on every Ray "
                                "container from rayAuth.mode"),
    "stream-idle-timeout-env-overridden": ({"head": {"env": [{"name": "KVMESH_STREAM_IDLE_TIMEOUT_S", "value": "0"}]}},
                                           "head.env sets KVMESH_STREAM_IDLE_TIMEOUT_S, which the chart sets on every "
                                           "Ray container from kvmesh.server.stream_idle_timeout_s"),
    "worker-hook-env-overridden": ({"worker": {"env": [{"name": "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR", "value": "x.y"}]}},
                                   "worker.env sets __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR, which the chart sets on "
                                   "every Ray container from kvmesh's worker hook"),
    "grpc-message-size-not-a-number": ({"serve": {"grpcMaxMessageBytes": "4MiB"}},
                                       "/serve/grpcMaxMessageBytes': got string, want integer"),
    "grpc-message-size-beyond-grpc": ({"serve": {"grpcMaxMessageBytes": 2**31}}, "/serve/grpcMaxMessageBytes': maximum"),
    "gpu-replicas-beyond-the-groups": ({"kvmesh": {"replicas": {"num_replicas": 4}}},
                                       "kvmesh.replicas.num_replicas (4) x kvmesh.replicas.num_gpus (1) needs 4 GPUs "
                                       "but the worker groups have at most 1 (gpu: replicas 1 x gpusPerPod 1)"),
    "autoscaled-replicas-beyond-the-groups": (
        {"kvmesh": {"autoscaling": {"enabled": True, "max_replicas": 12}},
         "additionalWorkerGroups": {"h200": {"replicas": 0, "minReplicas": 0, "maxReplicas": 2, "gpusPerPod": 0}}},
        "kvmesh.autoscaling.max_replicas (12) x kvmesh.replicas.num_gpus (1) needs 12 GPUs but the worker groups have "
        "at most 4 (gpu: maxReplicas 4 x gpusPerPod 1, h200: maxReplicas 2 x gpusPerPod 0)"),
    "gcs-fault-tolerance-without-redis": ({"gcsFaultTolerance": {"enabled": True}},
                                          "gcsFaultTolerance.redisAddress is empty"),
    "prefetch-without-cache": ({"modelCache": {"prefetch": True}}, "modelCache.prefetch is true but modelCache.enabled is false"),
    "metrics-auth-without-a-key": ({"kvmesh": {"server": {"auth_metrics": True}},
                                    "metrics": {"serviceMonitor": {"enabled": True}}},
                                   "kvmesh.server.auth_metrics is true but Prometheus has no key to send"),
    "fullname-not-a-dns-1035-label": ({"fullnameOverride": "1-llm"}, "/fullnameOverride': '1-llm' does not match pattern"),
    "fullname-too-long-for-kuberay": ({"fullnameOverride": "a" * 48}, "/fullnameOverride': maxLength"),
    "duplicate-group-name": ({"additionalWorkerGroups": {"gpu": {"replicas": 0, "minReplicas": 0, "maxReplicas": 1}}},
                             "additionalWorkerGroups.gpu has the name of another worker group"),
}
