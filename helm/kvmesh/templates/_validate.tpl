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
{{- $chartEnv := dict "RAY_AUTH_MODE" "rayAuth.mode" "RAY_AUTH_TOKEN" "rayAuth.secretName" "RAY_AUTH_TOKEN_PATH" "rayAuth.secretName" "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE" "serve.grpcMaxMessageBytes" }}
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
{{- end }}

{{- define "kvmesh.anyGpuGroup" -}}
{{- if .Values.worker.gpusPerPod }}yes{{ end }}
{{- range $name, $group := .Values.additionalWorkerGroups }}
{{- if and (not $group.disabled) $group.gpusPerPod }}yes{{ end }}
{{- end }}
{{- end }}
