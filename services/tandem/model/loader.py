"""Load a Hugging Face checkpoint directory unchanged: safetensors (single or sharded) and config.

Routed-expert tensors are stacked per layer into `ExpertWeights` for the expert executor; every
other tensor goes into the model on the compute device. A tensor the model has no place for is a
ModelError, not skipped: without it (a bias, a layer) the model would compute another one.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from tandem.experts.base import ExpertExecutor, ExpertWeights
from tandem.experts.cpu_executor import PreparedLayer
from tandem.model import huge_pages
from tandem.model.config import ModelConfig, ModelError, load_config, read_json
from tandem.model.fp8 import dequantize_stream, weight_of
from tandem.model.layers import RotaryEmbedding
from tandem.model.model import CausalLM
from tandem.model.quant_linear import check_dense_quant, quantize_dense_

_log = logging.getLogger(__name__)

PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar for checkpoints larger than this

# Per-expert tensors as checkpoints name them: (layer, expert, projection).
_EXPERT_KEY = re.compile(
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# Stacked tensors as transformers >= 5 may save them: (layer, name).
_STACKED_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# A layer's calibrated fp8 KV scales: compressed-tensors' (kv_cache_scheme) and vLLM's `self_attn.k_scale`
# and `v_scale`, and AutoFP8's older `self_attn.k_proj.output_scale` / `v_proj.output_scale`, which vLLM
# reads as them. An fp8 KV cache takes them (tandem.kv.fp8); an "auto" one ignores them.
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# A shared expert's tensors, per architecture that has one.
_SHARED_EXPERT = {"Qwen2MoeForCausalLM": re.compile(r"model\.layers\.\d+\.mlp\.shared_expert(?:_gate)?\."),
                  "DeepseekV3ForCausalLM": re.compile(r"model\.layers\.\d+\.mlp\.shared_experts\.")}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(cfg: ModelConfig, dtype: str | torch.dtype | None) -> torch.dtype:
    """`dtype` when given, else the checkpoint's; a float16 checkpoint's is float32, which holds its
    values exactly (bfloat16 would round them)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or _checkpoint_dtype(cfg)
    if dtype is None and name == "float16":
        return torch.float32
    if name not in _DTYPES:
        raise ModelError(f"unsupported dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _checkpoint_dtype(cfg: ModelConfig) -> str:
    return str(getattr(cfg.hf_config, "dtype", None) or "float32").replace("torch.", "")


def _weights_dtype(cfg: ModelConfig, dtype: str | torch.dtype | None) -> torch.dtype:
    """`resolve_dtype`, saying so when a float16 checkpoint becomes float32."""
    resolved = resolve_dtype(cfg, dtype)
    if dtype is None and _checkpoint_dtype(cfg) == "float16":
        _log.info("float16 checkpoint: its weights load as float32, which holds them exactly; "
                  "--dtype bfloat16 halves their memory but rounds them")
    return resolved


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelError(f"{index} has no \"weight_map\" from tensor names to shard files")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{index} names {len(missing)} shard(s) that {model_dir} does not hold, e.g. {missing[0]}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def _open_shard(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:  # empty, truncated or not safetensors at all
        raise ModelError(f"{path} is not a readable safetensors file: {exc}") from None


def iter_tensors(model_dir: Path, desc: str, skip: Callable[[str], bool] | None = None):
    """Yield (name, tensor) over every shard, with a progress bar for large checkpoints; the names
    `skip` is true for are not read."""
    files = checkpoint_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
              disable=total < PROGRESS_MIN_BYTES) as bar:
        done = 0
        for path in files:
            with _open_shard(path) as f:
                for name in f.keys():
                    if skip is not None and skip(name):
                        continue
                    tensor = f.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    yield name, tensor
            done += path.stat().st_size
            bar.update(done - bar.n)  # the shard's skipped tensors and header count as passed


def checkpoint_tensors(model_dir: Path, cfg: ModelConfig, desc: str, experts: bool = True, dense: bool = True):
    """`iter_tensors` as the model sees it: FP8 weights dequantized (`tandem.model.fp8`), their static
    activation scales dropped, multi-token-prediction layers not read; with experts False, the routed
    experts' tensors (and their FP8 scales) are not read, with dense False everything else is not (what
    the experts process of the split deployment needs).

    DeepSeek-V3 ships its multi-token-prediction module as `model.layers.{num_hidden_layers}.*`
    (a whole MoE layer, 11 GB in fp8); plain decoding never runs it, so it is not read. Any other
    layer past the last one reaches the caller, which refuses it (`_unexpected_tensor`).
    """
    def skip(name: str) -> bool:
        if cfg.num_layers <= _layer_index(name) < cfg.num_layers + cfg.mtp_layers:
            return True
        return not (experts if is_expert_tensor(weight_of(name)) else dense)

    return dequantize_stream(iter_tensors(model_dir, desc, skip), cfg.fp8)


def _layer_index(name: str) -> int:
    m = _LAYER.match(name)
    return int(m[1]) if m else -1


def is_expert_tensor(name: str) -> bool:
    return bool(_EXPERT_KEY.match(name) or _STACKED_KEY.match(name))


def _inert(cfg: ModelConfig, key: str) -> bool:
    """Whether a checkpoint tensor the model has no place for changes nothing: rotary frequencies the
    model computes itself, or the zero-width shared expert (and Qwen2-MoE's gate of it) transformers
    builds, and saves, for a config without one: its output is zero."""
    if key.endswith(".rotary_emb.inv_freq"):
        return True
    shared = _SHARED_EXPERT.get(cfg.architecture)
    return shared is not None and not cfg.shared_expert_intermediate_size and bool(shared.match(key))


def _unexpected_tensor(cfg: ModelConfig, name: str) -> ModelError:
    """The error for a checkpoint tensor the model as configured has no place for: loading without it
    would compute another model than the checkpoint's."""
    layer = _layer_index(name)
    if layer >= cfg.num_layers:
        return ModelError(f"checkpoint tensor {name} is in layer {layer}, but the config has num_hidden_layers "
                          f"{cfg.num_layers}")
    return ModelError(f"checkpoint tensor {name} is not a weight of {cfg.architecture} as its config describes it "
                      "(a config field that adds it, such as a bias, is missing or not supported)")


class ExpertCollector:
    """Gathers one MoE layer's routed-expert tensors and, as soon as the last of them arrives, stacks
    them as [E, 2I, H] and [E, H, I] and hands the layer to `on_layer(layer, weights)`.

    Only the layers still incomplete are held (checkpoints list a layer's tensors together, so
    normally one): the whole model's experts unquantized would not fit where their int4 copy does.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, on_layer: Callable[[int, ExpertWeights], None]):
        self.cfg, self.dtype, self.on_layer = cfg, dtype, on_layer
        self.parts: dict[int, dict] = defaultdict(dict)
        self.done: set[int] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if m := _EXPERT_KEY.match(name):
            layer, key = int(m[1]), (_PROJ[m[3]], int(m[2]))
            if key[1] >= self.cfg.num_experts:
                raise ModelError(f"{name}: expert {key[1]}, but the config has {self.cfg.num_experts} experts")
        elif m := _STACKED_KEY.match(name):
            layer, key = int(m[1]), m[2]
        else:
            return
        if not self.cfg.is_moe_layer(layer):
            raise _unexpected_tensor(self.cfg, name)
        parts = self.parts[layer]
        parts[key] = tensor.to(self.dtype)
        if self._complete(parts):
            del self.parts[layer]
            self.done.add(layer)
            self.on_layer(layer, self._stack(layer, parts))

    def finish(self) -> None:
        """Raise for the first MoE layer whose routed experts did not all arrive."""
        for layer in self.cfg.moe_layers:
            if layer in self.done:
                continue
            parts = self.parts.get(layer)
            if not parts:
                raise ModelError(f"checkpoint has no routed-expert weights for MoE layer {layer}")
            raise ModelError(f"layer {layer}: missing expert tensor {self._missing(parts)[0]}")

    def _complete(self, parts: dict) -> bool:
        if "gate_up_proj" in parts or "down_proj" in parts:
            return not self._missing(parts)
        return len(parts) == 3 * self.cfg.num_experts  # the keys are (proj, expert < E): no need to list them

    def _missing(self, parts: dict) -> list:
        if "gate_up_proj" in parts or "down_proj" in parts:
            return [k for k in ("gate_up_proj", "down_proj") if k not in parts]
        experts = range(self.cfg.num_experts)
        return [(proj, e) for proj in ("gate", "up", "down") for e in experts if (proj, e) not in parts]

    def _stack(self, layer: int, parts: dict) -> ExpertWeights:
        e, i, h = self.cfg.num_experts, self.cfg.moe_intermediate_size, self.cfg.hidden_size
        if "gate_up_proj" in parts:
            for name, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
                if tuple(parts[name].shape) != shape:
                    raise ModelError(f"layer {layer} mlp.experts.{name}: checkpoint shape {tuple(parts[name].shape)} "
                                     f"!= expected {shape} from the config's experts, moe_intermediate_size and "
                                     "hidden_size")
            return ExpertWeights(parts.pop("gate_up_proj").contiguous(), parts.pop("down_proj").contiguous())
        # Copy into the stacked tensors expert by expert, freeing each part as it lands, so a layer
        # costs its own size once rather than parts + stack + concatenation.
        gate_up = torch.empty(e, 2 * i, h, dtype=self.dtype)  # [E, 2I, H]
        down = torch.empty(e, h, i, dtype=self.dtype)  # [E, H, I]
        for expert in range(e):
            for proj, rows in (("gate", gate_up[expert, :i]), ("up", gate_up[expert, i:]), ("down", down[expert])):
                part = parts.pop((proj, expert))
                if part.shape != rows.shape:
                    raise ModelError(f"layer {layer} expert {expert} {proj}: checkpoint shape {tuple(part.shape)} "
                                     f"!= expected {tuple(rows.shape)}")
                rows.copy_(part)
        return ExpertWeights(gate_up, down)


def _model_key(name: str) -> str:
    # Mixtral calls its MoE block `block_sparse_moe`; our module is `mlp` for every architecture.
    return name.replace(".block_sparse_moe.", ".mlp.")


def load_model(model_dir: str | Path, *, device: torch.device | str = "cpu", dtype=None,
               executor: ExpertExecutor | None = None, expert_threads: int | None = None,
               expert_quant: str = "none", dense_quant: str = "none",
               experts_gguf: str | Path | None = None) -> tuple[CausalLM, ExpertExecutor | None]:
    """Build the model on `device`. Without an executor, the routed experts load into an in-process
    one: from the checkpoint, or with `experts_gguf` from that llama.cpp GGUF file in its own
    formats (`tandem.experts.gguf_experts`; the checkpoint's expert tensors are then not read and
    may be absent).

    dense_quant: "none" or "int8" for every dense linear layer (`tandem.model.quant_linear`).
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    dtype = _weights_dtype(cfg, dtype)
    device = torch.device(device)
    check_dense_quant(dense_quant, device)  # before any weight loads
    if experts_gguf is not None and executor is None:
        _check_gguf(cfg, expert_quant, experts_gguf)
    collector = None
    if executor is None and cfg.is_moe and experts_gguf is None:
        executor, add_layer = _empty_executor(expert_threads, expert_quant)
        collector = ExpertCollector(cfg, dtype, add_layer)
    with torch.device("meta"):
        model = CausalLM(cfg, executor)
    model = model.to_empty(device=device).to(dtype)
    _keep_float32(model)
    model.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim).to(device)
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in checkpoint_tensors(model_dir, cfg, "loading weights", experts=collector is not None):
        if is_expert_tensor(name):
            if collector is not None:
                collector.add(name, tensor)
            continue
        key = _model_key(name)
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if m := _KV_SCALE.match(key):
            _set_kv_scale(model, cfg, name, int(m[1]), m[2] or m[3], tensor)
            continue
        if key not in params:
            if _inert(cfg, key):
                continue
            raise _unexpected_tensor(cfg, name)
        param = params[key]
        if param.shape != tensor.shape:
            raise ModelError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    if collector is not None:
        collector.finish()
    if executor is None and cfg.is_moe:
        executor = _gguf_executor(experts_gguf, expert_threads)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "executor"):
                layer.mlp.executor = executor
    model.eval()
    quantize_dense_(model, dense_quant)
    on_huge_pages([*model.parameters(), *model.buffers(), *expert_tensors(executor)])
    return model, executor


def _set_kv_scale(model: CausalLM, cfg: ModelConfig, name: str, layer: int, kind: str, tensor: torch.Tensor) -> None:
    if layer >= cfg.num_layers:
        raise _unexpected_tensor(cfg, name)
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise ModelError(f"{name}: a KV scale must be one float (per tensor), got {tensor.dtype} of shape "
                         f"{tuple(tensor.shape)}; per-head KV scales are not supported")
    value = float(tensor.float())
    if not 0 < value < math.inf:
        raise ModelError(f"{name}: a KV scale must be finite and > 0, got {value}")
    setattr(model.model.layers[layer].self_attn, f"{kind}_scale", value)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's `tokenizers` tokenizer from its tokenizer.json; None when it has none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ModelError(f"{path} is not a tokenizer the tokenizers library can read: {exc}") from None


def _keep_float32(model: torch.nn.Module) -> None:
    # Small parameters a module lists in `keep_float32` (DeepSeek's router bias) stay float32 in a
    # bfloat16 model, as transformers keeps them: rounding them would change which experts win.
    for module in model.modules():
        for name in getattr(module, "keep_float32", ()):
            param = getattr(module, name)
            param.data = param.data.float()


def load_expert_weights(model_dir: str | Path, dtype=None) -> dict[int, ExpertWeights]:
    """Only the routed-expert weights, unquantized, all layers at once."""
    model_dir = Path(model_dir)
    layers = {}
    _load_experts(model_dir, _experts_config(model_dir), dtype, layers.__setitem__)
    return layers


def build_expert_executor(model_dir: str | Path, *, dtype=None, threads: int | None = None,
                          quant: str = "none", experts_gguf: str | Path | None = None) -> ExpertExecutor:
    """The routed experts of the checkpoint (or, with `experts_gguf`, of that GGUF file for the
    checkpoint's config) in an in-process executor: what the experts process of the split
    deployment holds. Each layer goes into the executor as soon as it is read."""
    model_dir = Path(model_dir)
    if experts_gguf is None:
        cfg = _experts_config(model_dir)
        executor, add_layer = _empty_executor(threads, quant)
        _load_experts(model_dir, cfg, dtype, add_layer)
    else:
        _check_gguf(load_config(model_dir), quant, experts_gguf)
        executor = _gguf_executor(experts_gguf, threads)
    on_huge_pages(expert_tensors(executor))
    return executor


def expert_tensors(executor) -> list[torch.Tensor]:
    """The stored weights (scales included) of an in-process executor's layers; none for another."""
    layers = getattr(executor, "layers", None)
    return [t for p in (layers.values() if isinstance(layers, dict) else ()) if isinstance(p, PreparedLayer)
            for t in p.native_args()]


def on_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Back the weights that decode streams with 2 MiB pages, where the kernel can (tandem.model.huge_pages);
    not when THP_MEM_ALLOC_ENABLE is "0", the operator's way to keep 4 KiB pages."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "0":
        return
    start = time.perf_counter()
    done = huge_pages.collapse(tensors)
    if done:
        _log.info("%d MiB of weights on 2 MiB pages (%.1f s)", done >> 20, time.perf_counter() - start)


def _experts_config(model_dir: Path) -> ModelConfig:
    cfg = load_config(model_dir)
    if not cfg.is_moe:
        raise ModelError(f"{cfg.architecture} has no routed experts to serve")
    return cfg


def _load_experts(model_dir: Path, cfg: ModelConfig, dtype, on_layer: Callable[[int, ExpertWeights], None]) -> None:
    """Read only the routed-expert weights, handing each MoE layer to `on_layer` once it is complete."""
    collector = ExpertCollector(cfg, _weights_dtype(cfg, dtype), on_layer)
    for name, tensor in checkpoint_tensors(model_dir, cfg, "loading experts", dense=False):
        collector.add(name, tensor)
    collector.finish()


def _check_gguf(cfg: ModelConfig, expert_quant: str, path: str | Path) -> None:
    """Before any weight loads: the GGUF file's routed experts are the checkpoint's, the same MoE
    layers and each layer's experts of its shapes (read from the file's tensor index)."""
    if not cfg.is_moe:
        raise ModelError(f"{cfg.architecture} has no routed experts to load from a GGUF file")
    if expert_quant != "none":
        raise ValueError(f"expert quantization {expert_quant!r} and a GGUF experts file exclude each other: "
                         "the file's types decide the experts' format")
    from tandem.experts.gguf_experts import gguf_expert_shapes

    layers = gguf_expert_shapes(path)
    if sorted(layers) != sorted(cfg.moe_layers):
        raise ModelError(f"{path}: routed experts for layers {sorted(layers)}, but the checkpoint's MoE layers "
                         f"are {sorted(cfg.moe_layers)}")
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
    for layer, shapes in sorted(layers.items()):
        for proj, shape in want.items():
            if shapes.get(proj) != shape:
                raise ModelError(f"{path}: layer {layer} has {_experts_of(shapes.get(proj))} ({proj}), "
                                 f"the checkpoint {_experts_of(shape)}")


def _experts_of(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "no tensor"
    return f"{shape[0]} experts of {list(shape[1:])}" if len(shape) == 3 else f"a tensor of shape {list(shape)}"


def _gguf_executor(path: str | Path, threads: int | None) -> ExpertExecutor:
    """An executor for the routed experts of `path` (a llama.cpp GGUF file `_check_gguf` passed)."""
    from tandem.experts.gguf_experts import gguf_quant, load_gguf_experts

    layers = load_gguf_experts(path)
    executor, add_layer = _empty_executor(threads, gguf_quant(layers))
    for layer, w in layers.items():
        add_layer(layer, w)
    return executor


def _empty_executor(threads: int | None, quant: str) -> tuple[ExpertExecutor, Callable[[int, ExpertWeights], None]]:
    """An in-process executor with no layers yet, and the function that adds one: the CPU executor
    converts (quantizes) it there, so the caller need not keep the layer's own weights."""
    try:
        from tandem.experts.factory import make_expert_executor
    except ImportError:
        from tandem.experts.torch_executor import TorchExpertExecutor

        if quant != "none":
            raise ModelError(f"expert quantization {quant!r} is not available in this build") from None
        layers = {}
        return TorchExpertExecutor(layers, threads), layers.__setitem__
    executor = make_expert_executor({}, threads=threads, quant=quant)
    return executor, executor.add_layer
