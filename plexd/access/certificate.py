"""The access proxy's own TLS certificate: self-signed, made once per set of addresses, kept 0600 in data_dir.

kubectl (client-go) sends a bearer token only over TLS, and an operator's client should be able to pin what it
talks to even inside the mesh: the certificate's PEM (and its SHA-256 fingerprint) is what the node reports, and
what a kubeconfig's `certificate-authority-data` holds. A new certificate is made only when the addresses it must
name change (a new mesh IP), so a client's pin survives restarts.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from plexd.base.atomicfile import write_atomic

CERT_FILE = "access-proxy.crt"
KEY_FILE = "access-proxy.key"
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class ProxyCertificate:
    cert_path: Path
    key_path: Path
    pem: str

    @property
    def fingerprint(self) -> str:
        der = x509.load_pem_x509_certificate(self.pem.encode()).public_bytes(serialization.Encoding.DER)
        return "SHA256:" + hashlib.sha256(der).hexdigest()

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])  # exec/attach/port-forward upgrades are HTTP/1.1
        ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}


def load_or_create(directory: str | Path, addresses: Iterable[str], node_name: str = "plexd") -> ProxyCertificate:
    """The certificate for `addresses` (IPs) in `directory`, made (ECDSA P-256) when missing, unreadable, expiring
    within a day or naming other addresses."""
    directory = Path(directory)
    want = {str(ipaddress.ip_address(a)) for a in addresses}
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    try:
        pem = cert_path.read_text()
        cert = x509.load_pem_x509_certificate(pem.encode())
        fresh = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=1)
        if key_path.exists() and fresh and _names(cert) == want:
            return ProxyCertificate(cert_path, key_path, pem)
    except (OSError, ValueError):
        pass
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{node_name} access proxy")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(a))
                                                        for a in sorted(want)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    write_atomic(key_path, key_pem, mode=0o600)
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    write_atomic(cert_path, pem.encode(), mode=0o600)
    os.chmod(key_path, 0o600)
    return ProxyCertificate(cert_path, key_path, pem)
