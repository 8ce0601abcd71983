{{/*
Arguments of `tandem-operator` (which is `kopf run --module=tandem_operator`), one YAML list item per line.
*/}}
{{- define "tandem.operatorArgs" -}}
- --standalone
{{- if include "tandem.clusterWide" . }}
- --all-namespaces
{{- else }}
{{- range .Values.operator.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- end }}
{{- $host := .Values.operator.healthBindAddress | default "0.0.0.0" }}
- --liveness=http://{{ if contains ":" $host }}[{{ $host }}]{{ else }}{{ $host }}{{ end }}:{{ .Values.operator.healthPort }}/healthz
- --log-format={{ .Values.operator.logFormat }}
{{- if eq .Values.operator.logLevel "quiet" }}
- --quiet
{{- else if eq .Values.operator.logLevel "verbose" }}
- --verbose
{{- else if eq .Values.operator.logLevel "debug" }}
- --debug
{{- end }}
{{- end }}
