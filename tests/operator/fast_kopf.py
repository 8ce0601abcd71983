"""`--module=fast_kopf` for operators run as processes in tests: kopf's timeouts cut short.

The same settings as kopf_fixtures' `operator` fixture: per-object workers idle 5 s before
exiting, and shutdown waits for them.
"""

import kopf


@kopf.on.startup()
def fast_kopf(settings: kopf.OperatorSettings, **_) -> None:
    settings.queueing.idle_timeout = 0.2
    settings.queueing.exit_timeout = 0.5
