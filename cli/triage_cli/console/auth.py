"""Who may use the console: one login token, then a session cookie and a CSRF token.

The command prints one URL holding the login token (as Jupyter does). Opening it trades
the token for a session: an HttpOnly, SameSite=Strict cookie, and a redirect to the same
page without the token, so it does not stay in the address bar or the history. Every
other request needs the cookie (401 without it); every action is a POST that must also
carry the session's CSRF token in the `X-CSRF-Token` header (403 without it).

Pure: no I/O, no clock; the server asks, this answers.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict

COOKIE = "triage_console"
"""The session cookie's name."""
CSRF_HEADER = "X-CSRF-Token"
"""The header every POST carries its session's CSRF token in."""
TOKEN_PARAM = "token"
"""The query parameter of the login URL."""
MAX_SESSIONS = 256
"""Sessions kept at most (the oldest is forgotten first: its browser logs in again)."""


class Auth:
    """The login token and the live sessions (session id -> its CSRF token)."""

    def __init__(self, token: str | None = None, *, max_sessions: int = MAX_SESSIONS) -> None:
        self.token = token or secrets.token_urlsafe(32)
        """What the printed URL carries."""
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max = max_sessions

    def login(self, token: str) -> str | None:
        """A new session id if `token` is the login token, else None."""
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return None
        session = secrets.token_urlsafe(32)
        self._sessions[session] = secrets.token_urlsafe(32)
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)
        return session

    def csrf(self, session: str | None) -> str | None:
        """The CSRF token of a live session, None for anything else."""
        if not session:
            return None
        return self._sessions.get(session)

    def allows(self, session: str | None, csrf: str | None) -> bool:
        """Whether a POST of `session` carrying `csrf` may act."""
        expected = self.csrf(session)
        if expected is None or not csrf:
            return False
        return hmac.compare_digest(csrf.encode(), expected.encode())
