"""The run's own certificates, for Monarch's TLS transport between hosts.

A job whose hosts are other machines (SLURM) talks TCP; Monarch 0.7 then serves
its channels with `trust_all_connections` unless its TLS transport (`tls://`) is
used. meshrl uses it with a certificate authority made for the run at its start:

- the controller draws the CA (ECDSA P-256) and a certificate for itself;
- each SLURM worker gets the CA's certificate and key through its job (the batch
  script's environment, which only the job's user and SLURM's administrators can
  read, never a command line), drops the CA's key from its environment, and
  issues its own certificate for its node's names and addresses;
- Monarch reads `HYPERACTOR_TLS_CERT`, `HYPERACTOR_TLS_KEY` and
  `HYPERACTOR_TLS_CA`, which take the PEM text itself as well as a path: meshrl
  passes the text, so no key is written to disk (none is left behind when SLURM
  kills a worker). Tried here: its server asks for a client certificate and
  refuses a connection without one ("certificate required") or with one another
  CA signed; its client checks the server's certificate against the same CA. Both
  ends are authenticated: a host without the run's CA can neither connect nor
  pose as a worker.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

CA_ENV = "MESHRL_TLS_CA_PEM"  # the CA's certificate and key, handed to a worker by its job
VALID_DAYS = 400


def _names(extra: list[str]) -> tuple[list[str], list[str]]:
    """DNS names and IP addresses to put in a certificate: this host's and `extra`."""
    candidates = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn(), *extra]
    dns, ips = [], []
    for name in candidates:
        if not name:
            continue
        try:
            ip = str(ipaddress.ip_address(name))
            if ip not in ips:
                ips.append(ip)
        except ValueError:
            if name not in dns:
                dns.append(name)
    return dns, ips


class RunCA:
    """A certificate authority of one run: issues the certificates of its hosts."""

    def __init__(self, cert_pem: bytes, key_pem: bytes):
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        self.cert_pem, self.key_pem = cert_pem, key_pem
        self.cert = x509.load_pem_x509_certificate(cert_pem)
        self.key = serialization.load_pem_private_key(key_pem, password=None)

    @classmethod
    def create(cls) -> RunCA:
        from cryptography import x509

        usage = x509.KeyUsage(
            digital_signature=False,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        )
        return cls(
            *_certificate(
                "meshrl run CA",
                None,  # its own issuer
                [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)],
            )
        )

    @classmethod
    def from_bundle(cls, bundle: str) -> RunCA:
        """The CA from `bundle()`'s text (certificate, then key)."""
        marker = "-----BEGIN PRIVATE KEY-----"
        cert, _, key = bundle.partition(marker)
        if not key:
            raise ValueError(f"{CA_ENV}: no private key in the run's CA bundle")
        return cls(cert.encode(), (marker + key).encode())

    def bundle(self) -> str:
        return (self.cert_pem + self.key_pem).decode()

    def issue(self, names: list[str]) -> tuple[bytes, bytes]:
        """A certificate for a host (server and client use) named `names` and this
        host's own names; (certificate PEM, key PEM)."""
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        dns, ips = _names(names)
        alt = [x509.DNSName(n) for n in dns] + [
            x509.IPAddress(ipaddress.ip_address(a)) for a in ips
        ]
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        extensions = [
            (x509.SubjectAlternativeName(alt), False),
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (x509.ExtendedKeyUsage(usage), False),
        ]
        return _certificate(dns[0], self, extensions)

    def install(self, names: list[str]) -> None:
        """Issue this host's certificate and point Monarch at it: `HYPERACTOR_TLS_*`
        in this process's environment (which the procs it starts inherit) hold the
        PEM text itself, so no key is ever written to disk, and none is left behind
        when SLURM kills the worker. A process's environment is readable by its
        user (and root) only, as a 0600 file would be."""
        cert, key = self.issue(names)
        os.environ.update(
            HYPERACTOR_TLS_CA=self.cert_pem.decode(),
            HYPERACTOR_TLS_CERT=cert.decode(),
            HYPERACTOR_TLS_KEY=key.decode(),
        )
        # This process read its settings from its environment when it loaded Monarch.
        from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

        reload_config_from_env()


def _certificate(common_name: str, issuer: RunCA | None, extensions: list) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and its certificate for `common_name`, valid for
    `VALID_DAYS` from five minutes ago, with `extensions` ((extension, critical)
    pairs), signed by `issuer` (None: by its own key); (certificate PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject if issuer is None else issuer.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    cert = builder.sign(key if issuer is None else issuer.key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
