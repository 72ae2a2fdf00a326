{{/* Name of the chart, overridable. */}}
{{- define "shardwise.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-qualified unless the release name already holds the chart name. */}}
{{- define "shardwise.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of the cluster-scoped objects (ClusterRole, ClusterRoleBinding). They are shared by the whole
cluster, so they carry the namespace too: two releases of the same name in two namespaces don't clash.
*/}}
{{- define "shardwise.clusterName" -}}
{{- printf "%s-%s" (include "shardwise.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shardwise.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shardwise.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardwise.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "shardwise.labels" -}}
helm.sh/chart: {{ include "shardwise.chart" . }}
{{ include "shardwise.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shardwise
{{- end }}

{{- define "shardwise.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shardwise.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: a digest wins over a tag; the tag defaults to the chart's appVersion. */}}
{{- define "shardwise.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Arguments of `shardwise operator run`, one per line. */}}
{{- define "shardwise.operatorArgs" -}}
- operator
- run
{{- range .Values.operator.watchNamespaces }}
- --namespace={{ . }}
{{- else }}
- --all-namespaces
{{- end }}
- --health-port={{ .Values.operator.healthPort }}
- --metrics-port={{ .Values.operator.metricsPort }}
- --log-level={{ .Values.operator.logLevel }}
- --worker-image={{ .Values.operator.workerImage }}
- --router-image={{ include "shardwise.image" . }}
{{- with .Values.operator.modelRoot.path }}
- --model-root={{ . }}
{{- end }}
{{- if .Values.operator.networkPolicy }}
# Every model's NetworkPolicy admits these pods (in $POD_NAMESPACE) to its serving port.
{{- $labels := list }}
{{- range $k, $v := include "shardwise.selectorLabels" . | fromYaml }}
{{- $labels = append $labels (printf "%s=%s" $k $v) }}
{{- end }}
- --operator-pod-labels={{ join "," $labels }}
{{- else }}
- --no-network-policy
{{- end }}
{{- range .Values.operator.localCheckpoints.roots }}
- --local-checkpoint-root={{ . }}
{{- else }}
- --local-checkpoint-root=
{{- end }}
{{- if not .Values.operator.localCheckpoints.prepareAsRoot }}
- --no-prepare-local-checkpoints
{{- end }}
- --model-cache-host-path={{ .Values.operator.modelCache.hostPath }}
- --model-cache-budget={{ .Values.operator.modelCache.budget }}
{{- if not .Values.operator.modelCache.prepareAsRoot }}
- --no-prepare-model-cache
{{- end }}
{{- range .Values.operator.plainHttpRegistries }}
- --plain-http-registry={{ . }}
{{- end }}
# One Lease per release, so that two releases in one namespace never share a leader.
- --lease-namespace={{ .Release.Namespace }}
- --lease-name={{ include "shardwise.fullname" . }}
{{- range .Values.operator.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
