{{/*
Chart name, overridable with nameOverride. Truncated to 63 characters, the
limit for label values and most resource names.
*/}}
{{- define "distbelief.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name prefix of the release's resources. The operator's objects append
"-operator", so it is kept to 46 characters to leave room for the longest
suffix ("-operator-metrics" is a Service name, limited to 63).
*/}}
{{- define "distbelief.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 46 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of the operator's Deployment, ServiceAccount and RBAC objects. */}}
{{- define "distbelief.operatorName" -}}
{{- printf "%s-operator" (include "distbelief.fullname" .) -}}
{{- end -}}

{{/* Value of the helm.sh/chart label. */}}
{{- define "distbelief.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels on every object of the chart. managed-by is "Helm" here; the objects
the operator creates for a job say "distbelief-operator" instead.
*/}}
{{- define "distbelief.labels" -}}
helm.sh/chart: {{ include "distbelief.chart" . }}
app.kubernetes.io/name: {{ include "distbelief.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: distbelief
{{- end -}}

{{/*
Selector of the operator pods. Job pods also carry
app.kubernetes.io/name=distbelief, and a job may be named like the release
(so share app.kubernetes.io/instance); the component label keeps the
operator's Service, NetworkPolicy and Deployment from selecting them.
*/}}
{{- define "distbelief.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "distbelief.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of the operator's Deployment, pods, Service and ServiceAccount. */}}
{{- define "distbelief.operatorLabels" -}}
{{ include "distbelief.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's image, repository:tag, the tag defaulting to appVersion. */}}
{{- define "distbelief.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) -}}
{{- end -}}

{{/* The image of job pods: jobImage, or else the operator's own image. */}}
{{- define "distbelief.jobImage" -}}
{{- default (include "distbelief.image" .) .Values.jobImage -}}
{{- end -}}

{{/*
A label map as `key=value` pairs, comma-separated, in key order: how the
operator's --metrics-namespace-selector reads it. An empty map gives "".
*/}}
{{- define "distbelief.labelPairs" -}}
{{- $pairs := list }}
{{- range $k, $v := . }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end -}}
