{{/*
Arguments of `tandem-operator`: its --leader-elect flags, then those of `kopf run --module=tandem_operator`;
one YAML list item per line.
*/}}
{{- define "tandem.operatorArgs" -}}
{{- $election := .Values.operator.leaderElection }}
{{- if $election.enabled }}
- --leader-elect
- --leader-election-id={{ include "tandem.leaseName" . }}
- --leader-election-lease-duration={{ $election.leaseDurationSeconds }}
- --leader-election-renew-deadline={{ $election.renewDeadlineSeconds }}
- --leader-election-retry-period={{ $election.retryPeriodSeconds }}
{{- end }}
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

{{/*
The Lease the operator's replicas elect their leader on, in the release namespace: named after the
release, so that two releases in one namespace never share it.
*/}}
{{- define "tandem.leaseName" -}}
{{- include "tandem.operatorName" . }}
{{- end }}

{{/*
Fails on operator replicas and leader-election timings that cannot work.
*/}}
{{- define "tandem.validateOperator" -}}
{{- $election := .Values.operator.leaderElection }}
{{- if and (gt (int .Values.operator.replicas) 1) (not $election.enabled) }}
{{- fail (print "operator.replicas > 1 needs operator.leaderElection.enabled: without leader election every"
          " replica would run kopf and handle every HybridModel at once") }}
{{- end }}
{{- if $election.enabled }}
{{- if le (float64 $election.leaseDurationSeconds) (float64 $election.renewDeadlineSeconds) }}
{{- fail (print "operator.leaderElection.renewDeadlineSeconds must be less than leaseDurationSeconds: the leader"
          " must give up before a standby may take over") }}
{{- end }}
{{- if le (float64 $election.renewDeadlineSeconds) (mulf $election.retryPeriodSeconds 1.2) }}
{{- fail (print "operator.leaderElection.renewDeadlineSeconds must be greater than 1.2 x retryPeriodSeconds"
          " (as client-go requires)") }}
{{- end }}
{{- end }}
{{- end }}
