"""TLS on the Inference API's port: `tandem serve --ssl-certfile/--ssl-keyfile` (with --ssl-ca-certs,
mutual TLS), certificates renewed without a restart, the plaintext --health-listen for the kubelet's
probes, and `tandem generate --server` over TLS. Real servers on real sockets, the tiny checkpoint,
certificates from CAs made here."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tandem import contract
from tandem.cli import build_parser, main
from tandem.rpc.cli_serve import options_from_args
from tandem.rpc.server import ServeOptions, serve

from svc_helpers import NOT_SERVING, SERVING, SMALL_ENGINE, channel, generate, greedy, token_ids, wait_health
from tls_helpers import CA, MountedSecret, check, server_pair, trusting

F = contract.SERVE_FLAGS


@pytest.fixture(scope="module")
def cas():
    """The servers' CA, and another that signed nothing they trust."""
    return CA("tandem test CA"), CA("another CA")


@pytest.fixture(scope="module")
def pem(cas, tmp_path_factory) -> dict[str, str]:
    """Paths of PEM files, good and bad, by name."""
    ca, _ = cas
    d = tmp_path_factory.mktemp("pem")
    paths = dict(zip(("cert", "key"), map(str, server_pair(ca).write(d, "server"))))
    paths["other_key"] = str(server_pair(ca).write(d, "other")[1])
    key = serialization.load_pem_private_key((d / "server.key").read_bytes(), password=None)
    (d / "encrypted.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.BestAvailableEncryption(b"secret")))
    (d / "garbage.pem").write_text("not a certificate\n")
    (d / "ca.crt").write_text(ca.cert_pem)
    return paths | {name: str(d / f"{name}.{ext}") for name, ext in
                    (("encrypted", "key"), ("garbage", "pem"), ("ca", "crt"), ("missing", "pem"))}


def tls_options(directory, pair, clients_ca: CA | None = None) -> dict[str, str]:
    """ServeOptions' TLS fields for `pair`, written to `directory`; with `clients_ca`, mutual TLS."""
    cert, key = pair.write(directory, "server")
    options = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    if clients_ca is not None:
        (directory / "clients-ca.crt").write_text(clients_ca.cert_pem)
        options["ssl_ca_certs"] = str(directory / "clients-ca.crt")
    return options


async def start_tls(start_server, model_dir, credentials: grpc.ChannelCredentials, **options):
    """An in-process server, once its Inference service answers SERVING to a client of `credentials`."""
    server = await start_server(model=str(model_dir("mixtral")), wait_serving=False, **options)
    await wait_health(server.address, SERVING, credentials=credentials)
    return server


async def refused(address: str, credentials: grpc.ChannelCredentials | None = None) -> str:
    """The details of a connection refused: UNAVAILABLE before any call is answered."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(address, credentials)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    return err.value.details()


def list_services(address: str, credentials: grpc.ChannelCredentials) -> list[str]:
    # The reflection client is synchronous: run it off the event loop the server runs on.
    with grpc.secure_channel(address, credentials) as ch:
        return ProtoReflectionDescriptorDatabase(ch).get_services()


async def test_a_tls_server_answers_clients_that_trust_its_ca(start_server, model_dir, cas, tmp_path):
    ca, other = cas
    server = await start_tls(start_server, model_dir, trusting(ca), **tls_options(tmp_path, server_pair(ca)))
    stream = await generate(server.address, greedy([5, 17, 42]), credentials=trusting(ca))
    assert len(token_ids(stream)) == 8
    assert await check(server.address, trusting(ca), contract.INFERENCE_SERVICE) == SERVING
    services = await asyncio.to_thread(list_services, server.address, trusting(ca))  # reflection on the TLS port
    assert contract.INFERENCE_SERVICE in services
    await refused(server.address)  # plaintext
    assert "CERTIFICATE_VERIFY_FAILED" in await refused(server.address, trusting(other))


async def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(start_server, model_dir, cas, tmp_path):
    ca, other = cas
    client = ca.issue(("pipeline",), client=True)
    server = await start_tls(start_server, model_dir, trusting(ca, client),
                             **tls_options(tmp_path, server_pair(ca), clients_ca=ca))
    assert len(token_ids(await generate(server.address, greedy([5, 6]), credentials=trusting(ca, client)))) == 8
    await refused(server.address, trusting(ca))  # no certificate
    await refused(server.address, trusting(ca, other.issue(("pipeline",), client=True)))
    assert await check(server.address, trusting(ca, client)) == SERVING


async def test_a_renewed_certificate_serves_new_connections_without_a_restart(start_server, model_dir, cas,
                                                                              tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tandem.tls")
    ca, other = cas
    old, new = server_pair(ca), server_pair(other)
    secret = MountedSecret(tmp_path, {"tls.crt": old.cert_pem, "tls.key": old.key_pem})
    server = await start_tls(start_server, model_dir, trusting(ca),
                             ssl_certfile=secret.path("tls.crt"), ssl_keyfile=secret.path("tls.key"))
    async with channel(server.address, trusting(ca)) as before:  # a connection open across the renewal
        stub = health_pb2_grpc.HealthStub(before)
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
        secret.update({"tls.crt": new.cert_pem, "tls.key": new.key_pem})  # as the kubelet swaps ..data
        assert await check(server.address, trusting(other)) == SERVING
        assert "CERTIFICATE_VERIFY_FAILED" in await refused(server.address, trusting(ca))
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
    assert not server.task.done()
    assert any(r.getMessage().startswith("TLS: loaded the new certificate") for r in caplog.records)


async def test_a_renewed_pair_that_does_not_load_leaves_the_current_one_serving(start_server, model_dir, cas,
                                                                               tmp_path, caplog):
    ca, other = cas
    options = tls_options(tmp_path, server_pair(ca))
    cert, key = options["ssl_certfile"], options["ssl_keyfile"]
    server = await start_tls(start_server, model_dir, trusting(ca), **options)

    def replace(path: str, text: str) -> None:  # write aside, rename over: a reader sees all or nothing
        with open(f"{path}.new", "w") as f:
            f.write(text)
        os.replace(f"{path}.new", path)

    renewed = server_pair(other)
    replace(cert, "not a certificate\n")
    assert await check(server.address, trusting(ca)) == SERVING
    replace(cert, renewed.cert_pem)  # the certificate renewed, its key not yet
    for _ in range(2):  # a handshake each: one warning, not one per handshake
        assert await check(server.address, trusting(ca)) == SERVING
    warnings = [r.getMessage() for r in caplog.records if r.name == "tandem.tls" and r.levelno == logging.WARNING]
    assert warnings == [f"TLS: keeping the current certificate: --ssl-certfile {cert}: no PEM certificate in it, "
                        f"or a damaged one",
                        f"TLS: keeping the current certificate: --ssl-keyfile {key}: the key does not match the "
                        f"certificate in --ssl-certfile {cert}"]
    replace(key, renewed.key_pem)  # the renewal complete
    assert await check(server.address, trusting(other)) == SERVING
    assert not server.task.done()


async def test_health_listen_serves_the_health_service_alone_in_plaintext(start_server, model_dir, cas, tmp_path):
    ca, _ = cas
    socket_path = tmp_path / "health.sock"
    probe = f"unix:{socket_path}"
    server = await start_tls(start_server, model_dir, trusting(ca), health_listen=probe,
                             **tls_options(tmp_path, server_pair(ca)))
    assert await check(probe, service=contract.INFERENCE_SERVICE) == SERVING
    assert await check(probe) == SERVING
    get_info = "/tandem.v1.Inference/GetModelInfo"
    reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    async with channel(server.address, trusting(ca)) as ch:  # the method's path is right: the TLS port answers it
        await ch.unary_unary(get_info)(b"", timeout=10)
    async with channel(probe) as ch:
        for method in (get_info, reflect):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary(method)(b"", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        # The shutdown's drain: the probes see the service NOT_SERVING, the process ("") alive.
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=contract.INFERENCE_SERVICE))
        assert (await watch.read()).status == SERVING
        server.stop.set()
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()
    assert await asyncio.wait_for(server.task, 60) == 0
    assert not socket_path.exists()


async def test_the_experts_role_takes_a_health_listener_too(start_server, model_dir, tmp_path):
    probe = f"unix:{tmp_path}/health.sock"
    server = await start_server(model=str(model_dir("mixtral")), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                health_listen=probe)
    assert await check(probe, service=contract.EXPERTS_SERVICE) == SERVING
    assert await server.close() == 0
    assert not (tmp_path / "health.sock").exists()


async def test_a_listener_that_cannot_bind_exits_2_and_frees_the_others(model_dir, cas, tmp_path, caplog):
    ca, _ = cas
    grpc_socket = tmp_path / "grpc.sock"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        health = f"127.0.0.1:{busy.getsockname()[1]}"
        opts = ServeOptions(model=str(model_dir("mixtral")), listen=f"unix:{grpc_socket}", health_listen=health,
                            metrics_port=0, device="cpu", max_model_len=256, max_num_seqs=8, cpu_kv_gib=0.01,
                            **tls_options(tmp_path, server_pair(ca)))
        assert await serve(opts, stop=asyncio.Event()) == 2
    [error] = [r.getMessage() for r in caplog.records if r.name == "tandem.serve" and r.levelno == logging.ERROR]
    assert error.startswith(f"cannot listen: --health-listen {health}: cannot bind it")
    assert not grpc_socket.exists()  # the TLS port bound before it was let go


@pytest.mark.parametrize("argv, message", [
    ([F["ssl_certfile"], "{cert}"], "--ssl-certfile and --ssl-keyfile go together"),
    ([F["ssl_keyfile"], "{key}"], "--ssl-certfile and --ssl-keyfile go together"),
    ([F["ssl_ca_certs"], "{ca}"], "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile"),
    ([F["ssl_certfile"], "{cert}", F["ssl_keyfile"], "{other_key}"],
     "--ssl-keyfile {other_key}: the key does not match the certificate in --ssl-certfile {cert}"),
    ([F["ssl_certfile"], "{garbage}", F["ssl_keyfile"], "{key}"], "--ssl-certfile {garbage}: no PEM certificate"),
    ([F["ssl_certfile"], "{cert}", F["ssl_keyfile"], "{garbage}"], "--ssl-keyfile {garbage}: no PEM private key"),
    ([F["ssl_certfile"], "{cert}", F["ssl_keyfile"], "{encrypted}"], "--ssl-keyfile {encrypted}: an encrypted key"),
    ([F["ssl_certfile"], "{missing}", F["ssl_keyfile"], "{key}"],
     "--ssl-certfile {missing}: cannot read it: No such file or directory"),
    ([F["ssl_certfile"], "{cert}", F["ssl_keyfile"], "{key}", F["ssl_ca_certs"], "{garbage}"],
     "--ssl-ca-certs {garbage}: no PEM certificate"),
    (["--role", "experts", "--listen", "unix:/run/x.sock", F["ssl_certfile"], "{cert}", F["ssl_keyfile"], "{key}"],
     "--ssl-certfile is for the Inference API (--role all or attention), not --role experts"),
    ([F["health_listen"], "nowhere"], "--health-listen: expected host:port or unix:/path"),
    (["--listen", "127.0.0.1:5000", F["health_listen"], "127.0.0.1:5000"],
     "--health-listen 127.0.0.1:5000: the address of --listen too"),
])
def test_tls_flags_that_cannot_serve_exit_2_naming_flag_and_file(tmp_path, capsys, pem, argv, message):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), *(a.format(**pem) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert message.format(**pem) in err and err.count("\n") == 1


def test_the_tls_flags_reach_the_options(tmp_path, pem):
    argv = ["serve", "--model", str(tmp_path), F["ssl_certfile"], pem["cert"], F["ssl_keyfile"], pem["key"],
            F["ssl_ca_certs"], pem["ca"], F["health_listen"], contract.HEALTH_SOCKET]
    opts = options_from_args(build_parser().parse_args(argv))
    assert (opts.ssl_certfile, opts.ssl_keyfile, opts.ssl_ca_certs) == (pem["cert"], pem["key"], pem["ca"])
    assert opts.health_listen == contract.HEALTH_SOCKET
    plain = options_from_args(build_parser().parse_args(["serve", "--model", str(tmp_path)]))
    assert plain.tls_files is None and plain.health_listen is None


def test_tandem_serve_with_a_bad_key_exits_2_leaving_nothing_behind(model_dir, pem, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir("mixtral")), "--device", "cpu",
         "--listen", f"unix:{tmp_path}/grpc.sock", "--health-listen", f"unix:{tmp_path}/health.sock",
         "--metrics-port", "0", "--kv-shm", f"{tmp_path}/shm/tier", *SMALL_ENGINE,
         F["ssl_certfile"], pem["cert"], F["ssl_keyfile"], pem["other_key"]],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert f"--ssl-keyfile {pem['other_key']}: the key does not match" in run.stderr
    assert list(tmp_path.iterdir()) == []  # no socket, no shared-memory file


async def test_tandem_generate_over_tls_and_what_it_says_when_the_handshake_fails(start_server, model_dir, cas,
                                                                                  tmp_path, capsys):
    ca, _ = cas
    client = ca.issue(("pipeline",), client=True)
    server = await start_tls(start_server, model_dir, trusting(ca, client),
                             **tls_options(tmp_path, server_pair(ca), clients_ca=ca))
    client_cert, client_key = map(str, client.write(tmp_path, "client"))
    (tmp_path / "ca.crt").write_text(ca.cert_pem)
    trust = ["--ssl-ca-certs", str(tmp_path / "ca.crt")]
    mutual = [*trust, "--ssl-certfile", client_cert, "--ssl-keyfile", client_key]

    async def tandem_generate(*flags: str, address: str = server.address) -> tuple[int, str, str]:
        capsys.readouterr()
        argv = ["generate", "--server", address, "--prompt-ids", "5,17,42", "--max-tokens", "4", "--json", *flags]
        code = await asyncio.to_thread(main, argv)  # a synchronous client: off the server's event loop
        return code, *capsys.readouterr()

    code, out, _ = await tandem_generate(*mutual, "--ssl-server-name", "localhost")
    assert code == 0 and json.loads(out)["usage"]["prompt_tokens"] == 3
    for flags, message in [
        ([], "the server closed the connection: if it serves TLS, connect with --tls or --ssl-ca-certs"),
        (["--tls"], "TLS handshake failed: the server's certificate is not signed by a CA this client trusts "
                    "(--ssl-ca-certs)"),
        (trust, "the server closed the connection in the TLS handshake: it may want a client certificate signed by "
                "a CA it trusts (--ssl-certfile, --ssl-keyfile)"),
        ([*mutual, "--ssl-server-name", "elsewhere.test"],
         "TLS handshake failed: the server's certificate does not name the host dialled (--ssl-server-name NAME"),
    ]:
        code, _, err = await tandem_generate(*flags)
        assert code == 1 and err.startswith(f"tandem: error: {server.address}: {message}"), (flags, err)
        assert err.count("\n") == 1
    plaintext = grpc.aio.server()  # a server that speaks no TLS
    address = f"127.0.0.1:{plaintext.add_insecure_port('127.0.0.1:0')}"
    await plaintext.start()
    code, _, err = await tandem_generate("--tls", address=address)
    await plaintext.stop(grace=0)
    assert code == 1 and err == (f"tandem: error: {address}: TLS handshake failed: the server does not speak TLS "
                                 f"(connect without --tls and the --ssl-* flags)\n")
    for flags, message in [
        (["--ssl-keyfile", client_key], "--ssl-certfile and --ssl-keyfile go together"),
        (["--ssl-ca-certs", client_key], f"--ssl-ca-certs {client_key}: no PEM certificate"),
    ]:
        code, _, err = await tandem_generate(*flags)
        assert code == 2 and err.startswith(f"tandem: error: {message}") and err.count("\n") == 1, err


def test_tls_flags_of_generate_are_for_server(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--tls"]) == 2
    err = capsys.readouterr().err
    assert "--tls: for --server" in err and err.count("\n") == 1
