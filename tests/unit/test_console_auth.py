"""The console's login token, sessions and CSRF tokens (pure)."""

from __future__ import annotations

from triage_cli.console.auth import Auth


def test_only_the_login_token_opens_a_session() -> None:
    auth = Auth("the-token")
    assert auth.login("wrong") is None
    assert auth.login("") is None
    assert auth.login("the-token ") is None
    session = auth.login("the-token")
    assert session is not None
    assert auth.csrf(session) is not None
    assert auth.csrf("made-up") is None
    assert auth.csrf(None) is None


def test_each_session_has_its_own_csrf_token() -> None:
    auth = Auth()
    one, two = auth.login(auth.token), auth.login(auth.token)
    assert one is not None
    assert two is not None
    assert one != two
    assert auth.allows(one, auth.csrf(one))
    assert not auth.allows(one, auth.csrf(two))
    assert not auth.allows(one, None)
    assert not auth.allows(one, "")
    assert not auth.allows(None, auth.csrf(one))
    assert not auth.allows("made-up", auth.csrf(one))


def test_sessions_are_bounded_oldest_first() -> None:
    auth = Auth(max_sessions=2)
    first = auth.login(auth.token)
    second = auth.login(auth.token)
    third = auth.login(auth.token)
    assert auth.csrf(first) is None
    assert auth.csrf(second) is not None
    assert auth.csrf(third) is not None


def test_tokens_are_random() -> None:
    assert Auth().token != Auth().token
    assert len(Auth().token) >= 40
