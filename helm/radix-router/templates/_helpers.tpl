{{/* Names, labels and the values several templates derive the same way. */}}

{{- define "radix-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Short enough that "<fullname>-worker-<model>-<ordinal>" stays a valid name. */}}
{{- define "radix-router.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 32 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 32 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 32 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "radix-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "radix-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radix-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "radix-router.labels" -}}
helm.sh/chart: {{ include "radix-router.chart" . }}
{{ include "radix-router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod selector of one component: router, worker or redis. Call with (list $ "router"). */}}
{{- define "radix-router.componentSelector" -}}
{{- $ := index . 0 -}}
{{ include "radix-router.selectorLabels" $ }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "radix-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "radix-router.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "radix-router.routerName" -}}
{{- printf "%s-router" (include "radix-router.fullname" .) }}
{{- end }}

{{- define "radix-router.redisName" -}}
{{- printf "%s-redis" (include "radix-router.fullname" .) }}
{{- end }}

{{/* Workers of one model entry. Call with (list $ $model). */}}
{{- define "radix-router.workerName" -}}
{{- printf "%s-worker-%s" (include "radix-router.fullname" (index . 0)) (index . 1).name }}
{{- end }}

{{- define "radix-router.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* External Redis: the Secret and key holding the full URL (password and TLS in it). */}}
{{- define "radix-router.redisUrlSecretName" -}}
{{- default (printf "%s-url" (include "radix-router.redisName" .)) .Values.redis.external.existingSecret }}
{{- end }}

{{- define "radix-router.redisUrlSecretKey" -}}
{{- ternary .Values.redis.external.existingSecretKey "redis-url" (ne .Values.redis.external.existingSecret "") }}
{{- end }}

{{- define "radix-router.redisPasswordSecretName" -}}
{{- default (printf "%s-auth" (include "radix-router.redisName" .)) .Values.redis.builtin.auth.existingSecret }}
{{- end }}

{{/* "true" when router replicas share routing decisions through Redis (issue 8). */}}
{{- define "radix-router.routerSync" -}}
{{- $r := .Values.routerSpec }}
{{- if eq (toString $r.sync) "auto" }}
{{- $max := int $r.replicaCount }}
{{- if $r.autoscaling.enabled }}{{ $max = int $r.autoscaling.maxReplicas }}{{ end }}
{{- ternary "true" "false" (gt $max 1) }}
{{- else }}
{{- ternary "true" "false" (eq (toString $r.sync) "true") }}
{{- end }}
{{- end }}

{{- define "radix-router.authSecretName" -}}
{{- default (printf "%s-auth" (include "radix-router.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Fail early on values the schema cannot express across keys. */}}
{{- define "radix-router.validate" -}}
{{- $r := .Values.redis }}
{{- if and (not $r.builtin.enabled) (not $r.external.url) (not $r.external.existingSecret) }}
{{- fail "redis: set redis.builtin.enabled=true, or redis.external.url, or redis.external.existingSecret" }}
{{- end }}
{{- if and $r.builtin.enabled (or $r.external.url $r.external.existingSecret) }}
{{- fail "redis: redis.external.* is set but redis.builtin.enabled is true; disable the built-in Redis to use an external one" }}
{{- end }}
{{- $names := dict }}
{{- range (include "radix-router.models" . | fromYaml).models }}
{{- if hasKey $names .name }}
{{- fail (printf "servingEngineSpec.modelSpec: name %q is used twice" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- if and (ne .engine "sim") (not .model.path) }}
{{- fail (printf "servingEngineSpec.modelSpec[%s].model.path is required for engine %s" .name .engine) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Environment shared by both services: the Redis URL. External Redis: the whole URL from
its Secret. Built-in Redis: the password from its Secret, put into the URL by the
kubelet's $(VAR) expansion (so the password must be URL-safe; the generated one is).
Call with (list $ "ROUTER").
*/}}
{{- define "radix-router.redisEnv" -}}
{{- $ := index . 0 }}
{{- $b := $.Values.redis.builtin }}
{{- if $b.enabled }}
{{- $host := printf "%s.%s.svc:%d" (include "radix-router.redisName" $) $.Release.Namespace (int $b.port) }}
{{- if $b.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "radix-router.redisPasswordSecretName" $ }}
      key: {{ $b.auth.existingSecretKey }}
- name: RADIX_{{ index . 1 }}_REDIS_URL
  value: "redis://:$(REDIS_PASSWORD)@{{ $host }}/0"
{{- else }}
- name: RADIX_{{ index . 1 }}_REDIS_URL
  value: "redis://{{ $host }}/0"
{{- end }}
{{- else }}
- name: RADIX_{{ index . 1 }}_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "radix-router.redisUrlSecretName" $ }}
      key: {{ include "radix-router.redisUrlSecretKey" $ }}
{{- end }}
{{- end }}

{{- define "radix-router.redisTlsVolume" -}}
{{- with .Values.redis.external.tls.caSecret }}
- name: redis-tls
  secret:
    secretName: {{ . }}
    items:
      - key: {{ $.Values.redis.external.tls.caKey }}
        path: ca.crt
{{- end }}
{{- end }}

{{- define "radix-router.redisTlsMount" -}}
{{- if .Values.redis.external.tls.caSecret }}
- name: redis-tls
  mountPath: /etc/radix-redis-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The model name clients send: servedModelName, else the model folder's name, else the entry's name. */}}
{{- define "radix-router.servedModelName" -}}
{{- if .model.servedModelName }}{{ .model.servedModelName }}
{{- else if .model.path }}{{ base .model.path }}
{{- else }}{{ .name }}{{ end }}
{{- end }}

{{/*
Recursive merge for modelSpec entries over modelDefaults: maps merge key by key, anything
else in the entry (lists, scalars, and also false, 0 and "", which sprig's mergeOverwrite
would skip) replaces the default. Returns YAML. Call with (list $defaults $entry).
*/}}
{{- define "radix-router.deepMerge" -}}
{{- $out := deepCopy (index . 0) }}
{{- range $k, $v := index . 1 }}
{{- $cur := index $out $k }}
{{- if and (kindIs "map" $v) (kindIs "map" $cur) }}
{{- $_ := set $out $k (include "radix-router.deepMerge" (list $cur $v) | fromYaml) }}
{{- else }}
{{- $_ := set $out $k $v }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* The modelSpec entries with modelDefaults filled in, as YAML {models: [...]}; use with fromYaml. */}}
{{- define "radix-router.models" -}}
{{- $e := .Values.servingEngineSpec }}
{{- $models := list }}
{{- range $e.modelSpec }}
{{- $models = append $models (include "radix-router.deepMerge" (list $e.modelDefaults .) | fromYaml) }}
{{- end }}
{{- toYaml (dict "models" $models) }}
{{- end }}

{{/* worker.yaml of one model entry (merged with modelDefaults). Call with (list $ $model). */}}
{{- define "radix-router.workerConfig" -}}
{{- $ := index . 0 }}{{- $m := index . 1 }}
{{- $cfg := dict "host" "0.0.0.0" "port" (int $.Values.servingEngineSpec.port) "engine" $m.engine "redis_prefix" $.Values.redisPrefix }}
{{- with $m.model.path }}{{ $_ := set $cfg "model" . }}{{ end }}
{{- $_ := set $cfg "served_model_name" (include "radix-router.servedModelName" $m) }}
{{- toYaml (mergeOverwrite (deepCopy (default dict $m.config)) $cfg) }}
{{- end }}
