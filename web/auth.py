"""Who is calling: a Bearer token, or the web page's session cookie (with its CSRF token).

Tokens are compared as SHA-256 hashes with `hmac.compare_digest`, against every identity (no
early exit), so neither the token nor which identity matched leaks through timing. A session
cookie is `<name>.<expiry>.<nonce>.<mac>`, signed with the server's session secret and the
identity's token hash: every copy sharing that secret accepts it, and removing the token ends
its sessions. The CSRF token is a second MAC over the cookie; a cookie-authenticated write
must send it in `X-CSRF-Token` (a Bearer token is no ambient credential and needs none).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from web.errors import ApiError
from web.settings import ApiSettings, Identity, Scope, hash_token

__all__ = ["COOKIE", "Caller", "Gate"]

COOKIE = "pb_session"
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: its identity, and the session cookie it came with, if any."""

    identity: Identity
    cookie: str | None = None

    @property
    def name(self) -> str:
        return self.identity.name

    def sees(self, thread_id: str) -> bool:
        """Whether the thread is within the identity's `threads` glob (escalation to one of its
        `groups` widens this for one prompt: web/access.py)."""
        return fnmatchcase(thread_id, self.identity.threads)


def _unauthenticated(message: str) -> ApiError:
    return ApiError(401, "unauthenticated", message, headers={"WWW-Authenticate": "Bearer"})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Gate:
    """Authenticates requests against the configured identities."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self._identities = settings.tokens
        self._by_name = {i.name: i for i in settings.tokens}
        secret = settings.session_secret or secrets.token_hex(32)
        self._secret = hashlib.sha256(secret.encode()).digest()

    # -- tokens ----------------------------------------------------------------------------

    def identify(self, token: str) -> Identity | None:
        """The identity whose token this is, or None; constant time over all identities."""
        presented = hash_token(token)
        found: Identity | None = None
        for identity in self._identities:
            if hmac.compare_digest(presented, identity.token_sha256):
                found = identity
        return found

    # -- session cookies ---------------------------------------------------------------------

    def _mac(self, identity: Identity, purpose: str, message: str) -> str:
        key = self._secret + bytes.fromhex(identity.token_sha256)
        return _b64(hmac.new(key, f"{purpose}\0{message}".encode(), hashlib.sha256).digest())

    def new_cookie(self, identity: Identity) -> tuple[str, int]:
        """A fresh session cookie for `identity` and its expiry (unix seconds)."""
        expires = int(time.time()) + self.settings.session_ttl
        body = f"{_b64(identity.name.encode())}.{expires}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._mac(identity, 'session', body)}", expires

    def from_cookie(self, cookie: str) -> Identity | None:
        try:
            name_b64, expires, nonce, mac = cookie.split(".")
            name = _unb64(name_b64).decode()
            expiry = int(expires)
        except (ValueError, UnicodeDecodeError):
            return None
        identity = self._by_name.get(name)
        if identity is None or not nonce:
            return None
        body = f"{name_b64}.{expires}.{nonce}"
        if not hmac.compare_digest(mac, self._mac(identity, "session", body)):
            return None
        return identity if expiry > time.time() else None

    @staticmethod
    def expiry(cookie: str) -> int:
        return int(cookie.split(".")[1])

    def csrf_token(self, caller: Caller) -> str | None:
        if caller.cookie is None:
            return None
        return self._mac(caller.identity, "csrf", caller.cookie)

    # -- requests ----------------------------------------------------------------------------

    def caller(self, conn: HTTPConnection) -> Caller:
        """The authenticated caller of a request, or a 401 `ApiError`."""
        header = conn.headers.get("authorization")
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise _unauthenticated("the Authorization header must be `Bearer <token>`")
            identity = self.identify(token.strip())
            if identity is None:
                raise _unauthenticated("unknown token")
            return Caller(identity)
        cookie = conn.cookies.get(COOKIE)
        if cookie:
            identity = self.from_cookie(cookie)
            if identity is None:
                raise _unauthenticated("the session has ended or is not valid: sign in again")
            caller = Caller(identity, cookie)
            if conn.scope.get("method", "GET") not in _SAFE:
                self._check_csrf(conn, caller)
            return caller
        raise _unauthenticated("no token: send `Authorization: Bearer <token>` or sign in")

    @staticmethod
    def check_origin(conn: HTTPConnection) -> None:
        """A browser's write from another site (its `Origin` is not ours) is refused."""
        origin = conn.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != conn.headers.get("host", ""):
            raise ApiError(403, "csrf_failed", "a write from another origin")

    def _check_csrf(self, conn: HTTPConnection, caller: Caller) -> None:
        """A cookie-authenticated write: the CSRF token must come with it, from our own origin."""
        self.check_origin(conn)
        sent = conn.headers.get("x-csrf-token", "")
        expected = self.csrf_token(caller) or ""
        if not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
            raise ApiError(403, "csrf_failed", "missing or wrong X-CSRF-Token header")

    def require(self, conn: HTTPConnection, scope: Scope, thread_id: str | None = None) -> Caller:
        """The caller, if it holds `scope` (and may see `thread_id`); else 401 or 403."""
        caller = self.caller(conn)
        if not caller.identity.allows(scope):
            raise ApiError(403, "forbidden", f"this token lacks the {scope!r} scope")
        if thread_id is not None and not caller.sees(thread_id):
            raise ApiError(403, "forbidden", "this token may not see that thread")
        return caller
