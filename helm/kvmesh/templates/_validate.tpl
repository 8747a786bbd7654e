{{/*
Checks across values that values.schema.json cannot express; each failure says what to change.
*/}}
{{- define "kvmesh.validate" -}}
{{- $server := .Values.kvmesh.server }}
{{- $reserved := dict "6379" "Ray GCS" "8265" "the Ray dashboard" "10001" "the Ray client server" }}
{{- $_ := set $reserved (toString .Values.metrics.rayMetricsPort) "metrics.rayMetricsPort" }}
{{- range $name, $port := dict "kvmesh.server.http_port" $server.http_port "kvmesh.server.grpc_port" $server.grpc_port }}
{{- with get $reserved (toString $port) }}
{{- fail (printf "%s=%v is already used by %s in every Ray pod; choose another port" $name $port .) }}
{{- end }}
{{- end }}
{{- if and $server.grpc_port (eq (toString $server.http_port) (toString $server.grpc_port)) }}
{{- fail (printf "kvmesh.server.http_port and kvmesh.server.grpc_port are both %v; they need different ports" $server.http_port) }}
{{- end }}
{{- if and (hasKey $server "grpc_max_message_bytes") (ne (int64 $server.grpc_max_message_bytes) (int64 .Values.serve.grpcMaxMessageBytes)) }}
{{- fail (printf "kvmesh.server.grpc_max_message_bytes (%v) differs from serve.grpcMaxMessageBytes (%v), which sets the limit in every pod: set serve.grpcMaxMessageBytes alone" (int64 $server.grpc_max_message_bytes) (int64 .Values.serve.grpcMaxMessageBytes)) }}
{{- end }}
{{- $auto := .Values.kvmesh.autoscaling }}
{{- if and $auto.enabled (gt (int $auto.min_replicas) (int $auto.max_replicas)) }}
{{- fail (printf "kvmesh.autoscaling.min_replicas (%v) is above max_replicas (%v)" $auto.min_replicas $auto.max_replicas) }}
{{- end }}
{{- $groups := dict .Values.worker.groupName .Values.worker }}
{{- range $name, $group := .Values.additionalWorkerGroups }}
{{- if not $group.disabled }}
{{- if hasKey $groups $name }}
{{- fail (printf "additionalWorkerGroups.%s has the name of another worker group; rename it" $name) }}
{{- end }}
{{- $_ := set $groups $name $group }}
{{- end }}
{{- end }}
{{- range $name, $group := $groups }}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) }}
{{- fail (printf "worker group %s: minReplicas (%v) is above maxReplicas (%v)" $name $group.minReplicas $group.maxReplicas) }}
{{- end }}
{{- if or (lt (int $group.replicas) (int $group.minReplicas)) (gt (int $group.replicas) (int $group.maxReplicas)) }}
{{- fail (printf "worker group %s: replicas (%v) must lie in [minReplicas, maxReplicas] = [%v, %v]" $name $group.replicas $group.minReplicas $group.maxReplicas) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.rayAuth.mode "disabled") .Values.rayAuth.secretName }}
{{- fail (printf "rayAuth.secretName is %s but rayAuth.mode is disabled: set mode to token, or drop the Secret" .Values.rayAuth.secretName) }}
{{- end }}
{{- $chartEnv := dict "RAY_AUTH_MODE" "rayAuth.mode" "RAY_AUTH_TOKEN" "rayAuth.secretName" "RAY_AUTH_TOKEN_PATH" "rayAuth.secretName" "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE" "serve.grpcMaxMessageBytes" "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH" "serve.grpcMaxMessageBytes" "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR" "kvmesh's worker hook (always on; nothing to set)" "KVMESH_LISTEN_HOST" "kvmesh.server.host" "KVMESH_MAX_HEADER_BYTES" "kvmesh.server.max_header_bytes" "KVMESH_HEADER_TIMEOUT_S" "kvmesh.server.header_timeout_s" "KVMESH_STREAM_IDLE_TIMEOUT_S" "kvmesh.server.stream_idle_timeout_s" }}
{{- $envs := dict "head.env" .Values.head.env "worker.env" .Values.worker.env }}
{{- range $name, $group := .Values.additionalWorkerGroups }}
{{- $_ := set $envs (printf "additionalWorkerGroups.%s.env" $name) $group.env }}
{{- end }}
{{- range $where, $env := $envs }}
{{- range $env }}
{{- $var := .name }}
{{- with get $chartEnv $var }}
{{- fail (printf "%s sets %s, which the chart sets on every Ray container from %s; set that value instead" $where $var .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (gt (float64 .Values.kvmesh.replicas.num_gpus) 0.0) (not (include "kvmesh.anyGpuGroup" .)) }}
{{- fail "kvmesh.replicas.num_gpus > 0 but no worker group requests GPUs (gpusPerPod); worker replicas could never be placed" }}
{{- end }}
{{- include "kvmesh.validateGpuCapacity" (dict "root" . "groups" $groups) }}
{{- $fault := .Values.gcsFaultTolerance }}
{{- if and $fault.enabled (not $fault.redisAddress) }}
{{- fail "gcsFaultTolerance.enabled is true but gcsFaultTolerance.redisAddress is empty: give the Redis address (host:port)" }}
{{- end }}
{{- if and .Values.modelCache.prefetch (not .Values.modelCache.enabled) }}
{{- fail "modelCache.prefetch is true but modelCache.enabled is false: the model is fetched into the cache volume, so enable it" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled $server.auth_metrics (not .Values.metrics.serviceMonitor.bearerTokenSecret.name) (not .Values.apiKeysSecret.name) }}
{{- fail "kvmesh.server.auth_metrics is true but Prometheus has no key to send: set metrics.serviceMonitor.bearerTokenSecret.name (or apiKeysSecret.name, holding one key)" }}
{{- end }}
{{- if and .Values.ingress.enabled (not .Values.ingress.hosts) }}
{{- fail "ingress.enabled is true but ingress.hosts is empty: give at least one host (host: \"\" matches any) with its paths" }}
{{- end }}
{{- range $kind, $route := dict "httpRoute" .Values.gateway.httpRoute "grpcRoute" .Values.gateway.grpcRoute }}
{{- if and $route.enabled (not $route.parentRefs) }}
{{- fail (printf "gateway.%s.enabled is true but gateway.%s.parentRefs is empty: name the Gateway it attaches to" $kind $kind) }}
{{- end }}
{{- end }}
{{- if and .Values.gateway.grpcRoute.enabled (not (and .Values.service.grpc.enabled (include "kvmesh.grpcEnabled" .))) }}
{{- fail "gateway.grpcRoute.enabled is true but there is no gRPC Service to route to: set service.grpc.enabled and a kvmesh.server.grpc_port above 0" }}
{{- end }}
{{- end }}

{{/*
GPU replicas must fit the GPUs the worker groups can have: kvmesh.replicas.num_gpus times the
replicas Serve may want (autoscaling.max_replicas, or num_replicas when autoscaling is off) against
the sum of each group's pods (maxReplicas, or replicas when KubeRay's autoscaler is off) times
gpusPerPod. Called with a dict: root, groups (name -> values of the enabled groups).
*/}}
{{- define "kvmesh.validateGpuCapacity" -}}
{{- $values := .root.Values }}
{{- $auto := $values.kvmesh.autoscaling.enabled }}
{{- $replicas := ternary $values.kvmesh.autoscaling.max_replicas $values.kvmesh.replicas.num_replicas $auto }}
{{- $replicasName := ternary "kvmesh.autoscaling.max_replicas" "kvmesh.replicas.num_replicas" $auto }}
{{- $podsName := ternary "maxReplicas" "replicas" $auto }}
{{- $need := mulf (float64 $values.kvmesh.replicas.num_gpus) (float64 $replicas) }}
{{- $have := 0.0 }}
{{- $parts := list }}
{{- range $name, $group := .groups }}
{{- $pods := ternary $group.maxReplicas $group.replicas $auto }}
{{- $have = addf $have (mulf (float64 $pods) (float64 ($group.gpusPerPod | default 0))) }}
{{- $parts = append $parts (printf "%s: %s %v x gpusPerPod %v" $name $podsName $pods ($group.gpusPerPod | default 0)) }}
{{- end }}
{{- if gt $need $have }}
{{- fail (printf "%s (%v) x kvmesh.replicas.num_gpus (%v) needs %v GPUs but the worker groups have at most %v (%s); raise the groups' %s or gpusPerPod, or lower %s" $replicasName $replicas $values.kvmesh.replicas.num_gpus $need $have (join ", " $parts) $podsName $replicasName) }}
{{- end }}
{{- end }}

{{- define "kvmesh.anyGpuGroup" -}}
{{- if .Values.worker.gpusPerPod }}yes{{ end }}
{{- range $name, $group := .Values.additionalWorkerGroups }}
{{- if and (not $group.disabled) $group.gpusPerPod }}yes{{ end }}
{{- end }}
{{- end }}
