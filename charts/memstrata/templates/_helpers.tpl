{{/* Names and labels shared by every template. */}}
{{- define "memstrata.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "memstrata.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "memstrata.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "memstrata.nodeAgentSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node-agent
{{- end -}}

{{- define "memstrata.image" -}}
{{- printf "%s:%s" .image.repository (default .appVersion .image.tag) -}}
{{- end -}}

{{- /* The node agent's device API, `auto` resolved against what the cluster serves (memstrata nodeagent --device-api). */ -}}
{{- define "memstrata.deviceApi" -}}
{{- $mode := .Values.nodeAgent.deviceApi | default "device-plugin" -}}
{{- if eq $mode "auto" -}}
{{- /* resource.k8s.io/v1 is served from 1.34, but the claims use consumable capacity and distinctAttribute, on by default from 1.36 */ -}}
{{- if and (.Capabilities.APIVersions.Has "resource.k8s.io/v1") (semverCompare ">=1.36-0" .Capabilities.KubeVersion.Version) }}dra{{ else }}device-plugin{{ end -}}
{{- else -}}
{{- $mode -}}
{{- end -}}
{{- end -}}

{{- /* Whether the operator queues jobs through Kueue (memstrata operator --kueue): `auto` when the cluster serves
Kueue's v1beta2 API (Kueue >= 0.17), whose Workloads the operator creates. */ -}}
{{- define "memstrata.kueue" -}}
{{- $k := .Values.kueue | default dict -}}
{{- $mode := ternary $k.enabled "auto" (hasKey $k "enabled") -}}
{{- if eq (toString $mode) "auto" -}}
{{- if .Capabilities.APIVersions.Has "kueue.x-k8s.io/v1beta2" }}true{{ else }}false{{ end -}}
{{- else -}}
{{- ternary "true" "false" (eq (toString $mode) "true") -}}
{{- end -}}
{{- end -}}
