"""A token service for the local distribution registry's `token` auth: the bearer flow of Docker Hub,
GHCR and Harbor, on loopback.

The registry answers an unauthenticated request with `401 WWW-Authenticate: Bearer realm=...,
service=...,scope=...`; a client asks the realm for a token with its username and password (HTTP
Basic); this service checks them and returns a JWT granting the scope asked, signed (RS256) by a
key whose self-signed certificate the registry trusts (`rootcertbundle`) and carries in the `x5c`
header, as the registry's token verification wants. `issued` counts the tokens handed out.
"""
from __future__ import annotations

import base64
import datetime
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

ISSUER = "shardwise-test-issuer"
SERVICE = "shardwise-test-registry"
TOKEN_TTL_S = 300


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    def __init__(self, folder: Path, users: dict[str, str]):
        self.users = users
        self.issued = 0
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.bundle = Path(folder) / "token-root.pem"
        self.bundle.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                service._answer(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.realm = f"http://127.0.0.1:{self._httpd.server_address[1]}/token"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def registry_auth(self) -> str:
        """The `auth:` section of the registry's config."""
        return (f"auth:\n  token:\n    realm: {self.realm}\n    service: {SERVICE}\n"
                f"    issuer: {ISSUER}\n    rootcertbundle: {self.bundle}\n")

    def _answer(self, req: BaseHTTPRequestHandler) -> None:
        query = parse_qs(urlsplit(req.path).query)
        if not self._authenticated(req.headers.get("Authorization", "")):
            req.send_response(401)
            req.send_header("Content-Length", "0")
            req.end_headers()
            return
        body = json.dumps({"token": self._token(query.get("scope", []))}).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def _authenticated(self, header: str) -> bool:
        if not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return False
        return user in self.users and secrets.compare_digest(self.users[user], password)

    def _token(self, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": "test", "aud": SERVICE, "exp": now + TOKEN_TTL_S,
                  "nbf": now - 10, "iat": now, "jti": secrets.token_hex(8), "access": access}
        der = self._cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self._key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        self.issued += 1
        return f"{signing}.{_b64url(signature)}"
