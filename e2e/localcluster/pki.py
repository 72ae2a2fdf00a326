"""Certificates for the local control plane: one CA, the API server's serving cert, client certs.

Generated in Python with `cryptography` (already a dependency of the kubernetes client), so no
openssl CLI and no cfssl. ECDSA P-256 keys: fast to generate, accepted by every component. The CA
lives only in the state folder and dies with `shardwise dev down`.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)

# Client identities. The components get the names their RBAC bootstrap roles are bound to; kwok and
# the local-node runtime act as cluster admins (they write status of many nodes at once, which the
# Node authorizer would only allow one node identity per node).
CLIENTS = {
    "admin": ("kubernetes-admin", ["system:masters"]),
    "controller-manager": ("system:kube-controller-manager", []),
    "scheduler": ("system:kube-scheduler", []),
    "kwok": ("shardwise:kwok", ["system:masters"]),
    "localnodes": ("shardwise:local-nodes", ["system:masters"]),
}


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _name(cn: str, orgs: list[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _sign(subject: x509.Name, public_key, ca_key, issuer: x509.Name, *, ca: bool = False,
          server_ips: list[str] = (), server_dns: list[str] = (), client: bool = False):
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + VALIDITY)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        sans = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        sans += [x509.DNSName(d) for d in server_dns]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def generate(pki: Path, service_ip: str) -> None:
    """Write ca.{crt,key}, apiserver.{crt,key}, <client>.{crt,key} and sa.{key,pub} into `pki`."""
    pki.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("shardwise-dev-ca")
    ca_cert = _sign(ca_name, ca_key.public_key(), ca_key, ca_name, ca=True)
    _write(pki / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(pki / "ca.key", _key_pem(ca_key), private=True)

    key = ec.generate_private_key(ec.SECP256R1())
    cert = _sign(_name("kube-apiserver"), key.public_key(), ca_key, ca_name,
                 server_ips=["127.0.0.1", service_ip],
                 server_dns=["localhost", "kubernetes", "kubernetes.default",
                             "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"])
    _write(pki / "apiserver.crt", cert.public_bytes(serialization.Encoding.PEM))
    _write(pki / "apiserver.key", _key_pem(key), private=True)

    for name, (cn, orgs) in CLIENTS.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _sign(_name(cn, orgs), key.public_key(), ca_key, ca_name, client=True)
        _write(pki / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
        _write(pki / f"{name}.key", _key_pem(key), private=True)

    # Service-account tokens are signed with RS256 by default; an RSA key keeps every consumer happy.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write(pki / "sa.key", _key_pem(sa_key), private=True)
    _write(pki / "sa.pub", sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
