{{/* Namespace of every namespaced object. */}}
{{- define "qgpu.namespace" -}}
{{- default .Release.Namespace .Values.namespace -}}
{{- end -}}

{{/* The qgpu image reference. */}}
{{- define "qgpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "qgpu.labels" -}}
app.kubernetes.io/name: qgpu
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Resource names. */}}
{{- define "qgpu.coreResource" -}}{{ .Values.resourcePrefix }}/qgpu-core{{- end -}}
{{- define "qgpu.memoryResource" -}}{{ .Values.resourcePrefix }}/qgpu-memory{{- end -}}
{{- define "qgpu.policyLabel" -}}{{ .Values.resourcePrefix }}/qgpu-schedule-policy{{- end -}}

{{/* Object names (as TKE names them). */}}
{{- define "qgpu.managerName" -}}qgpu-manager{{- end -}}
{{- define "qgpu.schedulerName" -}}qgpu-scheduler{{- end -}}
{{- define "qgpu.webhookSecret" -}}qgpu-scheduler-webhook-tls{{- end -}}
{{- define "qgpu.extenderSecret" -}}qgpu-scheduler-extender-tls{{- end -}}
{{- define "qgpu.webhookService" -}}qgpu-scheduler{{- end -}}

{{/* The interposer as installed on the host. */}}
{{- define "qgpu.hookPath" -}}{{ .Values.manager.interposerDir }}/libqgpu_hook.so{{- end -}}

{{/* The node agent's socket (under the state directory, shared by both containers). */}}
{{- define "qgpu.agentSocket" -}}{{ .Values.manager.stateDir }}/agent.sock{{- end -}}
