{{/*
Helpers shared by every template. Each takes either the root context (.) or a dict
with "root" (the root context) and the named arguments documented on it.
*/}}

{{/*
cachepoint.name: the chart name, or .Values.nameOverride. Used as app.kubernetes.io/name.
Takes: the root context.
*/}}
{{- define "cachepoint.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
cachepoint.fullname: the prefix of every object name: <release>-<chart>, or the release
name alone when it already contains the chart name, or .Values.fullnameOverride.
Truncated to 40 characters so that "<fullname>-otel-collector" stays a valid name.
Takes: the root context.
*/}}
{{- define "cachepoint.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
cachepoint.componentName: "<fullname>-<component>", the name of a component's objects.
Takes: dict "root" and "component" (e.g. "gateway").
*/}}
{{- define "cachepoint.componentName" -}}
{{- printf "%s-%s" (include "cachepoint.fullname" .root) .component }}
{{- end }}

{{/*
cachepoint.chart: "<chart>-<version>" for the helm.sh/chart label.
Takes: the root context.
*/}}
{{- define "cachepoint.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
cachepoint.selectorLabels: the immutable labels that select a component's pods
(Deployment/StatefulSet selectors, Services, the PodDisruptionBudget).
Takes: dict "root" and "component".
*/}}
{{- define "cachepoint.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachepoint.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
cachepoint.labels: the full app.kubernetes.io/* label set for any object of a component,
plus helm.sh/chart and .Values.commonLabels.
Takes: dict "root" and "component".
*/}}
{{- define "cachepoint.labels" -}}
helm.sh/chart: {{ include "cachepoint.chart" .root }}
{{ include "cachepoint.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: cachepoint
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
cachepoint.image: "<registry>/<repository>:<tag>" for one of Cachepoint's own images;
the tag defaults to the chart's appVersion and the registry to global.imageRegistry.
Takes: dict "root" and "image" (a values block with repository and tag).
*/}}
{{- define "cachepoint.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion }}
{{- with .root.Values.global.imageRegistry }}
{{- printf "%s/%s:%s" (trimSuffix "/" .) $.image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/*
cachepoint.thirdPartyImage: "<repository>:<tag>" for NATS, PostgreSQL, the collector and
Jaeger: pinned upstream images, never prefixed with global.imageRegistry.
Takes: a values block with repository and tag.
*/}}
{{- define "cachepoint.thirdPartyImage" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{/*
cachepoint.imagePullSecrets: the imagePullSecrets block for a pod spec (or nothing).
Takes: the root context.
*/}}
{{- define "cachepoint.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
cachepoint.serviceAccountName: the ServiceAccount a component runs as.
Takes: dict "root", "component" and "serviceAccount" (the component's values block).
*/}}
{{- define "cachepoint.serviceAccountName" -}}
{{- if .serviceAccount.create }}
{{- default (include "cachepoint.componentName" .) .serviceAccount.name }}
{{- else }}
{{- default "default" .serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
cachepoint.natsUrl: where every component finds NATS: the builtin server's Service, or
nats.url in external mode (required there).
Takes: the root context.
*/}}
{{- define "cachepoint.natsUrl" -}}
{{- if eq .Values.nats.mode "external" }}
{{- required "nats.url is required when nats.mode is external" .Values.nats.url }}
{{- else }}
{{- /* Fully qualified: member pods live in other namespaces than the release's. */}}
{{- printf "nats://%s.%s.svc.cluster.local:4222" (include "cachepoint.componentName" (dict "root" . "component" "nats")) .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
cachepoint.authSecretName: the Secret with the gateway's NATS password
(nats-gateway-password) and the replicas' internal token (internal-token):
auth.existingSecret when given, else the chart's own.
Takes: the root context.
*/}}
{{- define "cachepoint.authSecretName" -}}
{{- .Values.auth.existingSecret | default (include "cachepoint.componentName" (dict "root" . "component" "auth")) }}
{{- end }}

{{/*
cachepoint.natsUsersSecretName: the NATS users include (users.conf) that the operator
rebuilds from every CacheReplica's members.
Takes: the root context.
*/}}
{{- define "cachepoint.natsUsersSecretName" -}}
{{- include "cachepoint.componentName" (dict "root" . "component" "nats-users") }}
{{- end }}

{{/*
cachepoint.keptSecret: one key of a chart Secret, generated once and then kept: the
value already stored in the live Secret (so upgrades keep it), else a new random one.
Takes: dict "root", "name" (the Secret) and "key".
*/}}
{{- define "cachepoint.keptSecret" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing $existing.data (hasKey $existing.data .key) }}
{{- index $existing.data .key | b64dec }}
{{- else }}
{{- randAlphaNum 40 }}
{{- end }}
{{- end }}

{{/*
cachepoint.otlpEndpoint: the OTLP/gRPC endpoint components export traces to: the chart's
collector when tracing.enabled, else tracing.otlpEndpoint (possibly empty: no tracing).
Takes: the root context.
*/}}
{{- define "cachepoint.otlpEndpoint" -}}
{{- if .Values.tracing.enabled }}
{{- printf "http://%s:4317" (include "cachepoint.componentName" (dict "root" . "component" "otel-collector")) }}
{{- else }}
{{- .Values.tracing.otlpEndpoint }}
{{- end }}
{{- end }}

{{/*
cachepoint.otelEnv: the OTEL_* environment of a container, when there is an endpoint.
Takes: dict "root" and "component" (used as the service name suffix).
*/}}
{{- define "cachepoint.otelEnv" -}}
{{- $endpoint := include "cachepoint.otlpEndpoint" .root }}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "cachepoint-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,deployment.environment=%s" .root.Release.Namespace .root.Release.Name | quote }}
{{- end }}
{{- end }}

{{/*
cachepoint.databaseSecretName / cachepoint.databaseSecretKey: where the gateway reads its
SQLAlchemy URL: postgresql.external.existingSecret when given, else the chart's Secret.
Takes: the root context.
*/}}
{{- define "cachepoint.databaseSecretName" -}}
{{- if and (eq .Values.postgresql.mode "external") .Values.postgresql.external.existingSecret }}
{{- .Values.postgresql.external.existingSecret }}
{{- else }}
{{- include "cachepoint.componentName" (dict "root" . "component" "gateway-db") }}
{{- end }}
{{- end }}

{{- define "cachepoint.databaseSecretKey" -}}
{{- if and (eq .Values.postgresql.mode "external") .Values.postgresql.external.existingSecret }}
{{- .Values.postgresql.external.existingSecretKey }}
{{- else }}
{{- "DATABASE_URL" }}
{{- end }}
{{- end }}

{{/*
cachepoint.postgresqlPassword: the builtin database's password: postgresql.password, else
the one already stored in the release's Secret (so upgrades keep it), else a new random one.
Called once per render, from secret-gateway-db.yaml only, so both keys agree.
Takes: the root context.
*/}}
{{- define "cachepoint.postgresqlPassword" -}}
{{- if .Values.postgresql.password }}
{{- .Values.postgresql.password }}
{{- else }}
{{- $name := include "cachepoint.componentName" (dict "root" . "component" "gateway-db") }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name }}
{{- if and $existing (hasKey $existing.data "POSTGRES_PASSWORD") }}
{{- index $existing.data "POSTGRES_PASSWORD" | b64dec }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
cachepoint.podSecurityContext / cachepoint.containerSecurityContext: the restricted Pod
Security Standard for Cachepoint's own containers (images run as uid 10001).
Takes: nothing (the root context is ignored).
*/}}
{{- define "cachepoint.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "cachepoint.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/*
cachepoint.replicaImage: the default image of a CacheReplica entry: the CPU image when
it asks for no GPUs (gpusPerPod: 0), the CUDA image otherwise.
Takes: dict "root" and "replica" (one entry of .Values.replicas).
*/}}
{{- define "cachepoint.replicaImage" -}}
{{- if and (hasKey .replica "gpusPerPod") (eq (int .replica.gpusPerPod) 0) }}
{{- include "cachepoint.image" (dict "root" .root "image" .root.Values.replicaImages.cpu) }}
{{- else }}
{{- include "cachepoint.image" (dict "root" .root "image" .root.Values.replicaImages.cuda) }}
{{- end }}
{{- end }}

{{/*
cachepoint.operatorRules: the operator's permissions, least privilege. It reads and
watches CacheReplicas and patches them (finalizer, kopf's progress annotations) and
their status; lists, creates and deletes member pods; reads, creates, patches and
deletes the headless Service; posts Events; reads, creates, patches and deletes each
CacheReplica's credentials Secret (no list or watch: it never reads other Secrets in
bulk). Nothing cluster-wide beyond these
resources: kopf's CRD and namespace scanning is disabled (operator/handlers.py).
Shared by the ClusterRole (all namespaces) and the per-namespace Roles.
Takes: nothing.
*/}}
{{- define "cachepoint.operatorRules" -}}
- apiGroups: [cachepoint.dev]
  resources: [cachereplicas]
  verbs: [get, list, watch, patch]
- apiGroups: [cachepoint.dev]
  resources: [cachereplicas/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, create, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch, delete]
{{- end }}

{{/*
cachepoint.replicaPodLabels: labels every CacheReplica member pod carries, whatever its
CacheReplica (set by the operator, operator/naming.py common_labels), for selectors.
Takes: nothing (the root context is ignored).
*/}}
{{- define "cachepoint.replicaPodLabels" -}}
app.kubernetes.io/name: cachepoint-replica
app.kubernetes.io/component: replica
app.kubernetes.io/managed-by: cachepoint-operator
{{- end }}
