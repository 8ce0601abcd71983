"""The engine: requests in, tokens out. One step is schedule -> run -> postprocess.

Synchronous and single-threaded: `tandem.rpc` drives it from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from tandem.engine import cuda_graph
from tandem.engine.chat import ChatMessage, ChatTemplate
from tandem.engine.config import EngineConfig, EngineStats, context_length
from tandem.engine.logits_processors import bad_words_token_ids
from tandem.engine.model_runner import ModelRunner
from tandem.engine.requests import Completion, Requests
from tandem.engine.sampling_params import (DuplicateRequest, InvalidRequest, RequestOutput, SamplingParams,
                                           check_in_vocabulary)
from tandem.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
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
        try:
            self.scheduler = Scheduler(self._scheduler_config(), self.block_manager, set(cfg.eos_token_ids))
        except ValueError as exc:  # tiers too small: say which settings made them so
            raise ValueError(f"{exc} ({self._tier_sizes(layout, num_device, num_cpu)})") from None
        self.cache = KVCache(layout, config.block_size, num_device, num_cpu, device, config.kv_shm_path)
        try:
            self._prepare_runner(model, device, config)
        except BaseException:
            self.close()  # nothing of a failed engine stays behind in shared memory
            raise
        self.requests = Requests(tokenizer, device)  # by request id, until its last completion finishes
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

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_waiting=c.max_waiting, cpu_decode=c.cpu_decode,
            num_scheduler_steps=c.num_scheduler_steps, policy=c.scheduling_policy,
            sliding_window=self.model_config.sliding_window)

    def _num_blocks(self, layout: KVLayout) -> tuple[int, int]:
        c = self.config
        per_block = layout.bytes_per_block(c.block_size)
        # More blocks than every sequence could hold at once is memory for nothing.
        useful = self._scheduler_config().max_blocks_held(c.block_size) * c.max_num_seqs
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
        worker thread (a complex schema takes a while) and hands the matcher to add_request."""
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            raise InvalidRequest("structured_outputs", "needs the model's tokenizer; this model has no tokenizer.json")
        return self._grammars.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    constraint: Constraint | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request: its SamplingParams.n completions, a sequence each, on one prompt prefilled
        once (see tandem.engine.scheduler). `constraint`: its structured output compiled already
        (compile_constraint), completion 0's matcher, the others' a copy each; None: compiled here.
        `priority`: lower first, under the priority scheduling policy (EngineConfig.scheduling_policy).
        `cache_salt`: the prefix cache shares its blocks only with requests of the same salt (vLLM's).
        Raises InvalidRequest for bad input, QueueFull when the waiting queue is full."""
        prompt_token_ids = self._truncated(prompt_token_ids, params.truncate_prompt_tokens)
        self._validate(request_id, prompt_token_ids, params)
        if constraint is None:
            constraint = self.compile_constraint(params)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, self.model_config.vocab_size) \
            if params.bad_words else None
        request = self.requests.create(request_id, prompt_token_ids, params, constraint, bad_words, priority,
                                       cache_salt)
        first, *others = request.seqs
        self.scheduler.add(first, others)  # whatever raises before it leaves nothing queued
        self.requests.add(request)

    def _truncated(self, prompt: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (SamplingParams.truncate_prompt_tokens); -1: the most that
        leave room for one output token."""
        if keep is None:
            return prompt
        room = self.max_model_len - 1
        if keep > room:  # vLLM refuses it too: it could not keep what it says
            raise InvalidRequest("truncate_prompt_tokens", f"{keep} leaves no room to generate within the context "
                                                           f"length {self.max_model_len}; at most {room}, or -1")
        return list(prompt[-(room if keep == -1 else keep):])

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
        unfinished = self.requests.unfinished(request_id)
        seq_ids = {c.seq.request_id for c in unfinished}
        if self._pending is not None:
            self._pending.scheduled = [s for s in self._pending.scheduled if s.seq.request_id not in seq_ids]
        for c in unfinished:
            self.scheduler.abort(c.seq.request_id)
            c.seq.finish_reason = "cancelled"
        return [self.requests.output(c, finished=True) for c in unfinished]

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
        generators = {s.seq.request_id: self.requests.completion(s.seq).generator for s in out.scheduled}
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
            return [self._fail(s.seq) for s in out.scheduled if self.requests.completion(s.seq)]
        self._pending = None
        if streamed is not None:
            streamed.check_done(sampled)
            return []
        return self._postprocess(self.scheduler.update(out, sampled))

    def _fail(self, seq: Sequence) -> RequestOutput:
        self.scheduler.finish(seq.request_id, "error")
        return self.requests.output(self.requests.completion(seq), finished=True)

    def _postprocess(self, changed: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the sequences a step changed, after their stop strings; none for a
        sequence aborted or failed meanwhile."""
        outputs = []
        for seq in changed:
            comp = self.requests.completion(seq)
            if comp is None:
                continue
            stop = comp.detokenize()
            if stop is not None:  # a stop string ended it
                if seq.is_finished:  # by the same token, for its length: the stop string comes first
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq.request_id, "stop", stop)
            outputs.append(self.requests.output(comp, finished=seq.is_finished))
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_swapped=self.scheduler.num_swapped, num_offloaded=self.scheduler.num_offloaded,
            kv_blocks_used={t: bm.num_used_blocks(t) for t in (DEVICE, CPU)},
            kv_blocks_total={t: bm.num_total_blocks(t) for t in (DEVICE, CPU)},
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens,
            gpu_prefill_expert_calls=sum(w.calls for w in self.gpu_prefill),
            num_preemptions=self.scheduler.num_preemptions,
        )

    # convenience

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts together to completion (continuous batching) and return their completions in
        order: prompt by prompt, each prompt's SamplingParams.n of them by index (one each by default)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        outputs = {(rid, i): [] for rid, p in zip(ids, params) for i in range(p.n)}  # each completion's, in order
        while not all(o and o[-1].finished for o in outputs.values()):
            for out in self.step():
                outputs[out.request_id, out.index].append(out)
        return [Completion.from_outputs(o) for o in outputs.values()]


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
        outputs = engine._postprocess(changed)
        if outputs:
            self.emit(outputs)
        running = any(not w.seq.is_finished for w in self.scheduled)
        return running and not (self.interrupted is not None and self.interrupted())

    def check_done(self, sampled: dict[str, list[int]]) -> None:
        """The run returned `sampled`: every step of it must have been applied here."""
        done = max((len(t) for t in sampled.values()), default=0)
        if done != self.steps:
            raise RuntimeError(f"a streamed run returned {done} steps, {self.steps} applied")
