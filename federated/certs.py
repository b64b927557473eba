"""Self-signed TLS material for a loopback federation and one SuperNode auth key pair per site.

Layout under ``directory``: ``ca.crt``/``ca.key`` (the root every party trusts), ``server.crt``/``server.key``
(the SuperLink, valid for 127.0.0.1 and localhost), and ``site-<i>``/``site-<i>.pub`` (each SuperNode's
NIST P-384 key in OpenSSH format: the private half stays at the site, the public half is registered with the
SuperLink). Every file is written atomically; private keys are mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from opentinker.infra.files import atomic_write

VALID_DAYS = 365


@dataclass(frozen=True)
class CertPaths:
    """Where the federation's TLS files and site keys live."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    def site_key(self, site: int) -> Path:
        return self.directory / f"site-{site}"

    def site_public_key(self, site: int) -> Path:
        return self.directory / f"site-{site}.pub"


def _write(path: Path, data: bytes, private: bool = False) -> None:
    atomic_write(path, data, mode=0o600 if private else 0o644)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(subject: str, public_key, issuer: x509.Name | None, signing_key, is_ca: bool) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def generate_site_key(paths: CertPaths, site: int) -> None:
    """A fresh P-384 key pair for one SuperNode (OpenSSH encoding, as flower-supernode and `flwr supernode register`
    read it)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(paths.site_key(site), private, private=True)
    _write(paths.site_public_key(site), public + f" site-{site}\n".encode())


def generate_certs(directory: str | Path, sites: int, overwrite: bool = False) -> CertPaths:
    """Create the CA, the SuperLink's server certificate and one auth key pair per site.

    Existing material is kept unless ``overwrite``; missing site keys are added, so growing a federation
    does not invalidate the certificates its running sites already trust.
    """
    if sites < 1:
        raise ValueError(f"sites must be >= 1, got {sites}")
    paths = CertPaths(Path(directory).expanduser().resolve())
    paths.directory.mkdir(parents=True, exist_ok=True)
    if overwrite or not paths.ca_cert.exists():
        ca_key = ec.generate_private_key(ec.SECP384R1())
        ca_cert = _certificate("opentinker-federation-ca", ca_key.public_key(), None, ca_key, is_ca=True)
        server_key = ec.generate_private_key(ec.SECP384R1())
        server_cert = _certificate("127.0.0.1", server_key.public_key(), ca_cert.subject, ca_key, is_ca=False)
        _write(paths.directory / "ca.key", _pem_key(ca_key), private=True)
        _write(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
        _write(paths.server_key, _pem_key(server_key), private=True)
        _write(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
    for site in range(sites):
        if overwrite or not paths.site_key(site).exists():
            generate_site_key(paths, site)
    return paths
