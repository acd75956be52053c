{{/* ---------------------------------------------------------------- names and labels */}}

{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name, truncated to 63 characters (DNS-1123 label) less room for "-redis-headless". */}}
{{- define "kvtier.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvtier.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component. Argument: (list $root "server"|"redis"). */}}
{{- define "kvtier.componentSelectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvtier.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* All labels of one component. Argument: (list $root "server"|"redis"). */}}
{{- define "kvtier.componentLabels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "kvtier.chart" $root }}
{{ include "kvtier.componentSelectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: kvtier
{{- end }}

{{/* The llama-server + kvtier Pods. */}}
{{- define "kvtier.labels" -}}
{{ include "kvtier.componentLabels" (list . "server") }}
{{- end }}

{{- define "kvtier.selectorLabels" -}}
{{ include "kvtier.componentSelectorLabels" (list . "server") }}
{{- end }}

{{/* The bundled Redis. */}}
{{- define "kvtier.redis.labels" -}}
{{ include "kvtier.componentLabels" (list . "redis") }}
{{- end }}

{{- define "kvtier.redis.selectorLabels" -}}
{{ include "kvtier.componentSelectorLabels" (list . "redis") }}
{{- end }}

{{- define "kvtier.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvtier.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- images */}}

{{/* repository[:tag][@digest]. Argument: (dict "image" .Values.x.image "tag" defaultTag). */}}
{{- define "kvtier.imageRef" -}}
{{- $tag := .image.tag | default .tag -}}
{{- .image.repository }}{{ if $tag }}:{{ $tag }}{{ end }}{{ if .image.digest }}@{{ .image.digest }}{{ end }}
{{- end }}

{{- define "kvtier.llama.image" -}}
{{- $image := deepCopy .Values.llama.image -}}
{{- if .Values.gpu.enabled }}{{ $_ := set $image "tag" .Values.gpu.imageTag }}{{ end -}}
{{- include "kvtier.imageRef" (dict "image" $image "tag" "server") }}
{{- end }}

{{- define "kvtier.sidecar.image" -}}
{{- include "kvtier.imageRef" (dict "image" .Values.kvtier.image "tag" .Chart.AppVersion) }}
{{- end }}

{{- define "kvtier.redis.image" -}}
{{- include "kvtier.imageRef" (dict "image" .Values.redis.bundled.image "tag" "") }}
{{- end }}

{{/* ---------------------------------------------------------------- Redis */}}

{{- define "kvtier.redis.fullname" -}}
{{- printf "%s-redis" (include "kvtier.fullname" .) }}
{{- end }}

{{/* The bundled server's URL, by Service DNS name (no credentials: they come from a Secret). */}}
{{- define "kvtier.redis.bundledUrl" -}}
{{- printf "redis://%s.%s.svc:%d/0" (include "kvtier.redis.fullname" .) .Release.Namespace (int .Values.redis.bundled.port) }}
{{- end }}

{{/* "true" when the Redis password lives in the chart's own Secret (given in values or generated). */}}
{{- define "kvtier.redis.chartManagesPassword" -}}
{{- $redis := .Values.redis -}}
{{- if eq $redis.mode "bundled" -}}
{{- if not $redis.bundled.auth.existingSecret }}true{{ end -}}
{{- else if eq $redis.mode "external" -}}
{{- if and $redis.external.password (not (include "kvtier.redis.externalSecretHasPassword" .)) }}true{{ end -}}
{{- end -}}
{{- end }}

{{- define "kvtier.redis.externalSecretHasPassword" -}}
{{- if and .Values.redis.external.existingSecret .Values.redis.external.existingSecretPasswordKey }}true{{ end -}}
{{- end }}

{{/*
Where the Redis password lives, as "name: ...\nkey: ..." for a secretKeyRef, or "" when there is
no password. The bundled server and every sidecar read it from this one place.
*/}}
{{- define "kvtier.redis.passwordRef" -}}
{{- $redis := .Values.redis -}}
{{- if include "kvtier.redis.chartManagesPassword" . -}}
name: {{ include "kvtier.fullname" . }}
key: redis-password
{{- else if eq $redis.mode "bundled" -}}
name: {{ $redis.bundled.auth.existingSecret }}
key: {{ $redis.bundled.auth.existingSecretPasswordKey }}
{{- else if and (eq $redis.mode "external") (include "kvtier.redis.externalSecretHasPassword" .) -}}
name: {{ $redis.external.existingSecret }}
key: {{ $redis.external.existingSecretPasswordKey }}
{{- end -}}
{{- end }}

{{/* ---------------------------------------------------------------- the chart's Secret */}}

{{/*
Data (base64) of the chart-managed Secret, as YAML; empty when nothing needs it. Per key: the value
given in values, else the value already stored in the cluster (so upgrades keep a generated password
or token), else a new random one. Computed once per render and memoized on the root context, which
Helm shares between the templates of a chart: the checksum annotation on the Pods then hashes the
very data the Secret holds, also on the first install.
*/}}
{{- define "kvtier.secretData" -}}
{{- if not (hasKey . "kvtierSecretData") -}}
{{- $stored := (lookup "v1" "Secret" .Release.Namespace (include "kvtier.fullname" .)).data | default dict -}}
{{- $data := dict -}}
{{- $redis := .Values.redis -}}
{{- if include "kvtier.redis.chartManagesPassword" . -}}
{{- $given := ternary $redis.bundled.auth.password $redis.external.password (eq $redis.mode "bundled") -}}
{{- $_ := set $data "redis-password" (include "kvtier.secretValue" (list $given $stored "redis-password")) -}}
{{- end -}}
{{- if and .Values.kvtier.auth.enabled (not .Values.kvtier.auth.existingSecret) -}}
{{- $_ := set $data "auth-token" (include "kvtier.secretValue" (list .Values.kvtier.auth.token $stored "auth-token")) -}}
{{- end -}}
{{- if and (include "kvtier.chunkKey" .) (not .Values.kvtier.chunkKey.existingSecret) -}}
{{- $_ := set $data "chunk-key" (include "kvtier.secretValue" (list .Values.kvtier.chunkKey.key $stored "chunk-key")) -}}
{{- end -}}
{{- $_ := set . "kvtierSecretData" $data -}}
{{- end -}}
{{- with get . "kvtierSecretData" }}{{ toYaml . }}{{ end -}}
{{- end }}

{{/* Argument: (list given stored key): given value, else stored value, else random; base64. */}}
{{- define "kvtier.secretValue" -}}
{{- $given := index . 0 -}}
{{- $stored := index . 1 -}}
{{- $key := index . 2 -}}
{{- if $given -}}
{{- $given | b64enc -}}
{{- else if hasKey $stored $key -}}
{{- index $stored $key -}}
{{- else -}}
{{- randAlphaNum 40 | b64enc -}}
{{- end -}}
{{- end }}

{{/* The Secret that holds the sidecar's bearer token. */}}
{{- define "kvtier.authSecretName" -}}
{{- .Values.kvtier.auth.existingSecret | default (include "kvtier.fullname" .) }}
{{- end }}

{{- define "kvtier.authSecretKey" -}}
{{- if .Values.kvtier.auth.existingSecret }}{{ .Values.kvtier.auth.existingSecretKey }}{{ else }}auth-token{{ end }}
{{- end }}

{{/* ---------------------------------------------------------------- checks */}}

{{/* Cross-field checks the schema cannot express; each failure says what to change. */}}
{{- define "kvtier.validate" -}}
{{- $v := .Values -}}
{{- if and $v.kvtier.nativeSidecar (semverCompare "<1.29.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "kvtier.nativeSidecar=true needs Kubernetes >= 1.29 (native sidecar containers); this cluster is %s: set kvtier.nativeSidecar=false" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if eq (int $v.kvtier.port) (int $v.llama.port) -}}
{{- fail (printf "kvtier.port and llama.port are both %d: the sidecar and llama-server share the Pod's network, give them different ports" (int $v.llama.port)) -}}
{{- end -}}
{{- if eq $v.model.source "pvc" -}}
{{- if not $v.model.pvc.claimName }}{{ fail "model.source=pvc needs model.pvc.claimName (an existing PersistentVolumeClaim holding the model file)" }}{{ end -}}
{{- else if eq $v.model.source "hostPath" -}}
{{- if not $v.model.hostPath.path }}{{ fail "model.source=hostPath needs model.hostPath.path" }}{{ end -}}
{{- else if eq $v.model.source "image" -}}
{{- if not $v.model.image.reference }}{{ fail "model.source=image needs model.image.reference (an OCI image or artifact holding the model file)" }}{{ end -}}
{{- if semverCompare "<1.31.0-0" .Capabilities.KubeVersion.Version -}}
{{- fail (printf "model.source=image needs Kubernetes >= 1.31 (image volumes); this cluster is %s" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- if eq $v.redis.mode "external" -}}
{{- $external := $v.redis.external -}}
{{- if not (or $external.url (and $external.existingSecret $external.existingSecretUrlKey)) -}}
{{- fail "redis.mode=external needs redis.external.url, or redis.external.existingSecret with redis.external.existingSecretUrlKey" -}}
{{- end -}}
{{- if regexMatch "^[a-z+]+://[^/@]*:[^/@]*@" $external.url -}}
{{- fail "redis.external.url holds a password: remove it from the URL and set redis.external.password or redis.external.existingSecret (a password in a URL would sit in plain text in the Pod spec)" -}}
{{- end -}}
{{- if and $external.existingSecretUsernameKey (not $external.existingSecret) -}}
{{- fail "redis.external.existingSecretUsernameKey needs redis.external.existingSecret" -}}
{{- end -}}
{{- end -}}
{{- if and $v.podDisruptionBudget.enabled (not (kindIs "invalid" $v.podDisruptionBudget.minAvailable)) (not (kindIs "invalid" $v.podDisruptionBudget.maxUnavailable)) -}}
{{- fail "podDisruptionBudget: set either minAvailable or maxUnavailable, not both (set the other to null)" -}}
{{- end -}}
{{- if and (eq $v.redis.mode "none") (eq (toString $v.kvtier.forwarding.enabled) "true") -}}
{{- fail "kvtier.forwarding.enabled=true needs Redis (redis.mode bundled or external): the fleet view the sidecars forward by lives there" -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled $v.networkPolicy.egress.enabled (eq $v.redis.mode "external") (not $v.networkPolicy.egress.to) -}}
{{- fail "networkPolicy.egress.enabled with redis.mode=external needs a rule for that Redis in networkPolicy.egress.to (the Pods could not reach it)" -}}
{{- end -}}
{{- if and $v.autoscaling.enabled (lt (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) -}}
{{- fail "autoscaling.maxReplicas must be >= autoscaling.minReplicas" -}}
{{- end -}}
{{- end }}

{{/* ---------------------------------------------------------------- the fleet */}}

{{/* "true" when the sidecars forward requests to the peer holding their KV hot: kvtier.forwarding.enabled,
     or when it is null, whenever there is Redis and more than one replica (or the HPA may make more). */}}
{{- define "kvtier.forwarding" -}}
{{- $v := .Values -}}
{{- $f := $v.kvtier.forwarding.enabled -}}
{{- if ne $v.redis.mode "none" -}}
{{- if kindIs "invalid" $f -}}
{{- if or (gt (int $v.workload.replicas) 1) (and $v.autoscaling.enabled (gt (int $v.autoscaling.maxReplicas) 1)) }}true{{ end -}}
{{- else if $f }}true{{ end -}}
{{- end -}}
{{- end }}

{{/* "true" when the sidecars get the fleet secret (--chunk-key): always when they forward (kvtier refuses
     --forward without it), or when kvtier.chunkKey.enabled. */}}
{{- define "kvtier.chunkKey" -}}
{{- if or (include "kvtier.forwarding" .) .Values.kvtier.chunkKey.enabled }}true{{ end -}}
{{- end }}

{{/* The secretKeyRef of the fleet secret: kvtier.chunkKey.existingSecret, else the chart's Secret. */}}
{{- define "kvtier.chunkKeyRef" -}}
{{- $c := .Values.kvtier.chunkKey -}}
{{- if $c.existingSecret -}}
name: {{ $c.existingSecret }}
key: {{ $c.existingSecretKey }}
{{- else -}}
name: {{ include "kvtier.fullname" . }}
key: chunk-key
{{- end -}}
{{- end }}

{{/* "true" when the sidecars publish themselves in the fleet view (any Redis): peers may forward to them. */}}
{{- define "kvtier.advertise" -}}
{{- if ne .Values.redis.mode "none" }}true{{ end -}}
{{- end }}
