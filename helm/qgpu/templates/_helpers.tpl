{{/* Chart name (nameOverride replaces it). */}}
{{- define "qgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Base of every object name: fullnameOverride, else the release name when it contains
the chart's name (release "qgpu": qgpu-manager, qgpu-scheduler, as TKE names them), else
<release>-<name>. */}}
{{- define "qgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "qgpu.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Namespace of every namespaced object: namespaceOverride, else namespace, else the
release's. */}}
{{- define "qgpu.namespace" -}}
{{- default (default .Release.Namespace .Values.namespace) .Values.namespaceOverride -}}
{{- end -}}

{{/* An image reference from a component's image values over the chart-wide ones:
(dict "image" <component image> "fallback" <chart-wide image or nil> "root" $).
global.imageRegistry, when set, replaces every registry (a mirror). */}}
{{- define "qgpu.imageRef" -}}
{{- $img := .image -}}
{{- $base := .fallback | default dict -}}
{{- $global := .root.Values.global | default dict -}}
{{- $registry := default (default "" $base.registry) $img.registry -}}
{{- $registry = default $registry $global.imageRegistry -}}
{{- $repository := default $base.repository $img.repository -}}
{{- $tag := default (default .root.Chart.AppVersion $base.tag) $img.tag -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" $registry $repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The qgpu image (chart-wide). */}}
{{- define "qgpu.image" -}}
{{- include "qgpu.imageRef" (dict "image" .Values.image "fallback" nil "root" .) -}}
{{- end -}}

{{/* The qgpu image of the manager pods and of the scheduler pods. */}}
{{- define "qgpu.managerImage" -}}
{{- include "qgpu.imageRef" (dict "image" .Values.manager.image "fallback" .Values.image "root" .) -}}
{{- end -}}
{{- define "qgpu.schedulerImage" -}}
{{- include "qgpu.imageRef" (dict "image" .Values.scheduler.image "fallback" .Values.image "root" .) -}}
{{- end -}}
{{- define "qgpu.kubeSchedulerImage" -}}
{{- include "qgpu.imageRef" (dict "image" .Values.scheduler.kubeScheduler.image "fallback" nil "root" .) -}}
{{- end -}}

{{/* Selector labels of a component: (dict "root" $ "component" "manager"). */}}
{{- define "qgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qgpu.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "qgpu.labels" -}}
app.kubernetes.io/name: {{ include "qgpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Resource names. */}}
{{- define "qgpu.coreResource" -}}{{ .Values.resourcePrefix }}/qgpu-core{{- end -}}
{{- define "qgpu.memoryResource" -}}{{ .Values.resourcePrefix }}/qgpu-memory{{- end -}}
{{- define "qgpu.memoryPercentResource" -}}{{ .Values.resourcePrefix }}/qgpu-memory-percentage{{- end -}}
{{- define "qgpu.policyLabel" -}}{{ .Values.resourcePrefix }}/qgpu-schedule-policy{{- end -}}
{{- define "qgpu.slicesLabel" -}}{{ .Values.resourcePrefix }}/qgpu-slices-per-gpu{{- end -}}

{{/* Object names (release "qgpu": as TKE names them). */}}
{{- define "qgpu.managerName" -}}{{ include "qgpu.fullname" . }}-manager{{- end -}}
{{- define "qgpu.managerMetricsService" -}}{{ include "qgpu.fullname" . }}-manager-metrics{{- end -}}
{{- define "qgpu.schedulerName" -}}{{ include "qgpu.fullname" . }}-scheduler{{- end -}}
{{- define "qgpu.webhookSecret" -}}{{ include "qgpu.schedulerName" . }}-webhook-tls{{- end -}}
{{- define "qgpu.webhookService" -}}{{ include "qgpu.schedulerName" . }}{{- end -}}
{{- define "qgpu.extenderSecret" -}}{{ include "qgpu.schedulerName" . }}-extender-tls{{- end -}}
{{- /* The Secret holding the assignment key (generated, or the user's existing one). */ -}}
{{- define "qgpu.assignmentKeySecret" -}}{{ default (printf "%s-assignment-key" (include "qgpu.fullname" .)) .Values.assignmentSigning.existingSecret }}{{- end -}}
{{- define "qgpu.assignmentKeyDir" -}}/etc/qgpu-assignment-key{{- end -}}
{{- /* The key flags of the extender and the device plugin (one source for both). */ -}}
{{- define "qgpu.assignmentKeyArgs" -}}
{{- if .Values.assignmentSigning.enabled }}
- --assignment-key-file={{ include "qgpu.assignmentKeyDir" . }}/key
- --assignment-previous-key-file={{ include "qgpu.assignmentKeyDir" . }}/previous
{{- end }}
{{- end -}}

{{/* The interposer as installed on the host. */}}
{{- define "qgpu.hookPath" -}}{{ .Values.manager.interposerDir }}/libqgpu_hook.so{{- end -}}

{{/* The node agent's socket (under the state directory, shared by both containers). */}}
{{- define "qgpu.agentSocket" -}}{{ .Values.manager.stateDir }}/agent.sock{{- end -}}

{{/* The node's slices-per-GPU label value, written by label-node for both containers. */}}
{{- define "qgpu.slicesFile" -}}{{ .Values.manager.stateDir }}/slices-per-gpu{{- end -}}

{{/* A list of strings as CEL string literals, comma-separated. */}}
{{- define "qgpu.celStrings" -}}
{{- $out := list -}}
{{- range . }}{{ $out = append $out (squote .) }}{{ end -}}
{{- join ", " $out -}}
{{- end -}}
