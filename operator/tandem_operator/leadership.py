"""`tandem-operator --leader-elect`: run kopf only while this replica holds the Lease.

Several replicas may run; each waits as a standby until it holds the Lease (see
tandem_operator.leader_election), then runs kopf, still --standalone, with a stop flag that is
raised when the Lease is lost. Losing it ends the process with status 1, as controller-runtime
does, and the pod restarts as a candidate. On SIGTERM or SIGINT kopf stops gracefully and the
Lease is released, so a standby takes over within a retry period instead of a lease duration.

Health while standby: kopf serves its --liveness endpoint only once it runs, so a standby
serves the same endpoint itself, answering 200 as long as its event loop (and with it the
election) runs. The chart's liveness and readiness probes stay as they are. A standby is thus
Ready, as controller-runtime's standbys are: a rolling update (maxUnavailable 0) stops the old
leader only after the new pod is Ready, and a not-Ready standby would stall every upgrade and
keep the Deployment reporting unavailable replicas for as long as it waits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf
import kopf.cli

from . import login
from .leader_election import ElectionConfig, LeaderElector

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_LEASE_NAME = "tandem-operator"
ENV_PREFIX = "TANDEM_OPERATOR_"
# Status of a replica that lost the Lease (and of one whose kopf exceeded its grace after that).
LOST_EXIT_STATUS = 1
RunKopf = Callable[[list[str], "kopf.cli.CLIControls | None"], None]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElectionOptions:
    """tandem-operator's own flags; everything else goes to `kopf run`."""

    enabled: bool = False
    namespace: str | None = None
    lease_name: str = DEFAULT_LEASE_NAME
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def config(self, identity: str | None = None) -> ElectionConfig:
        namespace = self.namespace or own_namespace()
        if not namespace:
            raise ValueError("--leader-election-namespace is needed outside a pod: neither $POD_NAMESPACE "
                             f"nor {SERVICE_ACCOUNT_NAMESPACE} names one")
        return ElectionConfig(namespace=namespace, name=self.lease_name, identity=identity or own_identity(),
                              lease_duration=self.lease_duration, renew_deadline=self.renew_deadline,
                              retry_period=self.retry_period)


def own_namespace() -> str | None:
    """The pod's namespace: $POD_NAMESPACE (downward API), else the ServiceAccount's."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


def own_identity() -> str:
    """The pod's name plus a random suffix, as client-go's: a restarted pod is a new candidate."""
    pod = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{pod}_{uuid.uuid4()}"


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from "15", "1.5", "15s", "500ms" or Go's "1m30s"."""
    text = str(text).strip()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION_PART.findall(text)
        if not parts or "".join(number + unit for number, unit in parts) != text:
            raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use seconds, or e.g. 15s, 500ms)") from None
        seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be > 0, got {text!r}")
    return seconds


def parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _env(name: str, default: Any, parse: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get(ENV_PREFIX + name)
    if not raw:
        return default
    try:
        return parse(raw)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"${ENV_PREFIX}{name}: {e}") from None


def parser() -> argparse.ArgumentParser:
    """The flags of tandem-operator itself; each has a TANDEM_OPERATOR_* variable as default."""
    defaults = ElectionOptions()
    p = argparse.ArgumentParser(prog="tandem-operator", add_help=False, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Leader election (as controller-runtime's --leader-elect):")
    p.add_argument("--leader-elect", dest="enabled", action=argparse.BooleanOptionalAction,
                   default=_env("LEADER_ELECT", defaults.enabled, parse_bool),
                   help=f"run kopf only while holding the Lease; others wait as standbys [${ENV_PREFIX}LEADER_ELECT]")
    p.add_argument("--leader-election-namespace", dest="namespace",
                   default=_env("LEADER_ELECTION_NAMESPACE", defaults.namespace),
                   help="namespace of the Lease (default: the pod's, from $POD_NAMESPACE or the "
                        f"ServiceAccount) [${ENV_PREFIX}LEADER_ELECTION_NAMESPACE]")
    p.add_argument("--leader-election-id", dest="lease_name",
                   default=_env("LEADER_ELECTION_ID", defaults.lease_name),
                   help=f"name of the Lease (default: %(default)s) [${ENV_PREFIX}LEADER_ELECTION_ID]")
    for flag, field, what in (
            ("lease-duration", "lease_duration", "how long standbys wait after the last renewal to take over"),
            ("renew-deadline", "renew_deadline", "how long the leader retries a renewal before giving up"),
            ("retry-period", "retry_period", "time between renewals, and between a standby's attempts")):
        variable = "LEADER_ELECTION_" + field.upper()
        p.add_argument(f"--leader-election-{flag}", dest=field, type=parse_duration,
                       default=_env(variable, getattr(defaults, field), parse_duration),
                       help=f"{what} (default: %(default)ss) [${ENV_PREFIX}{variable}]")
    return p


def parse_args(args: list[str]) -> tuple[ElectionOptions, list[str]]:
    """Our flags, and the rest (in order) for `kopf run`."""
    p = parser()
    known, rest = p.parse_known_args(args)
    return ElectionOptions(**vars(known)), rest


def kopf_params(kopf_args: list[str]) -> dict[str, Any]:
    """`kopf run`'s options as its own parser reads them, without running anything."""
    return kopf.cli.run.make_context("tandem-operator", ["--module=tandem_operator", *kopf_args]).params


def run(options: ElectionOptions, kopf_args: list[str], run_kopf: RunKopf) -> int:
    """Wait for the Lease, run kopf while holding it; the process's exit status."""
    params = kopf_params(kopf_args)  # bad kopf options fail now, not after winning the Lease
    if params["peering_name"]:
        raise ValueError("--leader-elect runs kopf --standalone: leave out --peering")
    if not params["standalone"]:
        kopf_args = ["--standalone", *kopf_args]
    # kopf configures logging when it starts; a standby logs before that.
    kopf.configure(debug=params["debug"], verbose=params["verbose"], quiet=params["quiet"],
                   log_format=params["log_format"], log_refkey=params["log_refkey"],
                   log_prefix=params["log_prefix"])
    config = options.config()
    login.configure_client()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return _elect_and_run(loop, config, params["liveness_endpoint"], kopf_args, run_kopf)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


def _elect_and_run(loop: asyncio.AbstractEventLoop, config: ElectionConfig, liveness: str | None,
                   kopf_args: list[str], run_kopf: RunKopf) -> int:
    # kopf's stop flag, raised when the Lease is lost. kopf's cleanup raises it too: when a signal
    # stops kopf, it would otherwise wait 5 s at exit for its waiter of a flag nobody raised.
    stop_kopf = asyncio.Event()
    watchdog: list[asyncio.TimerHandle] = []

    async def kopf_stopped(**_: Any) -> None:
        stop_kopf.set()

    def lost() -> None:
        stop_kopf.set()
        # kopf has until a standby may take over to stop; then the process ends regardless.
        grace = config.lease_duration - config.renew_deadline
        watchdog.append(loop.call_later(grace, _exit_now, grace))

    kopf.on.cleanup(id="leader-election")(kopf_stopped)
    elector = LeaderElector(config, on_lost=lost)
    if not _wait_as_standby(loop, elector, liveness):
        logger.info("Stopped while a standby for Lease %s.", config.lease)
        return 0
    loop.run_until_complete(_start_renewing(elector))
    try:
        run_kopf(kopf_args, kopf.cli.CLIControls(stop_flag=stop_kopf, loop=loop))
    finally:
        for timer in watchdog:
            timer.cancel()
        _on_signals(loop, lambda: None)  # kopf's handlers point into its finished run
        if not elector.lost.is_set():
            loop.run_until_complete(elector.release())
    return LOST_EXIT_STATUS if elector.lost.is_set() else 0


def _wait_as_standby(loop: asyncio.AbstractEventLoop, elector: LeaderElector, liveness: str | None) -> bool:
    """Until this replica leads (True) or is asked to stop by a signal (False)."""
    stop = asyncio.Event()
    _on_signals(loop, stop.set)
    health = StandbyHealth(liveness, elector) if liveness else None
    if health is not None:
        loop.run_until_complete(health.start())
    try:
        return loop.run_until_complete(elector.acquire(stop))
    finally:
        if health is not None:
            loop.run_until_complete(health.stop())  # kopf serves the endpoint from now on


async def _start_renewing(elector: LeaderElector) -> None:
    # A task made before kopf starts: kopf leaves alone the tasks that existed when it started.
    elector.start_renewing()


def _on_signals(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, callback)


def _exit_now(grace: float) -> None:
    logger.critical("kopf did not stop within %.1fs of losing the Lease; exiting now.", grace)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(LOST_EXIT_STATUS)


class StandbyHealth:
    """kopf's --liveness endpoint, answered by a standby until kopf takes the address over."""

    def __init__(self, endpoint: str, elector: LeaderElector):
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme != "http":
            raise ValueError(f"--liveness must be an http:// URL, got {endpoint!r}")
        # The same defaults as kopf's health reporter, so both listen at one address.
        self.host, self.port, self.path = parts.hostname or "localhost", parts.port or 80, parts.path or "/"
        self.elector = elector
        self._runner: aiohttp.web.AppRunner | None = None

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.get(self.path, self._healthz)])
        self._runner = aiohttp.web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        config = self.elector.config
        return aiohttp.web.json_response({"leaderElection": {
            "lease": config.lease, "identity": config.identity, "role": "standby", "holder": self.elector.holder}})
