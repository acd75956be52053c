{{/*
The Pod of one llama-server and its kvtier sidecar. Both mount the slot directory: llama-server
writes slot states there (--slot-save-path) and kvtier reads, splits and assembles them (--slot-dir).
*/}}

{{/* Paths inside the containers. */}}
{{- define "kvtier.paths.authToken" -}}/etc/kvtier/auth/token{{- end }}
{{- define "kvtier.paths.config" -}}/etc/kvtier/config/config.yaml{{- end }}
{{- define "kvtier.paths.redisTls" -}}/etc/kvtier/redis-tls{{- end }}

{{/* The slot directory without a trailing slash. */}}
{{- define "kvtier.slotDir" -}}
{{- trimSuffix "/" .Values.slots.mountPath }}
{{- end }}

{{/* ---------------------------------------------------------------- llama-server */}}

{{- define "kvtier.llama.args" -}}
{{- $l := .Values.llama -}}
- -m
- {{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.file | quote }}
# Pod-local: only the sidecar (same network namespace) reaches llama-server.
- --host
- 127.0.0.1
- --port
- {{ int $l.port | quote }}
- -c
- {{ int $l.contextSize | quote }}
- -np
- {{ int $l.parallel | quote }}
# Trailing slash: llama-server joins this path and the file name by plain concatenation.
- --slot-save-path
- {{ printf "%s/" (include "kvtier.slotDir" .) | quote }}
- -fa
- {{ $l.flashAttention | quote }}
- -ctk
- {{ $l.cacheTypeK | quote }}
- -ctv
- {{ $l.cacheTypeV | quote }}
{{- if not (kindIs "invalid" $l.threads) }}
- -t
- {{ int $l.threads | quote }}
{{- end }}
{{- if not (kindIs "invalid" $l.gpuLayers) }}
- -ngl
- {{ int $l.gpuLayers | quote }}
{{- else if .Values.gpu.enabled }}
- -ngl
- "999"
{{- end }}
{{- if not (kindIs "invalid" $l.cacheRamMiB) }}
- --cache-ram
- {{ int $l.cacheRamMiB | quote }}
{{- end }}
{{- if $l.metrics }}
- --metrics
{{- end }}
{{- with $l.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvtier.llama.healthCommand" -}}
exec:
  command: ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:{{ int .Values.llama.port }}/health"]
{{- end }}

{{- define "kvtier.llama.container" -}}
{{- $l := .Values.llama -}}
name: llama-server
image: {{ include "kvtier.llama.image" . | quote }}
imagePullPolicy: {{ $l.image.pullPolicy }}
args:
  {{- include "kvtier.llama.args" . | nindent 2 }}
{{- with $l.extraEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
# No ports: llama-server listens on 127.0.0.1 and is reached through the sidecar.
startupProbe:
  {{- include "kvtier.llama.healthCommand" . | nindent 2 }}
  {{- toYaml $l.startupProbe | nindent 2 }}
livenessProbe:
  {{- include "kvtier.llama.healthCommand" . | nindent 2 }}
  {{- toYaml $l.livenessProbe | nindent 2 }}
{{- if $l.preStopSleepSeconds }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ int $l.preStopSleepSeconds | quote }}]
{{- end }}
{{- $resources := deepCopy ($l.resources | default dict) }}
{{- if .Values.gpu.enabled }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.gpu.count) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- with $resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $l.securityContext | nindent 2 }}
volumeMounts:
  - name: slots
    mountPath: {{ include "kvtier.slotDir" . }}
  - name: model
    mountPath: {{ .Values.model.mountPath }}
    readOnly: true
  - name: llama-tmp
    mountPath: /tmp
  {{- with $l.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- kvtier */}}

{{- define "kvtier.sidecar.args" -}}
{{- $k := .Values.kvtier -}}
- --listen
- {{ printf "0.0.0.0:%d" (int $k.port) | quote }}
- --llama-url
- {{ printf "http://127.0.0.1:%d" (int .Values.llama.port) | quote }}
- --slot-dir
- {{ include "kvtier.slotDir" . | quote }}
- --cache-size
- {{ $k.cacheSize | quote }}
- --chunk-tokens
- {{ int $k.chunkTokens | quote }}
- --compress
- {{ $k.compress | quote }}
- --log-format
- {{ $k.logFormat | quote }}
{{- if not (kindIs "invalid" .Values.llama.cacheRamMiB) }}
- --llama-cache-ram
- {{ int .Values.llama.cacheRamMiB | quote }}
{{- end }}
{{- if not (kindIs "invalid" $k.ttl) }}
- --ttl
- {{ int $k.ttl | quote }}
{{- end }}
{{- if $k.sharedTier.enabled }}
- --shared-dir
- {{ $k.sharedTier.mountPath | quote }}
- --shared-size
- {{ $k.sharedTier.size | quote }}
{{- end }}
{{- if include "kvtier.advertise" . }}
# Where peers reach this sidecar: the Pod IP (KVTIER_POD_IP, downward API), expanded by the kubelet.
- --advertise-url
- {{ printf "http://$(KVTIER_POD_IP):%d" (int $k.port) | quote }}
{{- end }}
{{- if include "kvtier.forwarding" . }}
- --forward
{{- end }}
{{- if $k.auth.enabled }}
- --auth-token-file
- {{ include "kvtier.paths.authToken" . | quote }}
{{- end }}
{{- if $k.config }}
- --config
- {{ include "kvtier.paths.config" . | quote }}
{{- end }}
{{- with $k.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Redis settings as KVTIER_* variables; kvtier merges username and password into the URL. */}}
{{- define "kvtier.sidecar.redisEnv" -}}
{{- $redis := .Values.redis -}}
{{- if eq $redis.mode "bundled" }}
- name: KVTIER_REDIS_URL
  value: {{ include "kvtier.redis.bundledUrl" . | quote }}
{{- else if eq $redis.mode "external" }}
{{- $external := $redis.external }}
{{- if and $external.existingSecret $external.existingSecretUrlKey }}
- name: KVTIER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $external.existingSecret }}
      key: {{ $external.existingSecretUrlKey }}
{{- else }}
- name: KVTIER_REDIS_URL
  value: {{ $external.url | quote }}
{{- end }}
{{- if $external.existingSecretUsernameKey }}
- name: KVTIER_REDIS_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $external.existingSecret }}
      key: {{ $external.existingSecretUsernameKey }}
{{- else if $external.username }}
- name: KVTIER_REDIS_USERNAME
  value: {{ $external.username | quote }}
{{- end }}
{{- if $external.tls.existingSecret }}
# The private CA that signed the Redis server's certificate (Python's ssl honours SSL_CERT_FILE).
- name: SSL_CERT_FILE
  value: {{ printf "%s/ca.crt" (include "kvtier.paths.redisTls" .) | quote }}
{{- end }}
{{- end }}
{{- with include "kvtier.redis.passwordRef" . }}
- name: KVTIER_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- end }}

{{- define "kvtier.sidecar.container" -}}
{{- $k := .Values.kvtier -}}
name: kvtier
image: {{ include "kvtier.sidecar.image" . | quote }}
imagePullPolicy: {{ $k.image.pullPolicy }}
{{- if $k.nativeSidecar }}
# Native sidecar: started before llama-server, stopped after it.
restartPolicy: Always
{{- end }}
# The image's entrypoint is `kvtier serve`.
args:
  {{- include "kvtier.sidecar.args" . | nindent 2 }}
env:
  - name: KVTIER_NODE_ID
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- if include "kvtier.advertise" . }}
  - name: KVTIER_POD_IP
    valueFrom:
      fieldRef:
        fieldPath: status.podIP
  {{- end }}
  {{- with include "kvtier.sidecar.redisEnv" . | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- if include "kvtier.chunkKey" . }}
  # The fleet secret: the MAC on stored values and on the fleet status peers forward by.
  - name: KVTIER_CHUNK_KEY
    valueFrom:
      secretKeyRef:
        {{- include "kvtier.chunkKeyRef" . | nindent 8 }}
  {{- end }}
  {{- with $k.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: http
    containerPort: {{ int $k.port }}
    protocol: TCP
startupProbe:
  httpGet:
    path: /healthz
    port: {{ int $k.port }}
  {{- toYaml $k.startupProbe | nindent 2 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ int $k.port }}
  {{- toYaml $k.livenessProbe | nindent 2 }}
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ int $k.port }}
  {{- toYaml $k.readinessProbe | nindent 2 }}
{{- with $k.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $k.securityContext | nindent 2 }}
volumeMounts:
  - name: slots
    mountPath: {{ include "kvtier.slotDir" . }}
  - name: kvtier-tmp
    mountPath: /tmp
  {{- if $k.sharedTier.enabled }}
  - name: shared-tier
    mountPath: {{ $k.sharedTier.mountPath }}
  {{- end }}
  {{- if $k.auth.enabled }}
  - name: auth-token
    mountPath: {{ dir (include "kvtier.paths.authToken" .) }}
    readOnly: true
  {{- end }}
  {{- if $k.config }}
  - name: config
    mountPath: {{ dir (include "kvtier.paths.config" .) }}
    readOnly: true
  {{- end }}
  {{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.existingSecret }}
  - name: redis-tls
    mountPath: {{ include "kvtier.paths.redisTls" . }}
    readOnly: true
  {{- end }}
  {{- with $k.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- volumes */}}

{{- define "kvtier.volumes" -}}
{{- $k := .Values.kvtier -}}
- name: slots
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.slots.sizeLimit }}
- name: model
  {{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
  {{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
  {{- else if eq .Values.model.source "image" }}
  image:
    reference: {{ .Values.model.image.reference }}
    pullPolicy: {{ .Values.model.image.pullPolicy }}
  {{- end }}
- name: llama-tmp
  emptyDir: {}
- name: kvtier-tmp
  emptyDir:
    sizeLimit: {{ $k.tmpSizeLimit }}
{{- if $k.sharedTier.enabled }}
- name: shared-tier
  emptyDir:
    medium: Memory
    sizeLimit: {{ $k.sharedTier.sizeLimit }}
{{- end }}
{{- if $k.auth.enabled }}
# 0444: readable by the non-root sidecar without a Pod fsGroup (an fsGroup would have the kubelet
# chown the model volume). Only the sidecar mounts these Secrets.
- name: auth-token
  secret:
    secretName: {{ include "kvtier.authSecretName" . }}
    defaultMode: 0444
    items:
      - key: {{ include "kvtier.authSecretKey" . }}
        path: {{ base (include "kvtier.paths.authToken" .) }}
{{- end }}
{{- if $k.config }}
- name: config
  configMap:
    name: {{ include "kvtier.fullname" . }}-config
{{- end }}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.existingSecret }}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.external.tls.existingSecret }}
    defaultMode: 0444
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- the Pod template */}}

{{- define "kvtier.podTemplate" -}}
metadata:
  labels:
    {{- include "kvtier.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Roll the Pods when their Secret or configuration changes.
    checksum/secret: {{ include "kvtier.secretData" . | sha256sum }}
    checksum/config: {{ toYaml .Values.kvtier.config | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "kvtier.serviceAccountName" . }}
  # Neither container talks to the Kubernetes API.
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ int .Values.workload.terminationGracePeriodSeconds }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- if .Values.kvtier.nativeSidecar }}
  initContainers:
    - {{ include "kvtier.sidecar.container" . | nindent 6 | trim }}
  {{- end }}
  containers:
    - {{ include "kvtier.llama.container" . | nindent 6 | trim }}
    {{- if not .Values.kvtier.nativeSidecar }}
    - {{ include "kvtier.sidecar.container" . | nindent 6 | trim }}
    {{- end }}
  volumes:
    {{- include "kvtier.volumes" . | nindent 4 }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
