{{/* Name of the chart's objects: the release name, with the chart name unless it contains it. */}}
{{- define "kvgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.labels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvgate.poolNamespace" -}}
{{- default .Release.Namespace .Values.inferencePool.namespace -}}
{{- end -}}

{{/* kvgate.yaml */}}
{{- define "kvgate.config" -}}
{{- $kube := dict "namespace" (include "kvgate.poolNamespace" .) "pool" (required "inferencePool.name is required" .Values.inferencePool.name) -}}
{{- with .Values.discovery.kvEvents }}{{ $_ := set $kube "kv_events" . }}{{ end -}}
{{- with .Values.discovery.kvReplay }}{{ $_ := set $kube "kv_replay" . }}{{ end -}}
{{- with .Values.discovery.model }}{{ $_ := set $kube "model" . }}{{ end -}}
{{- with .Values.discovery.blockSize }}{{ $_ := set $kube "block_size" . }}{{ end -}}
{{- $base := dict "admin_listen" (printf "0.0.0.0:%v" .Values.admin.port) "discovery" (dict "kubernetes" $kube) -}}
{{- toYaml (merge $base .Values.config) -}}
{{- end -}}
