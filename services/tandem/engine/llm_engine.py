"""The engine: requests in, tokens out. One step is schedule -> run -> postprocess.

Synchronous and single-threaded: `tandem.rpc` drives it from one thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tandem.engine import cuda_graph
from tandem.engine.chat import ChatMessage, ChatTemplate
from tandem.engine.config import EngineConfig, EngineStats, context_length
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.logits_processors import bad_words_token_ids
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampling_params import (DuplicateRequest, InvalidRequest, RequestOutput, SamplingParams,
                                           TokenLogprobs, check_in_vocabulary)
from tandem.engine.scheduler import QueueFull, Scheduler, SchedulerConfig, SchedulerOutput
from tandem.engine.sequence import Sequence
from tandem.engine.structured import Constraint, Grammars
from tandem.experts.base import ExpertExecutor, ExpertsUnavailable
from tandem.experts.cpu_executor import CpuExpertExecutor
from tandem.experts.device_prefill import DevicePrefill
from tandem.experts.shared_weights import SharedPrefill, give_pages_of_their_own
from tandem.kv.block_manager import KVBlockManager
from tandem.kv.cache import CPU, DEVICE, KVCache, KVLayout
from tandem.model.loader import load_model, load_tokenizer
from tandem.model.moe import wrap_executors

GiB = 1 << 30
log = logging.getLogger(__name__)
MAX_REQUEST_ID = 256  # characters


@dataclass
class Completion:
    """A finished completion of a request, as `LLMEngine.generate` returns it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first)
    index: int = 0  # which of the request's SamplingParams.n completions (prompt_logprobs come with 0's)


class LLMEngine:
    def __init__(self, model, tokenizer, device: torch.device, config: EngineConfig | None = None,
                 chat_template: ChatTemplate | None = None):
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.chat_template = chat_template  # None: chat requests are refused
        # Structured outputs' compiler (its llguidance tokenizer is made on first use); None without a tokenizer.
        self._grammars = Grammars(tokenizer, model.cfg.vocab_size, model.cfg.eos_token_ids) if tokenizer else None
        self.model_config = cfg = model.cfg
        self.max_model_len = context_length(cfg, config)
        dtype = next(model.parameters()).dtype
        layout = KVLayout.for_model(model.kv_entries(), cfg.num_layers, dtype, config.kv_cache_dtype, model.kv_scales())
        num_device, num_cpu = self._num_blocks(layout)
        # Bookkeeping first: tiers too small for the limits are refused before any memory is taken.
        self.block_manager = KVBlockManager(num_device, num_cpu, config.block_size, config.enable_prefix_caching)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_waiting=config.max_waiting, cpu_decode=config.cpu_decode,
            num_scheduler_steps=config.num_scheduler_steps)
        try:
            self.scheduler = Scheduler(scheduler_config, self.block_manager, set(cfg.eos_token_ids))
        except ValueError as exc:  # tiers too small: say which settings made them so
            raise ValueError(f"{exc} ({self._tier_sizes(layout, num_device, num_cpu)})") from None
        self.cache = KVCache(layout, config.block_size, num_device, num_cpu, device, config.kv_shm_path)
        try:
            self._prepare_runner(model, device, config)
        except BaseException:
            self.close()  # nothing of a failed engine stays behind in shared memory
            raise
        self.requests: dict[str, _Request] = {}  # by request id, until its last completion finishes
        self._completions: dict[str, _Completion] = {}  # the unfinished ones, by their sequence's id
        self._pending = None  # a scheduled step whose forward pass has not completed
        # Requests failed by a failed KV copy, returned with their step's outputs (kept across a
        # retry while the experts are unavailable).
        self._lost: list[RequestOutput] = []

    def _prepare_runner(self, model, device: torch.device, config: EngineConfig) -> None:
        self.runner = ModelRunner(model, self.cache, device)
        self.gpu_prefill = []  # the GPU prefill wrappers (their `calls` go into stats())
        if device.type == "cuda" and config.device_prefill_tokens:
            self.gpu_prefill = stream_prefill_experts(model, device, config.device_prefill_tokens,
                                                      config.page_lock_experts)
        if device.type == "cuda" and not config.enforce_eager:
            reason = cuda_graph.unsupported_reason(model, self.cache)
            if reason is None:
                graphs = cuda_graph.DecodeGraphs(
                    model, self.cache, self.max_model_len, min(config.max_num_seqs, cuda_graph.MAX_GRAPH_BATCH))
                graphs.capture_all()
                self.runner.graphs = graphs
            else:
                log.info("decode steps run eagerly, without CUDA graphs: %s", reason)

    def close(self) -> None:
        """Remove the CPU KV tier's shared-memory files (kv_shm_path), if any, when serving ends; safe
        to call twice. This process's tensors stay valid; another process can no longer map them."""
        self.cache.close()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device=None, dtype=None, config: EngineConfig | None = None,
                        expert_executor: ExpertExecutor | None = None, expert_threads: int | None = None,
                        expert_quant: str = "none", dense_quant: str = "none",
                        experts_gguf: str | Path | None = None) -> "LLMEngine":
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but no CUDA device is available")
        model, _ = load_model(model_dir, device=device, dtype=dtype, executor=expert_executor,
                              expert_threads=expert_threads, expert_quant=expert_quant, dense_quant=dense_quant,
                              experts_gguf=experts_gguf)
        return cls(model, load_tokenizer(model_dir), device, config, ChatTemplate(model_dir))

    def _num_blocks(self, layout: KVLayout) -> tuple[int, int]:
        c = self.config
        per_block = layout.bytes_per_block(c.block_size)
        # More blocks than every sequence at full length could use is memory for nothing.
        useful = math.ceil(self.max_model_len / c.block_size) * c.max_num_seqs
        if c.num_device_blocks is not None:
            device = c.num_device_blocks
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            device = min(useful, int(free * c.gpu_memory_fraction) // per_block)
        else:
            device = min(useful, int(c.device_kv_gib * GiB) // per_block)
        cpu = c.num_cpu_blocks if c.num_cpu_blocks is not None else min(useful, int(c.cpu_kv_gib * GiB) // per_block)
        if device < 1:
            raise ValueError(f"no room for a single KV block ({per_block} bytes) on the device: "
                             f"{self._tier_sizes(layout, device, cpu)}")
        return device, cpu

    def _tier_sizes(self, layout: KVLayout, num_device: int, num_cpu: int) -> str:
        """What each tier holds and the setting that sized it, for errors about their size."""
        c = self.config
        if c.num_device_blocks is not None:
            device_from = "num_device_blocks (--num-device-blocks)"
        elif self.device.type == "cuda":
            device_from = f"gpu_memory_fraction={c.gpu_memory_fraction} of the free GPU memory (--gpu-memory-fraction)"
        else:
            device_from = f"device_kv_gib={c.device_kv_gib}"
        cpu_from = "num_cpu_blocks" if c.num_cpu_blocks is not None else f"cpu_kv_gib={c.cpu_kv_gib} (--cpu-kv-gib)"
        return (f"device tier: {num_device} blocks of {c.block_size} tokens from {device_from}; CPU tier: {num_cpu} "
                f"blocks from {cpu_from}; a block of this model takes {layout.bytes_per_block(c.block_size)} bytes")

    # requests

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Safe to call from any thread. (`encode_batch` runs without the GIL, `encode` holds it:
        a long text would stall every other thread for as long as it takes.)"""
        if self.tokenizer is None:
            raise InvalidRequest("prompt", "this model has no tokenizer.json: send prompt token ids instead")
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """The prompt token ids of a conversation, rendered by the chat template. Safe from any thread."""
        if self.tokenizer is None:
            raise InvalidRequest("messages", "this model has no tokenizer.json: send prompt token ids instead")
        if self.chat_template is None:
            raise InvalidRequest("messages", "this engine has no chat template: send prompt or prompt_token_ids")
        text = self.chat_template.render(messages, add_generation_prompt, continue_final_message)
        return self.encode(text, add_special_tokens=False)  # the template wrote the BOS it wants

    def compile_constraint(self, params: SamplingParams) -> Constraint | None:
        """A fresh matcher for the request's structured output (None without one); InvalidRequest when it
        does not compile or the model has no tokenizer. Safe from any thread: EngineLoop compiles in a
        worker thread first, so that admitting the request finds it compiled (Grammars caches)."""
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            raise InvalidRequest("structured_outputs", "needs the model's tokenizer; this model has no tokenizer.json")
        return self._grammars.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request: its SamplingParams.n completions, a sequence each, on one prompt prefilled
        once (see tandem.engine.scheduler). Raises InvalidRequest for bad input, QueueFull when the
        waiting queue is full."""
        self._validate(request_id, prompt_token_ids, params)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, self.model_config.vocab_size) \
            if params.bad_words else None
        completions = [self._completion(request_id, i, prompt_token_ids, params, bad_words) for i in range(params.n)]
        seqs = [c.seq for c in completions]
        self.scheduler.add(seqs[0], seqs[1:])  # last: whatever raises before it leaves nothing queued
        self.requests[request_id] = _Request(completions)
        self._completions.update((c.seq.request_id, c) for c in completions)

    def _completion(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                    bad_words: list[list[int]] | None) -> _Completion:
        """Completion `index` of a request: its sequence, with a structured output's matcher of its own
        and the bad words' token sequences, its generator (seeded with seed + index) and its detokenizer."""
        if index > 0:  # the prompt is scored once, by completion 0
            params = replace(params, prompt_logprobs=None)
        seq = Sequence(sequence_id(request_id, index, params.n), list(prompt), params,
                       constraint=self.compile_constraint(params), bad_words_token_ids=bad_words)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(completion_seed(params.seed, index))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, params.stop, min_tokens=params.min_tokens,
                include_stop=params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens)
        return _Completion(request_id, index, seq, generator, detok)

    def _validate(self, request_id, prompt, params: SamplingParams) -> None:
        if not request_id:
            raise InvalidRequest("request_id", "must not be empty")
        if len(request_id) > MAX_REQUEST_ID:  # it is echoed in every streamed message
            raise InvalidRequest("request_id", f"must be at most {MAX_REQUEST_ID} characters, got {len(request_id)}")
        if request_id in self.requests:
            raise DuplicateRequest(request_id)
        if len(prompt) == 0:
            raise InvalidRequest("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        check_in_vocabulary("prompt_token_ids", prompt, vocab)
        if len(prompt) >= self.max_model_len:  # no room for one token, whatever max_tokens says
            raise InvalidRequest("prompt", f"{len(prompt)} tokens leave no room to generate within the context "
                                 f"length {self.max_model_len}")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                "max_tokens", f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}")
        for name, what in (("stop", "stop strings"), ("bad_words", "bad words")):
            if getattr(params, name) and self.tokenizer is None:
                raise InvalidRequest(name, f"{what} need a tokenizer; this model has none")
        check_in_vocabulary("logit_bias", params.logit_bias or (), vocab)
        check_in_vocabulary("allowed_token_ids", params.allowed_token_ids or (), vocab)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request: every completion of it still unfinished, whose KV blocks are freed at once.
        Returns their last outputs (finish_reason "cancelled"); none for a request unknown or finished."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        unfinished = [c for c in req.completions if c.seq.request_id in self._completions]
        seq_ids = {c.seq.request_id for c in unfinished}
        if self._pending is not None:
            self._pending.scheduled = [s for s in self._pending.scheduled if s.seq.request_id not in seq_ids]
        for c in unfinished:
            self.scheduler.abort(c.seq.request_id)
            c.seq.finish_reason = "cancelled"
        return [self._output(c, finished=True) for c in unfinished]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # the step

    def step(self, emit: Callable[[list[RequestOutput]], None] | None = None,
             interrupted: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Schedule, run and postprocess one step; returns its outputs.

        With `emit`, a multi-step decode (num_scheduler_steps > 1) streams: each token step's
        outputs go to emit as that step ends, inside the run, and are not returned again; the run
        ends early once every sequence in it has finished, or when `interrupted()` says the caller
        has work for the engine (a request to admit, an abort), so nothing waits for a whole run.
        A failed copy of KV blocks between the tiers fails only the requests it moved (see _swap)."""
        if self._pending is None:
            out = self.scheduler.schedule()
            self._lost += self._swap(out)
            self._pending = out
        outputs = self._execute(self._pending, emit, interrupted)
        lost, self._lost = self._lost, []
        return lost + outputs

    def _swap(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Copy the step's blocks between the tiers. A copy that fails fails the requests whose KV it
        carried (which of its blocks landed is unknown), not the step: they finish with "error", their
        blocks freed, and leave the batch; their outputs are returned."""
        try:
            self.runner.swap(out.swap_out, out.swap_in)
        except Exception:
            log.exception("copying KV blocks between the tiers failed; finishing %d requests with reason 'error'",
                          len(out.swapping))
            lost = {s.request_id for s in out.swapping}
            out.scheduled = [w for w in out.scheduled if w.seq.request_id not in lost]
            return [self._fail(s) for s in out.swapping]
        return []

    def _execute(self, out: SchedulerOutput, emit: Callable[[list[RequestOutput]], None] | None,
                 interrupted: Callable[[], bool] | None) -> list[RequestOutput]:
        """The forward pass of the pending step `out`, and its postprocessing."""
        generators = {s.seq.request_id: self._completions[s.seq.request_id].generator for s in out.scheduled}
        streamed = None
        if emit is not None and out.scheduled and out.scheduled[0].num_steps > 1:
            streamed = _StreamedRun(self, out, emit, interrupted)
        try:
            sampled = self.runner.execute(out.scheduled, generators, streamed)
        except ExpertsUnavailable:
            raise  # the step stays pending; the next call retries it, losing nothing
        except Exception:
            # A failed forward pass fails the requests in it, not the engine: the rest go on.
            log.exception("forward pass failed; finishing %d requests with reason 'error'", len(out.scheduled))
            self._pending = None
            # (a streamed run may have finished some of them already, and emitted their tokens)
            return [self._fail(s.seq) for s in out.scheduled if s.seq.request_id in self._completions]
        self._pending = None
        if streamed is not None:
            streamed.check_done(sampled)
            return []
        changed = self.scheduler.update(out, sampled)
        return [self._postprocess(seq) for seq in changed if seq.request_id in self._completions]

    def _fail(self, seq: Sequence) -> RequestOutput:
        self.scheduler.finish(seq.request_id, "error")
        return self._output(self._completions[seq.request_id], finished=True)

    def _postprocess(self, seq: Sequence) -> RequestOutput:
        comp = self._completions[seq.request_id]
        if comp.detok is not None:
            new = seq.output_token_ids[comp.reported:]
            # With stop strings, the tokens of a multi-step decode go in one at a time: those after
            # the token that completes a stop string are dropped, as the scheduler drops a stop token's.
            for i, chunk in enumerate([[t] for t in new] if comp.detok.stop and len(new) > 1 else [new]):
                delta, hit = comp.detok.add(chunk)
                comp.pending_text += delta
                if hit:
                    del seq.output_token_ids[comp.reported + i + len(chunk):]
                    comp.stopped_by_string = True
                    if seq.is_finished:  # by the same token, for its length: the stop string comes first
                        seq.finish_reason = "stop"
                    else:
                        self.scheduler.finish(seq.request_id, "stop")
                    break
        return self._output(comp, finished=seq.is_finished)

    def _output(self, comp: _Completion, finished: bool) -> RequestOutput:
        seq = comp.seq
        new = seq.output_token_ids[comp.reported:]
        logprobs = None if seq.logprobs is None else seq.logprobs[comp.reported:seq.num_output_tokens]
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not comp.prompt_reported and not seq.needs_prompt_logprobs:
            prompt_logprobs, comp.prompt_reported = list(seq.prompt_logprobs), True
        text, comp.pending_text = comp.pending_text, ""
        if comp.detok is not None:
            if len(comp.detok.ids) < seq.num_output_tokens:
                delta, _ = comp.detok.add(seq.output_token_ids[len(comp.detok.ids):])
                text += delta
            if finished and not comp.stopped_by_string:  # the tail held back in case a stop string began there
                text += comp.detok.flush()
        comp.reported = seq.num_output_tokens
        if finished:
            del self._completions[seq.request_id]
            siblings = self.requests[comp.request_id].completions
            if not any(c.seq.request_id in self._completions for c in siblings):
                del self.requests[comp.request_id]  # its last completion
        return RequestOutput(
            request_id=comp.request_id, new_token_ids=list(new), finished=finished,
            finish_reason=seq.finish_reason if finished else None, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens, text=text,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=comp.index,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_swapped=self.scheduler.num_swapped, num_offloaded=self.scheduler.num_offloaded,
            kv_blocks_used={t: bm.num_used_blocks(t) for t in (DEVICE, CPU)},
            kv_blocks_total={t: bm.num_total_blocks(t) for t in (DEVICE, CPU)},
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens,
            gpu_prefill_expert_calls=sum(w.calls for w in self.gpu_prefill),
        )

    # convenience

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts together to completion (continuous batching) and return their completions in
        order: prompt by prompt, each prompt's SamplingParams.n of them by index (one each by default)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        keys = [(rid, i) for rid, p in zip(ids, params) for i in range(p.n)]
        done: dict[tuple[str, int], Completion] = {}
        logprobs_of = {rid: p.logprobs for rid, p in zip(ids, params)}
        acc = {(rid, i): ([], [], None if logprobs_of[rid] is None else []) for rid, i in keys}
        scored: dict[tuple[str, int], list] = {}
        while len(done) < len(keys):
            for out in self.step():
                key = out.request_id, out.index
                tokens, texts, logprobs = acc[key]
                tokens.extend(out.new_token_ids)
                texts.append(out.text)
                if logprobs is not None:
                    logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    scored[key] = out.prompt_logprobs
                if out.finished:
                    done[key] = Completion(out.request_id, tokens, "".join(texts), out.finish_reason,
                                           out.num_prompt_tokens, out.num_cached_tokens, logprobs, scored.get(key),
                                           out.index)
        return [done[key] for key in keys]


def stream_prefill_experts(model, device: torch.device, min_tokens: int, pin: bool) -> list:
    """Give every MoE block's expert executor a GPU path for large prefill chunks, its weights
    page-locked if `pin` (once: a wrapper per layer would page-lock the same memory again): the
    in-process CPU executor's weights, or those a client's experts process shares (a client with
    `last_info`, the ExpertsInfo its process last gave: tandem.experts.shared_weights). Returns the
    wrappers, each counting in `calls` the layer calls it computed on the GPU."""
    def wrap(executor):
        if isinstance(executor, CpuExpertExecutor):
            if pin:  # so that all of its weights can be locked, scales included
                give_pages_of_their_own(executor)
            return DevicePrefill(executor, device, min_tokens, pin=pin, own_pages=pin)
        return SharedPrefill(executor, min_tokens, pin)

    return wrap_executors(model, wrap, lambda executor: isinstance(executor, CpuExpertExecutor)
                          or hasattr(executor, "last_info"))


class _StreamedRun:
    """A multi-step decode's tokens applied and emitted step by step (LLMEngine.step with emit):
    called as step i of the run ends, with its tokens in scheduled order, it accounts them as a
    one-token step of every sequence (the scheduler's stops, freeing a finished sequence's blocks,
    the stop strings) and emits the outputs. True: go on with the run."""

    def __init__(self, engine: LLMEngine, out: SchedulerOutput, emit, interrupted):
        self.engine, self.emit, self.interrupted = engine, emit, interrupted
        # The run's sequences in the order its tokens come in. A copy: an abort during the run
        # (from emit or interrupted) replaces the pending step's list with a shorter one.
        self.scheduled = list(out.scheduled)
        self.steps = 0  # steps applied

    def __call__(self, i: int, tokens: list[int]) -> bool:
        if i != self.steps:
            raise RuntimeError(f"decode step {i} of a streamed run, after {self.steps} applied")
        engine, self.steps = self.engine, i + 1
        step = SchedulerOutput([replace(w, start_pos=w.start_pos + i, num_steps=1) for w in self.scheduled])
        changed = engine.scheduler.update(step, {w.seq.request_id: t for w, t in zip(self.scheduled, tokens)})
        outputs = [engine._postprocess(seq) for seq in changed if seq.request_id in engine._completions]
        if outputs:
            self.emit(outputs)
        running = any(not w.seq.is_finished for w in self.scheduled)
        return running and not (self.interrupted is not None and self.interrupted())

    def check_done(self, sampled: dict[str, list[int]]) -> None:
        """The run returned `sampled`: every step of it must have been applied here."""
        done = max((len(t) for t in sampled.values()), default=0)
        if done != self.steps:
            raise RuntimeError(f"a streamed run returned {done} steps, {self.steps} applied")


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of completion `index` of a request for `n`: the request's own id for one
    completion (unless it holds a '#'), else f"{request_id}#{index}". Two (request id, index) pairs
    never share one: an id with a '#' splits back into them at its last '#'."""
    return request_id if n == 1 and "#" not in request_id else f"{request_id}#{index}"


def completion_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed: seed + index, wrapped past torch's largest seed (2**64 - 1) into
    the negative seeds it also takes."""
    seeded = seed + index
    return seeded - (1 << 64) if seed < 1 << 64 <= seeded else seeded


@dataclass
class _Request:
    completions: list[_Completion]  # by index; the request is over when the last one finishes


@dataclass
class _Completion:
    request_id: str
    index: int
    seq: Sequence
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    reported: int = 0  # output tokens already returned
    pending_text: str = ""
    stopped_by_string: bool = False  # its text ends before a stop string
    prompt_reported: bool = False  # its prompt logprobs returned
