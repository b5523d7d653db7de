"""Credentials for both protocols, token refresh, download-URL xattrs and secrets in logs.

Token services are auth_fixture.AuthServer (`auth_endpoint=`, `GCE_METADATA_HOST`); the GCS
protocol goes through GCSAuthProxy (401 unless a Bearer token the AuthServer issued), the
Firebase protocol through firebase_fixture (ID tokens verified, rules). storefs runs with a
clean environment (`bare_mount`): no host credentials, and any request that tries to leave
loopback fails the test. The first tests check the fixtures themselves (no storefs).
"""

from __future__ import annotations

import json
import os
from collections import Counter
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

import tls_fixture
from auth_fixture import (GOOGLE_TOKEN_AUD, JWT_BEARER, READ_ONLY_SCOPE, jwt_rs256,
                          sign_v4_url, verify_v4_signed_url, write_token_file)
from firebase_fixture import TOKENS_KEY
from gcs_emulator import quote_name
from storefs_testlib import errname, errno_of, is_mounted, run_storefs

CB = "cred-bucket"        # GCS protocol only (never read over v0: stays token-less)
FCB = "fbcred-bucket"     # Firebase protocol
URL_ATTR = "user.storefs.download_url"
NOBODY = 65534
ALICE_EMAIL, BOB_EMAIL = "alice@example.test", "bob@example.test"

GCS_FILES = {f"files/f{i}.txt": f"gcs file {i}\n".encode() for i in range(12)}
GCS_FILES["plain/no token+ü.txt"] = b"signed URLs for me\n"
GCS_FILES["tok/has-token.txt"] = b"firebase URL for me\n"
FB_FILES = {f"alice/a{i}.txt": f"alice {i}\n".encode() for i in range(6)}
FB_FILES.update({f"bob/b{i}.txt": f"bob {i}\n".encode() for i in range(6)})
FB_FILES.update({f"shared/s{i:02d}.txt": f"shared {i}\n".encode() for i in range(24)})
FB_FILES["admin/only.txt"] = b"admins only\n"
FB_FILES["public/p.txt"] = b"anyone\n"
FB_RULES = [("alice/", {"uid-alice"}), ("bob/", {"uid-bob"}), ("admin/", "deny"),
            ("public/", "public"), ("", "auth")]


@pytest.fixture(scope="module")
def buckets(emulator):
    for b in (CB, FCB):
        emulator.create_bucket(b, exist_ok=True)
    for name, data in GCS_FILES.items():
        meta = {TOKENS_KEY: "gcs-tok-1,gcs-tok-2"} if name.startswith("tok/") else None
        emulator.upload(CB, name, data, content_type="text/plain", metadata=meta)
    for name, data in FB_FILES.items():
        emulator.upload(FCB, name, data, content_type="text/plain")
    return {CB: GCS_FILES, FCB: FB_FILES}


@pytest.fixture
def users(auth_server, firebase):
    """alice and bob with passwords; the Firebase rules of FB_RULES."""
    pw = {ALICE_EMAIL: "alice-pw-Zq81!x", BOB_EMAIL: "bob-pw-Kk27#y"}
    auth_server.add_user(ALICE_EMAIL, pw[ALICE_EMAIL], uid="uid-alice")
    auth_server.add_user(BOB_EMAIL, pw[BOB_EMAIL], uid="uid-bob")
    firebase.set_rules(FB_RULES)
    return pw


def media_url(endpoint: str, bucket: str, name: str) -> str:
    """The download URL of a token object with protocol=gcs on an endpoint that is not Google's:
    the JSON API media URL, which such an endpoint serves, not a v0 token URL it does not
    (README, "Download URLs")."""
    return f"{endpoint}/download/storage/v1/b/{quote_name(bucket)}/o/{quote_name(name)}?alt=media"


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = b""
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return out
            out += b
    finally:
        os.close(fd)


def _http(url, data=None, headers=None, method=None):
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30, context=tls_fixture.client_context()) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def _post_json(url, doc):
    status, _, body = _http(url, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    return status, json.loads(body)


def _post_form(url, fields):
    status, _, body = _http(url, urllib.parse.urlencode(fields).encode(),
                            {"Content-Type": "application/x-www-form-urlencoded"})
    return status, json.loads(body)


def _password_file(bare_mount, password: str) -> str:
    path = os.path.join(bare_mount.new_dir("secret"), "password")
    with open(path, "w") as f:
        f.write(password + "\n")
    os.chmod(path, 0o600)
    return path


def fb_signin_mount(bare_mount, firebase, auth_server, pw, email=ALICE_EMAIL, options=()):
    return bare_mount(FCB, endpoint=firebase.endpoint, options=[
        "protocol=firebase", f"auth_endpoint={auth_server.endpoint}",
        f"api_key={auth_server.api_key}", f"email={email}",
        f"password_file={_password_file(bare_mount, pw[email])}", *options])


def _firebase_uids(firebase) -> set:
    return {r.uid for r in firebase.log if r.auth == "firebase" and r.status != 401}


def _wait_for(pred, timeout: float = 5.0, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


# ====================================================================== the fixtures themselves
def test_fixture_identity_toolkit_and_secure_token(auth_server):
    a = auth_server
    uid = a.add_user(ALICE_EMAIL, "pw-1")
    base = f"{a.endpoint}/identitytoolkit.googleapis.com/v1/accounts"
    status, body = _post_json(f"{base}:signInWithPassword?key={a.api_key}",
                              {"email": ALICE_EMAIL, "password": "pw-1", "returnSecureToken": True})
    assert status == 200 and body["localId"] == uid and body["expiresIn"] == "3600"
    assert body["registered"] is True and body["email"] == ALICE_EMAIL
    assert a.verify_id_token(body["idToken"])["user_id"] == uid
    status, bad = _post_json(f"{base}:signInWithPassword?key={a.api_key}",
                             {"email": ALICE_EMAIL, "password": "nope", "returnSecureToken": True})
    assert (status, bad["error"]["message"]) == (400, "INVALID_PASSWORD")
    status, bad = _post_json(f"{base}:signInWithPassword?key=wrong",
                             {"email": ALICE_EMAIL, "password": "pw-1"})
    assert status == 400 and bad["error"]["message"].startswith("API key not valid")
    status, anon = _post_json(f"{base}:signUp?key={a.api_key}", {"returnSecureToken": True})
    assert status == 200 and anon["localId"].startswith("anon-") and anon["idToken"]
    assert a.verify_id_token(anon["idToken"])["firebase"]["sign_in_provider"] == "anonymous"
    st = f"{a.endpoint}/securetoken.googleapis.com/v1/token?key={a.api_key}"
    status, r1 = _post_form(st, {"grant_type": "refresh_token", "refresh_token": body["refreshToken"]})
    assert status == 200 and r1["token_type"] == "Bearer" and r1["user_id"] == uid
    assert r1["access_token"] == r1["id_token"] and r1["refresh_token"] != body["refreshToken"]
    assert isinstance(r1["expires_in"], str) and r1["project_id"].isdigit()
    status, r2 = _post_json(st, {"grantType": "refresh_token", "refreshToken": r1["refresh_token"]})
    assert status == 200 and a.verify_id_token(r2["id_token"])["user_id"] == uid
    assert a.counts["stale_refresh"] == 0
    _post_form(st, {"grant_type": "refresh_token", "refresh_token": body["refreshToken"]})
    assert a.counts["stale_refresh"] == 1, "reuse of a rotated refresh token is counted"
    a.revoke_refresh_tokens(uid)
    status, bad = _post_form(st, {"grant_type": "refresh_token", "refresh_token": r2["refresh_token"]})
    assert (status, bad["error"]["message"]) == (400, "TOKEN_EXPIRED")
    a.id_token_lifetime, a.id_token_reported_lifetime = 3, 3600
    status, short = _post_json(f"{base}:signInWithPassword?key={a.api_key}",
                               {"email": ALICE_EMAIL, "password": "pw-1", "returnSecureToken": True})
    claims = a.verify_id_token(short["idToken"])
    assert short["expiresIn"] == "3600" and claims["exp"] - claims["iat"] == 3
    assert not any(s in repr(a.log) for s in a.secrets()), "the fixture log holds a secret"


def test_fixture_oauth2_grants_and_metadata_server(auth_server, tmp_path):
    a = auth_server
    key = a.make_service_account_key(str(tmp_path / "sa.json"))
    doc = json.loads((tmp_path / "sa.json").read_text())
    assert doc["type"] == "service_account" and doc["private_key"].startswith("-----BEGIN PRIVATE KEY-----")
    assert doc["client_email"] == key.client_email and doc["private_key_id"] == key.private_key_id
    assert doc["token_uri"] == a.trap_token_uri
    now = int(time.time())
    good = {"iss": key.client_email, "scope": READ_ONLY_SCOPE, "aud": GOOGLE_TOKEN_AUD,
            "iat": now, "exp": now + 3600}
    tok = f"{a.endpoint}/oauth2.googleapis.com/token"

    def grant(claims, kid=key.private_key_id, pkey=key.private_key):
        return _post_form(tok, {"grant_type": JWT_BEARER,
                                "assertion": jwt_rs256(claims, pkey, kid)})

    status, body = grant(good)
    assert status == 200 and body["token_type"] == "Bearer" and body["expires_in"] == 3600
    assert a.access_token_subject(body["access_token"]) == key.client_email
    other = a.make_service_account_key(str(tmp_path / "other.json"))
    for claims, kid, pkey, why in [
            (good, "wrong-kid", key.private_key, "kid"),
            (good, key.private_key_id, other.private_key, "Signature"),
            ({**good, "aud": tok}, key.private_key_id, key.private_key, "aud"),
            ({**good, "scope": "https://www.googleapis.com/auth/cloud-platform"},
             key.private_key_id, key.private_key, "scope"),
            ({**good, "exp": now + 3601}, key.private_key_id, key.private_key, "exp - iat"),
            ({**good, "iat": now - 7200, "exp": now - 3600}, key.private_key_id, key.private_key, "iat")]:
        status, body = grant(claims, kid, pkey)
        assert status == 400 and body["error"] == "invalid_grant" and why in body["error_description"], \
            (why, body)
    user = a.make_authorized_user(str(tmp_path / "adc.json"))
    status, body = _post_form(tok, {"grant_type": "refresh_token", "client_id": user.client_id,
                                    "client_secret": user.client_secret,
                                    "refresh_token": user.refresh_token})
    assert status == 200 and a.access_token_subject(body["access_token"]) == f"user:{user.client_id}"
    status, _ = _post_form(tok, {"grant_type": "refresh_token", "client_id": user.client_id,
                                 "client_secret": "wrong", "refresh_token": user.refresh_token})
    assert status == 401
    md = f"http://{a.metadata_host}/computeMetadata/v1/instance/service-accounts/default/token"
    assert _http(md)[0] == 403
    status, headers, body = _http(md, headers={"Metadata-Flavor": "Google"})
    assert status == 200 and headers["metadata-flavor"] == "Google"
    assert a.access_token_subject(json.loads(body)["access_token"]) == a.metadata_subject
    assert _post_form(a.trap_token_uri, {"grant_type": JWT_BEARER})[0] == 400
    assert a.counts["trap"] == 1


def test_fixture_v4_signed_url_verifier_and_gcs_proxy(auth_server, gcs_auth_proxy, emulator,
                                                      buckets, tmp_path):
    key = auth_server.make_service_account_key(str(tmp_path / "sa.json"))
    name = "plain/no token+ü.txt"
    url = sign_v4_url(key, CB, name, expires=900)
    info = verify_v4_signed_url(url, key.public_key, CB, name, expected_email=key.client_email)
    assert info["expires"] == 900 and "/plain/no%20token%2B%C3%BC.txt?" in url
    for broken in [url.replace("X-Goog-Expires=900", "X-Goog-Expires=901"),
                   url[:-2] + ("00" if not url.endswith("00") else "11"),
                   url.replace("/cred-bucket/", "/other-bucket/")]:
        with pytest.raises(AssertionError):
            verify_v4_signed_url(broken, key.public_key, CB, name)
    with pytest.raises(AssertionError):
        verify_v4_signed_url(sign_v4_url(key, CB, name, expires=604801), key.public_key, CB, name)
    with pytest.raises(AssertionError):
        verify_v4_signed_url(url, key.public_key, CB, "plain/other.txt")
    # the signed path names the object: fake-gcs serves it for Host storage.googleapis.com
    parts = urllib.parse.urlsplit(url)
    status, _, body = _http(f"{emulator.endpoint}{parts.path}?{parts.query}",
                            headers={"Host": "storage.googleapis.com"})
    assert (status, body) == (200, GCS_FILES[name])
    obj = f"{gcs_auth_proxy.endpoint}/storage/v1/b/{CB}/o/{quote_name('files/f0.txt')}?alt=media"
    assert _http(obj)[0] == 401
    assert _http(obj, headers={"Authorization": "Bearer ya29.forged"})[0] == 401
    token = auth_server.mint_access_token("tester")
    assert _http(obj, headers={"Authorization": f"Bearer {token}"})[2] == GCS_FILES["files/f0.txt"]
    auth_server.reject_current_access_tokens()
    assert _http(obj, headers={"Authorization": f"Bearer {token}"})[0] == 401
    assert [c.status for c in gcs_auth_proxy.checks] == [401, 401, 200, 401]
    assert gcs_auth_proxy.subjects() == {"tester"}


# ====================================================================== Firebase credentials
def test_token_file_firebase_is_sent_and_reread(bare_mount, firebase, auth_server, users, buckets):
    tf = os.path.join(bare_mount.new_dir("tok"), "id-token")
    write_token_file(tf, auth_server.mint_id_token("uid-alice", email=ALICE_EMAIL))
    m = bare_mount(FCB, endpoint=firebase.endpoint,
                   options=["protocol=firebase", f"token_file={tf}", "negative_ttl=0"])
    assert _read(m.p("alice/a0.txt")) == FB_FILES["alice/a0.txt"]
    assert errname(errno_of(_read, m.p("bob/b0.txt"))) == "EACCES"
    assert _firebase_uids(firebase) == {"uid-alice"}
    write_token_file(tf, auth_server.mint_id_token("uid-bob", email=BOB_EMAIL))
    assert _wait_for(lambda: errno_of(_read, m.p("bob/b1.txt")) is None, timeout=5), \
        "a new token in token_file was not picked up within 5 s"
    assert _read(m.p("bob/b1.txt")) == FB_FILES["bob/b1.txt"]
    assert "uid-bob" in _firebase_uids(firebase)


def test_email_password_sign_in(bare_mount, firebase, auth_server, users, buckets):
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("alice/a1.txt")) == FB_FILES["alice/a1.txt"]
    assert _read(m.p("shared/s00.txt")) == FB_FILES["shared/s00.txt"]
    assert errname(errno_of(_read, m.p("bob/b0.txt"))) == "EACCES"
    assert auth_server.counts["signInWithPassword:ok"] == 1
    assert _firebase_uids(firebase) == {"uid-alice"}


def test_anonymous_sign_up(bare_mount, firebase, auth_server, users, buckets):
    m = bare_mount(FCB, endpoint=firebase.endpoint, options=[
        "protocol=firebase", f"auth_endpoint={auth_server.endpoint}", f"api_key={auth_server.api_key}"])
    assert _read(m.p("shared/s01.txt")) == FB_FILES["shared/s01.txt"]
    assert errname(errno_of(_read, m.p("alice/a0.txt"))) == "EACCES"
    assert auth_server.counts["signUp:ok"] == 1 and auth_server.counts["signInWithPassword"] == 0
    uids = _firebase_uids(firebase)
    assert len(uids) == 1 and next(iter(uids)).startswith("anon-")


def test_api_key_is_not_left_in_proc_cmdline(bare_mount, firebase, auth_server, users, buckets):
    """Other users read /proc/PID/cmdline: the daemon overwrites api_key= and email= values."""
    m = bare_mount(FCB, endpoint=firebase.endpoint, options=[
        "protocol=firebase", f"auth_endpoint={auth_server.endpoint}", f"api_key={auth_server.api_key}"])
    assert _read(m.p("shared/s01.txt")) == FB_FILES["shared/s01.txt"]
    assert m.pid is not None
    with open(f"/proc/{m.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert auth_server.api_key.encode() not in cmdline, cmdline
    assert b"api_key=" + b"*" * len(auth_server.api_key) in cmdline, cmdline


def test_service_account_key_with_firebase_protocol_is_admin(bare_mount, firebase, auth_server,
                                                            users, buckets):
    key = auth_server.make_service_account_key(os.path.join(bare_mount.new_dir("sa"), "key.json"))
    m = bare_mount(FCB, endpoint=firebase.endpoint, options=[
        "protocol=firebase", f"credentials={key.path}", f"auth_endpoint={auth_server.endpoint}"])
    assert _read(m.p("admin/only.txt")) == FB_FILES["admin/only.txt"], "Bearer = admin: no rules"
    assert _read(m.p("bob/b2.txt")) == FB_FILES["bob/b2.txt"]
    assert {r.auth for r in firebase.log} == {"bearer"}
    assert {r.uid for r in firebase.log} == {key.client_email}
    assert auth_server.counts["oauth2.jwt:ok"] >= 1 and auth_server.counts["trap"] == 0


def test_id_token_refreshed_before_expiry(bare_mount, firebase, auth_server, users, buckets):
    auth_server.id_token_lifetime = 302          # refresh is due once < 300 s remain
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("shared/s02.txt")) == FB_FILES["shared/s02.txt"]
    first_serials = {r.serial for r in firebase.log if r.serial}
    time.sleep(3.5)
    assert _read(m.p("shared/s03.txt")) == FB_FILES["shared/s03.txt"]
    assert auth_server.counts["securetoken:ok"] >= 1, "no refresh although < 300 s were left"
    late = [r for r in firebase.log if r.name == "shared/s03.txt"]
    assert late and all(r.serial not in first_serials for r in late), "the old ID token was sent"
    assert firebase.counts["status:401"] == 0, "the refresh should come before a 401, not after"
    assert auth_server.counts["stale_refresh"] == 0, "the rotated refresh token was not kept"


def test_expired_id_token_is_refreshed_and_the_read_succeeds(bare_mount, firebase, auth_server,
                                                             users, buckets):
    auth_server.id_token_lifetime = 3            # the JWT says exp = iat + 3 ...
    auth_server.id_token_reported_lifetime = 3600  # ... while expiresIn says "3600"
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("shared/s04.txt")) == FB_FILES["shared/s04.txt"]
    time.sleep(4)
    assert _read(m.p("shared/s05.txt")) == FB_FILES["shared/s05.txt"]
    assert auth_server.counts["securetoken:ok"] >= 1
    statuses = [r.status for r in firebase.log if r.name == "shared/s05.txt"]
    assert statuses[-1] in (200, 206), statuses


def test_401_forces_one_refresh_then_succeeds(bare_mount, firebase, auth_server, users, buckets):
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("shared/s06.txt")) == FB_FILES["shared/s06.txt"]
    refreshes = auth_server.counts["securetoken"]
    auth_server.reject_current_id_tokens()        # the server no longer takes the token it has
    assert _read(m.p("shared/s07.txt")) == FB_FILES["shared/s07.txt"]
    assert auth_server.counts["securetoken:ok"] == refreshes + 1, "exactly one forced refresh"
    assert firebase.counts["status:401"] >= 1


def test_persistent_401_is_eacces_after_one_forced_refresh(bare_mount, firebase, auth_server,
                                                          users, buckets):
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("shared/s10.txt")) == FB_FILES["shared/s10.txt"]
    refreshes = auth_server.counts["securetoken"]
    assert firebase.settle()
    seen = len(firebase.log)
    firebase.fail_always(401)                    # even a fresh token is turned away
    e = errno_of(_read, m.p("shared/s11.txt"))
    assert errname(e) == "EACCES", f"got {errname(e)}"
    assert auth_server.counts["securetoken"] == refreshes + 1, \
        f"{auth_server.counts['securetoken'] - refreshes} refreshes for one 401 (expected one)"
    assert firebase.settle()  # the fixture logs a request after its answer went out
    tries = [(r.kind, r.name or r.prefix, r.auth) for r in firebase.log[seen:]]
    # A lookup asks "a directory?" (list), "an object?" (metadata) and, on v0, the file's first
    # bytes (media) at once: each request at most once more after the one refresh (a probe
    # whose lookup the others' answers already decided is cancelled before its second try),
    # and at least one of them tried again with the fresh token.
    by_request = Counter((kind, what) for kind, what, _ in tries)
    assert max(by_request.values()) == 2 and len(by_request) <= 3, \
        f"expected each request at most once and once more after the refresh: {tries}"
    assert all(auth == "firebase" for _, _, auth in tries), tries
    firebase.clear_faults()
    assert _read(m.p("shared/s11.txt")) == FB_FILES["shared/s11.txt"], "EACCES was cached"


def test_a_persistent_401_forces_one_refresh_not_one_per_request(bare_mount, firebase, auth_server,
                                                                  users, buckets):
    # Every request after the forced refresh carries the fresh token: each one's 401 used to
    # force a refresh of its own, one per file read while the server turned them all away.
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("shared/s12.txt")) == FB_FILES["shared/s12.txt"]
    refreshes = auth_server.counts["securetoken"]
    firebase.fail_always(401)
    for name in ("shared/s13.txt", "shared/s14.txt", "shared/s15.txt", "shared/s16.txt"):
        assert errname(errno_of(_read, m.p(name))) == "EACCES", name
    assert auth_server.counts["securetoken"] == refreshes + 1, \
        f"{auth_server.counts['securetoken'] - refreshes} refreshes for four reads refused with 401"
    firebase.clear_faults()
    assert _read(m.p("shared/s17.txt")) == FB_FILES["shared/s17.txt"]


def test_persistent_401_with_token_file_is_eacces(bare_mount, firebase, auth_server, users,
                                                  buckets):
    tf = os.path.join(bare_mount.new_dir("tok"), "id-token")
    write_token_file(tf, auth_server.mint_id_token("uid-alice", email=ALICE_EMAIL))
    m = bare_mount(FCB, endpoint=firebase.endpoint,
                   options=["protocol=firebase", f"token_file={tf}", "negative_ttl=0"])
    assert _read(m.p("alice/a4.txt")) == FB_FILES["alice/a4.txt"]
    assert firebase.settle()
    seen = len(firebase.log)
    auth_server.reject_current_id_tokens()       # and nobody writes a new one
    assert errname(errno_of(_read, m.p("alice/a5.txt"))) == "EACCES"
    assert firebase.settle()
    tries = [(r.kind, r.name or r.prefix, r.status) for r in firebase.log[seen:]]
    by_request = Counter((kind, what) for kind, what, _ in tries)  # list, metadata, first bytes
    assert tries and max(by_request.values()) <= 2 and len(by_request) <= 3 and all(t[2] == 401 for t in tries), \
        f"a token known to be rejected was sent again and again: {tries}"


def test_revoked_refresh_token_is_eacces(bare_mount, firebase, auth_server, users, buckets):
    m = fb_signin_mount(bare_mount, firebase, auth_server, users)
    assert _read(m.p("shared/s08.txt")) == FB_FILES["shared/s08.txt"]
    auth_server.revoke_refresh_tokens("uid-alice")
    auth_server.reject_current_id_tokens()        # so the next request needs a refresh
    e = errno_of(_read, m.p("shared/s09.txt"))
    assert errname(e) == "EACCES", f"got {errname(e)}"
    assert auth_server.counts["securetoken:fail"] >= 1
    assert is_mounted(m.path), "a failed refresh must not bring the mount down"


@pytest.mark.parametrize("case", ["wrong_password", "unknown_email", "wrong_api_key",
                                  "expired_token_file"])
def test_bad_firebase_credentials_fail_before_mounting(bare_mount, firebase, auth_server, users,
                                                       buckets, case):
    opts = ["protocol=firebase", f"auth_endpoint={auth_server.endpoint}"]
    secret = "Wr0ng-pa55word-xyz"
    if case == "expired_token_file":
        tf = os.path.join(bare_mount.new_dir("tok"), "id-token")
        secret = auth_server.mint_id_token("uid-alice", lifetime=-10)
        write_token_file(tf, secret)
        opts.append(f"token_file={tf}")
    else:
        email = "nobody@example.test" if case == "unknown_email" else ALICE_EMAIL
        key = "not-the-key" if case == "wrong_api_key" else auth_server.api_key
        opts += [f"api_key={key}", f"email={email}",
                 f"password_file={_password_file(bare_mount, secret)}"]
    argv, mnt = bare_mount.command(FCB, endpoint=firebase.endpoint, options=opts)
    r = run_storefs(argv, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0, f"exit 0; stderr={r.stderr!r}"
    assert len(lines) == 1 and lines[0].startswith("storefs: "), \
        f"stderr must be exactly one 'storefs: ' line, got {r.stderr!r}"
    assert secret not in r.stderr
    assert not is_mounted(mnt)


# ====================================================================== GCS credentials
def _gcs_read_check(m, proxy, subject: str | None = None) -> None:
    assert _read(m.p("files/f1.txt")) == GCS_FILES["files/f1.txt"]
    assert sorted(os.listdir(m.p("files"))) == sorted(n.split("/")[1] for n in GCS_FILES
                                                      if n.startswith("files/"))
    assert proxy.counts["unauthenticated"] == 0, [c for c in proxy.checks if c.status == 401]
    subjects = proxy.subjects()
    assert subjects, "no authorized request reached the proxy"
    if subject is not None:
        assert subjects == {subject}


def test_service_account_key_on_gcs(bare_mount, gcs_auth_proxy, auth_server, buckets):
    key = auth_server.make_service_account_key(os.path.join(bare_mount.new_dir("sa"), "key.json"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[
        f"credentials={key.path}", f"auth_endpoint={auth_server.endpoint}"])
    _gcs_read_check(m, gcs_auth_proxy, key.client_email)
    assert auth_server.counts["oauth2.jwt:ok"] >= 1, auth_server.failures()
    assert auth_server.counts["trap"] == 0, "token_uri must be replaced when auth_endpoint is set"


def test_authorized_user_via_google_application_credentials(bare_mount, gcs_auth_proxy,
                                                            auth_server, buckets):
    user = auth_server.make_authorized_user(os.path.join(bare_mount.new_dir("adc"), "user.json"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint,
                   options=[f"auth_endpoint={auth_server.endpoint}"],
                   env={"GOOGLE_APPLICATION_CREDENTIALS": user.path})
    _gcs_read_check(m, gcs_auth_proxy, f"user:{user.client_id}")
    assert auth_server.counts["oauth2.refresh:ok"] >= 1, auth_server.failures()


def test_gcloud_adc_file_via_cloudsdk_config(bare_mount, gcs_auth_proxy, auth_server, buckets):
    cfg = bare_mount.new_dir("gcloud")
    user = auth_server.make_authorized_user(os.path.join(cfg, "application_default_credentials.json"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint,
                   options=[f"auth_endpoint={auth_server.endpoint}"],
                   env={"CLOUDSDK_CONFIG": cfg})
    _gcs_read_check(m, gcs_auth_proxy, f"user:{user.client_id}")
    assert auth_server.counts["oauth2.refresh:ok"] >= 1, auth_server.failures()


def test_metadata_server_via_gce_metadata_host(bare_mount, gcs_auth_proxy, auth_server, buckets):
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint,
                   env={"GCE_METADATA_HOST": auth_server.metadata_host})
    _gcs_read_check(m, gcs_auth_proxy, auth_server.metadata_subject)
    assert auth_server.counts["metadata:ok"] >= 1
    assert auth_server.counts["metadata:fail"] == 0, "requests without Metadata-Flavor: Google"


def test_token_file_bearer_on_gcs_and_reread(bare_mount, gcs_auth_proxy, auth_server, buckets):
    tf = os.path.join(bare_mount.new_dir("tok"), "access-token")
    write_token_file(tf, auth_server.mint_access_token("token-file-1"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[f"token_file={tf}"])
    _gcs_read_check(m, gcs_auth_proxy, "token-file-1")
    auth_server.reject_current_access_tokens()
    write_token_file(tf, auth_server.mint_access_token("token-file-2"))
    assert _wait_for(lambda: errno_of(_read, m.p("files/f2.txt")) is None, timeout=5), \
        "the rewritten token_file was not picked up within 5 s"
    assert "token-file-2" in gcs_auth_proxy.subjects()


def test_gcs_access_token_is_refreshed(bare_mount, gcs_auth_proxy, auth_server, buckets):
    auth_server.access_token_lifetime = 302
    key = auth_server.make_service_account_key(os.path.join(bare_mount.new_dir("sa"), "key.json"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[
        f"credentials={key.path}", f"auth_endpoint={auth_server.endpoint}"])
    assert _read(m.p("files/f3.txt")) == GCS_FILES["files/f3.txt"]
    grants = auth_server.counts["oauth2.jwt:ok"]
    time.sleep(3.5)
    assert _read(m.p("files/f4.txt")) == GCS_FILES["files/f4.txt"]
    assert auth_server.counts["oauth2.jwt:ok"] > grants, "no new grant although < 300 s were left"


def test_bad_gcs_token_file_fails_before_mounting(bare_mount, gcs_auth_proxy, auth_server, buckets):
    tf = os.path.join(bare_mount.new_dir("tok"), "access-token")
    forged = "ya29.forged-" + "q" * 30
    write_token_file(tf, forged)
    argv, mnt = bare_mount.command(CB, endpoint=gcs_auth_proxy.endpoint, options=[f"token_file={tf}"])
    r = run_storefs(argv, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("storefs: "), r.stderr
    assert forged not in r.stderr
    assert not is_mounted(mnt)


# ====================================================================== download URLs
def test_v4_signed_url_verifies_and_names_the_object(bare_mount, gcs_auth_proxy, auth_server,
                                                     emulator, buckets):
    key = auth_server.make_service_account_key(os.path.join(bare_mount.new_dir("sa"), "key.json"))
    base = [f"credentials={key.path}", f"auth_endpoint={auth_server.endpoint}"]
    name = "plain/no token+ü.txt"
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=base)
    url = os.getxattr(m.p(name), URL_ATTR).decode()
    info = verify_v4_signed_url(url, key.public_key, CB, name, expected_email=key.client_email)
    assert info["expires"] == 3600, "default url_expiry is 3600 s"
    parts = urllib.parse.urlsplit(url)
    status, _, body = _http(f"{emulator.endpoint}{parts.path}?{parts.query}",
                            headers={"Host": "storage.googleapis.com"})
    assert (status, body) == (200, GCS_FILES[name]), "the signed path does not fetch the object"
    # a token object still gets no signed URL: on an endpoint that is not Google's, the media
    # URL that endpoint serves (README, "Download URLs")
    assert os.getxattr(m.p("tok/has-token.txt"), URL_ATTR).decode() == media_url(
        gcs_auth_proxy.endpoint, CB, "tok/has-token.txt")
    short = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[*base, "url_expiry=600"])
    url = os.getxattr(short.p("files/f5.txt"), URL_ATTR).decode()
    assert verify_v4_signed_url(url, key.public_key, CB, "files/f5.txt")["expires"] == 600
    week = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[*base, "url_expiry=604800"])
    url = os.getxattr(week.p("files/f5.txt"), URL_ATTR).decode()
    assert verify_v4_signed_url(url, key.public_key, CB, "files/f5.txt")["expires"] == 604800


def test_url_expiry_over_seven_days_is_refused_or_capped(bare_mount, gcs_auth_proxy, auth_server,
                                                         buckets):
    """The contract says "max 604800"; either a one-line error or URLs capped at 7 days."""
    key = auth_server.make_service_account_key(os.path.join(bare_mount.new_dir("sa"), "key.json"))
    argv, mnt = bare_mount.command(CB, endpoint=gcs_auth_proxy.endpoint, options=[
        f"credentials={key.path}", f"auth_endpoint={auth_server.endpoint}", "url_expiry=604801"])
    err = os.path.join(bare_mount.new_dir("err"), "stderr")
    with open(err, "wb") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                start_new_session=True)
    deadline = time.monotonic() + 30
    while proc.poll() is None and not is_mounted(mnt) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_mounted(mnt):
        url = os.getxattr(os.path.join(mnt, "files/f9.txt"), URL_ATTR).decode()
        assert verify_v4_signed_url(url, key.public_key, CB, "files/f9.txt")["expires"] == 604800
        return                                   # teardown unmounts (command() adopted it)
    assert proc.wait(timeout=30) != 0
    text = open(err, encoding="utf-8", errors="replace").read()
    assert len(text.splitlines()) == 1 and text.startswith("storefs: ") and "url_expiry" in text, text


def test_url_xattr_off_hides_the_attribute(bare_mount, gcs_auth_proxy, auth_server, buckets):
    tf = os.path.join(bare_mount.new_dir("tok"), "access-token")
    write_token_file(tf, auth_server.mint_access_token("reader"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[f"token_file={tf}", "url_xattr=off"])
    for name in ("tok/has-token.txt", "files/f6.txt"):
        assert errname(errno_of(os.getxattr, m.p(name), URL_ATTR)) == "ENODATA"
        names = os.listxattr(m.p(name))
        assert URL_ATTR not in names and "user.storefs.gs_uri" in names
    assert os.getxattr(m.p("files/f6.txt"), "user.storefs.gs_uri") == f"gs://{CB}/files/f6.txt".encode()


def _xattr_as(uid: int, path: str, attr: str) -> tuple[int, str]:
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                        "getfattr", "--absolute-names", "--only-values", "-n", attr, path],
                       capture_output=True, text=True, timeout=30)
    return r.returncode, (r.stdout if r.returncode == 0 else r.stderr)


@pytest.mark.parametrize("mode", ["owner", "all", None], ids=["owner", "all", "default"])
def test_url_xattr_with_allow_other(bare_mount, gcs_auth_proxy, auth_server, buckets, mode):
    assert os.getuid() == 0, "this test mounts with allow_other and switches uid: run as root"
    os.chmod(bare_mount.tmp, 0o755)           # let uid 65534 reach the mount point
    tf = os.path.join(bare_mount.new_dir("tok"), "access-token")
    write_token_file(tf, auth_server.mint_access_token("reader"))
    opts = [f"token_file={tf}", "allow_other"] + ([f"url_xattr={mode}"] if mode else [])
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=opts)
    path = m.p("tok/has-token.txt")
    want = media_url(gcs_auth_proxy.endpoint, CB, "tok/has-token.txt")
    assert os.getxattr(path, URL_ATTR).decode() == want, "root may always read it"
    rc, out = _xattr_as(NOBODY, path, "user.storefs.gs_uri")
    assert rc == 0 and out == f"gs://{CB}/tok/has-token.txt", f"other xattrs stay readable: {out!r}"
    rc, out = _xattr_as(NOBODY, path, URL_ATTR)
    if mode == "all":
        assert rc == 0 and out == want, out
    else:
        assert rc != 0 and "Permission denied" in out, f"uid {NOBODY} read the capability: {out!r}"


# ====================================================================== secrets in logs
def _assert_no_secrets(m, secrets: set[str]) -> None:
    log = m.stderr()
    assert log.strip(), "log_level=debug produced no log at all (nothing to check)"
    leaked = sorted(s[:12] + "…" for s in secrets if len(s) >= 6 and s in log)
    assert leaked == [], f"secrets in storefs's log (prefixes shown): {leaked}"


@pytest.mark.parametrize("level", ["debug", "trace"])
def test_no_secrets_in_debug_log_firebase(bare_mount, firebase, auth_server, users, emulator,
                                          buckets, level):
    auth_server.id_token_lifetime = 302      # force a refresh, so refresh tokens travel too
    m = fb_signin_mount(bare_mount, firebase, auth_server, users, options=[f"log_level={level}"])
    assert _read(m.p("alice/a2.txt")) == FB_FILES["alice/a2.txt"]
    time.sleep(3.5)
    assert _read(m.p("alice/a3.txt")) == FB_FILES["alice/a3.txt"]
    url = os.getxattr(m.p("alice/a3.txt"), URL_ATTR).decode()
    token = emulator.get_object(FCB, "alice/a3.txt")["metadata"][TOKENS_KEY]
    assert url.endswith(f"&token={token}")
    assert auth_server.counts["securetoken:ok"] >= 1
    _assert_no_secrets(m, auth_server.secrets() | {token, users[ALICE_EMAIL]})


@pytest.mark.parametrize("level", ["debug", "trace"])
def test_no_secrets_in_debug_log_gcs(bare_mount, gcs_auth_proxy, auth_server, buckets, level):
    key = auth_server.make_service_account_key(os.path.join(bare_mount.new_dir("sa"), "key.json"))
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[
        f"credentials={key.path}", f"auth_endpoint={auth_server.endpoint}", f"log_level={level}"])
    assert _read(m.p("files/f7.txt")) == GCS_FILES["files/f7.txt"]
    signed = os.getxattr(m.p("files/f7.txt"), URL_ATTR).decode()
    sig = urllib.parse.parse_qs(urllib.parse.urlsplit(signed).query)["X-Goog-Signature"][0]
    fb_url = os.getxattr(m.p("tok/has-token.txt"), URL_ATTR).decode()
    assert fb_url == media_url(gcs_auth_proxy.endpoint, CB, "tok/has-token.txt")
    _assert_no_secrets(m, auth_server.secrets() | {sig, "gcs-tok-1", "gcs-tok-2"})


def test_no_secrets_in_debug_log_token_file(bare_mount, gcs_auth_proxy, auth_server, buckets):
    tf = os.path.join(bare_mount.new_dir("tok"), "access-token")
    token = auth_server.mint_access_token("reader")
    write_token_file(tf, token)
    m = bare_mount(CB, endpoint=gcs_auth_proxy.endpoint, options=[f"token_file={tf}",
                                                                  "log_level=debug"])
    assert _read(m.p("files/f8.txt")) == GCS_FILES["files/f8.txt"]
    _assert_no_secrets(m, {token})
