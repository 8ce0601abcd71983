"""Periodic work on every HybridModel (the drift resync, autoscaling), without kopf timers.

kopf puts its finalizer on every object a timer or daemon runs for, and a finalizer outlives the
operator: after `helm uninstall` no HybridModel could be deleted. These loops need none. One
starts for each job when the watch first delivers a HybridModel, is handed each newer body the
watch delivers, and ends when the HybridModel is deleted or the operator stops; the children
go with their owner through the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

_log = logging.getLogger(__name__)

# job(body, memo, logger): blocking work, run in a thread. The memo is one per HybridModel.
Job = Callable[[dict, Any, logging.Logger | logging.LoggerAdapter], Any]


class Gone(Exception):
    """Raised by a job whose HybridModel no longer exists (its deletion was missed): ends its loops."""


@dataclass(frozen=True)
class Every:
    """Run `job` every `interval` seconds, the first time after `initial_delay`."""

    job: Job
    interval: float
    initial_delay: float = 0.0


class Loops:
    """The periodic jobs of every live HybridModel, keyed by uid, fed the newest body watched."""

    def __init__(self, jobs: list[Every]):
        self.jobs = list(jobs)
        self._bodies: dict[str, dict] = {}
        self._tasks: dict[str, list[asyncio.Task]] = {}

    def seen(self, body: dict, logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Note a watched HybridModel's newest `body`; start its loops the first time."""
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            self.gone(body)
            return
        key = _key(body)
        self._bodies[key] = body
        if key not in self._tasks:
            memo = types.SimpleNamespace()
            self._tasks[key] = [asyncio.create_task(self._run(key, every, memo, logger)) for every in self.jobs]

    def gone(self, body: dict) -> None:
        """The HybridModel is deleted (or being deleted): stop its loops."""
        key = _key(body)
        self._bodies.pop(key, None)
        for task in self._tasks.pop(key, []):
            task.cancel()

    def running(self) -> set[str]:
        """Keys (uids) of the HybridModels whose loops run."""
        return set(self._tasks)

    async def stop(self) -> None:
        """Stop every loop and wait for them to end (the operator is exiting)."""
        tasks = [task for tasks in self._tasks.values() for task in tasks]
        self._tasks.clear()
        self._bodies.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, key: str, every: Every, memo: Any, logger: logging.Logger | logging.LoggerAdapter) -> None:
        await asyncio.sleep(every.initial_delay)
        while key in self._bodies:
            try:
                await asyncio.to_thread(every.job, self._bodies[key], memo, logger)
            except Gone:
                self.gone(self._bodies.get(key) or {"metadata": {"uid": key}})
                return
            except Exception as e:  # kopf's retry errors too: the next round is the retry
                # Not the object's logger: that would post an Event every round.
                _log.warning("%s of HybridModel %s failed: %s", _name(every.job), _where(self._bodies.get(key)), e)
            await asyncio.sleep(every.interval)


def _key(body: dict) -> str:
    meta = body.get("metadata") or {}
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"


def _where(body: dict | None) -> str:
    meta = (body or {}).get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _name(job: Job) -> str:
    return getattr(job, "__name__", repr(job))
