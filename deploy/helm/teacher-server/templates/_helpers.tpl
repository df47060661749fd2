{{/*
Short name of the app: the chart name unless nameOverride is set. DNS labels are at most
63 characters.
*/}}
{{- define "teacher-server.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Name of every object of the release. The release name alone when it already contains
the app name (`helm install teacher-server ...`), else "<release>-<app>".
*/}}
{{- define "teacher-server.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $app := include "teacher-server.name" . -}}
{{- $full := ternary .Release.Name (printf "%s-%s" .Release.Name $app) (contains $app .Release.Name) -}}
{{- $full | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the pods: must never change for a release. */}}
{{- define "teacher-server.selectorLabels" -}}
app.kubernetes.io/name: {{ include "teacher-server.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "teacher-server.labels" -}}
{{ include "teacher-server.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/component: server
app.kubernetes.io/part-of: teacher-server
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "teacher-server.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Secret holding the API key, or "" when no key is configured. */}}
{{- define "teacher-server.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.create -}}
{{- printf "%s-api-key" (include "teacher-server.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "teacher-server.apiKeySecretKey" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecretKey -}}
{{- else -}}
api-key
{{- end -}}
{{- end -}}

{{- define "teacher-server.newClaimName" -}}
{{- printf "%s-model" (include "teacher-server.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "teacher-server.compileCacheClaimName" -}}
{{- if eq .Values.compileCache.source "existingClaim" -}}
{{- required "compileCache.existingClaim must name a claim when compileCache.source=existingClaim" .Values.compileCache.existingClaim -}}
{{- else -}}
{{- printf "%s-compile-cache" (include "teacher-server.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Where the server reads its config file (the ConfigMap's mount). */}}
{{- define "teacher-server.configDir" -}}
/etc/teacher-server
{{- end -}}

{{/*
terminationGracePeriodSeconds: the value when given, else preStop sleep + drain + exit
margin. The kubelet counts it from the start of deletion, preStop included.
*/}}
{{- define "teacher-server.terminationGracePeriod" -}}
{{- $s := .Values.shutdown -}}
{{- if kindIs "invalid" $s.terminationGracePeriodSeconds -}}
{{- add $s.preStopSleepSeconds $s.drainTimeoutSeconds $s.exitMarginSeconds -}}
{{- else -}}
{{- $s.terminationGracePeriodSeconds | int -}}
{{- end -}}
{{- end -}}

{{/*
The rclone source for model.fetch.objectStore.url: s3:// and gs:// URLs become rclone
on-the-fly remotes that take credentials from the environment; anything else is already
an rclone path.
*/}}
{{- define "teacher-server.objectStoreSource" -}}
{{- $url := .Values.model.fetch.objectStore.url -}}
{{- $url = regexReplaceAll "^s3://" $url ":s3,env_auth=true:" -}}
{{- $url = regexReplaceAll "^gs://" $url ":gcs,env_auth=true:" -}}
{{- $url -}}
{{- end -}}

{{/*
Checks that span several values, which values.schema.json cannot express. A failure
stops the render with a message naming the values.
*/}}
{{/* The Secret holding the nodes' shared key (nnodes > 1): the one named, else the chart's. */}}
{{- define "teacher-server.nodeAuthkeySecretName" -}}
{{- .Values.multiNode.authkeySecret | default (printf "%s-node-authkey" (include "teacher-server.fullname" .)) -}}
{{- end -}}

{{/* Services select the pods that serve HTTP: under a LeaderWorkerSet, the leaders (LWS labels them worker-index 0). */}}
{{- define "teacher-server.serviceSelector" -}}
{{ include "teacher-server.selectorLabels" . }}
{{- if gt (int .Values.nnodes) 1 }}
leaderworkerset.sigs.k8s.io/worker-index: "0"
{{- end }}
{{- end -}}

{{- define "teacher-server.validate" -}}
{{- $s := .Values.shutdown -}}
{{- $need := add $s.preStopSleepSeconds $s.drainTimeoutSeconds $s.exitMarginSeconds | int -}}
{{- if lt (include "teacher-server.terminationGracePeriod" . | int) $need -}}
{{- fail (printf "shutdown.terminationGracePeriodSeconds (%v) must be at least shutdown.preStopSleepSeconds + shutdown.drainTimeoutSeconds + shutdown.exitMarginSeconds (%v + %v + %v), or the kubelet kills requests that are still draining; leave it null to derive it" $s.terminationGracePeriodSeconds $s.preStopSleepSeconds $s.drainTimeoutSeconds $s.exitMarginSeconds) -}}
{{- end -}}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.create -}}
{{- fail "apiKey: set either existingSecret or create, not both" -}}
{{- end -}}
{{- $world := mul (int .Values.tensorParallelSize) (int .Values.pipelineParallelSize) -}}
{{- if gt (int .Values.nnodes) 1 -}}
{{- if mod $world (int .Values.nnodes) -}}
{{- fail (printf "nnodes (%v) must divide pipelineParallelSize x tensorParallelSize (%v): each pod holds world / nnodes ranks" .Values.nnodes $world) -}}
{{- end -}}
{{- if or (gt (int .Values.dataParallelSize) 1) .Values.config.teachers -}}
{{- fail "nnodes > 1 spreads one model over pods: not with dataParallelSize > 1 or config.teachers" -}}
{{- end -}}
{{- if or .Values.autoscaling.enabled .Values.networkPolicy.enabled -}}
{{- fail "nnodes > 1 (a LeaderWorkerSet): not with autoscaling (it scales a Deployment) or networkPolicy (the ranks' NCCL connections use ports chosen at run time)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling.minReplicas (%v) is above autoscaling.maxReplicas (%v)" .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) -}}
{{- end -}}
{{- end -}}
