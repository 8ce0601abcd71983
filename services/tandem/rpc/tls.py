"""TLS on the Inference API: the PEM files `tandem serve` and `tandem generate --server` take (vLLM's
flag names), checked with a message that names the flag, the file and what is wrong; the server's
are read again when they change, so that a renewed certificate needs no restart.

The checks use Python's `ssl` module (OpenSSL, as gRPC's BoringSSL reads the same PEM): a file
gRPC core would reject fails here first, with a reason, instead of failing every handshake.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem import contract

log = logging.getLogger("tandem.tls")

CERTFILE, KEYFILE, CA_CERTS = (contract.SERVE_FLAGS[k] for k in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"))


class FilesChanged(ValueError):
    """The files changed while they were read and checked (a rotation under way): read them again."""


class _Encrypted(Exception):
    pass


@dataclass(frozen=True)
class Pem:
    """One side's TLS material: its certificate chain and private key (None: a client without a
    certificate), and the CAs it trusts the peer's certificate by (None: a server asks clients for
    no certificate; a client trusts the system's roots)."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


@dataclass(frozen=True)
class TlsFiles:
    """The paths of --ssl-certfile, --ssl-keyfile and --ssl-ca-certs; the first two go together."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    def __post_init__(self):
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError(f"{CERTFILE} and {KEYFILE} go together: a certificate chain and its private key")

    def load(self) -> Pem:
        """The files' contents, checked: ValueError naming the flag, the file and the reason."""
        pem = self.read()
        if pem.cert is not None:
            _check_certificates(pem.cert, CERTFILE, self.certfile)
            if b"PRIVATE KEY-----" not in pem.key:
                raise ValueError(f"{KEYFILE} {self.keyfile}: no PEM private key in it")
            self._check_pair()
        if pem.ca is not None:
            _check_certificates(pem.ca, CA_CERTS, self.ca_certs)
        # The pair was loaded from the paths again: the bytes handed on must be the bytes checked.
        if self.read() != pem:
            raise FilesChanged("the TLS files changed while they were read: try again")
        return pem

    def read(self) -> Pem:
        """The files' contents, unchecked."""
        return Pem(*(None if path is None else _read_file(path, flag) for path, flag in
                     ((self.certfile, CERTFILE), (self.keyfile, KEYFILE), (self.ca_certs, CA_CERTS))))

    def _check_pair(self) -> None:
        def no_password():
            raise _Encrypted

        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.certfile, self.keyfile, password=no_password)
        except _Encrypted:
            raise ValueError(f"{KEYFILE} {self.keyfile}: an encrypted key; gRPC takes only unencrypted ones") from None
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(f"{KEYFILE} {self.keyfile}: the key does not match the certificate in "
                                 f"{CERTFILE} {self.certfile}") from None
            raise ValueError(f"{KEYFILE} {self.keyfile}: not a private key of {CERTFILE} {self.certfile} "
                             f"({exc.reason or exc})") from None
        except OSError as exc:  # gone since it was read
            raise FilesChanged(f"{CERTFILE} {self.certfile}: {exc.strerror or exc}") from None


def server_files(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> TlsFiles | None:
    """A server's TLS files from its flags, None for plaintext; ValueError for flags that cannot go together."""
    if ca_certs is not None and certfile is None:
        raise ValueError(f"{CA_CERTS} needs {CERTFILE} and {KEYFILE}: clients are asked for a certificate in "
                         f"the TLS handshake")
    if certfile is None and keyfile is None:
        return None
    return TlsFiles(certfile, keyfile, ca_certs)


def _read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None


def _check_certificates(pem: bytes, flag: str, path: str) -> None:
    try:  # parses every certificate in it; a str, as bytes would be taken for DER
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("latin-1"))
    except ssl.SSLError:
        raise ValueError(f"{flag} {path}: no PEM certificate in it, or a damaged one") from None


def _configuration(pem: Pem):
    return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.ca)


class ServerCredentials:
    """A server's TLS credentials, read again when its files change: cert-manager renews a Secret
    and the kubelet swaps the mounted files (a `..data` symlink). gRPC core asks `fetch` before each
    TLS handshake, grpc.aio servers included; connections already open keep the old certificate.

    A changed pair that does not load is refused with a warning, and the last good one stays."""

    def __init__(self, files: TlsFiles):
        self.files = files
        self._current = files.load()  # ValueError: a bad file at startup is an error, not a warning
        self._warned: str | None = None  # the reason last warned of
        self._lock = threading.Lock()  # handshakes run on several of gRPC core's threads

    @property
    def requires_client_certificate(self) -> bool:
        return self.files.ca_certs is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(_configuration(self._current), self.fetch,
                                                   require_client_authentication=self.requires_client_certificate)

    def fetch(self):
        """A new certificate configuration when the files changed and hold a good pair, else None
        (gRPC keeps the one it has). Never raises: a handshake must not fail for a rotation."""
        with self._lock:
            # Contents, not stat: a swapped symlink, a rename and a rewrite in place all show.
            try:
                pem = self.files.read()
                if pem == self._current:
                    self._warned = None
                    return None
                checked = self.files.load()
            except FilesChanged:  # caught mid-rotation: the next handshake sees it whole
                return None
            except ValueError as exc:  # a file removed (mid-swap, or for good), or a pair that does not load
                return self._keep(str(exc))
            self._current, self._warned = checked, None
            log.info("TLS: loaded the new certificate from %s", self.files.certfile)
            return _configuration(checked)

    def _keep(self, reason: str) -> None:
        if reason != self._warned:  # once, not at every handshake
            log.warning("TLS: keeping the current certificate: %s", reason)
            self._warned = reason
        return None


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client's credentials: trusting files.ca_certs (default: the system's roots), presenting
    files.certfile when given (mutual TLS). ValueError naming the flag and file."""
    pem = files.load()
    return grpc.ssl_channel_credentials(root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert)


def explain_unavailable(details: str, tls: bool) -> str | None:
    """What a client should change when its connection failed as a TLS mismatch does, from gRPC's
    UNAVAILABLE details; None when they show no sign of one."""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return f"TLS handshake failed: the server's certificate is not signed by a CA this client trusts ({CA_CERTS})"
    if "Hostname Verification" in details:
        return ("TLS handshake failed: the server's certificate does not name the host dialled "
                "(--ssl-server-name NAME: the name it holds)")
    if "WRONG_VERSION_NUMBER" in details:
        return "TLS handshake failed: the server does not speak TLS (connect without --tls and the --ssl-* flags)"
    if "Socket closed" in details:
        if tls:
            return (f"the server closed the connection in the TLS handshake: it may want a client certificate "
                    f"signed by a CA it trusts ({CERTFILE}, {KEYFILE})")
        return f"the server closed the connection: if it serves TLS, connect with --tls or {CA_CERTS}"
    if "handshake" in details.lower():
        return f"TLS handshake failed: {details}"
    return None
