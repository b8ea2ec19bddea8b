"""A small OpenID Connect provider on loopback, for the dashboard's `st.login` in a real browser:
a discovery document, an authorize endpoint (a sign-in form: the user types an email, and is
sent back to the client with a code), a token endpoint (the code and the client's secret for
an RS256-signed id_token carrying the nonce) and the JWKS to check it with. One client,
authorization-code flow only; it says no, as a provider does, to anything else."""

from __future__ import annotations

import base64
import html
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import RSAKey

CLIENT_ID = "claw-dashboard"
FORM = """<!doctype html><title>Test IdP</title><h1>Sign in to Test IdP</h1>
<form method="post" action="/authorize">{hidden}
<label>Email <input name="email" autofocus></label> <button type="submit">Sign in</button>
</form>"""


@dataclass
class Provider:
    """What the provider issued and to whom (read by tests)."""

    issuer: str
    client_secret: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    key: RSAKey = field(default_factory=lambda: RSAKey.generate_key(2048, {"kid": "test-1"}))
    codes: dict[str, dict] = field(default_factory=dict)  # code -> the sign-in it stands for
    issued: list[dict] = field(default_factory=list)  # the id_tokens' claims, in order
    unverified: set[str] = field(default_factory=set)  # emails it says are not verified

    @property
    def metadata_url(self) -> str:
        """The discovery document's URL (`server_metadata_url`)."""
        return self.issuer + "/.well-known/openid-configuration"

    def metadata(self) -> dict:
        return {
            "issuer": self.issuer,
            "authorization_endpoint": self.issuer + "/authorize",
            "token_endpoint": self.issuer + "/token",
            "jwks_uri": self.issuer + "/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "scopes_supported": ["openid", "email", "profile"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
        }

    def secrets_toml(self, redirect_uri: str) -> str:
        """The dashboard's `[auth]` section for this provider."""
        return (
            "[auth]\n"
            f'redirect_uri = "{redirect_uri}"\n'
            f'cookie_secret = "{secrets.token_urlsafe(32)}"\n'
            f'client_id = "{CLIENT_ID}"\n'
            f'client_secret = "{self.client_secret}"\n'
            f'server_metadata_url = "{self.metadata_url}"\n'
        )

    def id_token(self, signed_in: dict) -> str:
        now = int(time.time())
        email = signed_in["email"]
        claims = {
            "iss": self.issuer,
            "aud": CLIENT_ID,
            "sub": "user-" + email,
            "email": email,
            "email_verified": email not in self.unverified,
            "name": email.split("@")[0],
            "iat": now,
            "exp": now + 300,
        }
        if signed_in.get("nonce"):
            claims["nonce"] = signed_in["nonce"]
        self.issued.append(claims)
        return jwt.encode({"alg": "RS256", "kid": "test-1"}, claims, self.key)


class _Handler(BaseHTTPRequestHandler):
    provider: Provider

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: str, kind: str = "application/json", **headers) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, error: str) -> None:
        self._send(status, json.dumps({"error": error}))

    def _form(self) -> dict[str, str]:
        length = int(self.headers.get("Content-Length") or 0)
        fields = parse_qs(self.rfile.read(length).decode())
        return {k: v[0] for k, v in fields.items()}

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        provider = self.provider
        if url.path == "/.well-known/openid-configuration":
            self._send(200, json.dumps(provider.metadata()))
        elif url.path == "/jwks":
            self._send(200, json.dumps({"keys": [provider.key.as_dict(private=False)]}))
        elif url.path == "/authorize":
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if query.get("client_id") != CLIENT_ID or query.get("response_type") != "code":
                return self._error(400, "unauthorized_client")
            keep = ("redirect_uri", "state", "nonce")
            hidden = "".join(
                f'<input type="hidden" name="{k}" value="{html.escape(query.get(k, ""))}">'
                for k in keep
            )
            self._send(200, FORM.format(hidden=hidden), "text/html; charset=utf-8")
        else:
            self._error(404, "not_found")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        fields = self._form()
        if url.path == "/authorize":  # the sign-in form: back to the client with a code
            code = secrets.token_urlsafe(16)
            self.provider.codes[code] = fields
            query = urlencode({"code": code, "state": fields["state"]})
            back = fields["redirect_uri"] + "?" + query
            self._send(302, "", "text/plain", Location=back)
        elif url.path == "/token":
            self._token(fields)
        else:
            self._error(404, "not_found")

    def _token(self, fields: dict[str, str]) -> None:
        provider = self.provider
        client_id, secret = fields.get("client_id"), fields.get("client_secret")
        basic = self.headers.get("Authorization", "")
        if basic.startswith("Basic "):
            client_id, _, secret = base64.b64decode(basic[6:]).decode().partition(":")
        if client_id != CLIENT_ID or secret != provider.client_secret:
            return self._error(401, "invalid_client")
        signed_in = provider.codes.pop(fields.get("code", ""), None)  # a code serves once
        if fields.get("grant_type") != "authorization_code" or signed_in is None:
            return self._error(400, "invalid_grant")
        if fields.get("redirect_uri") != signed_in["redirect_uri"]:
            return self._error(400, "invalid_grant")
        token = {
            "access_token": secrets.token_urlsafe(16),
            "token_type": "Bearer",
            "expires_in": 300,
            "scope": "openid email profile",
            "id_token": provider.id_token(signed_in),
        }
        self._send(200, json.dumps(token))


@contextmanager
def oidc_provider() -> Iterator[Provider]:
    """The provider, serving on a free loopback port until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    provider = Provider(f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = type("Handler", (_Handler,), {"provider": provider})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield provider
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
