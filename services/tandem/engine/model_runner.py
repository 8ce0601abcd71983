"""The model runner: turns one scheduler step into tensors, runs the model, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.engine import structured
from tandem.engine.cuda_graph import DecodeGraphs
from tandem.engine.logits_processors import LogitsProcessors
from tandem.engine.sampler import Penalties, Sampler
from tandem.experts.base import ExpertsUnavailable
from tandem.kv.attention import AttentionMetadata, DecodeSteps
from tandem.kv.cache import CPU, DEVICE, KVCache
from tandem.kv.tiered import CpuAttentionBackend, CpuBatch, LocalCpuAttention, StepAttention
from tandem.model.model import CausalLM

log = logging.getLogger(__name__)

# Called as each step of a multi-step decode ends, with its tokens in scheduled order; a false
# return ends the run there (tandem.engine.llm_engine streams a run's tokens this way).
StepCallback = Callable[[int, list[int]], bool]

_NOT_RUN = -2  # a multi-step decode's token for the steps it has not run (NO_TOKEN is -1)

PROMPT_LOGPROBS_ROWS = 256  # prompt positions scored per LM-head call: [256, V] float32 logits at a time


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.sampler = Sampler()
        self.sliding_window = model.cfg.sliding_window
        # Attention of CPU-tier sequences: here by default; the split deployment's experts process
        # (which maps the same shared-memory tier) when the engine is given its client.
        self.cpu_attention: CpuAttentionBackend = LocalCpuAttention(cache)
        # Decode steps of device-tier sequences replayed from CUDA graphs; None: always eager.
        self.graphs: DecodeGraphs | None = None
        # Test and debugging hook: called with (request_id, logits [V]) for every sampled position.
        self.logits_hook: Callable[[str, torch.Tensor], None] | None = None

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        # Out before in: a block freed by a swap-out may be the target of a swap-in in the same step.
        self.cache.swap(swap_out, DEVICE, CPU)
        self.cache.swap(swap_in, CPU, DEVICE)

    def execute(self, scheduled, generators: dict[str, torch.Generator | None],
                on_step: StepCallback | None = None) -> dict[str, int | list[int]]:
        """Run one forward pass over the scheduled chunks; returns request_id -> sampled token (the
        tokens, for a multi-step decode: see decode_steps, which on_step is for)."""
        if not scheduled:
            return {}
        if scheduled[0].num_steps > 1 or (self.device.type == "cpu" and self._greedy_decode(scheduled)):
            # one step of it: the native greedy run, if it serves
            return self.decode_steps(scheduled, generators, on_step)
        # Device-tier sequences first: each tier's tokens are then one slice (see tandem.kv.tiered).
        on_device = [s for s in scheduled if s.tier == DEVICE]
        on_cpu = [s for s in scheduled if s.tier == CPU]
        scheduled = on_device + on_cpu
        tokens, positions = [], []
        for s in scheduled:
            tokens.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        if self._graphed(on_device, on_cpu):
            hidden = self.graphs.run(tokens, positions, [s.block_table for s in on_device])  # [T, H]
        else:
            input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
            hidden = self.model(input_ids, pos, self.cache, self._step_attention(on_device, on_cpu),
                                max_position=max(positions))  # [T, H]
        self._score_prompts(scheduled, hidden)
        # Sample from the last position of each chunk that reaches the end of its sequence.
        last, ends = [], 0
        for s in scheduled:
            ends += len(s.token_ids)
            if s.sample:
                last.append(ends - 1)
        sampling = [s for s in scheduled if s.sample]
        if not sampling:
            return {}
        seqs = [s.seq for s in sampling]
        ids, _ = self._sample(hidden[last], seqs, [generators.get(s.request_id) for s in seqs])
        return {s.request_id: token for s, token in zip(seqs, ids.tolist())}

    def decode_steps(self, scheduled, generators: dict[str, torch.Generator | None],
                     on_step: StepCallback | None = None) -> dict[str, list[int]]:
        """num_steps decode steps in a row of device-tier sequences (the scheduler's multi-step
        decode), each step's sampled tokens the next one's inputs: request_id -> its tokens.

        The steps' attention metadata is built once, and the sampled ids stay a tensor until the
        end. When every sequence samples greedily and nothing watches the logits, the model may run
        all the steps in one native call (`CausalLM.greedy_steps`). on_step(i, tokens), when given,
        is called as each step i ends with its tokens (a list in scheduled order); a false return
        ends the run after that step, and the tokens so far are returned. So are they when the
        experts become unavailable after the first step (the next step meets the outage again and
        stays pending, see LLMEngine.step)."""
        steps = scheduled[0].num_steps
        if any(s.num_steps != steps or s.tier != DEVICE or len(s.token_ids) != 1 for s in scheduled):
            raise ValueError("a multi-step decode takes one token of every sequence, all on the device tier, "
                             "for the same number of steps")
        seqs = [s.seq for s in scheduled]
        rids = [s.request_id for s in seqs]
        gens = [generators.get(r) for r in rids]
        history = None  # what sampling carries from step to step, built at the first step
        tables = [s.block_table for s in scheduled]
        starts = [s.start_pos for s in scheduled]
        run = DecodeSteps.build(starts, tables, steps, self.cache.block_size, self.sliding_window)
        graphed = self._graphed(scheduled, [])
        ids = torch.tensor([s.token_ids[0] for s in scheduled], dtype=torch.long, device=self.device)  # [B]
        tokens = torch.full((len(rids), steps), _NOT_RUN, dtype=torch.long, device=self.device)  # a column a step
        greedy = not graphed and self._greedy_decode(scheduled)
        native_step = None if on_step is None else (lambda i: on_step(i, tokens[:, i].tolist()))
        try:
            if not (greedy and self.model.greedy_steps(ids, run, self.cache, tokens, native_step)):
                metas = AttentionMetadata.decode_steps(run, self.cache.block_size, self.device)
                for i, meta in enumerate(metas):
                    if graphed:
                        hidden = self.graphs.run(ids.tolist(), [p + i for p in starts], tables)  # [B, H]
                    else:
                        step = StepAttention(meta, None, len(rids), self.cpu_attention)
                        hidden = self.model(ids, meta.query_pos.view(-1), self.cache, step,
                                            max_position=max(starts) + i)
                    tokens[:, i], history = self._sample(hidden, seqs, gens, history)  # [B]
                    history.add(tokens[:, i])
                    if on_step is not None and not on_step(i, tokens[:, i].tolist()):
                        break
                    # A sequence that got NO_TOKEN is finished with "error" (its later tokens dropped);
                    # until the run ends it is fed a real token id.
                    ids = tokens[:, i].clamp_min(0)  # [B]
        except ExpertsUnavailable:
            if tokens[0, 0] == _NOT_RUN:
                raise
            log.warning("experts unavailable after %d of %d decode steps; keeping the tokens sampled",
                        int((tokens[0] != _NOT_RUN).sum()), steps, exc_info=True)
        done = int((tokens[0] != _NOT_RUN).sum())  # fewer than steps: an outage, or on_step ended the run
        return dict(zip(rids, tokens[:, :done].tolist()))

    def _sample(self, hidden: torch.Tensor, seqs, generators,
                history: SamplingHistory | None = None) -> tuple[torch.Tensor, SamplingHistory]:
        """hidden [B, H] of the positions sampled from, one per sequence -> (token ids [B] long, the
        sequences' sampling history: given, or built here from the sequences). A sequence that asked
        for logprobs gets this token's appended to its `logprobs` (of the raw logits); one with a
        structured output samples among the tokens its matcher allows, and the token advances it."""
        logits = self.model.compute_logits(hidden)  # [B, V]
        if self.logits_hook is not None:
            for seq, row in zip(seqs, logits):
                self.logits_hook(seq.request_id, row)
        if history is None:
            history = SamplingHistory(Penalties.of(seqs, logits.device), LogitsProcessors.of(
                seqs, self.model.cfg.eos_token_ids, logits.shape[1], logits.device))
        constraints = [s.constraint for s in seqs]
        constrained = any(c is not None for c in constraints)
        masked = structured.mask_logits(logits, constraints) if constrained else logits  # [B, V]
        if history.processors is not None:
            masked = history.processors.apply(masked)  # [B, V]
        tokens = self.sampler.sample(masked, [s.params for s in seqs], generators, history.penalties)
        if constrained:
            structured.advance(constraints, tokens.tolist())
        wanted = [s.params.logprobs for s in seqs]
        if any(n is not None for n in wanted):
            for seq, entry in zip(seqs, self.sampler.logprobs(logits, tokens, wanted)):
                if entry is not None:
                    seq.logprobs.append(entry)
        return tokens, history

    def _score_prompts(self, scheduled, hidden: torch.Tensor) -> None:
        """Prompt logprobs (Sequence.prompt_logprobs) of the requests that asked for them: each chunk
        position p whose next token, p + 1, is a prompt token not yet scored. hidden [T, H] holds the
        chunks' positions in scheduled order."""
        rows, targets, owners = [], [], []
        offset = 0
        for s in scheduled:
            seq, end = s.seq, s.start_pos + len(s.token_ids)
            if seq.needs_prompt_logprobs:
                first = len(seq.prompt_logprobs) - 1  # the position that scores the next unscored token
                if s.start_pos <= first < end:
                    for p in range(first, min(end, seq.num_prompt_tokens - 1)):
                        rows.append(offset + p - s.start_pos)
                        targets.append(seq.prompt_token_ids[p + 1])
                        owners.append(seq)
            offset += len(s.token_ids)
        for i in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            index = torch.tensor(rows[i:i + PROMPT_LOGPROBS_ROWS], device=hidden.device)
            logits = self.model.compute_logits(hidden[index])  # [R, V]
            part = owners[i:i + PROMPT_LOGPROBS_ROWS]
            tokens = torch.tensor(targets[i:i + PROMPT_LOGPROBS_ROWS], device=logits.device)
            counts = [q.params.prompt_logprobs for q in part]
            for seq, entry in zip(part, self.sampler.logprobs(logits, tokens, counts)):
                seq.prompt_logprobs.append(entry)

    def _greedy_decode(self, scheduled) -> bool:
        """A decode step of device-tier sequences that all take the argmax of the raw logits
        (Sampler.argmax_only), nothing watching the logits: the model may run its steps without
        returning to Python (`CausalLM.greedy_steps`)."""
        return self.logits_hook is None and all(
            s.tier == DEVICE and s.sample and len(s.token_ids) == 1 and self.sampler.argmax_only(s.seq.params)
            for s in scheduled)

    def _graphed(self, on_device, on_cpu) -> bool:
        """A decode step (one token per sequence) of device-tier sequences only, of a graphed size."""
        return (self.graphs is not None and not on_cpu and self.graphs.serves(len(on_device))
                and all(len(s.token_ids) == 1 for s in on_device))

    def _step_attention(self, on_device, on_cpu) -> StepAttention:
        def args(work):
            return [s.start_pos for s in work], [len(s.token_ids) for s in work], [s.block_table for s in work]

        device = cpu = None
        if on_device:
            device = AttentionMetadata.build(*args(on_device), self.cache.block_size, self.device, self.sliding_window)
        if on_cpu:
            cpu = CpuBatch.build(*args(on_cpu), self.cache.block_size, self.sliding_window)
        num_device_tokens = sum(len(s.token_ids) for s in on_device)
        return StepAttention(device, cpu, num_device_tokens, self.cpu_attention)


@dataclass
class SamplingHistory:
    """What sampling a batch carries from step to step of a multi-step decode, built from its sequences
    at the first step: the tokens its penalized rows have seen, and its logits processors' state."""

    penalties: Penalties | None
    processors: LogitsProcessors | None

    def add(self, tokens: torch.Tensor) -> None:
        """A step's tokens [B] join the outputs they were sampled for."""
        for part in (self.penalties, self.processors):
            if part is not None:
                part.add(tokens)
