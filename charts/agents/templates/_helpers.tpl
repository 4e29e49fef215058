{{/*
Names and labels shared by every template (rbac.yaml included).
*/}}

{{/* The chart name, overridable. */}}
{{- define "agents.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The base name of this release's objects: the release name when it already
holds the chart name ("agents", "agents-prod"), else "<release>-agents".
Objects append a role: <fullname>-operator, <fullname>-metrics, ...
*/}}
{{- define "agents.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's ServiceAccount (created by serviceaccount.yaml unless serviceAccount.create=false). */}}
{{- define "agents.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "agents.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Lease the replicas elect a leader on (in the release namespace). */}}
{{- define "agents.leaseName" -}}
{{- printf "%s-operator" (include "agents.fullname" .) }}
{{- end }}

{{/* The operator image reference. */}}
{{- define "agents.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{/* Labels on every object of the release (roles and bindings too). */}}
{{- define "agents.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "agents.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agents
{{- end }}

{{/* Labels that select the operator pods (never change them: a Deployment's selector is immutable). */}}
{{- define "agents.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agents.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's command-line arguments (values -> flags). */}}
{{- define "agents.operatorArgs" -}}
- operator
- --metrics-addr=0.0.0.0:{{ .Values.metrics.port | int }}
- --log-format={{ .Values.operator.logFormat }}
{{- if .Values.leaderElection.enabled }}
- --leader-elect
- --lease-name={{ include "agents.leaseName" . }}
- --lease-duration-seconds={{ .Values.leaderElection.leaseDurationSeconds | int }}
- --lease-grace-seconds={{ .Values.leaderElection.renewGraceSeconds | int }}
{{- end }}
{{- range .Values.watchNamespaces }}
- {{ printf "--namespace=%s" . | quote }}
{{- end }}
- {{ printf "--agents-image=%s" (include "agents.image" .) | quote }}
{{- range .Values.operator.allowedToolImages }}
- {{ printf "--allowed-tool-image=%s" . | quote }}
{{- end }}
{{- range .Values.operator.httpToolAllowedUrls }}
- {{ printf "--http-tool-allowed-urls=%s" . | quote }}
{{- end }}
{{- range .Values.operator.modelAllowedUrls }}
- {{ printf "--model-allowed-urls=%s" . | quote }}
{{- end }}
{{- with .Values.operator.notifyWebhookUrl }}
- {{ printf "--notify-webhook-url=%s" . | quote }}
{{- end }}
{{- with .Values.approvals.pageUrl }}
- {{ printf "--approvals-page-url=%s" . | quote }}
{{- end }}
- {{ printf "--job-cpu-limit=%v" .Values.operator.jobDefaults.cpuLimit | quote }}
- {{ printf "--job-memory-limit=%v" .Values.operator.jobDefaults.memoryLimit | quote }}
- --job-active-deadline-seconds={{ .Values.operator.jobDefaults.activeDeadlineSeconds | int }}
{{- if hasKey .Values.operator.jobDefaults "ttlSecondsAfterFinished" }}
- --job-ttl-seconds-after-finished={{ .Values.operator.jobDefaults.ttlSecondsAfterFinished | int }}
{{- end }}
- --model-timeout-seconds={{ .Values.operator.modelTimeoutSeconds | int }}
{{- with .Values.operator.resyncSeconds }}
- --resync-seconds={{ . | int }}
{{- end }}
{{- with .Values.operator.stallSeconds }}
- --stall-seconds={{ . | int }}
{{- end }}
{{- with .Values.operator.maxCallsPerReply }}
- --max-calls-per-reply={{ . | int }}
{{- end }}
- --secrets-need-label={{ .Values.operator.secretsNeedLabel }}
{{- if not (kindIs "invalid" .Values.operator.finishedSessionTTLSeconds) }}
- --finished-session-ttl-seconds={{ .Values.operator.finishedSessionTTLSeconds | int }}
{{- end }}
- --max-concurrent-reconciles={{ .Values.operator.maxConcurrentReconciles | int }}
- --max-background-runs-per-namespace={{ .Values.operator.maxBackgroundRunsPerNamespace | int }}
{{- if not (kindIs "invalid" .Values.operator.maxReconcilesPerNamespace) }}
- --max-reconciles-per-namespace={{ .Values.operator.maxReconcilesPerNamespace | int }}
{{- end }}
{{- if gt (int .Values.operator.apiQPS) 0 }}
- --api-qps={{ .Values.operator.apiQPS | int }}
{{- if gt (int .Values.operator.apiBurst) 0 }}
- --api-burst={{ .Values.operator.apiBurst | int }}
{{- end }}
{{- end }}
- --event-qps={{ .Values.operator.eventQPS | int }}
- --event-burst={{ .Values.operator.eventBurst | int }}
{{- range .Values.operator.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
