{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix, also the RayService's name. KubeRay accepts a RayService name only as a
DNS-1035 label of at most 47 characters (it appends a 6-character suffix for the RayCluster, whose
Services add up to 10 more), so dots become dashes, the name is prefixed with "kvmesh-" when it
would not start with a letter (a release named "1st") and cut to 47 characters.
*/}}
{{- define "kvmesh.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- $full := "" }}
{{- if .Values.fullnameOverride }}
{{- $full = .Values.fullnameOverride }}
{{- else if contains $name .Release.Name }}
{{- $full = .Release.Name }}
{{- else }}
{{- $full = printf "%s-%s" .Release.Name $name }}
{{- end }}
{{- $full = $full | replace "." "-" }}
{{- if not (regexMatch "^[a-z]" $full) }}
{{- $full = printf "kvmesh-%s" $full }}
{{- end }}
{{- regexReplaceAll "-+$" ($full | trunc 47) "" }}
{{- end }}

{{- define "kvmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels that select this release's Ray pods. Not app.kubernetes.io/name: KubeRay sets that one
on the pods it creates when the template lacks it, and may own it in later versions.
*/}}
{{- define "kvmesh.podSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvmesh
{{- end }}

{{/* Labels of every Ray pod of this release. */}}
{{- define "kvmesh.podLabels" -}}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/part-of: kvmesh
{{- end }}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ include "kvmesh.chart" . }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Non-empty when the gRPC API is on: a gRPC port and servicer functions to register. */}}
{{- define "kvmesh.grpcEnabled" -}}
{{- if and .Values.kvmesh.server.grpc_port .Values.serve.grpcServicerFunctions }}true{{ end }}
{{- end }}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cu128" .Chart.AppVersion) .Values.image.tag) }}
{{- end }}

{{/*
The kvmesh serving config handed to build_app. Replica count and autoscaling bounds come from
values as they are; `kvmesh.autoscaling.enabled` alone switches Serve autoscaling on. The gRPC
message limit is serve.grpcMaxMessageBytes, the one the pods' Serve proxies apply.
*/}}
{{- define "kvmesh.servingConfig" -}}
{{- $kvmesh := deepCopy .Values.kvmesh }}
{{- $_ := set $kvmesh.server "grpc_max_message_bytes" (.Values.serve.grpcMaxMessageBytes | int64) }}
{{- toYaml $kvmesh }}
{{- end }}

{{/* Ray Serve config (multi-application format) that KubeRay deploys: serveConfigV2. */}}
{{- define "kvmesh.serveConfig" -}}
proxy_location: {{ .Values.serve.proxyLocation }}
http_options:
  host: {{ .Values.kvmesh.server.host | quote }}
  port: {{ .Values.kvmesh.server.http_port }}
  keep_alive_timeout_s: {{ .Values.kvmesh.server.keep_alive_timeout_s }}
{{- if include "kvmesh.grpcEnabled" . }}
grpc_options:
  port: {{ .Values.kvmesh.server.grpc_port }}
  grpc_servicer_functions:
    {{- toYaml .Values.serve.grpcServicerFunctions | nindent 4 }}
    {{- if .Values.kvmesh.server.grpc_reflection }}
    - kvmesh.cluster.grpc_health.add_reflection_v1
    {{- end }}
  enable_reflection: {{ .Values.kvmesh.server.grpc_reflection }}
{{- end }}
applications:
  - name: {{ .Values.kvmesh.app_name }}
    route_prefix: {{ .Values.kvmesh.route_prefix }}
    import_path: {{ .Values.serve.importPath }}
    {{- with .Values.serve.runtimeEnv }}
    runtime_env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      {{- include "kvmesh.servingConfig" . | nindent 6 }}
{{- end }}

{{/*
Container ports every Ray pod declares. KubeRay finds the Serve port by the name "serve".
*/}}
{{- define "kvmesh.servePorts" -}}
- name: serve
  containerPort: {{ .Values.kvmesh.server.http_port }}
  protocol: TCP
{{- if include "kvmesh.grpcEnabled" . }}
- name: grpc
  containerPort: {{ .Values.kvmesh.server.grpc_port }}
  protocol: TCP
{{- end }}
- name: metrics
  containerPort: {{ .Values.metrics.rayMetricsPort }}
  protocol: TCP
{{- end }}

{{/*
One worker group spec. Called with a dict: root (the chart context), name, group (its values).
*/}}
{{- define "kvmesh.workerGroup" -}}
{{- $root := .root }}
{{- $group := .group }}
- groupName: {{ .name }}
  replicas: {{ $group.replicas }}
  minReplicas: {{ $group.minReplicas }}
  maxReplicas: {{ $group.maxReplicas }}
  rayStartParams:
    metrics-export-port: {{ $root.Values.metrics.rayMetricsPort | quote }}
    {{- range $key, $value := $group.rayStartParams }}
    {{ $key }}: {{ $value | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "kvmesh.podLabels" $root | nindent 8 }}
        app.kubernetes.io/component: worker
        {{- with $group.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "kvmesh.proxyOptionsAnnotation" $root | nindent 8 }}
        {{- with $group.annotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      containers:
        - name: ray-worker
          image: {{ include "kvmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          ports:
            {{- include "kvmesh.servePorts" $root | nindent 12 }}
          resources:
            requests:
              {{- with ($group.resources).requests }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              {{- if $group.gpusPerPod }}
              nvidia.com/gpu: {{ $group.gpusPerPod }}
              {{- end }}
            limits:
              {{- with ($group.resources).limits }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              {{- if $group.gpusPerPod }}
              nvidia.com/gpu: {{ $group.gpusPerPod }}
              {{- end }}
          {{- include "kvmesh.containerExtras" (dict "root" $root "group" $group) | nindent 10 }}
      {{- include "kvmesh.podExtras" (dict "root" $root "group" $group "prefetch" true) | nindent 6 }}
{{- end }}

{{/*
Environment of every Ray container (head and each worker group): Ray's token authentication,
where models come from, Serve's options (a proxy or replica may run on any pod), and KVMESH_API_KEYS from apiKeysSecret.
*/}}
{{- define "kvmesh.rayEnv" -}}
{{- include "kvmesh.rayAuthEnv" . }}
{{- include "kvmesh.modelEnv" . }}
{{- include "kvmesh.serveEnv" . }}
{{- include "kvmesh.apiKeysEnv" . }}
{{- end }}

{{/*
Ray's token authentication, set here as well as through authOptions (KubeRay adds only what a
container lacks), so the rendered pods say it and a named Secret reaches them whatever KubeRay adds.
*/}}
{{- define "kvmesh.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: {{ .Values.rayAuth.mode | quote }}
{{- with .Values.rayAuth.secretName }}
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: auth_token
{{- end }}
{{- end }}

{{- define "kvmesh.serveEnv" -}}
{{- if .Values.serve.throughputOptimized }}
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: "1"
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "0"
{{- end }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ .Values.serve.grpcMaxMessageBytes | int64 | toString | quote }}
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
  value: {{ include "kvmesh.replicaGrpcMessageBytes" . | quote }}
{{- include "kvmesh.patchesEnv" . }}
{{- end }}

{{/*
Serve's limit on messages between its proxy and a replica: a request the gRPC proxy accepts must
also fit, re-wrapped, on its way to the ingress replica. serve.grpcMaxMessageBytes plus 1 MiB, never
below Ray's 4 MiB default nor above gRPC's 2 GiB - 1, as `kvmesh serve` sets it
(cluster/launcher.py replica_message_bytes).
*/}}
{{- define "kvmesh.replicaGrpcMessageBytes" -}}
{{- min 2147483647 (max 4194304 (add (int64 .Values.serve.grpcMaxMessageBytes) 1048576)) | int64 | toString }}
{{- end }}

{{/*
kvmesh's worker hook (cluster/ray_patches.py) in every Ray worker process of every pod, by Ray's
own variable for a worker setup hook, so Serve's proxies and replicas that KubeRay's RayService
starts get the patches (request-head limits, stream idle timeout, gRPC cancel and decode, binds),
with the settings of kvmesh.server.
*/}}
{{/*
Serve's proxy options that the proxies take only when they start (Serve keeps a running cluster's
http_options and grpc_options, whatever a new serveConfigV2 says): carried in the pods' spec too, so
that changing them starts a new cluster (KubeRay compares rayClusterConfig).
*/}}
{{- define "kvmesh.proxyOptionsAnnotation" -}}
kvmesh.io/proxy-options: {{ printf "keep_alive_timeout_s=%v grpc_reflection=%v" .Values.kvmesh.server.keep_alive_timeout_s .Values.kvmesh.server.grpc_reflection | quote }}
{{- end }}

{{- define "kvmesh.patchesEnv" }}
- name: __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR
  value: kvmesh.cluster.ray_patches.setup_worker
- name: KVMESH_LISTEN_HOST
  value: {{ .Values.kvmesh.server.host | quote }}
- name: KVMESH_MAX_HEADER_BYTES
  value: {{ .Values.kvmesh.server.max_header_bytes | int64 | toString | quote }}
- name: KVMESH_HEADER_TIMEOUT_S
  value: {{ .Values.kvmesh.server.header_timeout_s | toString | quote }}
- name: KVMESH_STREAM_IDLE_TIMEOUT_S
  value: {{ .Values.kvmesh.server.stream_idle_timeout_s | toString | quote }}
{{- end }}

{{- define "kvmesh.apiKeysEnv" -}}
{{- with .Values.apiKeysSecret.name }}
- name: KVMESH_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKeysSecret.key }}
{{- end }}
{{- end }}

{{/*
Pod-level settings of every Ray pod (the head and each worker group), from the chart's global
values and the group's own. Called with a dict: root (the chart context), group (its values),
prefetch (whether this pod fetches the model in an init container when modelCache.prefetch is on).
*/}}
{{- define "kvmesh.podExtras" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- with $root.Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $init := list }}
{{- if and .prefetch $root.Values.modelCache.enabled $root.Values.modelCache.prefetch }}
{{- $init = append $init (include "kvmesh.prefetchContainer" $root | fromYaml) }}
{{- end }}
{{- with (concat $init ($group.initContainers | default list)) }}
initContainers:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $volumes := list }}
{{- if $root.Values.modelCache.enabled }}
{{- $volumes = append $volumes (dict "name" "model-cache" "persistentVolumeClaim" (dict "claimName" (include "kvmesh.modelCacheClaim" $root))) }}
{{- end }}
{{- with (concat $volumes ($group.volumes | default list)) }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- range $key := list "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" }}
{{- with get $group $key }}
{{ $key }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- range $key := list "priorityClassName" "runtimeClassName" "schedulerName" }}
{{- with get $group $key }}
{{ $key }}: {{ . }}
{{- end }}
{{- end }}
{{- with $group.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Container settings of every Ray container beyond image and ports: the chart's environment, the
model cache mount, and the group's envFrom, mounts, security context and probe overrides (a probe
left empty keeps KubeRay's own). Called with a dict: root, group.
*/}}
{{- define "kvmesh.containerExtras" -}}
{{- $root := .root }}
{{- $group := .group }}
env:
  {{- include "kvmesh.rayEnv" $root | nindent 2 }}
  {{- with $group.env }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $group.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (concat (include "kvmesh.modelCacheMounts" $root | fromYamlArray) ($group.volumeMounts | default list)) }}
volumeMounts:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- range $key := list "securityContext" "readinessProbe" "livenessProbe" "startupProbe" }}
{{- with get $group $key }}
{{ $key }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/* The model cache's volume mount (a list, empty when the cache is off). */}}
{{- define "kvmesh.modelCacheMounts" -}}
{{- if .Values.modelCache.enabled }}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- else }}
[]
{{- end }}
{{- end }}

{{- define "kvmesh.modelCacheClaim" -}}
{{- .Values.modelCache.existingClaim | default (printf "%s-model-cache" (include "kvmesh.fullname" .)) }}
{{- end }}

{{/*
Where models come from: the Hugging Face hub's endpoint and token, and the model cache (hub
downloads and the converted default model) on the cache volume when there is one.
*/}}
{{- define "kvmesh.modelEnv" -}}
{{- if .Values.modelCache.enabled }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelCache.mountPath | quote }}
- name: KVMESH_CACHE
  value: {{ printf "%s/kvmesh" .Values.modelCache.mountPath | quote }}
{{- end }}
{{- with .Values.huggingface.endpoint }}
- name: HF_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.huggingface.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.huggingface.tokenSecret.key }}
{{- end }}
{{- end }}

{{/* The init container that fetches kvmesh.model into the model cache before Ray starts. */}}
{{- define "kvmesh.prefetchContainer" -}}
name: fetch-model
image: {{ include "kvmesh.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
command: ["kvmesh", "fetch", {{ .Values.kvmesh.model | quote }}]
env:
  {{- include "kvmesh.modelEnv" . | nindent 2 }}
volumeMounts:
  - name: model-cache
    mountPath: {{ .Values.modelCache.mountPath }}
{{- end }}
