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
{{- if and (ne .engine "sim") (not .model.path) (not .model.huggingface.repo) }}
{{- fail (printf "servingEngineSpec.modelSpec[%s]: engine %s needs model.path or model.huggingface.repo" .name .engine) }}
{{- end }}
{{- if and .model.huggingface.repo (eq .model.storage.type "none") }}
{{- fail (printf "servingEngineSpec.modelSpec[%s]: model.huggingface.repo needs a model.storage volume to download into" .name) }}
{{- end }}
{{- if and (eq .engine "radix") (gt (int .gpu.count) 1) }}
{{- fail (printf "servingEngineSpec.modelSpec[%s]: engine radix runs on one GPU per pod; a model that needs tensor parallelism uses engine vllm or sglang" .name) }}
{{- end }}
{{- $stop := add (int (default 0 .config.shutdown_delay)) (int (default 30 .config.drain_timeout)) }}
{{- if has .engine (list "sglang" "vllm") }}{{ $stop = add (int .preStopSleepSeconds) 30 }}{{ end }}
{{- if lt (int .terminationGracePeriodSeconds) (int $stop) }}
{{- fail (printf "servingEngineSpec.modelSpec[%s].terminationGracePeriodSeconds (%d) must cover the shutdown delay and the drain (%d s)" .name (int .terminationGracePeriodSeconds) (int $stop)) }}
{{- end }}
{{- end }}
{{- $r := .Values.routerSpec }}
{{- $rstop := add (int $r.preStopSleepSeconds) (int (default 30 $r.config.drain_timeout)) }}
{{- if lt (int $r.terminationGracePeriodSeconds) (int $rstop) }}
{{- fail (printf "routerSpec.terminationGracePeriodSeconds (%d) must cover preStopSleepSeconds + config.drain_timeout (%d s)" (int $r.terminationGracePeriodSeconds) (int $rstop)) }}
{{- end }}
{{- end }}

{{/* Is a model entry a stock engine (its own image, with the attach sidecar)? "true"/"". */}}
{{- define "radix-router.isStock" -}}
{{- if has .engine (list "sglang" "vllm") }}true{{ end }}
{{- end }}

{{/* The folder the engine loads: model.path, or <mountPath>/<name> for a Hub download. */}}
{{- define "radix-router.modelPath" -}}
{{- if .model.path }}{{ .model.path }}
{{- else if .model.huggingface.repo }}{{ printf "%s/%s" (trimSuffix "/" .model.storage.mountPath) .name }}
{{- end }}
{{- end }}

{{/* Pod-level extension points shared by every workload. Call with the spec map. */}}
{{- define "radix-router.podExtras" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Environment shared by both services: the Redis URL. External Redis: the whole URL from
its Secret. Built-in Redis: the password from its Secret, put into the URL by the
kubelet's $(VAR) expansion (so the password must be URL-safe; the generated one is).
Call with (list $ "ROUTER").
*/}}
{{- define "radix-router.redisEnv" -}}
{{- $ := index . 0 }}{{- $role := index . 1 }}
{{- $b := $.Values.redis.builtin }}
{{- if $b.enabled }}
{{- $host := printf "%s.%s.svc:%d" (include "radix-router.redisName" $) $.Release.Namespace (int $b.port) }}
{{- if and $b.auth.enabled (eq $role "WORKER") }}
{{- /* User radix-worker-<pod name>; the password file is the pod's own (worker-statefulset.yaml). */}}
- name: RADIX_WORKER_REDIS_URL
  value: "redis://radix-worker-$(POD_NAME)@{{ $host }}/0"
- name: RADIX_WORKER_REDIS_PASSWORD_FILE
  value: /run/radix-redis/password
{{- else if $b.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "radix-router.redisPasswordSecretName" $ }}
      key: {{ $b.auth.routerPasswordKey }}
- name: RADIX_{{ $role }}_REDIS_URL
  value: "redis://radix-router:$(REDIS_PASSWORD)@{{ $host }}/0"
{{- else }}
- name: RADIX_{{ $role }}_REDIS_URL
  value: "redis://{{ $host }}/0"
{{- end }}
{{- else }}
{{- $x := $.Values.redis.external }}
- name: RADIX_{{ $role }}_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "radix-router.redisUrlSecretName" $ }}
      {{- if and (eq $role "WORKER") $x.existingSecret $x.workerExistingSecretKey }}
      key: {{ $x.workerExistingSecretKey }}
      {{- else }}
      key: {{ include "radix-router.redisUrlSecretKey" $ }}
      {{- end }}
{{- end }}
{{- end }}

{{/*
Redis ACL rules (after "user NAME on >PASSWORD"), for the built-in Redis and documented
for an external one (chart README). Keys and channels are limited to the fleet's prefix.
Routers read worker records and KV-event streams but cannot write them (%R~, Redis 7+;
a selector lets them XTRIM the streams alone: a worker's own MAXLEN is not trusted); they
own the sync stream, their load hashes and the rate-limit cells. Each worker pod (or its attach
sidecar) may only write its own heartbeat record and publish join/leave events: membership
is the heartbeat records themselves (routers SCAN them), so no worker can erase or forge
another (shared/wire/registry.py).
*/}}
{{- define "radix-router.redisAclRouter" -}}
{{- $p := .Values.redisPrefix -}}
resetkeys %R~{{ $p }}worker:* %R~{{ $p }}kvevents:* ~{{ $p }}decisions ~{{ $p }}router:* ~{{ $p }}ratelimit:* resetchannels &{{ $p }}events -@all +@connection +@read +@write +@keyspace +@stream +@pubsub +@scripting +@transaction +time -@dangerous (~{{ $p }}kvevents:* +xtrim)
{{- end }}

{{/*
One worker pod's rules: its own heartbeat hash only (its id is its pod name) and the
events channel. Call with (list $ $podName).
*/}}
{{- define "radix-router.redisAclWorker" -}}
{{- $ := index . 0 }}{{- $pod := index . 1 }}{{- $p := $.Values.redisPrefix -}}
resetkeys ~{{ $p }}worker:{{ $pod }} ~{{ $p }}kvevents:{{ $pod }} resetchannels &{{ $p }}events -@all +@connection -@dangerous +hset +pexpire +del +publish +multi +exec +discard +xadd
{{- end }}

{{/*
True (non-empty) when each worker pod logs in as its own Redis user: the built-in Redis
with auth. Its passwords live in their own Secret, one key per pod name.
*/}}
{{- define "radix-router.perWorkerUsers" -}}
{{- if and .Values.redis.builtin.enabled .Values.redis.builtin.auth.enabled }}true{{ end }}
{{- end }}

{{- define "radix-router.workerPasswordsSecretName" -}}
{{- printf "%s-workers" (include "radix-router.redisName" .) }}
{{- end }}

{{/*
The pod names one model entry's StatefulSet can have, as JSON {"pods": [...]}: ordinals
0 .. n-1, n being replicaCount, or keda.maxReplicaCount when KEDA scales the entry (the
scaler never goes past it). A pod past them (a manual `kubectl scale`) finds no
credential and its init container fails saying so. Call with (list $ $model).
*/}}
{{- define "radix-router.workerPods" -}}
{{- $ := index . 0 }}{{- $m := index . 1 }}
{{- $name := include "radix-router.workerName" (list $ $m) }}
{{- $n := ternary $m.keda.maxReplicaCount $m.replicaCount (and $m.keda $m.keda.enabled | default false) }}
{{- $pods := list }}
{{- range $i := until (int $n) }}
{{- $pods = append $pods (printf "%s-%d" $name $i) }}
{{- end }}
{{- toJson (dict "pods" $pods) }}
{{- end }}

{{/* Every worker pod name of the release, as JSON {"pods": [...]}. */}}
{{- define "radix-router.allWorkerPods" -}}
{{- $all := list }}
{{- range (include "radix-router.models" . | fromYaml).models }}
{{- $all = concat $all (include "radix-router.workerPods" (list $ .) | fromJson).pods }}
{{- end }}
{{- toJson (dict "pods" $all) }}
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
{{- else if .model.huggingface.repo }}{{ base .model.huggingface.repo }}
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
{{- with include "radix-router.modelPath" $m }}{{ $_ := set $cfg "model" . }}{{ end }}
{{- $_ := set $cfg "served_model_name" (include "radix-router.servedModelName" $m) }}
{{- toYaml (mergeOverwrite (deepCopy (default dict $m.config)) $cfg) }}
{{- end }}

{{/*
A worker pod's identity and Redis URL (our worker, or the attach sidecar of a stock
engine): the pod's stable name is its worker id; routers dial the advertised URL.
Call with (list $ $statefulSetName).
*/}}
{{- define "radix-router.workerIdentityEnv" -}}
{{- $ := index . 0 }}{{- $name := index . 1 }}
{{- $e := $.Values.servingEngineSpec }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RADIX_WORKER_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: RADIX_WORKER_ADVERTISE_URL
  {{- if eq $e.advertise "dns" }}
  value: "http://$(POD_NAME).{{ $name }}.$(POD_NAMESPACE).svc:{{ $e.port }}"
  {{- else }}
  value: "http://$(POD_IP):{{ $e.port }}"
  {{- end }}
{{ include "radix-router.redisEnv" (list $ "WORKER") | trim }}
{{- end }}
