"""The bearer tokens a proxy accepts now, re-read from the config file on SIGHUP.

The gRPC service checks each call's token against them, and push registration's HTTP
route does too (push/). `reload()` only asks (safe from a signal handler); the follower
task reads the [auth] section again in a thread (it may ask Secrets Manager) and applies
it; a file that fails to load keeps the tokens in force.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping

from triage_proxy.config.sections import AuthSettings
from triage_proxy.errors import TriageError
from triage_proxy.waiting import wait_any

__all__ = ["Tokens"]

logger = logging.getLogger(__name__)


class Tokens:
    """name -> token for every token accepted now (AuthSettings.active)."""

    def __init__(
        self, auth: AuthSettings, source: Callable[[], AuthSettings] | None = None
    ) -> None:
        self.active: Mapping[str, str] = auth.active()
        """The tokens accepted now, by name (replaced whole on a reload)."""
        self.source = source
        """Re-reads the [auth] section; None: the tokens never change."""
        self._wanted = asyncio.Event()

    def values(self) -> Collection[str]:
        return self.active.values()

    def reload(self) -> None:
        """Ask for the tokens to be re-read (SIGHUP; safe from a signal handler)."""
        self._wanted.set()

    async def follow(
        self, apply: Callable[[Mapping[str, str]], object], closing: asyncio.Event
    ) -> None:
        """On each reload() until `closing`: read [auth] again and `apply` the new tokens
        (the service's update_tokens); a bad file keeps the current tokens."""
        source = self.source
        if source is None:
            return
        while await wait_any(self._wanted, closing):
            if closing.is_set():
                return
            self._wanted.clear()
            try:
                auth = await asyncio.to_thread(source)
            except (TriageError, OSError) as exc:
                logger.error("token reload failed, keeping the current tokens: %s", exc)  # noqa: TRY400 - the message is the whole story
                continue
            self.active = auth.active()
            apply(self.active)
