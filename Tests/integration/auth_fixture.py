"""Google / Firebase token services on one loopback server, for storefs credential tests.

storefs given `auth_endpoint=http://127.0.0.1:PORT` calls the production paths prefixed by
that origin (the Auth-emulator convention, protocol.md §3.2). One `AuthServer` answers all:

    POST /identitytoolkit.googleapis.com/v1/accounts:signInWithPassword?key=K   (§3.2)
    POST /identitytoolkit.googleapis.com/v1/accounts:signUp?key=K               (anonymous)
    POST /securetoken.googleapis.com/v1/token?key=K      form or JSON refresh grant
    POST /oauth2.googleapis.com/token                    JWT-bearer and refresh_token grants (§5.7)
    GET  /computeMetadata/v1/instance/service-accounts/default/token
                                                         GCE metadata server (GCE_METADATA_HOST)
    POST /trap/...                                       a token_uri that must NOT be used
    CONNECT host:443, GET http://host/...                proxy requests: a request that tried
                                                         to leave loopback (see `escapes`)

ID tokens are HS256 JWTs signed with `AuthServer.secret`; `verify_id_token` is what the v0
fixture (firebase_fixture.py) calls. OAuth access tokens are opaque (`ya29.test-…`) and
`access_token_subject` says who holds one. Nothing secret is ever logged: `log` holds
endpoint names, statuses and reasons; every secret issued or received is in `secrets()` so a
test can grep storefs's stderr for them.

Also here:
- `make_service_account_key`, `make_authorized_user`: credential files (+ registration);
- `verify_v4_signed_url`: protocol.md §5.8 verification of a V4 signed URL;
- `GCSAuthProxy`: the 403 proxy of storefs_testlib turned into a 401-unless-Bearer proxy;
- `ExplicitMountManager`: the `mount` factory without the implicit `anonymous`, with a clean
  environment (no host credentials) and proxy variables that trap any non-loopback request.

Only the standard library and `cryptography` are used.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import os
import re
import secrets as _secrets
import socket
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from storefs_testlib import AUTO, ForbiddingProxy, LoopbackServer, MountManager, _ProxyHandler, classify

READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
GOOGLE_TOKEN_AUD = "https://oauth2.googleapis.com/token"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
SIGNED_URL_HOST = "storage.googleapis.com"
MAX_SIGNED_URL_EXPIRES = 604800
CLOCK_SKEW_S = 300


# ====================================================================== JWT helpers
def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwt_parts(token: str) -> tuple[dict, dict, bytes, bytes]:
    """(header, claims, signing input, signature); ValueError when it is not a JWT."""
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT (needs 3 dot-separated parts)")
    try:
        header = json.loads(b64url_decode(parts[0]))
        claims = json.loads(b64url_decode(parts[1]))
        sig = b64url_decode(parts[2])
    except Exception as exc:  # noqa: BLE001 - any decoding problem means "not a JWT"
        raise ValueError(f"undecodable JWT: {exc}") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise ValueError("JWT header or claims are not JSON objects")
    return header, claims, f"{parts[0]}.{parts[1]}".encode(), sig


def jwt_hs256(claims: dict, secret: bytes, kid: str = "storefs-test") -> str:
    header = {"alg": "HS256", "typ": "JWT", "kid": kid}
    signing = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
    sig = hmac.new(secret, signing.encode(), hashlib.sha256).digest()
    return f"{signing}.{b64url(sig)}"


def jwt_rs256(claims: dict, private_key, kid: str) -> str:
    """What storefs should send for a service account (protocol.md §5.7); for fixture tests."""
    header = {"alg": "RS256", "typ": "JWT", "kid": kid}
    signing = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
    sig = private_key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing}.{b64url(sig)}"


def unsigned_mock_token(uid: str, project: str = "storefs-test") -> str:
    """The Firebase JS `createMockUserToken` form (alg none), accepted only in emulator mode."""
    now = int(time.time())
    claims = {"iss": f"https://securetoken.google.com/{project}", "aud": project, "iat": now,
              "exp": now + 3600, "auth_time": now, "sub": uid, "user_id": uid,
              "firebase": {"sign_in_provider": "custom", "identities": {}}}
    return (f"{b64url(json.dumps({'alg': 'none', 'type': 'JWT'}).encode())}."
            f"{b64url(json.dumps(claims).encode())}.")


class AuthError(Exception):
    """A token the server does not accept; the message says why (never the token)."""


# ====================================================================== credential files
@dataclass
class ServiceAccountKey:
    path: str
    client_email: str
    private_key_id: str
    client_id: str
    project_id: str
    private_key: object          # cryptography RSAPrivateKey
    public_key: object           # cryptography RSAPublicKey
    pem: str                     # the PKCS#8 PEM written into the file
    token_uri: str

    def secret_fragments(self) -> list[str]:
        """Lines of the PEM body: none of them may ever show up in a log."""
        return [ln for ln in self.pem.splitlines() if ln and not ln.startswith("-----")]


@dataclass
class AuthorizedUser:
    path: str
    client_id: str
    client_secret: str
    refresh_token: str
    quota_project_id: str | None = None


def make_service_account_key(path: str, token_uri: str = GOOGLE_TOKEN_AUD, *,
                             project_id: str = "storefs-test",
                             client_email: str | None = None) -> ServiceAccountKey:
    """Writes a service-account JSON key file (a fresh RSA-2048 key) and returns its parts."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    email = client_email or f"storefs-reader-{uuid.uuid4().hex[:6]}@{project_id}.iam.gserviceaccount.com"
    key_id = _secrets.token_hex(20)
    client_id = str(100000000000000000000 + _secrets.randbelow(10 ** 20))
    doc = {
        "type": "service_account",
        "project_id": project_id,
        "private_key_id": key_id,
        "private_key": pem,
        "client_email": email,
        "client_id": client_id,
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
        "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
        "client_x509_cert_url": "https://www.googleapis.com/robot/v1/metadata/x509/"
                                + urllib.parse.quote(email),
        "universe_domain": "googleapis.com",
    }
    _write_private(path, json.dumps(doc, indent=2) + "\n")
    return ServiceAccountKey(path, email, key_id, client_id, project_id, key, key.public_key(),
                             pem, token_uri)


def make_authorized_user(path: str, *, quota_project_id: str | None = None) -> AuthorizedUser:
    """Writes an `authorized_user` file (what `gcloud auth application-default login` writes)."""
    user = AuthorizedUser(path,
                          client_id=f"{_secrets.randbelow(10 ** 12)}-test.apps.googleusercontent.com",
                          client_secret="GOCSPX-" + _secrets.token_urlsafe(18),
                          refresh_token="1//0g" + _secrets.token_urlsafe(60),
                          quota_project_id=quota_project_id)
    doc = {"type": "authorized_user", "client_id": user.client_id,
           "client_secret": user.client_secret, "refresh_token": user.refresh_token,
           "universe_domain": "googleapis.com"}
    if quota_project_id:
        doc["quota_project_id"] = quota_project_id
    _write_private(path, json.dumps(doc, indent=2) + "\n")
    return user


def _write_private(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_token_file(path: str, token: str) -> None:
    """Replaces `path` atomically (a reader never sees half a token), with a new mtime."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:6]}"
    _write_private(tmp, token + "\n")
    os.replace(tmp, path)


# ====================================================================== V4 signed URLs
def _enc(s: str, safe: str = "") -> str:
    return urllib.parse.quote(s, safe=safe, encoding="utf-8")   # keeps A-Za-z0-9-._~


def verify_v4_signed_url(url: str, public_key, expected_bucket: str, expected_object: str, *,
                         expected_email: str | None = None, now: float | None = None) -> dict:
    """Checks a V4 signed GET URL the way GCS would (protocol.md §5.8); returns its fields.

    Raises AssertionError naming the first problem. Checks: https://storage.googleapis.com,
    path `/<bucket>/<object, percent-encoded, '/' kept>` naming the expected object, algorithm
    GOOG4-RSA-SHA256, credential `<email>/<date>/auto/storage/goog4_request` with the date of
    X-Goog-Date, 1 <= X-Goog-Expires <= 604800 and not yet expired, SignedHeaders=host, and a
    lowercase-hex RSA-SHA256 PKCS#1 v1.5 signature over the string to sign that is rebuilt from
    the URL's own query (canonical query: every name and value percent-encoded, sorted).
    """
    now = time.time() if now is None else now
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme == "https", f"signed URL scheme {parts.scheme!r}, expected https"
    assert parts.netloc == SIGNED_URL_HOST, f"signed URL host {parts.netloc!r}"
    assert not parts.fragment, "signed URL has a fragment"
    expected_path = f"/{_enc(expected_bucket)}/{_enc(expected_object, safe='/')}"
    assert parts.path == expected_path, \
        f"signed URL path {parts.path!r}, expected {expected_path!r}"
    params: dict[str, str] = {}
    for pair in parts.query.split("&"):
        assert "=" in pair, f"query item without '=': {pair!r}"
        k, v = pair.split("=", 1)
        k, v = urllib.parse.unquote(k), urllib.parse.unquote(v)   # '+' is not a space here
        assert k not in params, f"query parameter {k!r} repeated"
        params[k] = v
    for need in ("X-Goog-Algorithm", "X-Goog-Credential", "X-Goog-Date", "X-Goog-Expires",
                 "X-Goog-SignedHeaders", "X-Goog-Signature"):
        assert need in params, f"signed URL lacks {need}"
    assert params["X-Goog-Algorithm"] == "GOOG4-RSA-SHA256", params["X-Goog-Algorithm"]
    date = params["X-Goog-Date"]
    assert re.fullmatch(r"\d{8}T\d{6}Z", date), f"X-Goog-Date {date!r}"
    signed_at = time.mktime(time.strptime(date, "%Y%m%dT%H%M%SZ")) - time.timezone
    assert signed_at <= now + CLOCK_SKEW_S, f"X-Goog-Date {date} is in the future"
    cred = params["X-Goog-Credential"]
    email, sep, scope = cred.partition("/")
    assert sep, f"X-Goog-Credential {cred!r} has no scope"
    want_scope = f"{date[:8]}/auto/storage/goog4_request"
    assert scope == want_scope, f"credential scope {scope!r}, expected {want_scope!r}"
    if expected_email is not None:
        assert email == expected_email, f"credential email {email!r}, expected {expected_email!r}"
    expires_s = params["X-Goog-Expires"]
    assert expires_s.isdigit(), f"X-Goog-Expires {expires_s!r}"
    expires = int(expires_s)
    assert 1 <= expires <= MAX_SIGNED_URL_EXPIRES, f"X-Goog-Expires {expires} out of 1..604800"
    assert now < signed_at + expires, "the signed URL has already expired"
    assert params["X-Goog-SignedHeaders"] == "host", \
        f"X-Goog-SignedHeaders {params['X-Goog-SignedHeaders']!r}, expected 'host'"
    signature = params.pop("X-Goog-Signature")
    assert re.fullmatch(r"[0-9a-f]+", signature), "X-Goog-Signature is not lowercase hex"
    canonical_query = "&".join(f"{_enc(k)}={_enc(v)}" for k, v in sorted(params.items()))
    canonical_request = "\n".join([
        "GET", parts.path, canonical_query, f"host:{SIGNED_URL_HOST}\n", "host",
        "UNSIGNED-PAYLOAD"])
    string_to_sign = "\n".join([
        "GOOG4-RSA-SHA256", date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()])
    try:
        public_key.verify(bytes.fromhex(signature), string_to_sign.encode(), padding.PKCS1v15(),
                          hashes.SHA256())
    except InvalidSignature:
        raise AssertionError("X-Goog-Signature does not verify with the service account's "
                             f"public key; canonical request was:\n{canonical_request}") from None
    return {"email": email, "date": date, "expires": expires, "scope": scope,
            "bucket": expected_bucket, "object": expected_object, "params": params,
            "canonical_query": canonical_query, "signature": signature}


def sign_v4_url(key: ServiceAccountKey, bucket: str, name: str, expires: int = 3600,
                now: float | None = None) -> str:
    """Reference signer (python-storage's algorithm), to test `verify_v4_signed_url` itself."""
    ts = time.gmtime(time.time() if now is None else now)
    date = time.strftime("%Y%m%dT%H%M%SZ", ts)
    scope = f"{date[:8]}/auto/storage/goog4_request"
    params = {"X-Goog-Algorithm": "GOOG4-RSA-SHA256",
              "X-Goog-Credential": f"{key.client_email}/{scope}", "X-Goog-Date": date,
              "X-Goog-Expires": str(expires), "X-Goog-SignedHeaders": "host"}
    path = f"/{_enc(bucket)}/{_enc(name, safe='/')}"
    query = "&".join(f"{_enc(k)}={_enc(v)}" for k, v in sorted(params.items()))
    creq = "\n".join(["GET", path, query, f"host:{SIGNED_URL_HOST}\n", "host", "UNSIGNED-PAYLOAD"])
    sts = "\n".join(["GOOG4-RSA-SHA256", date, scope, hashlib.sha256(creq.encode()).hexdigest()])
    sig = key.private_key.sign(sts.encode(), padding.PKCS1v15(), hashes.SHA256()).hex()
    return f"https://{SIGNED_URL_HOST}{path}?{query}&X-Goog-Signature={sig}"


# ====================================================================== the server
@dataclass
class _RefreshToken:
    uid: str
    revoked: bool = False
    superseded: bool = False     # a newer one was issued in its place (rotation)


@dataclass
class _AccessToken:
    subject: str
    expires_at: float


@dataclass
class AuthEvent:
    endpoint: str       # signInWithPassword | signUp | securetoken | oauth2.jwt | oauth2.refresh |
                        # metadata | trap | escape | other
    status: int
    detail: str = ""    # why it failed, or who got a token; never a secret


class AuthServer(LoopbackServer):
    """Identity Toolkit, Secure Token, OAuth2 token and GCE metadata endpoints on 127.0.0.1.

    TLS (issue 42): `endpoint` (for `auth_endpoint=`, token_uri) is https, like Google's token
    services (`tls=False` for plain http). `plain_endpoint` is a second, plain-http listener
    with the same handler, for what is plain http in real life: the GCE metadata server
    (`metadata_host`: GCE_METADATA_HOST=host:port means http) and the proxy trap
    (`http_proxy=` a plain http proxy: an https one would fail its handshake before any
    CONNECT was recorded).

    Knobs (plain attributes, change them any time):
    - `api_key`: the only Web API key accepted (`?key=`);
    - `id_token_lifetime`: seconds until an ID token's `exp`; `id_token_reported_lifetime`:
      what `expiresIn`/`expires_in` claim (None: the same), to make a token expire earlier
      than the client was told;
    - `access_token_lifetime`: seconds an OAuth access token (all three grants) lives;
    - `strict_rotation`: refuse a refresh token once a newer one was issued (default False:
      it keeps working, but `counts["stale_refresh"]` goes up).
    State: `users` (email -> (password, uid)), `counts` per endpoint (+ `:ok`/`:fail`),
    `log` (AuthEvent), `escapes` (targets of requests that tried to leave loopback).
    """

    default_tls = True
    also_plain = True

    def __init__(self, project_id: str = "storefs-test", api_key: str = "test-web-api-key", *,
                 tls=None) -> None:
        self.tls = tls
        self.project_id = project_id
        self.project_number = "123456789012"
        self.api_key = api_key
        self.secret = _secrets.token_bytes(32)
        self.id_token_lifetime = 3600
        self.id_token_reported_lifetime: int | None = None
        self.access_token_lifetime = 3600
        self.strict_rotation = False
        self.users: dict[str, tuple[str, str]] = {}
        self.counts: Counter[str] = Counter()
        self.log: list[AuthEvent] = []
        self.escapes: list[str] = []
        self.service_accounts: dict[str, ServiceAccountKey] = {}
        self.authorized_users: dict[str, AuthorizedUser] = {}
        self.metadata_subject = f"{self.project_number}-compute@developer.gserviceaccount.com"
        self._refresh: dict[str, _RefreshToken] = {}
        self._access: dict[str, _AccessToken] = {}
        self._secrets: set[str] = set()
        self._serial = 0
        self._min_valid_serial = 0
        self._lock = threading.Lock()

    # -------------------------------------------------------------- lifecycle
    thread_name = "auth-fixture"

    def request_handler(self) -> type:
        return _AuthHandler

    @property
    def metadata_host(self) -> str:
        """The value for GCE_METADATA_HOST (host:port, no scheme: plain http, the plain port)."""
        return f"127.0.0.1:{self.plain_port}"

    @property
    def trap(self) -> str:
        """The http_proxy value that catches requests trying to leave loopback (plain http)."""
        return self.plain_endpoint

    @property
    def trap_token_uri(self) -> str:
        """A loopback token_uri that answers 400 and counts `trap`: it must not be used."""
        return f"{self.endpoint}/trap/oauth2/token"

    # -------------------------------------------------------------- users and tokens
    def add_user(self, email: str, password: str, uid: str | None = None) -> str:
        uid = uid or "uid-" + uuid.uuid4().hex[:12]
        with self._lock:
            self.users[email] = (password, uid)
            self._secrets.add(password)
        return uid

    def remember_secret(self, value: str) -> None:
        with self._lock:
            self._secrets.add(value)

    def secrets(self) -> set[str]:
        """Every secret issued or received so far (tokens, passwords, keys' PEM lines...)."""
        with self._lock:
            return set(self._secrets)

    def mint_id_token(self, uid: str, *, lifetime: int | None = None, email: str | None = None,
                      provider: str = "password") -> str:
        now = int(time.time())
        with self._lock:
            self._serial += 1
            serial = self._serial
        claims = {"iss": f"https://securetoken.google.com/{self.project_id}",
                  "aud": self.project_id, "auth_time": now, "user_id": uid, "sub": uid,
                  "iat": now, "exp": now + (self.id_token_lifetime if lifetime is None else lifetime),
                  "firebase": {"identities": {"email": [email]} if email else {},
                               "sign_in_provider": provider},
                  "storefs_serial": serial}
        if email:
            claims["email"] = email
            claims["email_verified"] = False
        token = jwt_hs256(claims, self.secret)
        self.remember_secret(token)
        return token

    def verify_id_token(self, token: str) -> dict:
        """The claims of a valid ID token this server issued; AuthError otherwise."""
        try:
            header, claims, signing, sig = jwt_parts(token)
        except ValueError as exc:
            raise AuthError(str(exc)) from None
        if header.get("alg") != "HS256":
            raise AuthError(f"ID token alg {header.get('alg')!r} is not HS256")
        if not hmac.compare_digest(sig, hmac.new(self.secret, signing, hashlib.sha256).digest()):
            raise AuthError("ID token signature does not verify")
        if claims.get("aud") != self.project_id or \
                claims.get("iss") != f"https://securetoken.google.com/{self.project_id}":
            raise AuthError("ID token for another project")
        if not isinstance(claims.get("exp"), int) or time.time() >= claims["exp"]:
            raise AuthError("ID token expired")
        with self._lock:
            if claims.get("storefs_serial", 0) < self._min_valid_serial:
                raise AuthError("ID token no longer accepted (reject_current_id_tokens)")
        return claims

    def reject_current_id_tokens(self) -> None:
        """Every ID token issued so far gets 401 from now on; new ones are fine."""
        with self._lock:
            self._min_valid_serial = self._serial + 1

    def _new_refresh_token(self, uid: str) -> str:
        rt = "AMf-vB" + _secrets.token_urlsafe(48)
        with self._lock:
            self._refresh[rt] = _RefreshToken(uid)
            self._secrets.add(rt)
        return rt

    def revoke_refresh_tokens(self, uid: str) -> int:
        """Revokes every refresh token of `uid` (a refresh gives 400 TOKEN_EXPIRED)."""
        n = 0
        with self._lock:
            for rt in self._refresh.values():
                if rt.uid == uid and not rt.revoked:
                    rt.revoked = True
                    n += 1
        return n

    def refresh_tokens_of(self, uid: str) -> int:
        with self._lock:
            return sum(1 for rt in self._refresh.values() if rt.uid == uid)

    def mint_access_token(self, subject: str, lifetime: int | None = None) -> str:
        token = "ya29.test-" + _secrets.token_urlsafe(40)
        life = self.access_token_lifetime if lifetime is None else lifetime
        with self._lock:
            self._access[token] = _AccessToken(subject, time.time() + life)
            self._secrets.add(token)
        return token

    def access_token_subject(self, token: str) -> str | None:
        """Who holds `token`, or None when this server did not issue it or it expired."""
        with self._lock:
            at = self._access.get(token)
        if at is None or time.time() >= at.expires_at:
            return None
        return at.subject

    def reject_current_access_tokens(self) -> None:
        with self._lock:
            for at in self._access.values():
                at.expires_at = 0.0

    def add_service_account(self, key: ServiceAccountKey) -> None:
        with self._lock:
            self.service_accounts[key.client_email] = key
            self._secrets.update(key.secret_fragments())

    def make_service_account_key(self, path: str, token_uri: str | None = None,
                                 **kwargs) -> ServiceAccountKey:
        """`make_service_account_key` + registration here. Default token_uri: the trap, so a
        client that ignores `auth_endpoint` is caught (and still stays on loopback)."""
        key = make_service_account_key(path, token_uri or self.trap_token_uri,
                                       project_id=self.project_id, **kwargs)
        self.add_service_account(key)
        return key

    def make_authorized_user(self, path: str, **kwargs) -> AuthorizedUser:
        user = make_authorized_user(path, **kwargs)
        with self._lock:
            self.authorized_users[user.client_id] = user
            self._secrets.update({user.client_secret, user.refresh_token})
        return user

    def revoke_authorized_user(self, user: AuthorizedUser) -> None:
        with self._lock:
            self.authorized_users.pop(user.client_id, None)

    # -------------------------------------------------------------- bookkeeping
    def event(self, endpoint: str, status: int, detail: str = "") -> None:
        with self._lock:
            self.counts[endpoint] += 1
            self.counts[f"{endpoint}:{'ok' if status < 400 else 'fail'}"] += 1
            self.log.append(AuthEvent(endpoint, status, detail))

    def failures(self, endpoint: str | None = None) -> list[str]:
        with self._lock:
            return [f"{e.endpoint} {e.status}: {e.detail}" for e in self.log
                    if e.status >= 400 and (endpoint is None or e.endpoint == endpoint)]

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.log.clear()

    # -------------------------------------------------------------- endpoint logic
    # Each returns (status, JSON-able body); the handler does the HTTP.
    def _id_response(self, uid: str, email: str | None, provider: str, *, registered: bool
                     ) -> dict:
        token = self.mint_id_token(uid, email=email, provider=provider)
        reported = self.id_token_reported_lifetime or self.id_token_lifetime
        out = {"kind": "identitytoolkit#VerifyPasswordResponse", "localId": uid,
               "idToken": token, "refreshToken": self._new_refresh_token(uid),
               "expiresIn": str(reported)}
        if email:
            out.update(email=email, displayName="", registered=registered)
        return out

    def sign_in_with_password(self, key: str, body: dict) -> tuple[int, dict]:
        if key != self.api_key:
            return 400, _api_key_error()
        email, password = body.get("email"), body.get("password")
        if isinstance(password, str):
            self.remember_secret(password)
        if not email or not password:
            return 400, _itk_error("MISSING_EMAIL" if not email else "MISSING_PASSWORD")
        with self._lock:
            user = self.users.get(email)
        if user is None:
            return 400, _itk_error("EMAIL_NOT_FOUND")
        if not hmac.compare_digest(user[0].encode(), str(password).encode()):
            return 400, _itk_error("INVALID_PASSWORD")
        return 200, self._id_response(user[1], email, "password", registered=True)

    def sign_up(self, key: str, body: dict) -> tuple[int, dict]:
        if key != self.api_key:
            return 400, _api_key_error()
        email, password = body.get("email"), body.get("password")
        if email or password:
            if not (email and password):
                return 400, _itk_error("MISSING_PASSWORD" if email else "MISSING_EMAIL")
            with self._lock:
                if email in self.users:
                    return 400, _itk_error("EMAIL_EXISTS")
            uid = self.add_user(email, password)
            out = self._id_response(uid, email, "password", registered=False)
        else:
            uid = "anon-" + uuid.uuid4().hex[:12]
            out = self._id_response(uid, None, "anonymous", registered=False)
        out["kind"] = "identitytoolkit#SignupNewUserResponse"
        return 200, out

    def secure_token(self, key: str, form: dict) -> tuple[int, dict, str]:
        if key != self.api_key:
            return 400, _api_key_error(), "bad api key"
        grant = form.get("grant_type") or form.get("grantType")
        rt = form.get("refresh_token") or form.get("refreshToken")
        if rt:
            self.remember_secret(rt)
        if grant != "refresh_token":
            return 400, _itk_error("INVALID_GRANT_TYPE"), f"grant_type {grant!r}"
        if not rt:
            return 400, _itk_error("MISSING_REFRESH_TOKEN"), "no refresh token"
        with self._lock:
            entry = self._refresh.get(rt)
            stale = entry is not None and entry.superseded
            if stale:
                self.counts["stale_refresh"] += 1
        if entry is None:
            return 400, _itk_error("INVALID_REFRESH_TOKEN"), "unknown refresh token"
        if entry.revoked:
            return 400, _itk_error("TOKEN_EXPIRED"), f"revoked refresh token of {entry.uid}"
        if stale and self.strict_rotation:
            return 400, _itk_error("INVALID_REFRESH_TOKEN"), "superseded refresh token"
        with self._lock:
            entry.superseded = True
        email = next((e for e, (_, u) in self.users.items() if u == entry.uid), None)
        provider = "anonymous" if entry.uid.startswith("anon-") else "password"
        token = self.mint_id_token(entry.uid, email=email, provider=provider)
        reported = self.id_token_reported_lifetime or self.id_token_lifetime
        return 200, {"access_token": token, "id_token": token,
                     "refresh_token": self._new_refresh_token(entry.uid),
                     "expires_in": str(reported), "token_type": "Bearer",
                     "user_id": entry.uid, "project_id": self.project_number}, f"uid={entry.uid}"

    def oauth2_token(self, form: dict) -> tuple[int, dict, str, str]:
        grant = form.get("grant_type", "")
        if grant == JWT_BEARER:
            assertion = form.get("assertion", "")
            if assertion:
                self.remember_secret(assertion)
            try:
                subject = self._check_assertion(assertion)
            except AuthError as exc:
                return 400, {"error": "invalid_grant", "error_description": str(exc)}, \
                    "oauth2.jwt", str(exc)
            return 200, self._access_response(subject), "oauth2.jwt", f"sub={subject}"
        if grant == "refresh_token":
            cid, csecret, rt = (form.get("client_id", ""), form.get("client_secret", ""),
                                form.get("refresh_token", ""))
            for s in (csecret, rt):
                if s:
                    self.remember_secret(s)
            with self._lock:
                user = self.authorized_users.get(cid)
            if user is None or not hmac.compare_digest(user.client_secret, csecret):
                return 401, {"error": "invalid_client", "error_description": "Unauthorized"}, \
                    "oauth2.refresh", f"unknown client or wrong secret ({cid})"
            if not hmac.compare_digest(user.refresh_token, rt):
                return 400, {"error": "invalid_grant", "error_description": "Bad Request"}, \
                    "oauth2.refresh", "wrong refresh token"
            return 200, self._access_response(f"user:{cid}"), "oauth2.refresh", f"client={cid}"
        return 400, {"error": "unsupported_grant_type",
                     "error_description": f"Invalid grant_type: {grant}"}, "oauth2.other", \
            f"grant_type {grant!r}"

    def _access_response(self, subject: str) -> dict:
        return {"access_token": self.mint_access_token(subject),
                "expires_in": self.access_token_lifetime, "token_type": "Bearer"}

    def _check_assertion(self, assertion: str) -> str:
        try:
            header, claims, signing, sig = jwt_parts(assertion)
        except ValueError as exc:
            raise AuthError(f"assertion: {exc}") from None
        if header.get("alg") != "RS256":
            raise AuthError(f"assertion alg {header.get('alg')!r}, expected RS256")
        iss = claims.get("iss")
        with self._lock:
            key = self.service_accounts.get(iss)
        if key is None:
            raise AuthError(f"assertion iss {iss!r} is no known service account")
        if header.get("kid") != key.private_key_id:
            raise AuthError("assertion header kid is not the key's private_key_id")
        try:
            key.public_key.verify(sig, signing, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            raise AuthError("Invalid JWT Signature.") from None
        if claims.get("scope") != READ_ONLY_SCOPE:
            raise AuthError(f"assertion scope {claims.get('scope')!r}, expected {READ_ONLY_SCOPE}")
        if claims.get("aud") != GOOGLE_TOKEN_AUD:
            raise AuthError(f"assertion aud {claims.get('aud')!r}, expected {GOOGLE_TOKEN_AUD}")
        iat, exp, now = claims.get("iat"), claims.get("exp"), time.time()
        if not isinstance(iat, (int, float)) or not isinstance(exp, (int, float)):
            raise AuthError("assertion iat/exp missing or not numbers")
        if abs(iat - now) > CLOCK_SKEW_S:
            raise AuthError(f"assertion iat is {iat - now:+.0f} s from now")
        if not (iat < exp <= iat + 3600):
            raise AuthError(f"assertion exp - iat = {exp - iat}, must be in (0, 3600]")
        if exp <= now:
            raise AuthError("assertion expired")
        return key.client_email

    def metadata_token(self) -> dict:
        return self._access_response(self.metadata_subject)


def _itk_error(message: str) -> dict:
    return {"error": {"code": 400, "message": message,
                      "errors": [{"message": message, "domain": "global", "reason": "invalid"}]}}


def _api_key_error() -> dict:
    msg = "API key not valid. Please pass a valid API key."
    return {"error": {"code": 400, "message": msg, "status": "INVALID_ARGUMENT",
                      "errors": [{"message": msg, "domain": "global", "reason": "badRequest"}]}}


class _AuthHandler(http.server.BaseHTTPRequestHandler):
    owner: AuthServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms stalls

    def _send(self, status: int, body, content_type: str = "application/json; charset=UTF-8",
              extra: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _fields(self, raw: bytes) -> dict:
        """Form or JSON body as a flat dict of strings (JSON values kept as they are)."""
        ctype = (self.headers.get("Content-Type") or "").lower()
        text = raw.decode("utf-8", "replace")
        if "json" in ctype or text.lstrip().startswith("{"):
            try:
                doc = json.loads(text or "{}")
                return doc if isinstance(doc, dict) else {}
            except json.JSONDecodeError:
                return {}
        return {k: v[0] for k, v in urllib.parse.parse_qs(text, keep_blank_values=True).items()}

    def do_CONNECT(self):  # noqa: N802 - a client tried to tunnel out through the proxy vars
        owner = self.owner
        with owner._lock:
            owner.escapes.append(f"CONNECT {self.path}")
        owner.event("escape", 403, f"CONNECT {self.path}")
        self._send(403, {"error": "storefs tests never leave loopback"})
        self.close_connection = True

    def do_GET(self):  # noqa: N802
        self._dispatch()

    def do_POST(self):  # noqa: N802
        self._dispatch()

    def do_HEAD(self):  # noqa: N802
        self._dispatch()

    def _dispatch(self) -> None:
        owner = self.owner
        raw = self._body() if self.command == "POST" else b""
        if not self.path.startswith("/"):     # absolute-form: sent to us as an HTTP proxy
            with owner._lock:
                owner.escapes.append(f"{self.command} {urllib.parse.urlsplit(self.path).netloc}")
            owner.event("escape", 403, self.path.split("?")[0])
            return self._send(403, {"error": "storefs tests never leave loopback"})
        parts = urllib.parse.urlsplit(self.path)
        path = parts.path
        query = {k: v[0] for k, v in urllib.parse.parse_qs(parts.query).items()}
        key = query.get("key", "")
        if self.command == "POST" and path == "/identitytoolkit.googleapis.com/v1/accounts:signInWithPassword":
            status, body = owner.sign_in_with_password(key, self._fields(raw))
            owner.event("signInWithPassword", status, body.get("error", {}).get("message", "")
                        if status >= 400 else f"uid={body['localId']}")
            return self._send(status, body)
        if self.command == "POST" and path == "/identitytoolkit.googleapis.com/v1/accounts:signUp":
            status, body = owner.sign_up(key, self._fields(raw))
            owner.event("signUp", status, body.get("error", {}).get("message", "")
                        if status >= 400 else f"uid={body['localId']}")
            return self._send(status, body)
        if self.command == "POST" and path == "/securetoken.googleapis.com/v1/token":
            status, body, detail = owner.secure_token(key, self._fields(raw))
            owner.event("securetoken", status, detail)
            return self._send(status, body)
        if self.command == "POST" and path == "/oauth2.googleapis.com/token":
            status, body, endpoint, detail = owner.oauth2_token(self._fields(raw))
            owner.event(endpoint, status, detail)
            return self._send(status, body)
        if path.startswith("/trap/"):
            owner.event("trap", 400, f"{self.command} {path}: this URL must not be used")
            return self._send(400, {"error": "invalid_request",
                                    "error_description": "test trap: wrong token endpoint"})
        if self.command in ("GET", "HEAD") and (path == "/" or path.startswith("/computeMetadata/")):
            return self._metadata(path)
        owner.event("other", 404, f"{self.command} {path}")
        self._send(404, {"error": {"code": 404, "message": f"no such endpoint: {path}"}})

    def _metadata(self, path: str) -> None:
        owner = self.owner
        flavor = {"Metadata-Flavor": "Google"}
        if self.headers.get("Metadata-Flavor") != "Google":
            owner.event("metadata", 403, f"{path} without Metadata-Flavor: Google")
            return self._send(403, "Missing Metadata-Flavor:Google header.\n", "text/html",
                              flavor)
        if path == "/":
            owner.event("metadata.probe", 200)
            return self._send(200, "computeMetadata/\n", "application/text", flavor)
        if path == "/computeMetadata/v1/instance/service-accounts/default/token":
            body = owner.metadata_token()
            owner.event("metadata", 200, f"sub={owner.metadata_subject}")
            return self._send(200, body, "application/json", flavor)
        simple = {"/computeMetadata/v1/project/project-id": owner.project_id,
                  "/computeMetadata/v1/project/numeric-project-id": owner.project_number,
                  "/computeMetadata/v1/instance/service-accounts/default/email":
                      owner.metadata_subject}
        if path in simple:
            owner.event("metadata.info", 200, path)
            return self._send(200, simple[path], "application/text", flavor)
        owner.event("metadata.info", 404, path)
        self._send(404, "Not Found\n", "text/html", flavor)


# ====================================================================== GCS 401 proxy
UNAUTHENTICATED_BODY = json.dumps({"error": {"code": 401, "message": "Invalid Credentials",
                                             "errors": [{"domain": "global", "reason": "authError",
                                                         "message": "Invalid Credentials",
                                                         "locationType": "header",
                                                         "location": "Authorization"}]}}).encode()


@dataclass
class AuthCheck:
    kind: str            # list | metadata | media | other (storefs_testlib.classify)
    auth: str            # none | bearer | other
    subject: str | None  # who holds the bearer token, when valid
    status: int          # 401 (answered here) or 200 (authorized, forwarded upstream)
    user_project: str | None = None


class GCSAuthProxy(ForbiddingProxy):
    """In front of fake-gcs-server (https towards storefs by default, as ForbiddingProxy): 401 unless `Authorization: Bearer <token AuthServer issued,
    unexpired>`, otherwise forwarded like ForbiddingProxy does (which denies nothing here).

    `checks` lists every request (kind, auth kind, subject, status); `counts` as in
    ForbiddingProxy plus `unauthenticated`.
    """

    def __init__(self, upstream: str, auth: AuthServer, *, tls=None, aliases=()) -> None:
        super().__init__(upstream, denied_prefix="", tls=tls, aliases=aliases)
        self.auth = auth
        self.checks: list[AuthCheck] = []

    def denies(self, req) -> bool:
        return False

    thread_name = "gcs-auth-proxy"

    def request_handler(self) -> type:
        return _AuthCheckingHandler

    def add_check(self, check: AuthCheck) -> None:
        with self._lock:
            self.checks.append(check)

    def subjects(self) -> set[str]:
        with self._lock:
            return {c.subject for c in self.checks if c.subject}


class _AuthCheckingHandler(_ProxyHandler):
    owner: GCSAuthProxy

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms stalls

    def _handle(self) -> None:
        header = self.headers.get("Authorization") or ""
        scheme, _, cred = header.partition(" ")
        kind = "none" if not header else ("bearer" if scheme.lower() == "bearer" else "other")
        subject = self.owner.auth.access_token_subject(cred.strip()) if kind == "bearer" else None
        req = classify(self.command, self.path)
        user_project = self.headers.get("x-goog-user-project")
        if subject is None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            req.status = 401
            self.owner.arrived(req)
            self.owner.record(req)
            with self.owner._lock:
                self.owner.counts["unauthenticated"] += 1
            self.owner.add_check(AuthCheck(req.kind, kind, None, 401, user_project))
            self.send_response(401)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("WWW-Authenticate", 'Bearer realm="https://accounts.google.com/"')
            self.send_header("Content-Length", str(len(UNAUTHENTICATED_BODY)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(UNAUTHENTICATED_BODY)
            return
        self.owner.add_check(AuthCheck(req.kind, kind, subject, 200, user_project))  # forwarded
        super()._handle()


# ====================================================================== mounts with explicit credentials
class ExplicitMountManager(MountManager):
    """The `mount` factory with nothing implicit: no `anonymous`, no default endpoint.

    `m = bare_mount(source, options=[...], endpoint=URL or None, env={...})`; endpoint None
    leaves `endpoint=` out. `ca_file=` as in MountManager (AUTO: the session CA when the
    endpoint or `auth_endpoint=` is https). storefs runs through `env -i` with PATH, a private empty HOME, the
    `env` given, and http(s)_proxy pointing at `trap` (the AuthServer) with loopback exempt: a
    request meant for a real Google host lands in `AuthServer.escapes` instead of the network.
    `command(...)` builds the argv (and adopts the mount point) for runs that must fail.
    """

    def __init__(self, bin_path: str, trap: str | None = None) -> None:
        super().__init__("", bin_path)
        self.trap = trap
        self.home = self.new_dir("home")
        self._call_env: dict[str, str] = {}

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
               "HOME": self.home, "LANG": "C.UTF-8"}
        if self.trap:
            for var in ("http_proxy", "https_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
                env[var] = self.trap
            env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost,::1"
        for k, v in (extra or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def argv(self, source, mnt, *, endpoint, options=(), foreground=True, cache_dir=None,
             ca_file=AUTO):
        cache_dir = cache_dir or self.new_dir("cache")
        opts = (([f"endpoint={endpoint}"] if endpoint else []) + [f"cache_dir={cache_dir}"]
                + self.tls_options(endpoint, options, ca_file) + list(options))
        env = self.environment(self._call_env)
        argv = (["/usr/bin/env", "-i", *[f"{k}={v}" for k, v in env.items()], self.bin]
                + (["-f"] if foreground else []) + ["-o", ",".join(opts), source, mnt])
        return argv, cache_dir

    def __call__(self, source: str, *, options=(), endpoint: str | None = None,
                 env: dict[str, str] | None = None, **kwargs):
        self._call_env = dict(env or {})
        try:
            return super().__call__(source, options=options, endpoint=endpoint, **kwargs)
        finally:
            self._call_env = {}

    def command(self, source: str, *, options=(), endpoint: str | None = None,
                env: dict[str, str] | None = None, foreground: bool = True, ca_file=AUTO
                ) -> tuple[list[str], str]:
        """(argv, mount point) for a run that is expected to fail; cleanup is still ours."""
        mnt = self.new_dir("mnt")
        self._call_env = dict(env or {})
        try:
            argv, cache = self.argv(source, mnt, endpoint=endpoint, options=options,
                                    foreground=foreground, ca_file=ca_file)
        finally:
            self._call_env = {}
        self.adopt(mnt, cache)
        return argv, mnt
