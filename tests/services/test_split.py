"""Real `tandem serve` processes: the split pair (attention + experts) against the embedded
server, an experts outage and recovery, SIGTERM, /metrics, and `tandem generate --server`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from svc_helpers import NOT_SERVING, SERVING, SMALL_ENGINE, eventually, generate, greedy, token_ids, wait_health

from tandem import contract
from tandem.cli import main as tandem_main
from tandem.kv.attention import AttentionMetadata, paged_attention
from tandem.rpc.cpu_attention import SharedCpuKV
from tandem.rpc.experts_client import GrpcExpertExecutor
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 7, 300, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def start_pair(serve_process, model, tmp_path, wait: bool = True, experts_flags: tuple[str, ...] = ()):
    """An experts process and an attention process calling it over a unix socket, sharing the CPU KV file."""
    shm = str(tmp_path / "shm" / "kv")
    socket = f"unix:{tmp_path}/experts.sock"
    experts = serve_process("--model", str(model), "--role", "experts", "--listen", socket,
                            "--metrics-port", "0", "--kv-shm", shm, *experts_flags, wait=wait)
    attention = serve_process("--model", str(model), "--role", "attention", "--experts", socket,
                              "--listen", "127.0.0.1:0", "--metrics-port", "0", "--kv-shm", shm, "--device", "cpu",
                              *SMALL_ENGINE, wait=wait)
    return experts, attention


def scrape(port: int) -> dict:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


async def generate_all(address: str) -> list[list[int]]:
    """PROMPTS at once (one continuous batch), greedy."""
    streams = await asyncio.gather(*(generate(address, greedy(p, max_tokens=12)) for p in PROMPTS))
    return [token_ids(s) for s in streams]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
async def test_split_pair_generates_what_the_embedded_server_does(serve_process, model_dir, tmp_path, arch):
    model = model_dir(arch)
    experts, attention = start_pair(serve_process, model, tmp_path, wait=False)
    embedded = serve_process("--model", str(model), "--listen", f"unix:{tmp_path}/embedded.sock",
                             "--metrics-port", "0", "--device", "cpu", *SMALL_ENGINE, wait=False)
    for proc in (experts, attention, embedded):
        proc.wait_listening()
    await wait_health(experts.address, SERVING, service=contract.EXPERTS_SERVICE)
    await asyncio.gather(*(wait_health(p.address, SERVING) for p in (attention, embedded)))

    split, alone = await asyncio.gather(generate_all(attention.address), generate_all(embedded.address))
    assert split == alone
    assert all(len(ids) == 12 for ids in split)

    # Both sides count what they did, under names of their own (a sum over a pod's two targets counts
    # each call once): the attention side times each expert call it makes, the experts side computing it.
    moe_layers = 1 if arch == "qwen2_moe" else 2  # the qwen2_moe demo has one dense (mlp_only) layer
    calls = scrape(attention.metrics_port)[(contract.EXPERT_CALL_LATENCY + "_count", ())]
    assert calls >= moe_layers * 12 and calls % moe_layers == 0
    # The experts process observes the frames its native end answered once that end returns to
    # Python, just after the last answer: poll for it.
    count = (contract.EXPERTS_FORWARD_LATENCY + "_count", ())
    assert await eventually(lambda: scrape(experts.metrics_port)[count], calls) == calls
    # and the tokens it computed the experts of: each token fed to the model (a request's last is
    # sampled, never fed), once a MoE layer, prompts' cached blocks skipped
    served = scrape(attention.metrics_port)
    fed = sum(map(len, PROMPTS)) + served[(contract.GENERATED_TOKENS + "_total", ())] - len(PROMPTS)
    fed -= served[(contract.PREFIX_CACHED_TOKENS + "_total", ())]
    assert scrape(experts.metrics_port)[(contract.EXPERTS_FORWARD_TOKENS + "_total", ())] == moe_layers * fed
    names = [{name for name, _ in scrape(proc.metrics_port)} for proc in (attention, experts)]
    assert not names[0] & names[1]
    assert scrape(attention.metrics_port)[(contract.GENERATED_TOKENS + "_total", ())] == 36

    if arch == "mixtral":  # `tandem generate --server` prints what the local command prints
        await check_remote_generate_matches_local(model, attention.address, embedded.address)
        await check_experts_read_the_shared_cpu_tier(experts.address, tmp_path / "shm" / "kv")


async def test_split_pair_with_gguf_experts_generates_what_the_embedded_server_does(serve_process, model_dir,
                                                                                      tmp_path):
    # The experts process takes the routed experts from a llama.cpp GGUF file (Q4_0: int4 on its
    # kernels); the embedded server takes them from the same file.
    import gguf

    model = model_dir("mixtral")
    config = json.loads((model / "config.json").read_text())
    e, i, h = config["num_local_experts"], config["intermediate_size"], config["hidden_size"]
    g, q4_0 = torch.Generator().manual_seed(0), gguf.GGMLQuantizationType.Q4_0
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for layer in range(config["num_hidden_layers"]):
        for name, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            w = (torch.randn(*shape, generator=g) / shape[2] ** 0.5).numpy()
            writer.add_tensor(f"blk.{layer}.ffn_{name}_exps.weight", gguf.quants.quantize(w, q4_0), raw_dtype=q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    experts, attention = start_pair(serve_process, model, tmp_path, wait=False,
                                    experts_flags=("--experts-gguf", str(path)))
    embedded = serve_process("--model", str(model), "--listen", f"unix:{tmp_path}/embedded.sock", "--metrics-port", "0",
                             "--device", "cpu", "--experts-gguf", str(path), *SMALL_ENGINE, wait=False)
    plain = serve_process("--model", str(model), "--listen", f"unix:{tmp_path}/plain.sock", "--metrics-port", "0",
                          "--device", "cpu", *SMALL_ENGINE, wait=False)
    for proc in (experts, attention, embedded, plain):
        proc.wait_listening()
    await wait_health(experts.address, SERVING, service=contract.EXPERTS_SERVICE)
    await asyncio.gather(*(wait_health(p.address, SERVING) for p in (attention, embedded, plain)))
    split, alone, own = await asyncio.gather(*(generate_all(p.address) for p in (attention, embedded, plain)))
    assert split == alone and all(len(ids) == 12 for ids in split)
    assert split != own  # the experts are the file's, not the checkpoint's


# A device KV tier of 6 blocks of 4 tokens: every prompt here outgrows it within 24 new tokens.
TINY_DEVICE_TIER = ["--block-size", "4", "--num-device-blocks", "6", "--max-num-batched-tokens", "16",
                    "--max-model-len", "64", "--max-num-seqs", "8", "--cpu-kv-gib", "0.01"]


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
async def test_offloaded_sequences_decode_on_the_experts_process(serve_process, model_dir, tmp_path, arch,
                                                                  kv_cache_dtype):
    """Sequences the device tier cannot hold move to the shared CPU tier; the experts process
    computes their attention from the shared memory (the latent layout for DeepSeek; an fp8 tier read
    as the attention process's --kv-cache-dtype made it, from its published layout), with the tokens
    the embedded server computes in-process."""
    model = model_dir(arch)
    tiny_device_tier = [*TINY_DEVICE_TIER, "--kv-cache-dtype", kv_cache_dtype]
    shm, socket = str(tmp_path / "shm" / "kv"), f"unix:{tmp_path}/experts.sock"
    experts = serve_process("--model", str(model), "--role", "experts", "--listen", socket, "--metrics-port", "0",
                            "--kv-shm", shm, wait=False)
    attention = serve_process("--model", str(model), "--role", "attention", "--experts", socket, "--listen",
                              "127.0.0.1:0", "--metrics-port", "0", "--kv-shm", shm, "--device", "cpu",
                              *tiny_device_tier, wait=False)
    embedded = serve_process("--model", str(model), "--listen", f"unix:{tmp_path}/embedded.sock",
                             "--metrics-port", "0", "--device", "cpu", *tiny_device_tier, wait=False)
    for proc in (experts, attention, embedded):
        proc.wait_listening()
    await wait_health(experts.address, SERVING, service=contract.EXPERTS_SERVICE)
    await asyncio.gather(*(wait_health(p.address, SERVING) for p in (attention, embedded)))

    async def run(address):
        streams = await asyncio.gather(*(generate(address, greedy(p, max_tokens=24)) for p in PROMPTS))
        return [token_ids(s) for s in streams]

    split, alone = await asyncio.gather(run(attention.address), run(embedded.address))
    assert split == alone and all(len(ids) == 24 for ids in split)

    count = (contract.CPU_ATTENTION_LATENCY + "_count", ())
    remote_calls = scrape(experts.metrics_port)[(contract.EXPERTS_CPU_ATTENTION_LATENCY + "_count", ())]
    assert remote_calls > 0 and scrape(attention.metrics_port)[count] == remote_calls
    assert scrape(embedded.metrics_port)[count] > 0  # in-process there
    metrics = scrape(attention.metrics_port)
    assert metrics[(contract.OFFLOADED_REQUESTS, ())] == 0
    assert metrics[(contract.KV_BLOCKS_USED, (("tier", "cpu"),))] == 0  # every block came back


async def check_experts_read_the_shared_cpu_tier(experts_address: str, shm) -> None:
    """The attention process published its CPU KV tier; bytes written there reach the experts process."""
    layout, tensors = SharedCpuKV(shm).tensors()  # a third process mapping the same files
    torch.manual_seed(1)
    for t in tensors.values():
        t.normal_()
    heads = 4  # the demo checkpoints' attention heads
    query = torch.randn(2, heads, tensors["k"].shape[-1])  # [S, H, D]
    tables, lens = [[1, 2], [0]], [20, 3]
    client = GrpcExpertExecutor(experts_address)
    remote = await asyncio.to_thread(client.cpu_attention, 1, query, tables, lens)
    client.close()
    meta = AttentionMetadata.build([n - 1 for n in lens], [1, 1], tables, layout["block_size"], torch.device("cpu"))
    local = paged_attention(query, tensors["k"][1], tensors["v"][1], meta, 1.0 / math.sqrt(query.shape[-1]))
    torch.testing.assert_close(remote, local, rtol=0, atol=1e-6)


async def check_remote_generate_matches_local(model, *addresses: str) -> None:
    flags = ["--prompt", "The expert said", "--max-tokens", "10", "--json"]
    outputs = []
    for where in [["--model", str(model), "--device", "cpu"], *(["--server", a] for a in addresses)]:
        outputs.append(await asyncio.to_thread(run_cli, ["generate", *where, *flags]))
    assert {code for code, _, _ in outputs} == {0}
    local = json.loads(outputs[0][1])
    assert set(local) == {"token_ids", "text", "finish_reason", "stop_reason", "usage"}
    assert local["usage"]["prompt_tokens"] > 0
    assert [out for _, out, _ in outputs[1:]] == [outputs[0][1]] * len(addresses)
    # the sampling flags reach the server, and logprobs come back one per token
    flags += ["--logprobs", "2", "--repetition-penalty", "1.3", "--min-p", "0.1", "--prompt-logprobs", "1"]
    local, remote = [json.loads((await asyncio.to_thread(run_cli, ["generate", *where, *flags]))[1])
                     for where in (["--model", str(model), "--device", "cpu"], ["--server", addresses[0]])]
    assert remote["token_ids"] == local["token_ids"] and len(remote["logprobs"]) == len(local["token_ids"])
    for theirs, ours in zip(remote["logprobs"], local["logprobs"]):
        assert theirs["rank"] == ours["rank"] and theirs["logprob"] == pytest.approx(ours["logprob"], abs=1e-5)
        assert [t["token_id"] for t in theirs["top"]] == [t["token_id"] for t in ours["top"]] and len(ours["top"]) == 2
    assert remote["prompt_logprobs"][0] is None and local["prompt_logprobs"][0] is None
    assert len(remote["prompt_logprobs"]) == len(local["prompt_logprobs"]) == local["usage"]["prompt_tokens"]
    for theirs, ours in zip(remote["prompt_logprobs"][1:], local["prompt_logprobs"][1:]):
        assert theirs["rank"] == ours["rank"] and theirs["logprob"] == pytest.approx(ours["logprob"], abs=1e-5)
    code, out, err = await asyncio.to_thread(run_cli, ["generate", "--server", addresses[0], "--prompt-ids", "5,99999"])
    assert code == 2 and out == "" and "prompt_token_ids: token id 99999 is outside the vocabulary" in err


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `tandem ARGV`, run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tandem_main(argv)
    return code, out.getvalue(), err.getvalue()


async def test_experts_outage_is_unavailable_then_serving_resumes(serve_process, model_dir, tmp_path):
    model = model_dir("mixtral")
    socket = f"unix:{tmp_path}/experts.sock"

    def start_experts():  # its weights in a shared-memory file, which a restart maps instead of loading
        return serve_process("--model", str(model), "--role", "experts", "--listen", socket, "--metrics-port", "0",
                             "--experts-shm", str(tmp_path / "shm" / "weights"))

    # The attention side first: loaded, but NOT_SERVING until the experts answer.
    attention = serve_process("--model", str(model), "--role", "attention", "--experts", socket, "--listen",
                              "127.0.0.1:0", "--metrics-port", "0", "--device", "cpu", *SMALL_ENGINE)
    assert "NOT_SERVING until the experts process answers" in attention.wait_for_line("model loaded")
    await check_unavailable(attention.address)
    experts = start_experts()
    assert "weights shared at" in experts.wait_for_line("weights shared at|mapped from")
    await wait_health(attention.address, SERVING)
    expected = token_ids(await generate(attention.address, greedy(PROMPTS[0])))

    experts.kill()
    async with grpc.aio.insecure_channel(attention.address) as channel:
        pending = inference_pb2_grpc.InferenceStub(channel).Generate(greedy(PROMPTS[0]))  # first step fails
        await wait_health(attention.address, NOT_SERVING, timeout_s=60)
        await check_alive(attention.address)  # out of rotation, not restarted: it keeps the GPU weights
        await check_unavailable(attention.address)
        assert "mapped from" in start_experts().wait_for_line("weights shared at|mapped from")
        await wait_health(attention.address, SERVING)
        responses = [r async for r in pending]
    assert token_ids(responses) == expected  # the pending request lost nothing, on the mapped weights
    assert responses[-1].finish_reason == "length"
    assert token_ids(await generate(attention.address, greedy(PROMPTS[0]))) == expected
    metrics = scrape(attention.metrics_port)
    assert metrics[(contract.REQUESTS + "_total", (("outcome", "unavailable"),))] == 2
    assert metrics[(contract.REQUESTS + "_total", (("outcome", "length"),))] == 3


async def check_alive(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == SERVING


async def check_unavailable(address: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(address, greedy(PROMPTS[1]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "experts" in err.value.details()


async def test_sigterm_finishes_in_flight_streams_and_exits_0(serve_process, model_dir):
    server = serve_process("--model", str(model_dir("mixtral")), "--listen", "127.0.0.1:0", "--metrics-port", "0",
                           "--device", "cpu", *SMALL_ENGINE)
    await wait_health(server.address, SERVING)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(greedy([5, 6, 7], max_tokens=120))
        first = await call.read()
        exit_code = asyncio.get_running_loop().run_in_executor(None, server.terminate)
        await wait_health(server.address, NOT_SERVING)
        await check_alive(server.address)  # draining: out of rotation, alive until it exits
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no longer admitting
            await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[5])).read()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = []
        while (response := await call.read()) is not grpc.aio.EOF:
            rest.append(response)
    assert len(token_ids([first, *rest])) == 120 and rest[-1].finish_reason == "length"
    assert await exit_code == 0, server.log()
    assert "shutting down" in server.log()
