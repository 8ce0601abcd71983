"""Routed experts from llama.cpp GGUF files (written here by the gguf package's own writer), into
the executor's formats: each conversion against the gguf package's reference dequantization, and a
whole model whose experts come from a GGUF file against transformers on the same weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from tandem.cli import main
from tandem.engine.llm_engine import LLMEngine
from tandem.experts.base import ExpertWeights
from tandem.experts.factory import make_expert_executor
from tandem.experts.gguf_experts import (gguf_expert_shapes, gguf_files, gguf_quant, load_gguf_experts,
                                         q4_0_to_int4, q4_k_to_int4)
from tandem.experts.quant import Int4Weight, Int8Weight, dequantize_int4, dequantize_int8
from tandem.experts.shared_weights import load_key
from tandem.experts.torch_executor import TorchExpertExecutor
from tandem.model.config import ModelError
from test_experts_quality import forced_against, transformers_logits

T = gguf.GGMLQuantizationType
E, H, I, K = 4, 256, 256, 2


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_blocks(qtype, e: int, n: int, k: int, g: torch.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s block layout [e, n, k / block * bytes], with sane fp16 factors:
    the gguf package cannot quantize to K-quants, and any codes and 6-bit scales are valid."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (e, n, k // weights, nbytes), generator=g, dtype=torch.uint8)

    def fp16(lo, hi):
        return (lo + (hi - lo) * torch.rand(e, n, k // weights, generator=g)).half().view(torch.uint8).reshape(
            e, n, k // weights, 2)

    if qtype == T.Q4_K:  # d, dmin first: w = d sc q - dmin m, sc, m in 0..63, q in 0..15
        raw[..., 0:2], raw[..., 2:4] = fp16(2e-4, 6e-4), fp16(2e-4, 8e-4)
    elif qtype == T.Q6_K:  # d last: w = d sc (q - 32), sc int8
        raw[..., -2:] = fp16(1e-5, 3e-5)
    else:
        raise AssertionError(qtype)
    return raw.reshape(e, n, -1).numpy()


def reference(blocks: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, object]], split_max_tensors: int = 0):
    """name -> (data, type): quantized bytes with their type, or float32 weights (type None); with
    split_max_tensors, split as gguf-split does (PATH-00001-of-0000N.gguf ...)."""
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))  # not an expert: ignored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expert_names(layer: int) -> list[str]:
    return [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]


def test_q4_0_blocks_are_int4_groups_exactly():
    w = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(0)).numpy()
    blocks = gguf.quants.quantize(w, T.Q4_0)
    int4 = q4_0_to_int4(blocks)
    assert int4.group_size == 32 and int4.shape == (2, 8, 128)
    assert torch.equal(dequantize_int4(int4), reference(blocks, T.Q4_0))  # scale d, min -8d: the same numbers


def test_q4_k_blocks_are_int4_groups_up_to_fp16_scales():
    blocks = random_blocks(T.Q4_K, 2, 8, 512, torch.Generator().manual_seed(1))
    int4 = q4_k_to_int4(blocks)
    want = reference(blocks, T.Q4_K)  # ggml's dequantize_row_q4_K, in the gguf package
    assert int4.group_size == 32 and int4.shape == (2, 8, 512)
    got = dequantize_int4(int4)
    # The codes are the file's; each sub-block's d * sc and dmin * m rounded to fp16 (2^-11 relative).
    bound = (want.abs() * 2.0**-10 + 1e-7).reshape(2, 8, 16, 32)
    assert ((got - want).abs().reshape(2, 8, 16, 32) <= bound.amax(dim=-1, keepdim=True)).all()
    assert 0 < rel_err(got, want) < 1e-3


def test_requantized_rows_stay_within_half_a_step_of_q8_0(mixed_file):
    path, want = mixed_file
    layer = load_gguf_experts(path)[2]  # every tensor Q8_0
    gate, up, down = want[2]
    for int8, q8 in ((layer.gate_up, torch.cat([gate, up], dim=1)), (layer.down, down)):
        assert ((dequantize_int8(int8) - q8).abs() <= int8.scale[..., None] / 2 + 1e-6).all()
        assert int8.q.abs().amax(dim=-1).eq(127).all()  # each row's largest weight uses the full range


@pytest.fixture(scope="module")
def mixed_tensors():
    """Expert tensors as llama.cpp's Q4_K_M writes them (name -> (bytes, type)), and the gguf
    package's reading of them: layer 0 in Q4_K and Q4_0 (int4), layer 1 Q4_K with ffn_down in Q6_K
    (int8), layer 2 in Q8_0."""
    g = torch.Generator().manual_seed(3)
    q4_0 = gguf.quants.quantize((torch.randn(E, I, H, generator=g) / 16).numpy(), T.Q4_0)
    q8_0 = [gguf.quants.quantize((torch.randn(*s, generator=g) / 16).numpy(), T.Q8_0) for s in ((E, I, H),) * 2]
    q8_0.append(gguf.quants.quantize((torch.randn(E, H, I, generator=g) / 16).numpy(), T.Q8_0))
    layers = {
        0: [(random_blocks(T.Q4_K, E, I, H, g), T.Q4_K), (q4_0, T.Q4_0), (random_blocks(T.Q4_K, E, H, I, g), T.Q4_K)],
        1: [(random_blocks(T.Q4_K, E, I, H, g), T.Q4_K), (random_blocks(T.Q4_K, E, I, H, g), T.Q4_K),
            (random_blocks(T.Q6_K, E, H, I, g), T.Q6_K)],
        2: [(b, T.Q8_0) for b in q8_0],
    }
    tensors = {name: t for layer, ts in layers.items() for name, t in zip(expert_names(layer), ts)}
    want = {layer: [reference(data, qtype) for data, qtype in ts] for layer, ts in layers.items()}
    return tensors, want


@pytest.fixture(scope="module")
def mixed_file(mixed_tensors, tmp_path_factory):
    """A GGUF file of `mixed_tensors`, and the gguf package's reading of it."""
    tensors, want = mixed_tensors
    return write_gguf(tmp_path_factory.mktemp("gguf") / "experts.gguf", tensors), want


def test_each_layer_takes_the_format_its_tensors_share(mixed_file):
    path, want = mixed_file
    layers = load_gguf_experts(path)
    assert sorted(layers) == [0, 1, 2] and gguf_quant(layers) == "int4"
    assert isinstance(layers[0].gate_up, Int4Weight) and isinstance(layers[0].down, Int4Weight)
    assert isinstance(layers[1].gate_up, Int8Weight) and isinstance(layers[1].down, Int8Weight)  # Q6_K: not 4 bits
    assert isinstance(layers[2].gate_up, Int8Weight)
    bounds = {0: 1e-3, 1: 0.01, 2: 0.01}  # fp16 scales; int8 rows (half a step of the row's largest)
    for layer, (gate, up, down) in want.items():
        w = layers[layer]
        deq = dequantize_int4 if isinstance(w.gate_up, Int4Weight) else dequantize_int8
        assert rel_err(deq(w.gate_up), torch.cat([gate, up], dim=1)) < bounds[layer]
        assert rel_err(deq(w.down), down) < bounds[layer]


def test_the_kernels_compute_what_the_file_holds(mixed_file):
    path, want = mixed_file
    ex = make_expert_executor(load_gguf_experts(path), quant="int4", threads=2)
    exact = TorchExpertExecutor({layer: ExpertWeights(torch.cat([g, u], dim=1), d)
                                 for layer, (g, u, d) in want.items()})
    g = torch.Generator().manual_seed(4)
    for tokens in (3, 40):  # decode-sized (the native GEMV) and prefill-sized batches
        hidden = torch.randn(tokens, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
        weights = torch.full((tokens, K), 0.5)
        for layer in want:
            # int8 activations of the native kernels (per 32 values, or per 256 for int4 rows on
            # AVX2: ~1.3x the rounding), fp16 Q4_K scales, int8 rows: under 4%
            err = rel_err(ex.forward(layer, hidden, ids, weights), exact.forward(layer, hidden, ids, weights))
            assert 0 < err < 0.04, (tokens, layer, err)


def test_unreadable_and_incomplete_files_are_refused(tmp_path, mixed_file):
    with pytest.raises(ValueError, match="is not a file"):
        load_gguf_experts(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_experts(tmp_path / "junk.gguf")
    g = torch.Generator().manual_seed(5)
    q4k = random_blocks(T.Q4_K, E, I, H, g)
    gate, up, _ = expert_names(0)
    with pytest.raises(ValueError, match="no ffn_down_exps tensor"):
        load_gguf_experts(write_gguf(tmp_path / "nodown.gguf", {gate: (q4k, T.Q4_K), up: (q4k, T.Q4_K)}))
    with pytest.raises(ValueError, match="no routed-expert tensors"):
        load_gguf_experts(write_gguf(tmp_path / "none.gguf", {}))
    wrong_down = random_blocks(T.Q4_K, E, H, 2 * I, g)  # [E, H, 2I]: not the gate's [E, I, H] turned
    with pytest.raises(ValueError, match="do not form"):
        load_gguf_experts(write_gguf(tmp_path / "shapes.gguf", {
            gate: (q4k, T.Q4_K), up: (q4k, T.Q4_K), expert_names(0)[2]: (wrong_down, T.Q4_K)}))


def test_unsupported_tensor_types_are_refused_from_the_index(tmp_path):
    # Q8_K is an activation type the gguf package cannot dequantize: refused by the check made
    # before any weight loads (gguf_expert_shapes), naming the tensor and its type.
    g = torch.Generator().manual_seed(7)
    q4k = random_blocks(T.Q4_K, E, I, H, g)
    q8k = torch.randint(0, 256, (E, H, I // 256 * gguf.GGML_QUANT_SIZES[T.Q8_K][1]), generator=g,
                        dtype=torch.uint8).numpy()
    gate, up, down = expert_names(0)
    path = write_gguf(tmp_path / "q8k.gguf", {gate: (q4k, T.Q4_K), up: (q4k, T.Q4_K), down: (q8k, T.Q8_K)})
    for read in (gguf_expert_shapes, load_gguf_experts):
        with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight: tensor type Q8_K is not supported"):
            read(path)


def test_a_split_file_is_read_from_all_its_shards(mixed_tensors, mixed_file, tmp_path):
    # Large GGUF models come split by gguf-split (DeepSeek-R1 Q4_K_M: 9 files); the first shard
    # names them all. Here 9 expert tensors (and a norm) in 4 files of up to 3 tensors.
    tensors, _ = mixed_tensors
    write_gguf(tmp_path / "experts.gguf", tensors, split_max_tensors=3)
    shards = [tmp_path / f"experts-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    assert gguf_files(shards[0]) == shards and all(p.is_file() for p in shards)
    whole, split = load_gguf_experts(mixed_file[0]), load_gguf_experts(shards[0])
    assert gguf_expert_shapes(shards[0]) == gguf_expert_shapes(mixed_file[0]) and sorted(split) == [0, 1, 2]
    for layer, w in whole.items():
        deq = dequantize_int4 if isinstance(w.gate_up, Int4Weight) else dequantize_int8
        assert torch.equal(deq(split[layer].gate_up), deq(w.gate_up)) and torch.equal(deq(split[layer].down),
                                                                                      deq(w.down))
    # A restart's stored weights are keyed by every shard (tandem.experts.shared_weights).
    assert [f[0] for f in load_key(tmp_path, "float32", "none", shards[0])["files"]] == [str(p) for p in shards]
    with pytest.raises(ValueError, match="split in 4: name its first shard, PREFIX-00001-of-00004.gguf"):
        gguf_expert_shapes(shards[1])
    shards[2].unlink()
    with pytest.raises(ValueError, match="experts-00003-of-00004.gguf is not a file"):
        load_gguf_experts(shards[0])


def test_quantized_weights_need_one_format_and_a_quantizing_executor(mixed_file):
    layers = load_gguf_experts(mixed_file[0])
    with pytest.raises(ValueError, match="quant int8 or int4"):
        make_expert_executor(layers, quant="none", threads=1)
    mixed = {0: ExpertWeights(layers[0].gate_up, layers[1].down)}
    with pytest.raises(ValueError, match="one format"):
        make_expert_executor(mixed, quant="int4", threads=1)


# A whole model: the checkpoint's experts written as a GGUF file (layer 0 Q4_K with up in Q4_0,
# layer 1 Q4_K with down in Q6_K), and the same checkpoint with the experts replaced by the gguf
# package's reading of that file, which transformers runs.

GEN = 12
PROMPTS = [[5, 17, 42, 9, 100, 3], [250, 7, 7, 81], [11, 12, 13, 14, 15, 16, 17, 18], [300, 3, 64, 128, 200]]


@pytest.fixture(scope="module")
def gguf_model(demo_model_dir, tmp_path_factory):
    """(checkpoint dir, GGUF file of its experts, reference dir: the checkpoint with the file's experts)."""
    src = demo_model_dir("mixtral", hidden_size=H, intermediate_size=I, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = model.config
    g = torch.Generator().manual_seed(6)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        e = cfg.num_local_experts
        gate, up, down = (random_blocks(T.Q4_K, e, I, H, g), T.Q4_K), (random_blocks(T.Q4_K, e, I, H, g), T.Q4_K), \
            (random_blocks(T.Q6_K if layer else T.Q4_K, e, H, I, g), T.Q6_K if layer else T.Q4_K)
        if layer == 0:
            up = (gguf.quants.quantize((torch.randn(e, I, H, generator=g) / 8).numpy(), T.Q4_0), T.Q4_0)
        tensors.update(zip(expert_names(layer), (gate, up, down)))
        experts = model.model.layers[layer].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.copy_(torch.cat([reference(*gate), reference(*up)], dim=1))
            experts.down_proj.copy_(reference(*down))
    tmp = tmp_path_factory.mktemp("gguf-model")
    model.save_pretrained(tmp / "reference")
    return src, write_gguf(tmp / "experts.gguf", tensors), tmp / "reference"


def test_a_model_with_gguf_experts_matches_transformers_on_the_same_weights(gguf_model):
    src, path, ref_dir = gguf_model
    want_tokens, want = transformers_logits(ref_dir, PROMPTS, GEN)  # [prompts * GEN, V]
    engine = LLMEngine.from_pretrained(src, device="cpu", dtype="float32", experts_gguf=path, expert_threads=2)
    assert engine.model.model.layers[0].mlp.executor.quant == "int4"
    agree, got = forced_against(engine, want_tokens, PROMPTS, GEN)  # at each position of transformers' continuation
    assert agree >= 0.95, f"{agree:.0%} of the positions agree"
    assert rel_err(got, want) < 0.02  # the kernels' int8 activations, fp16 Q4_K scales, int8 Q6_K rows


def test_generate_takes_experts_from_a_gguf_file(gguf_model, capsys):
    src, path, _ = gguf_model
    assert main(["generate", "--model", str(src), "--experts-gguf", str(path), "--prompt-ids", "5,17,42",
                 "--max-tokens", "4", "--device", "cpu", "--json"]) == 0
    assert len(__import__("json").loads(capsys.readouterr().out)["token_ids"]) == 4
    assert main(["generate", "--model", str(src), "--experts-gguf", str(path), "--expert-quant", "int8",
                 "--prompt-ids", "5", "--device", "cpu"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_a_gguf_file_of_another_model_is_refused(gguf_model, demo_model_dir):
    _, path, _ = gguf_model
    message = r"layer 0 has 8 experts of \[256, 256\] \(gate\), the checkpoint 8 experts of \[128, 64\]"
    with pytest.raises(ModelError, match=message):
        LLMEngine.from_pretrained(demo_model_dir("mixtral"), device="cpu", experts_gguf=path)
    with pytest.raises(ModelError, match="no routed experts"):
        LLMEngine.from_pretrained(demo_model_dir("llama"), device="cpu", experts_gguf=path)
