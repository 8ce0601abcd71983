"""Continuous batching: which sequences run each step, and how many of their tokens.

Plain Python, no torch. Every step has a token budget (max_num_batched_tokens) and a seat
limit (max_num_seqs). Running sequences go first (decodes, then unfinished prefills, which
continue in chunks), then swapped-out sequences come back if the device tier has room, then
waiting sequences are admitted in arrival order, reusing cached prefixes. When a running
sequence cannot get a block, the most recently arrived running sequence is preempted: swapped
to the CPU tier if it fits there, else freed and re-queued in waiting by its arrival to be
recomputed (prompt and outputs re-prefilled; nothing is lost). New work never preempts.

With the `priority` policy (vLLM's `--scheduling-policy priority`), each request's priority (lower
first; ties by arrival) orders all of that instead of arrival alone: waiting and swapped-out
sequences are taken from the highest priority, and the lowest-priority running sequence is the one
preempted (the latest-arrived among equals). As in vLLM, a waiting request never preempts a
running one, whatever its priority: it is next in line for the blocks they free.

With `num_scheduler_steps` N > 1 (vLLM's multi-step scheduling), a step in which every running
sequence is decoding on the device tier, and nothing waits or is swapped out, decodes up to N
tokens in a row: each sequence gets the slots for all of them at once and the runner feeds each
sampled token to the next forward pass, so the scheduling and the output processing around a
forward pass run once per N tokens. A sequence that stops early (a stop token, a stop string)
drops the tokens after its stop; N is cut so that no sequence passes max_tokens or max_model_len.
The engine can stream such a run (LLMEngine.step's emit): each token step is accounted here as a
one-token step as it ends, and the run ends early when all its sequences have stopped or the
caller has work (a request to admit), keeping the slots allocated for the steps not run.

With `cpu_decode` (the serving default), a sequence that would be swapped out is offloaded
instead: its KV moves to the CPU tier and it keeps running there, its attention computed on
the CPU socket (`tandem.kv.tiered`), so a context longer than the device tier still decodes.
It stays on the CPU tier until it finishes (no ping-pong between tiers). A sequence that does not
fit the CPU tier with room to grow is recomputed, never swapped out, as is the latest-arrived
CPU-tier sequence when the CPU tier is full.

With a sliding window (every layer of the model attending to the last `sliding_window` keys), a
sequence's blocks that fall out of the window are freed as it goes (vLLM does the same): a long
sequence holds about window / block_size blocks, not its whole length, and the device tier need
only hold that much (SchedulerConfig.max_blocks_held), not max_model_len.

A request for n completions (SamplingParams.n) is n sequences that share its prompt. The first
is queued as any request; with prefix caching the others are held until its prompt is computed,
then go to the front of the waiting queue, where they take its full prompt blocks from the
prefix cache: the prompt is prefilled once, and each of the others computes only the last partial
block and the last token (whose logits it samples its first token from).

Not thread-safe: the engine calls schedule → run → update from one thread, and abort/finish
between steps.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tandem.contract import SCHEDULING_POLICIES
from tandem.engine.sampling_params import NO_TOKEN, DuplicateRequest, InvalidRequest
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.kv.block_manager import CPU, DEVICE, KVBlockManager

FINISH_REASONS = ("stop", "length", "cancelled", "error")

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at max_waiting; the caller should reject the request (RESOURCE_EXHAUSTED)."""


@dataclass
class SchedulerConfig:
    """Limits of the scheduler, checked on construction."""

    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 2048  # tokens computed per step, prefill chunks included
    max_model_len: int = 4096  # prompt + output tokens of one sequence
    max_waiting: int = 1024  # queued requests before add() refuses
    cpu_decode: bool = False  # offload to the CPU tier and keep running, instead of swapping out
    num_scheduler_steps: int = 1  # decode tokens per scheduled step when only decodes run (see above)
    policy: str = "fcfs"  # or "priority": requests' priorities order the queues (see above)
    sliding_window: int | None = None  # the model's, when every layer has one: blocks before it are freed

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting", "num_scheduler_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len must leave room for one output token, "
                             f"got {self.max_model_len}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"SchedulerConfig.sliding_window must be None or an int >= 1, got {window!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")

    def max_blocks_held(self, block_size: int) -> int:
        """The most KV blocks one sequence holds at once: its whole length's, or with a sliding
        window, whose blocks are freed as the sequence goes (Scheduler._computed), those of the
        window's keys before a step (window - 1 positions) and of the step's new tokens (a prefill
        chunk, or a multi-step run), a span that can start and end inside a block."""
        whole = -(-self.max_model_len // block_size)
        if self.sliding_window is None:
            return whole
        span = self.sliding_window - 1 + max(self.max_num_batched_tokens, self.num_scheduler_steps)
        return min(whole, (span + block_size - 2) // block_size + 1)


@dataclass
class ScheduledSeq:
    """One sequence's work this step: compute token_ids at positions start_pos.. with block_table."""

    seq: Sequence
    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # device block ids covering start_pos + len(token_ids) slots
    sample: bool  # the chunk reaches the last known token: sample a new one from its logits
    tier: str = DEVICE  # the KV tier block_table is in: DEVICE, or CPU for an offloaded sequence
    # Decode steps in a row (a decode only): each sampled token is the next step's input, and
    # block_table covers them all.
    num_steps: int = 1

    @property
    def is_decode(self) -> bool:
        return self.sample and len(self.token_ids) == 1


@dataclass
class SchedulerOutput:
    """What the model runner must do this step.

    Order of work: copy `swap_out` blocks (device -> CPU) first, then `swap_in` blocks
    (CPU -> device; they may land in blocks just swapped out), then run `scheduled`.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_id, device_id)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_id, cpu_id)
    # The sequences whose KV the swap_in and swap_out copies carry: their block tables already name
    # the copies' destinations, so a copy that fails loses their KV.
    swapping: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    offloaded: list[Sequence] = field(default_factory=list)  # moved to the CPU tier this step, still running
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_in or self.swap_out)


class Scheduler:
    """Owns the waiting, running and swapped queues and the block manager's per-sequence use."""

    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager, eos_token_ids: set[int]):
        size = block_manager.block_size
        device = block_manager.num_total_blocks(DEVICE) * size
        cpu = block_manager.num_total_blocks(CPU) * size
        held = config.max_blocks_held(size) * size  # a sliding window's sequence needs less than its length
        if config.cpu_decode and cpu >= held:
            # A sequence outgrowing the device tier moves to the CPU tier; its first chunk must fit the device.
            if device < min(held, config.max_num_batched_tokens):
                raise ValueError(f"the device KV tier holds {device} tokens, fewer than one prefill chunk "
                                 f"(max_num_batched_tokens={config.max_num_batched_tokens}); give it more blocks")
        elif device < held:
            # Otherwise a long sequence alone could outgrow the device tier and never finish.
            hint = f" and the CPU tier {cpu}" if config.cpu_decode else ""
            need, lower = f"max_model_len={config.max_model_len}", "max_model_len"
            if held < config.max_model_len:
                need = (f"the {held} a sequence holds at once with its sliding window of {config.sliding_window} "
                        f"(of {need}, in chunks of max_num_batched_tokens={config.max_num_batched_tokens})")
                lower = "max_num_batched_tokens"
            raise ValueError(f"the device KV tier holds {device} tokens{hint}, fewer than {need}; "
                             f"lower {lower} or give the KV cache more blocks")
        self.config = config
        self.block_manager = block_manager
        self._device = block_manager.num_total_blocks(DEVICE)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()  # by rank (Sequence.rank: priority, then arrival)
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # by rank
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        # A request's other completions, held (status WAITING, not in `waiting`) until the first one's
        # prompt is computed: by the first one's id, and each held one's first one's id.
        self._held: dict[str, list[Sequence]] = {}
        self._held_for: dict[str, str] = {}
        self.num_preemptions = 0  # so far: sequences swapped out or freed to be recomputed

    # queue

    def add(self, seq: Sequence, siblings: tuple[Sequence, ...] | list[Sequence] = ()) -> None:
        """Queue a new request: `seq`, and `siblings`, the request's other completions (on the same
        prompt). Raises InvalidRequest for requests that can never run, QueueFull when full.

        With prefix caching the siblings wait for seq's prompt (see the module docstring), when it
        has a full block to share. Without it each prefills the prompt itself: forking seq's block
        table (a copy-on-write of its partial last block) would save that prefill, at the price of
        the first shared block a sequence writes."""
        group = [seq, *siblings]
        if len({s.request_id for s in group}) < len(group):
            raise InvalidRequest("request_id", f"{seq.request_id!r}: its completions need ids of their own")
        for s in group:
            if s.request_id in self._seqs:
                raise DuplicateRequest(s.request_id)
            if s.num_prompt_tokens >= self.config.max_model_len:
                raise InvalidRequest("prompt", f"{s.num_prompt_tokens} tokens leave no room to generate "
                                               f"within max_model_len={self.config.max_model_len}")
            if s.status is not SequenceStatus.WAITING or s.num_computed_tokens or s.output_token_ids:
                raise InvalidRequest("request_id", f"{s.request_id!r} is not a new request")
            if s.priority != 0 and self.config.policy != "priority":
                raise InvalidRequest("priority", f"{s.priority} needs the priority scheduling policy; this server "
                                                 f"schedules first come, first served (--scheduling-policy)")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_waiting={self.config.max_waiting})")
        for s in group:
            s.params = s.params.within(self.config.max_model_len - s.num_prompt_tokens)  # an unset max_tokens
            self._seqs[s.request_id] = s
        self._queue(seq)
        bm = self.block_manager
        if siblings and bm.enable_prefix_caching and seq.num_prompt_tokens > bm.block_size:  # a full block to share
            self._held[seq.request_id] = list(siblings)
            self._held_for.update((s.request_id, seq.request_id) for s in siblings)
        else:
            for s in siblings:
                self._queue(s)

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request and free its blocks now. None if it is unknown or already finished."""
        return self.finish(request_id, "cancelled")

    def finish(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> Sequence | None:
        """End a request with `reason` (e.g. "stop" when the engine sees a stop string)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._retire(seq, reason, stop_reason)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be admitted, completions held for their request's prompt included."""
        return len(self.waiting) + len(self._held_for)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_offloaded(self) -> int:
        """Running sequences whose KV is on the CPU tier (decoding there)."""
        return sum(self.block_manager.tier_of(s) == CPU for s in self.running)

    # schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Changes queues and block tables, not token counts (see update)."""
        steps = self._decode_steps()
        if steps > 1:
            out = self._schedule_decode_steps(steps)
            if out is not None:
                return out
        step = _Step(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.out.preempted:
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
        return step.finish()

    def _decode_steps(self) -> int:
        """Tokens every running sequence can decode in a row this step: num_scheduler_steps, cut so
        that none passes its max_tokens or max_model_len; 1 when anything else has to run."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or self.waiting or self.swapped or not self.running:
            return 1
        bm = self.block_manager
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or bm.tier_of(seq) != DEVICE:
                return 1
            steps = min(steps, seq.params.max_tokens - seq.num_output_tokens,
                        self.config.max_model_len - seq.num_tokens)
        return max(steps, 1)

    def _schedule_decode_steps(self, steps: int) -> SchedulerOutput | None:
        """Every running sequence decodes `steps` tokens, or None (nothing allocated) when the
        device tier is short of the blocks for that."""
        bm = self.block_manager
        needed = sum(max(0, bm.blocks_needed(seq.num_computed_tokens + steps) - len(bm.block_table(seq)))
                     for seq in self.running)
        if needed > bm.num_free_blocks(DEVICE):
            return None
        for seq in self.running:
            if not bm.allocate_slots(seq, steps):
                raise RuntimeError("block manager refused slots that were free")
        out = SchedulerOutput(num_batched_tokens=len(self.running))
        for seq in sorted(self.running, key=lambda s: s.rank):
            out.scheduled.append(ScheduledSeq(seq, [seq.last_token_id], seq.num_computed_tokens, bm.block_table(seq),
                                              sample=True, num_steps=steps))
        return out

    def _schedule_running(self, step: _Step) -> None:
        # decodes first: they are latency bound, and each costs one token of the budget
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.rank))
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
            if num_new <= 0:
                continue  # budget spent; it stays running and goes next step
            while not self.block_manager.allocate_slots(seq, num_new):
                # Only a sequence in the same tier frees blocks that seq can use.
                tier = self.block_manager.tier_of(seq)
                victim = max((s for s in self.running if self.block_manager.tier_of(s) == tier),
                             key=lambda s: s.rank)
                if tier == DEVICE and self.config.cpu_decode and self._offload(victim, step):
                    continue  # seq retries: on the device if a victim made room, else on the CPU tier
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                self._add(step, seq, num_new)

    def _schedule_swapped(self, step: _Step) -> None:
        while self.swapped and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
            if not self.block_manager.can_swap_in(seq, num_new):
                return
            step.out.swap_in += self.block_manager.swap_in(seq)
            step.out.swapping.append(seq)
            if not self.block_manager.allocate_slots(seq, num_new):
                raise RuntimeError("block manager refused slots that can_swap_in promised")
            self.swapped.pop(0)
            self._run(seq)
            self._add(step, seq, num_new)

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # A request scoring its prompt needs the hidden state of every prompt position: no cached prefix.
            computed_blocks, num_cached = ([], 0) if seq.needs_prompt_logprobs else \
                self.block_manager.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - num_cached, step.budget)
            # A cached prefix that leaves no room on the device tier for a chunk after it (a long
            # prompt run before, then moved to the CPU tier) would never fit: use only what does.
            while computed_blocks and len(computed_blocks) + self.block_manager.blocks_needed(num_new) > self._device:
                computed_blocks = computed_blocks[:-1]
                num_cached -= self.block_manager.block_size
                num_new = min(seq.num_tokens - num_cached, step.budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed_blocks):
                return  # in order: later (or lower-priority) requests do not jump ahead
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                seq.first_scheduled = time.perf_counter()
            self._run(seq)
            self._add(step, seq, num_new)

    def _add(self, step: _Step, seq: Sequence, num_new: int) -> None:
        bm = self.block_manager
        step.add(seq, num_new, bm.block_table(seq), bm.tier_of(seq))

    def _offload(self, seq: Sequence, step: _Step) -> bool:
        """Move a running sequence's KV to the CPU tier, where it keeps running; False if it does not fit."""
        work = step.drop(seq)
        num_new = len(work.token_ids) if work is not None else 1
        pairs = self.block_manager.swap_out(seq, num_new)
        if pairs is None:
            if work is not None:
                step.restore(work)
            return False
        step.out.swap_out += pairs
        step.out.swapping.append(seq)
        step.out.offloaded.append(seq)
        if work is not None:  # already scheduled this step: its slots moved with its table
            if not self.block_manager.allocate_slots(seq, num_new):
                raise RuntimeError("block manager refused CPU slots that swap_out promised")
            self._add(step, seq, num_new)
        return True

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self.running.remove(seq)
        step.drop(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        step.out.preempted.append(seq)
        # With cpu_decode the CPU tier is where sequences run, not where they wait: one parked there
        # because it could not grow there could need more blocks than the whole device tier has, and
        # would wait for them forever (and the waiting queue behind it). It is recomputed instead.
        pairs = None if self.config.cpu_decode else self.block_manager.swap_out(seq)
        if pairs is not None:
            step.out.swap_out += pairs
            step.out.swapping.append(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.rank)
        else:
            if seq in step.out.swapping:  # offloaded earlier in this step: the copy no longer carries its KV
                step.out.swapping.remove(seq)
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._queue(seq)

    # update

    def update(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Sequence]:
        """Account for a finished step: advance progress, append sampled tokens, apply token stops.

        `sampled` maps request_id to the token sampled for every scheduled chunk with sample=True,
        or to the tokens of a multi-step decode in order: its num_steps of them, or fewer when the
        steps were cut short (a decode step fed each one but the last to the model).
        Returns the sequences that got a token or finished, in scheduled order.
        """
        changed = []
        for work in output.scheduled:
            seq = work.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished between schedule and update
            if not work.sample:
                seq.num_computed_tokens = work.start_pos + len(work.token_ids)
                self._computed(seq)
                continue
            if seq.request_id not in sampled:
                raise KeyError(f"no sampled token for request {seq.request_id!r}")
            tokens = sampled[seq.request_id]
            tokens = [tokens] if isinstance(tokens, int) else tokens
            if not 0 < len(tokens) <= work.num_steps:
                raise ValueError(f"{len(tokens)} tokens for request {seq.request_id!r}, "
                                 f"scheduled for {work.num_steps}")
            for i, token in enumerate(tokens):
                # KV computed: the chunk's tokens, then each earlier token of this step fed back
                seq.num_computed_tokens = work.start_pos + len(work.token_ids) + i
                if token == NO_TOKEN:
                    log.error("request %s: its logits held a NaN or an infinity, or its logits processors and "
                              "structured output left no token, after %d tokens; finishing it with reason 'error'",
                              seq.request_id, seq.num_output_tokens)
                    reason, stop_reason = "error", None
                    break
                seq.output_token_ids.append(token)
                reason, stop_reason = self._check_stop(seq, token)
                if reason is not None:
                    break  # the tokens after a stop are dropped
            self._computed(seq)
            self._release(seq)  # its prompt is computed and cached
            if reason is not None:
                self._retire(seq, reason, stop_reason)
            changed.append(seq)
        return changed

    def _computed(self, seq: Sequence) -> None:
        """seq.num_computed_tokens advanced: cache its newly full blocks, then free those out of the
        sliding window. Every later query is at a position >= num_computed_tokens, so reads no key
        before num_computed_tokens - window + 1 (attention's window: a query at p reads p - window + 1..p)."""
        self.block_manager.cache_full_blocks(seq)
        if self.config.sliding_window is not None:
            self.block_manager.free_blocks_before(seq, seq.num_computed_tokens - self.config.sliding_window + 1)

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None  # vLLM's stop_reason: only a stop token or string is named
        constraint = seq.constraint  # tandem.engine.structured.Constraint
        if constraint is not None and constraint.failed_at == seq.num_output_tokens:
            return "error", None  # the matcher refused the token (logged by tandem.engine.structured)
        if constraint is not None and constraint.completed_at == seq.num_output_tokens:
            return "stop", None  # the structured output is complete
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None, None

    def _release(self, seq: Sequence) -> None:
        """Queue the completions held for seq's prompt (by their request's rank, ahead of what came after)."""
        for s in self._held.pop(seq.request_id, ()):
            del self._held_for[s.request_id]
            self._queue(s)

    def _queue(self, seq: Sequence) -> None:
        """Into waiting by rank: a preempted sequence or a released completion goes ahead of later arrivals."""
        bisect.insort(self.waiting, seq, key=lambda s: s.rank)

    def _retire(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        self._release(seq)  # should it end before its prompt is computed, they compute the prompt themselves
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq.request_id in self._held_for:
            self._held[self._held_for.pop(seq.request_id)].remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        del self._seqs[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason


class _Step:
    """The output being built for one step and the token budget it has left."""

    def __init__(self, budget: int):
        self.budget = budget
        self.out = SchedulerOutput()
        self._by_id: dict[str, ScheduledSeq] = {}

    def add(self, seq: Sequence, num_new: int, block_table: list[int], tier: str = DEVICE) -> None:
        start = seq.num_computed_tokens
        work = ScheduledSeq(seq, seq.token_ids(start, start + num_new), start, block_table,
                            sample=start + num_new == seq.num_tokens, tier=tier)
        self.restore(work)

    def restore(self, work: ScheduledSeq) -> None:
        self._by_id[work.seq.request_id] = work
        self.budget -= len(work.token_ids)

    def drop(self, seq: Sequence) -> ScheduledSeq | None:
        """Unschedule a sequence preempted (or moved) after it got its slots this step."""
        work = self._by_id.pop(seq.request_id, None)
        if work is not None:
            self.budget += len(work.token_ids)
        return work

    def finish(self) -> SchedulerOutput:
        work = list(self._by_id.values())
        self.out.scheduled = [w for w in work if w.is_decode] + [w for w in work if not w.is_decode]
        self.out.num_batched_tokens = sum(len(w.token_ids) for w in work)
        return self.out
