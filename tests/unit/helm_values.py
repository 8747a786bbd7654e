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
    "grpc-message-size-not-a-number": ({"serve": {"grpcMaxMessageBytes": "4MiB"}},
                                       "/serve/grpcMaxMessageBytes': got string, want integer"),
    "grpc-message-size-beyond-grpc": ({"serve": {"grpcMaxMessageBytes": 2**31}}, "/serve/grpcMaxMessageBytes': maximum"),
    "duplicate-group-name": ({"additionalWorkerGroups": {"gpu": {"replicas": 0, "minReplicas": 0, "maxReplicas": 1}}},
                             "additionalWorkerGroups.gpu has the name of another worker group"),
}
