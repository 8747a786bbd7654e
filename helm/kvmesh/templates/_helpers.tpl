{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix. RayService names become RayCluster and pod name prefixes with suffixes
appended by KubeRay, so keep it short (50 characters).
*/}}
{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
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
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The kvmesh serving config handed to build_app. Replica count and autoscaling bounds come from
values as they are; `kvmesh.autoscaling.enabled` alone switches Serve autoscaling on.
*/}}
{{- define "kvmesh.servingConfig" -}}
{{- toYaml .Values.kvmesh }}
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
      {{- with $group.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.serviceAccountName }}
      serviceAccountName: {{ . }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
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
          env:
            {{- include "kvmesh.rayEnv" $root | nindent 12 }}
            {{- with $group.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with $group.volumeMounts }}
          volumeMounts:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $group.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      {{- with $group.volumes }}
      volumes:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/*
Environment of every Ray container (head and each worker group): Ray's token authentication,
Serve's options (a proxy or replica may run on any pod), and KVMESH_API_KEYS from apiKeysSecret.
*/}}
{{- define "kvmesh.rayEnv" -}}
{{- include "kvmesh.rayAuthEnv" . }}
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
