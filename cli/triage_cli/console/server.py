"""The console's aiohttp application: pages, the JSON API and the security around them.

    GET  /?token=T                          login: sets the session cookie, redirects
    GET  /overview /deadletters /fleet      page shells (the scripts fill them)
    GET  /deadletters/<topic>/<p>/<offset>  one dead letter (404 page when there is none)
    GET  /static/...                        scripts, styles, the vendored chart library
    GET  /api/overview                      the last sample and the last hour's series
    GET  /api/fleet                         processes, leases, rebalances
    GET  /api/deadletters?partition&reason&since&state&after&size   one page
    GET  /api/deadletters/reasons?...       counts by reason
    GET  /api/deadletters/count?...         pending items a bulk action would try
    GET  /api/deadletters/item/<id>         metadata;  .../payload  key, value, headers
    POST /api/deadletters/item/<id>/replay  .../discard   one item
    POST /api/jobs                          bulk replay or discard of a filter
    GET  /api/jobs/<job>                    its progress

Every response carries a Content-Security-Policy that allows scripts, styles and
connections to this origin only (no inline script, no frame, no form posting elsewhere).
Every request but the login needs the session cookie (401); every POST also needs the
CSRF token (403) and, when the browser sends one, this origin's `Origin`. Errors are
pages or JSON with what is wrong, never a traceback: a source that does not answer is
503 with the reason, and the page retries.
"""

from __future__ import annotations

import asyncio
import html
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from triage_cli.console.auth import COOKIE, CSRF_HEADER, TOKEN_PARAM, Auth
from triage_cli.console.deadletters import DeadLetters, key_text, parse_key
from triage_cli.console.jobs import Jobs
from triage_cli.console.sampler import Sampler

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings
    from triage_proxy.store.query import Filters

logger = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGES = {
    "overview": "Overview",
    "deadletters": "Dead letters",
    "deadletter": "Dead letter",
    "fleet": "Fleet",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SAMPLER: web.AppKey[Sampler] = web.AppKey("sampler", Sampler)
DEADLETTERS: web.AppKey[DeadLetters] = web.AppKey("deadletters", DeadLetters)
JOBS: web.AppKey[Jobs] = web.AppKey("jobs", Jobs)
AUTH: web.AppKey[Auth] = web.AppKey("auth", Auth)
SETTINGS: web.AppKey[Any] = web.AppKey("settings", object)


# --- pages ------------------------------------------------------------------------------


def _page(
    request: web.Request, page: str, *, status: int = 200, data: dict[str, str] | None = None
) -> web.Response:
    """A page shell: the nav, empty containers, and the scripts that fill them. Nothing
    from a record is in it; `data` values (ids the server checked) are escaped."""
    settings = request.app[SETTINGS]
    csrf = request.app[AUTH].csrf(request.cookies.get(COOKIE)) or ""
    attrs = "".join(
        f' data-{html.escape(k)}="{html.escape(v, quote=True)}"' for k, v in (data or {}).items()
    )
    title = PAGES[page]
    deployment = f"{settings.kafka.topic} · group {settings.kafka.group_id}"
    nav = "".join(
        f'<a href="/{name}"{" aria-current=page" if name == page else ""}>{label}</a>'
        for name, label in PAGES.items()
        if name != "deadletter"
    )
    body = (STATIC / f"{page}.html").read_text(encoding="utf-8")
    text = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<meta name="csrf-token" content="{html.escape(csrf, quote=True)}">
<title>{html.escape(title)} · Triage console</title>
<link rel="stylesheet" href="/static/vendor/uplot/uplot.min.css">
<link rel="stylesheet" href="/static/console.css">
<script src="/static/vendor/uplot/uplot.iife.min.js" defer></script>
<script src="/static/console.js" defer></script>
<script src="/static/{page}.js" defer></script>
</head><body data-page="{page}"{attrs}>
<header><strong>Triage console</strong><nav>{nav}</nav>
<span class="deployment">{html.escape(deployment)}</span></header>
<div id="banner" role="alert" hidden></div>
<main>{body}</main>
</body></html>
"""
    return web.Response(text=text, status=status, content_type="text/html")


def error_page(status: int, title: str, message: str) -> web.Response:
    """A page for an error: what is wrong and what to do, escaped; no script."""
    text = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<title>{status} {html.escape(title)}</title>
<link rel="stylesheet" href="/static/console.css"></head>
<body><header><strong>Triage console</strong><nav><a href="/overview">Overview</a>
<a href="/deadletters">Dead letters</a><a href="/fleet">Fleet</a></nav></header>
<main><h1>{status} {html.escape(title)}</h1><p class="error-message">{html.escape(message)}</p>
</main></body></html>
"""
    return web.Response(text=text, status=status, content_type="text/html")


def _is_api(request: web.Request) -> bool:
    return request.path.startswith("/api/")


def _error(request: web.Request, status: int, title: str, message: str) -> web.Response:
    if _is_api(request):
        return web.json_response(
            {"error": message, "status": status, "retriable": status == 503}, status=status
        )
    return error_page(status, title, message)


# --- middlewares --------------------------------------------------------------------------


@web.middleware
async def security_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers.update(SECURITY_HEADERS)
        raise
    response.headers.update(SECURITY_HEADERS)
    return response


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as a page or JSON saying what is wrong (never a traceback)."""
    from triage_proxy.errors import NotFoundError, TriageError, UnavailableError
    from triage_proxy.store.query import TableNotFound

    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(request, 404, "Not found", f"nothing at {request.path}")
    except web.HTTPMethodNotAllowed:
        return _error(request, 405, "Method not allowed", f"{request.method} {request.path}")
    except web.HTTPException:
        raise
    except TableNotFound as exc:
        return _error(request, 503, "Table missing", f"{exc}; waiting for it to come back")
    except NotFoundError as exc:
        return _error(request, 404, "Not found", str(exc))
    except UnavailableError as exc:
        return _error(request, 503, "Unavailable", f"{exc} (the page retries)")
    except (ValueError, TriageError) as exc:
        return _error(request, 400, "Bad request", str(exc))
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return _error(request, 500, "Internal error", "the console failed; see its log")


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Login by token, then the session cookie everywhere; POSTs need the CSRF token."""
    auth = request.app[AUTH]
    token = request.query.get(TOKEN_PARAM)
    if token is not None and request.method == "GET":
        session = auth.login(token)
        if session is None:
            return _error(
                request, 401, "Wrong token",
                "the login token is wrong: open the URL `triage console` printed",
            )  # fmt: skip
        rest = [(k, v) for k, v in request.query.items() if k != TOKEN_PARAM]
        response = _redirect(str(request.rel_url.with_query(rest)))
        response.set_cookie(COOKIE, session, httponly=True, samesite="Strict", path="/")
        return response
    session = request.cookies.get(COOKIE)
    if auth.csrf(session) is None:
        return _error(
            request, 401, "Log in",
            "no session: open the URL `triage console` printed (it holds the login token)",
        )  # fmt: skip
    if request.method not in ("GET", "HEAD"):
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            return _error(request, 403, "Refused", f"a request from {origin} is refused")
        if not auth.allows(session, request.headers.get(CSRF_HEADER)):
            return _error(
                request, 403, "Refused",
                f"missing or wrong CSRF token (the {CSRF_HEADER} header): reload the page",
            )  # fmt: skip
    return await handler(request)


# --- page handlers ----------------------------------------------------------------------


def _redirect(location: str) -> web.Response:
    return web.Response(status=302, headers={"Location": location})


async def root(request: web.Request) -> web.StreamResponse:
    return _redirect("/overview")


def page(name: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return _page(request, name)

    return handler


async def deadletter_page(request: web.Request) -> web.StreamResponse:
    from triage_proxy.errors import UnavailableError
    from triage_proxy.store.query import DeadLetterNotFound

    try:
        key = _key(request)
    except ValueError as exc:
        return error_page(404, "No such dead letter", str(exc))
    try:
        await asyncio.to_thread(request.app[DEADLETTERS].table.get, key)
    except DeadLetterNotFound as exc:
        return error_page(404, "No such dead letter", str(exc))
    except UnavailableError:
        pass  # the page shows the table's trouble and retries
    return _page(request, "deadletter", data={"id": key_text(key)})


def _key(request: web.Request) -> tuple[str, int, int]:
    info = request.match_info
    return parse_key(f"{info['topic']}/{info['partition']}/{info['offset']}")


# --- API handlers -----------------------------------------------------------------------


async def api_overview(request: web.Request) -> web.StreamResponse:
    sampler = request.app[SAMPLER]
    settings = request.app[SETTINGS]
    return web.json_response(
        {
            "deployment": {"topic": settings.kafka.topic, "group": settings.kafka.group_id},
            **sampler.latest(),
            "rates": sampler.history.last_rates(),
            "history": sampler.history.series(),
        }
    )


async def api_fleet(request: web.Request) -> web.StreamResponse:
    return web.json_response(request.app[SAMPLER].fleet())


def _filters(request: web.Request, source: Any = None) -> tuple[Filters, dict[str, Any]]:
    query = source if source is not None else request.query
    shown = {
        name: str(query.get(name) or "").strip()
        for name in ("partition", "reason", "since", "state")
    }
    filters = request.app[DEADLETTERS].filters(
        partition=shown["partition"] or None,
        reason=shown["reason"] or None,
        since=shown["since"] or None,
        state=shown["state"] or None,
    )
    return filters, {k: v for k, v in shown.items() if v}


async def api_list(request: web.Request) -> web.StreamResponse:
    filters, shown = _filters(request)
    after = request.query.get("after")
    size = request.query.get("size", "")
    deadletters = request.app[DEADLETTERS]
    found = await asyncio.to_thread(
        deadletters.page,
        filters,
        after=after or None,
        size=int(size) if size.isdigit() else 50,
    )
    return web.json_response({"items": found.items, "next": found.next, "filters": shown})


async def api_reasons(request: web.Request) -> web.StreamResponse:
    filters, _ = _filters(request)
    return web.json_response(await asyncio.to_thread(request.app[DEADLETTERS].reasons, filters))


async def api_count(request: web.Request) -> web.StreamResponse:
    filters, shown = _filters(request)
    count = await asyncio.to_thread(request.app[DEADLETTERS].count, filters)
    return web.json_response({"pending": count, "filters": shown})


async def api_item(request: web.Request) -> web.StreamResponse:
    key = _key(request)
    return web.json_response(await asyncio.to_thread(request.app[DEADLETTERS].detail, key))


async def api_payload(request: web.Request) -> web.StreamResponse:
    key = _key(request)
    return web.json_response(await asyncio.to_thread(request.app[DEADLETTERS].payload, key))


async def api_replay(request: web.Request) -> web.StreamResponse:
    key = _key(request)
    return web.json_response(await asyncio.to_thread(request.app[DEADLETTERS].replay_one, key))


async def api_discard(request: web.Request) -> web.StreamResponse:
    key = _key(request)
    return web.json_response(await asyncio.to_thread(request.app[DEADLETTERS].discard_one, key))


async def api_start_job(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except ValueError:
        raise ValueError("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")  # noqa: TRY004 - a 400, not a bug
    action = body.get("action")
    if action not in ("replay", "discard"):
        raise ValueError(f"action must be replay or discard, got {action!r}")
    filters, shown = _filters(request, body)
    job = request.app[JOBS].start(action, filters, shown)
    return web.json_response(job.to_json(), status=202)


async def api_job(request: web.Request) -> web.StreamResponse:
    job = request.app[JOBS].get(request.match_info["job"])
    if job is None:
        return _error(request, 404, "Not found", "no such job (the console may have restarted)")
    return web.json_response(job.to_json())


# --- the application --------------------------------------------------------------------


def make_app(
    settings: Settings,
    auth: Auth,
    *,
    interval_s: float,
    proxy_host: str | None = None,
    config: str = "<config>",
    state_dir: Path | None = None,
) -> web.Application:
    """The console for `settings`' deployment. The sampler starts with the app and stops
    (after the jobs, which are signalled first) when it is cleaned up."""
    app = web.Application(middlewares=[security_headers, errors, authenticate])
    deadletters = DeadLetters(settings)
    app[SETTINGS] = settings
    app[AUTH] = auth
    app[DEADLETTERS] = deadletters
    app[JOBS] = Jobs(deadletters)
    app[SAMPLER] = Sampler(
        settings, interval_s=interval_s, host=proxy_host, config=config, state_dir=state_dir
    )

    async def on_startup(app: web.Application) -> None:
        await app[SAMPLER].start()

    async def on_cleanup(app: web.Application) -> None:
        await app[JOBS].stop()
        await app[SAMPLER].stop()
        await asyncio.to_thread(app[DEADLETTERS].close)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    item = "/api/deadletters/item/{topic}/{partition}/{offset}"
    app.add_routes(
        [
            web.get("/", root),
            web.get("/overview", page("overview")),
            web.get("/deadletters", page("deadletters")),
            web.get("/fleet", page("fleet")),
            web.get("/deadletters/{topic}/{partition}/{offset}", deadletter_page),
            web.get("/api/overview", api_overview),
            web.get("/api/fleet", api_fleet),
            web.get("/api/deadletters", api_list),
            web.get("/api/deadletters/reasons", api_reasons),
            web.get("/api/deadletters/count", api_count),
            web.get(item, api_item),
            web.get(item + "/payload", api_payload),
            web.post(item + "/replay", api_replay),
            web.post(item + "/discard", api_discard),
            web.post("/api/jobs", api_start_job),
            web.get("/api/jobs/{job}", api_job),
            web.static("/static", STATIC, follow_symlinks=False),
        ]
    )
    return app
