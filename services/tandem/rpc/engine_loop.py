"""The serving loop: one thread owns the (not thread-safe) LLMEngine and steps it while there
is work, fanning each step's RequestOutputs into per-request asyncio queues.

Everything that touches the engine, adding and aborting requests included, runs on that
thread as a queued command, so Generate handlers on the asyncio loop never block on a step.
When the experts process is unreachable the engine keeps the failed step pending; this loop
marks itself down (health NOT_SERVING, new requests UNAVAILABLE) and retries with backoff
until a step, or a probe of the experts when nothing is pending, succeeds again.

A request for n completions (SamplingParams.n) has one stream, which ends after the last of
its completions' final outputs. One completion that fails ("error") fails the request: the loop
aborts the others (their KV blocks freed) and ends the stream with the failed output. Its metrics
are a request's: one outcome (error, else length if any completion reached it, else stop) and
one time to first token (of whichever completion's comes first); tokens count one by one, and
inter-token latency is each completion's own gaps.

A bug that escapes the loop thread itself (not an engine step's error, which fails that step's
requests) ends the loop: its requests fail with UNAVAILABLE, new ones are refused, and
`on_fatal` tells the server, which reports itself not alive so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.sampling_params import RequestOutput, SamplingParams
from tandem.experts.base import ExpertsUnavailable
from tandem.metrics import ServingMetrics
from tandem.rpc.errors import ServerUnavailable

if TYPE_CHECKING:
    from tandem.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    """How the serving loop retries an unreachable experts process. Checked on construction.

    The waiting-queue limit (RESOURCE_EXHAUSTED) is the engine's: EngineConfig.max_waiting."""

    retry_initial_s: float = 0.05  # first backoff after the experts become unreachable
    retry_max_s: float = 2.0

    def __post_init__(self):
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError("need 0 < retry_initial_s <= retry_max_s")


@dataclass
class _Stream:
    """The asyncio side of one request, plus what its metrics need."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    unfinished: set[int] = field(default_factory=set)  # its completions' indexes
    last_token: dict[int, float] = field(default_factory=dict)  # by completion index
    outcomes: set[str] = field(default_factory=set)  # of its finished completions

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Drives one LLMEngine from a background thread. `submit` from the asyncio loop."""

    def __init__(
        self,
        engine,
        metrics: ServingMetrics,
        config: LoopConfig | None = None,
        *,
        on_serving_change: Callable[[bool], None] | None = None,
        probe_experts: Callable[[], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.config = config or LoopConfig()
        self._on_serving_change = on_serving_change or (lambda serving: None)
        self._probe_experts = probe_experts
        self._on_fatal = on_fatal or (lambda exc: None)
        self._cond = threading.Condition()
        # queued commands, each with the future its caller awaits (None for fire-and-forget ones)
        self._commands: list[tuple[Callable[[], None], concurrent.futures.Future | None]] = []
        self._batch: list[tuple[Callable[[], None], concurrent.futures.Future | None]] = []  # being run
        self._dead: BaseException | None = None  # what ended the loop thread
        self._streams: dict[str, _Stream] = {}  # owned by the loop thread
        self._stopping = False
        self._admitting = True
        self.experts_down = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def submit(
        self, request_id: str, prompt: str | list[int] | Callable[[LLMEngine], list[int]], params: SamplingParams,
        priority: int = 0, cache_salt: str | None = None,
    ) -> asyncio.Queue:
        """Admits a request; returns the queue its RequestOutputs (or an exception) arrive on. The
        prompt is text, token ids, or a callable that makes the ids with the engine (a chat's template);
        `priority` and `cache_salt` as LLMEngine.add_request's.

        Raises InvalidRequest, QueueFull or ServerUnavailable without admitting it.
        """
        loop = asyncio.get_running_loop()
        received = time.perf_counter()  # time to first token counts the tokenizing too
        # in a worker thread, not the loop's: a long text (or a chat's rendering) takes a while
        if isinstance(prompt, str):
            prompt = await asyncio.to_thread(self.engine.encode, prompt)
        elif callable(prompt):
            prompt = await asyncio.to_thread(prompt, self.engine)
        constraint = None
        if params.structured_outputs is not None:  # compiled here, not on the engine's thread; add_request takes it
            constraint = await asyncio.to_thread(self.engine.compile_constraint, params)
        stream = _Stream(asyncio.Queue(), loop, received, set(range(params.n)))
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._call(lambda: self._add(request_id, prompt, params, constraint, priority, cache_salt, stream, done),
                   done)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the caller is gone (deadline, disconnect): take the request out again
            with contextlib.suppress(ServerUnavailable):  # not counted: the caller, handed no queue, counts it
                self._call(lambda: self._abort(request_id, notify=False, queue=stream.queue, counted=False))
            raise
        return stream.queue

    def abort(self, request_id: str, queue: asyncio.Queue) -> None:
        """Aborts the request whose outputs go to `queue` (client gone); its KV blocks are freed on
        the loop thread. A later request that reuses the id is not touched."""
        self._call(lambda: self._abort(request_id, notify=False, queue=queue))

    async def run_on_engine(self, fn: Callable):
        """Runs `fn(engine)` on the loop thread (the engine is not thread-safe) and returns its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command():
            if not done.set_running_or_notify_cancel():
                return  # the caller is gone
            try:
                done.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

        self._call(command, done)
        return await asyncio.wrap_future(done)

    def stop_admitting(self) -> None:
        with self._cond:
            self._admitting = False

    def in_flight(self) -> int:
        """Requests admitted and not yet finished (read without the loop thread: approximate)."""
        return len(self._streams)

    def cancel_all(self) -> None:
        """Aborts every in-flight request; each stream gets a final 'cancelled' output."""
        self._call(self._cancel_all)

    def stop(self, timeout: float | None = None) -> None:
        """Stops the thread after the commands already queued (call cancel_all first to drain)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _call(self, command: Callable[[], None], done: concurrent.futures.Future | None = None) -> None:
        with self._cond:
            if self._dead is not None:
                raise ServerUnavailable(f"the serving loop stopped: {self._dead!r}")
            if self._stopping:
                raise ServerUnavailable("the server is shutting down")
            self._commands.append((command, done))
            self._cond.notify()

    # -- loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a bug in the loop itself: see the module docstring
            log.critical("the serving loop died; failing %d requests", len(self._streams), exc_info=True)
            self._die(exc)

    def _serve(self) -> None:
        backoff = self.config.retry_initial_s
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self._has_work()):
                    self._cond.wait()
                self._batch, self._commands = self._commands, []
                stopping = self._stopping
            for command, _ in self._batch:
                command()
            if stopping and not self._commands:
                return
            if self.experts_down:
                backoff = self._retry(backoff)
            elif self.engine.has_unfinished_requests():
                self._step()

    def _die(self, exc: BaseException) -> None:
        """Refuses new callers, tells the server, then fails every request and queued caller; the
        engine is not touched again."""
        error = ServerUnavailable(f"the serving loop stopped: {exc!r}")
        with self._cond:
            self._dead = exc
            queued, self._commands = self._batch + self._commands, []
        try:
            self._on_fatal(exc)
        except Exception:  # noqa: BLE001 - the requests below must still end
            log.exception("on_fatal failed")
        for _, done in queued:
            if done is not None and not done.done():
                done.set_exception(error)
        for stream in self._streams.values():
            self.metrics.record_outcome("error")
            stream.put(error)
        self._streams.clear()

    def _interrupted(self) -> bool:
        return bool(self._commands) or self._stopping  # read without the lock: a step ends one token early or late

    def _has_work(self) -> bool:
        return self.experts_down or self.engine.has_unfinished_requests()

    def _step(self) -> bool:
        """One engine step; False when the experts were unreachable (the engine keeps it pending)."""
        try:
            # A multi-step decode streams each token step's outputs as it ends, and ends early when
            # a command (a request to admit, an abort) or shutdown is waiting.
            outputs = self.engine.step(emit=self._dispatch, interrupted=self._interrupted)
        except ExpertsUnavailable as exc:
            self._set_down(True, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - a bug in the engine fails its requests, not the server
            log.exception("engine step failed; failing %d requests", len(self._streams))
            self._fail_all(exc)
            return True
        self._dispatch(outputs)
        self.metrics.record_engine_stats(self.engine.stats())
        return True

    def _retry(self, backoff: float) -> float:
        """Sleeps `backoff` (waking for commands), then tries a step or a probe; returns the next backoff."""
        with self._cond:
            if not (self._commands or self._stopping):
                self._cond.wait(backoff)
            if self._commands or self._stopping:
                return backoff  # handle aborts and shutdown first; retry on the next turn
        if self.engine.has_unfinished_requests():
            reachable = self._step()
        else:
            reachable = self._probe()
        if not reachable:
            return min(backoff * 2, self.config.retry_max_s)
        self._set_down(False)
        return self.config.retry_initial_s

    def _probe(self) -> bool:
        if self._probe_experts is None:
            return True
        try:
            self._probe_experts()
        except ExpertsUnavailable:
            return False
        return True

    def _set_down(self, down: bool, exc: BaseException | None = None) -> None:
        if down == self.experts_down:
            return
        self.experts_down = down
        if down:
            log.warning("experts unreachable (%s): NOT_SERVING, retrying", exc)
        else:
            log.warning("experts reachable again: SERVING")
        self._on_serving_change(not down)

    def mark_experts_down(self, exc: BaseException) -> None:
        """Starts in the down state (the experts were unreachable at startup)."""
        self._call(lambda: self._set_down(True, exc))

    def _add(self, request_id, prompt: list[int], params, constraint, priority: int, cache_salt: str | None,
             stream: _Stream, done: concurrent.futures.Future) -> None:
        if not done.set_running_or_notify_cancel():
            return  # the caller is gone: nothing to admit
        try:
            if not self._admitting:
                raise ServerUnavailable("the server is shutting down")
            if self.experts_down:
                raise ServerUnavailable("the experts process is unreachable; retry later")
            ids = list(prompt)
            self.engine.add_request(request_id, ids, params, constraint, priority, cache_salt)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)
            return
        self._streams[request_id] = stream
        self.metrics.prompt_tokens.inc(len(ids))
        done.set_result(None)

    def _abort(self, request_id: str, notify: bool, queue: asyncio.Queue | None = None, counted: bool = True) -> None:
        """Aborts `request_id`, or nothing when `queue` is given and is not that request's; `counted`:
        its outcome counts as cancelled here."""
        stream = self._streams.get(request_id)
        if queue is not None and (stream is None or stream.queue is not queue):
            return  # finished already (its id maybe reused since): not ours to abort
        self._streams.pop(request_id, None)
        outputs = self.engine.abort_request(request_id)
        self.metrics.record_engine_stats(self.engine.stats())  # its blocks are free now
        if stream is None:
            return
        if counted:
            self.metrics.record_outcome("cancelled")
        if notify:  # a last output for each completion not finished
            for output in outputs or [RequestOutput(request_id, index=i) for i in sorted(stream.unfinished)]:
                output.finished, output.finish_reason = True, "cancelled"
                stream.put(output)

    def _cancel_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, notify=True)

    def _fail_all(self, exc: BaseException) -> None:
        failed, self._streams = self._streams, {}
        for request_id in failed:
            self.engine.abort_request(request_id)
        # their blocks are free in the gauges before a caller hears of the failure (and may scrape them)
        self.metrics.record_engine_stats(self.engine.stats())
        for stream in failed.values():
            self.metrics.record_outcome("error")
            stream.put(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            self._observe_tokens(stream, out, now)
            if out.finished:
                self._finish(stream, out)
            stream.put(out)

    def _finish(self, stream: _Stream, out: RequestOutput) -> None:
        """Accounts a completion's final output; the request's when it is the last, or failed."""
        stream.unfinished.discard(out.index)
        self.metrics.prefix_cached_tokens.inc(out.num_cached_tokens)
        stream.outcomes.add(out.finish_reason if out.finish_reason in ("stop", "length") else "error")
        if "error" in stream.outcomes and stream.unfinished:
            self.engine.abort_request(out.request_id)  # the request failed: the others end with it
            stream.unfinished.clear()
        if not stream.unfinished:
            self._streams.pop(out.request_id)
            self.metrics.record_outcome(next((o for o in ("error", "length") if o in stream.outcomes), "stop"))
            self.metrics.e2e_request_latency.observe(time.perf_counter() - stream.arrival)

    def _observe_tokens(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        n = len(out.new_token_ids)
        if n == 0:
            return
        self.metrics.generated_tokens.inc(n)
        last = stream.last_token.get(out.index)
        if not stream.last_token:  # the request's first token, whichever completion's
            self.metrics.time_to_first_token.observe(now - stream.arrival)
            if out.first_scheduled is not None:  # (None only for a sequence the engine never scheduled)
                self.metrics.request_queue_time.observe(max(0.0, out.first_scheduled - stream.arrival))
        elif last is not None:
            gap = (now - last) / n  # several tokens in one output share the gap
            for _ in range(n):
                self.metrics.inter_token_latency.observe(gap)
        stream.last_token[out.index] = now
