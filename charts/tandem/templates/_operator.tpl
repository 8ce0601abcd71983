{{/*
Arguments of `kopf run` for the operator container, one YAML list item per line.
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
- --liveness=http://0.0.0.0:{{ .Values.operator.healthPort }}/healthz
- --log-format={{ .Values.operator.logFormat }}
{{- if eq .Values.operator.logLevel "quiet" }}
- --quiet
{{- else if eq .Values.operator.logLevel "verbose" }}
- --verbose
{{- else if eq .Values.operator.logLevel "debug" }}
- --debug
{{- end }}
- --module=tandem_operator
{{- end }}
