{{- define "seaweedfs-csi-driver.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "seaweedfs-csi-driver.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "seaweedfs-csi-driver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "seaweedfs-csi-driver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selector labels; call with (dict "ctx" . "component" "node") */}}
{{- define "seaweedfs-csi-driver.selector" -}}
app.kubernetes.io/name: {{ include "seaweedfs-csi-driver.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
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
{{- end -}}

{{- define "seaweedfs-csi-driver.pluginDir" -}}
{{- printf "%s/%s" .Values.node.volumes.plugins_dir .Values.driverName -}}
{{- end -}}
