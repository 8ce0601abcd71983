"""Throwaway X.509: a self-signed CA and the server (or client) certificates it issues, for tests over TLS."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Issued:
    cert_pem: str
    key_pem: str

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """(certificate file, key file) under `directory`."""
        cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert.write_text(self.cert_pem)
        key.write_text(self.key_pem)
        return cert, key


class CA:
    """A self-signed certificate authority."""

    def __init__(self, name: str = "tandem test CA"):
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.name = subject
        self.cert = (_builder(subject, subject, self.key.public_key())
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(self, dns_names: tuple[str, ...] = (), ips: tuple[str, ...] = (), client: bool = False) -> Issued:
        """A server certificate for `dns_names` and `ips` (subject alternative names); with `client`, a
        client certificate (mutual TLS) named by the first of them."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (dns_names or ips)[0])])
        cert = (_builder(subject, self.name, key.public_key())
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                      else x509.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
        return Issued(cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1)))
