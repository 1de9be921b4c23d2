{{/* Chart name (nameOverride wins). */}}
{{- define "pdunit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: <release>-<chart>, or the release alone when it already
contains the chart name. Kept short so "-operator", "-scaler" suffixes stay under 63. */}}
{{- define "pdunit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "pdunit.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "pdunit.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "pdunit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdunit
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "operator"). */}}
{{- define "pdunit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdunit.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* image reference: (dict "image" .Values.images.operator "ctx" $). */}}
{{- define "pdunit.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "pdunit.operatorName" -}}{{ include "pdunit.fullname" . }}-operator{{- end -}}
{{- define "pdunit.scalerName" -}}{{ include "pdunit.fullname" . }}-scaler{{- end -}}
{{- define "pdunit.routerName" -}}{{ include "pdunit.fullname" . }}-router{{- end -}}

{{/* Namespace the router discovers units in. */}}
{{- define "pdunit.routerNamespace" -}}
{{- default .Release.Namespace .Values.router.namespace -}}
{{- end -}}

{{/* PDUnitSet the ScaledObject scales. */}}
{{- define "pdunit.kedaUnitSet" -}}
{{- default .Values.examplePDUnitSet.name .Values.keda.unitSet -}}
{{- end -}}

{{/* Restricted pod security: every container of the operator and router runs this way. */}}
{{- define "pdunit.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The named ports a unit pod serves /metrics on (operator/pod.py metrics_port; the
LB's on http): the PodMonitor scrapes them, the NetworkPolicy admits Prometheus to them.
Comma-separated: splitList "," (include "pdunit.unitMetricsPorts" .). */}}
{{- define "pdunit.unitMetricsPorts" -}}
http,metrics-prefill,metrics-proxy,metrics-guard,metrics-decode0,metrics-decode1,metrics-decode2,metrics-decode3,metrics-decode4,metrics-decode5,metrics-decode6
{{- end -}}
