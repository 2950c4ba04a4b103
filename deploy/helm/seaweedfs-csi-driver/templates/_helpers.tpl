{{- define "seaweedfs-csi-driver.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix: the release name, as in the Go driver's chart, so that a release
installed from that chart upgrades in place (same object names, same selectors). */}}
{{- define "seaweedfs-csi-driver.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "seaweedfs-csi-driver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "seaweedfs-csi-driver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels; call with (dict "ctx" . "component" "node"). spec.selector is immutable:
this is the Go chart's `app: <release>-<component>`, so `helm upgrade` of a release installed
from it does not fail (tests/deploy/go_chart_immutable.json). Do not change it. */}}
{{- define "seaweedfs-csi-driver.selector" -}}
app: {{ include "seaweedfs-csi-driver.fullname" .ctx }}-{{ .component }}
{{- end -}}

{{/* Pod template labels: the selector plus the recommended labels. */}}
{{- define "seaweedfs-csi-driver.podLabels" -}}
{{ include "seaweedfs-csi-driver.selector" . }}
app.kubernetes.io/name: {{ include "seaweedfs-csi-driver.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
The CSIDriver spec fields the API server refuses to change. `helm upgrade` would apply the
other objects and then fail on this one, half-way; so compare with the live object first
(lookup; empty without a cluster, e.g. helm template) and fail before anything changes.
Call with (dict "ctx" . "live" $liveObject "kubeVersion" .Capabilities.KubeVersion.Version).
fsGroupPolicy and podInfoOnMount became mutable in Kubernetes 1.29.
*/}}
{{- define "seaweedfs-csi-driver.csidriverImmutableCheck" -}}
{{- $v := .ctx.Values -}}
{{- $spec := dig "spec" dict (.live | default dict) -}}
{{- if .live -}}
{{- $fields := list -}}
{{- $have := list -}}
{{- $want := list -}}
{{- $keep := list -}}
{{- $live := hasKey $spec "attachRequired" | ternary $spec.attachRequired true -}}
{{- if ne (toString $live) (toString $v.csiAttacher.enabled) -}}
{{- $fields = append $fields "attachRequired" -}}
{{- $have = append $have (printf "attachRequired=%v" $live) -}}
{{- $want = append $want (printf "attachRequired=%v" $v.csiAttacher.enabled) -}}
{{- $keep = append $keep (printf "--set csiAttacher.enabled=%v" $live) -}}
{{- end -}}
{{- $live = join "," (hasKey $spec "volumeLifecycleModes" | ternary $spec.volumeLifecycleModes (list "Persistent")) -}}
{{- if ne $live "Persistent" -}}
{{- $fields = append $fields "volumeLifecycleModes" -}}
{{- $have = append $have (printf "volumeLifecycleModes=%s" $live) -}}
{{- $want = append $want "volumeLifecycleModes=Persistent" -}}
{{- end -}}
{{- if semverCompare "<1.29-0" .kubeVersion -}}
{{- $live = hasKey $spec "fsGroupPolicy" | ternary $spec.fsGroupPolicy "ReadWriteOnceWithFSType" -}}
{{- if ne $live $v.fsGroupPolicy -}}
{{- $fields = append $fields "fsGroupPolicy" -}}
{{- $have = append $have (printf "fsGroupPolicy=%s" $live) -}}
{{- $want = append $want (printf "fsGroupPolicy=%s" $v.fsGroupPolicy) -}}
{{- $keep = append $keep (printf "--set fsGroupPolicy=%s" $live) -}}
{{- end -}}
{{- $live = hasKey $spec "podInfoOnMount" | ternary $spec.podInfoOnMount false -}}
{{- if not $live -}}
{{- $fields = append $fields "podInfoOnMount" -}}
{{- $have = append $have "podInfoOnMount=false" -}}
{{- $want = append $want "podInfoOnMount=true" -}}
{{- end -}}
{{- end -}}
{{- if $fields -}}
{{- $alt := "" -}}
{{- if eq (len $keep) (len $fields) -}}
{{- $alt = printf " Or keep the cluster's settings: helm upgrade ... %s." (join " " $keep) -}}
{{- end -}}
{{- fail (printf "CSIDriver %s exists with %s; this release wants %s. These fields are immutable, so the upgrade would stop half-way; nothing was changed. Delete the object, then run the same helm upgrade again (mounted volumes keep working; helm creates it anew): `kubectl delete csidriver %s`.%s See the README section Migration from the Go driver." $v.driverName (join ", " $have) (join ", " $want) $v.driverName $alt) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "seaweedfs-csi-driver.image" -}}
{{- printf "%s:%s" .Values.seaweedfsCsiPlugin.image (default .Chart.AppVersion .Values.seaweedfsCsiPlugin.tag) -}}
{{- end -}}

{{/* log settings, read by the binary itself (--v / --logLevel via WEED_V / WEED_LOGLEVEL) */}}
{{- define "seaweedfs-csi-driver.logEnv" -}}
{{- if .Values.logFilter }}
- name: WEED_LOGLEVEL
  value: {{ .Values.logFilter | quote }}
{{- end }}
{{- if hasKey .Values "logVerbosity" }}
- name: WEED_V
  value: {{ .Values.logVerbosity | quote }}
{{- end }}
{{- end -}}

{{- define "seaweedfs-csi-driver.securitySource" -}}
{{- if .Values.security.existingSecret -}}
secret:
  secretName: {{ .Values.security.existingSecret }}
{{- else if .Values.security.existingConfigMap -}}
configMap:
  name: {{ .Values.security.existingConfigMap }}
{{- else if and .Values.security.create (eq .Values.security.type "configmap") -}}
configMap:
  name: {{ include "seaweedfs-csi-driver.fullname" . }}-security
{{- else if .Values.security.create -}}
secret:
  secretName: {{ include "seaweedfs-csi-driver.fullname" . }}-security
{{- else -}}
{{- fail "security.enabled needs security.existingSecret, security.existingConfigMap or security.create" -}}
{{- end -}}
{{- end -}}

{{/* env shared by every plugin container */}}
{{- define "seaweedfs-csi-driver.pluginEnv" -}}
{{- include "seaweedfs-csi-driver.logEnv" . }}
{{- if .Values.tlsSecret }}
- name: WEED_GRPC_CA
  value: /var/run/secrets/app/tls/ca.crt
- name: WEED_GRPC_CLIENT_CERT
  value: /var/run/secrets/app/tls/tls.crt
- name: WEED_GRPC_CLIENT_KEY
  value: /var/run/secrets/app/tls/tls.key
{{- end }}
{{- end -}}

{{- define "seaweedfs-csi-driver.securityMounts" -}}
{{- if .Values.tlsSecret }}
- name: tls
  mountPath: /var/run/secrets/app/tls
  readOnly: true
{{- end }}
{{- if .Values.security.enabled }}
- name: security-config
  mountPath: /etc/seaweedfs/security.toml
  subPath: security.toml
  readOnly: true
{{- end }}
{{- end -}}

{{- define "seaweedfs-csi-driver.securityVolumes" -}}
{{- if .Values.tlsSecret }}
- name: tls
  secret:
    secretName: {{ .Values.tlsSecret }}
{{- end }}
{{- if .Values.security.enabled }}
- name: security-config
{{- include "seaweedfs-csi-driver.securitySource" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* driver flags that are only rendered when set */}}
{{- define "seaweedfs-csi-driver.tuningArgs" -}}
{{- if hasKey .Values "cacheCapacityMB" }}
- --cacheCapacityMB={{ .Values.cacheCapacityMB }}
{{- end }}
{{- if hasKey .Values "cacheMetaTtlSec" }}
- --cacheMetaTtlSec={{ .Values.cacheMetaTtlSec }}
{{- end }}
{{- if hasKey .Values "concurrentWriters" }}
- --concurrentWriters={{ .Values.concurrentWriters }}
{{- end }}
{{- if hasKey .Values "concurrentReaders" }}
- --concurrentReaders={{ .Values.concurrentReaders }}
{{- end }}
{{- if hasKey .Values.node "memoryBudgetMB" }}
- --memoryBudgetMB={{ .Values.node.memoryBudgetMB }}
{{- end }}
{{- end -}}

{{- define "seaweedfs-csi-driver.pluginDir" -}}
{{- printf "%s/%s" .Values.node.volumes.plugins_dir .Values.driverName -}}
{{- end -}}

{{/* --topologyKeys: node.topologyKeys, a comma-separated string or a list; entries trimmed,
blank ones dropped (" , " renders nothing). The controller gets the same value as the node
plugin: the csi-provisioner does topology only if the controller's Identity advertises it. */}}
{{- define "seaweedfs-csi-driver.topologyKeys" -}}
{{- $k := .Values.node.topologyKeys | default "" -}}
{{- $items := kindIs "slice" $k | ternary $k (splitList "," (toString $k)) -}}
{{- $out := list -}}
{{- range $items }}{{ with (toString .) | trim }}{{ $out = append $out . }}{{ end }}{{ end -}}
{{- join "," $out -}}
{{- end -}}

{{/* --dataCenterLabel: node.dataCenterLabel, else the Go chart's
node.injectTopologyInfoFromNodeLabel (enabled, labels.dataCenter), read directly instead of
through KubeMod. Nothing when node.dataCenter is set: it wins, so no label is read (and the
node plugin gets no token or RBAC for it). */}}
{{- define "seaweedfs-csi-driver.dataCenterLabel" -}}
{{- $inject := .Values.node.injectTopologyInfoFromNodeLabel | default dict -}}
{{- if (.Values.node.dataCenter | default "" | trim) -}}
{{- else if (.Values.node.dataCenterLabel | default "" | trim) -}}{{ .Values.node.dataCenterLabel | trim }}
{{- else if and (kindIs "map" $inject) $inject.enabled -}}{{ dig "labels" "dataCenter" "topology.kubernetes.io/zone" $inject | trim }}
{{- end -}}
{{- end -}}

{{/* "true" when the node plugin reads its own Node object (a topology key without "=", or a
data-center label): its ServiceAccount then gets `get` on nodes and its token. */}}
{{- define "seaweedfs-csi-driver.readsNode" -}}
{{- $reads := include "seaweedfs-csi-driver.dataCenterLabel" . | ne "" -}}
{{- range splitList "," (include "seaweedfs-csi-driver.topologyKeys" .) -}}
{{- if and (trim .) (not (contains "=" .)) }}{{ $reads = true }}{{ end -}}
{{- end -}}
{{- if $reads }}true{{ end -}}
{{- end -}}
