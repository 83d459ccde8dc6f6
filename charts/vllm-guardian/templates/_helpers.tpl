{{/* Names and labels shared by every object. */}}
{{- define "vg.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vg.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
vllm-guardian.io/model: {{ .Values.model.name | quote }}
{{- end -}}

{{- define "vg.labels" -}}
{{ include "vg.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vg.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The guardian's config. The chart owns the keys that make the pod work (the service, its
command, where state lives, the process backend); guardian.config is merged over the rest.
*/}}
{{- define "vg.config" -}}
{{- $host := ternary "127.0.0.1" "0.0.0.0" .Values.gate.enabled -}}
{{- $base := dict
  "listen" (printf "0.0.0.0:%d" (int .Values.guardian.port))
  "runtime_dir" "/run/vllm-guardian"
  "state_dir" "/var/lib/vllm-guardian"
  "services" (list (dict
    "name" "vllm"
    "url" (printf "http://127.0.0.1:%d" (int .Values.vllm.port))
    "gpus" "auto"
    "gpu_memory_by_device" true
    "log_file" "/var/lib/vllm-guardian/vllm.log"
    "command" (concat (list "vllm" "serve" .Values.model.path "--host" $host "--port" (toString .Values.vllm.port)) .Values.vllm.args)
  ))
  "sources" (dict "unit" (dict "enabled" false))
  "recorder" (dict "path" "/var/lib/vllm-guardian/flight.jsonl")
  "policy" (dict "backend" "process" "dry_run" .Values.guardian.dryRun)
  "fleet" (dict
    "permit" .Values.fleet.permit
    "model" .Values.model.name
    "lease_ttl_seconds" .Values.fleet.leaseTTLSeconds
    "wait_timeout_seconds" .Values.fleet.waitTimeoutSeconds
    "pdb" (printf "%s" (include "vg.fullname" .))
  )
-}}
{{- $user := deepCopy (default dict .Values.guardian.config) -}}
{{- $merged := mustMergeOverwrite $user $base -}}
{{- toYaml $merged -}}
{{- end -}}

{{/*
"true" when a Prometheus Operator object (root, key: its values' name, kind) is to be rendered:
enabled, and the cluster serves its CRD or force asks for it. Without the CRD, `helm install`
fails on the unknown kind.
*/}}
{{- define "vg.operatorObject" -}}
{{- $v := index .root.Values .key -}}
{{- if and $v.enabled (or $v.force (.root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind))) -}}
true
{{- end -}}
{{- end -}}
