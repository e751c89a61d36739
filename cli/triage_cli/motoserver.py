"""moto server for the embedded stack, with item ordering that does not grow slower per item.

    python -m triage_cli.motoserver [--no-access-log] -H 127.0.0.1 -p PORT
                                    (then moto.server's arguments)

moto answers every DynamoDB Query and Scan by sorting the whole table in Python, and it
sorts with `DynamoType` objects as keys: each comparison builds `Decimal`s for numbers
and runs four Python methods. On 100,000 dead letters one Query of the console's first
page took 3-9 s, most of it in those comparisons. This launcher replaces the two sort
keys (`Table.all_items` and `Table.sorted_items`) with the comparable values themselves
(`DynamoType.cast_value`, which is what `DynamoType`'s comparisons compare), so Python
sorts plain strings and Decimals in C. It also reads moto's list of its own modules once
(`cache_module_list`), and each response class's method names once (`cache_method_names`),
instead of on every request. Nothing else about moto changes: the same items
come back in the same order (tests/unit/test_motoserver.py checks both against moto's own
keys), and the embedded stack still speaks DynamoDB's HTTP API through moto.

Key attributes have one declared type (S, N or B), which is why comparing cast values
equals comparing `DynamoType`s there: `DynamoType.__eq__` also compares the type, which
can only differ between attributes of different declared types.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any


def native(value: Any) -> Any:
    """What `DynamoType`'s comparisons compare (`cast_value`), without its chain of type
    tests for the three key types: Decimal for N, the value itself for S and B."""
    kind = value.type
    if kind == "S" or kind == "B":
        return value.value
    if kind == "N":
        return Decimal(value.value)
    return value.cast_value


def sort_key_all_items(item: Any) -> Any:
    """`Table.all_items`'s order (hash key, then range key when the table has one)."""
    if item.range_key is not None:
        return (native(item.hash_key), native(item.range_key))
    return native(item.hash_key)


def sort_key_by(attributes: Sequence[str]) -> Callable[[Any], tuple[Any, ...]]:
    """`Table.sorted_items`'s order: the named attributes' values, in turn."""

    def key(item: Any) -> tuple[Any, ...]:
        attrs = item.attrs
        return tuple([native(attrs[name]) for name in attributes])

    return key


def equal(self: Any, other: Any) -> bool:
    """`DynamoType.__eq__` (same type, same cast value), comparing S and B values as they
    are instead of through `cast_value`."""
    kind = self.type
    if kind != other.type:
        return False
    if kind == "S" or kind == "B":
        return bool(self.value == other.value)
    return bool(self.cast_value == other.cast_value)


def not_equal(self: Any, other: Any) -> bool:
    """`DynamoType.__ne__`, the negation of `equal`."""
    return not equal(self, other)


def all_items(table: Any) -> list[Any]:
    """`Table.all_items` with native sort keys: every item, by hash key then range key."""
    items: list[Any] = []
    for hash_set in table.items.values():
        if table.range_key_attr:
            items.extend(hash_set.values())
        else:
            items.append(hash_set)
    items.sort(key=sort_key_all_items)
    return items


def sorted_items(
    table: Any,
    hash_key_attrs: list[str],
    range_key_attrs: list[str | None],
    items: list[Any],
) -> list[Any]:
    """`Table.sorted_items` with native sort keys (an index's keys, then the table's)."""
    attributes = table._generate_attr_to_sort_by(hash_key_attrs, range_key_attrs)
    items.sort(key=sort_key_by(attributes))
    return items


def install() -> None:
    """Give moto's `Table` the two sorts (in this process only); idempotent."""
    from moto.dynamodb.models.dynamo_type import DynamoType
    from moto.dynamodb.models.table import Table

    if getattr(Table, "_triage_sorts", False):
        return
    setattr(DynamoType, "__eq__", equal)  # noqa: B010
    setattr(DynamoType, "__ne__", not_equal)  # noqa: B010
    setattr(Table, "all_items", all_items)  # noqa: B010 (mypy refuses a method assignment)
    setattr(Table, "sorted_items", sorted_items)  # noqa: B010
    setattr(Table, "_triage_sorts", True)  # noqa: B010


def cache_module_list() -> None:
    """moto's server lists its own package folder (`os.listdir` and an `isdir` per entry)
    on every request, to see whether the Host names a backend: a tenth of its CPU per
    DynamoDB call in a profile of the test suite. The folder does not change while the
    server runs, so the list is read once (in this process only); idempotent."""
    from moto import backends

    listed = backends.list_of_moto_modules
    if getattr(listed, "_triage_cached", False):
        return
    modules = tuple(listed())

    def cached() -> tuple[str, ...]:
        return modules

    setattr(cached, "_triage_cached", True)  # noqa: B010
    setattr(backends, "list_of_moto_modules", cached)  # noqa: B010


def cache_method_names() -> None:
    """moto lists a response class's methods (`inspect.getmembers`, every attribute of the
    class and its bases) on every request, to see whether the action is one of them: a
    twentieth of its CPU per DynamoDB call. Classes do not change while the server runs,
    so each class's list is made once (in this process only); idempotent."""
    import functools

    from moto.core import responses

    listed = responses.method_names_from_class
    if getattr(listed, "_triage_cached", False):
        return
    cached = functools.cache(listed)
    setattr(cached, "_triage_cached", True)  # noqa: B010
    setattr(responses, "method_names_from_class", cached)  # noqa: B010


NO_BODY_STATUSES = frozenset({204, 304})
"""Answers that never carry a body, so never a Content-Length of their own."""


def keep_alive_handler(access_log: bool = True) -> type[Any]:
    """moto's request handler (werkzeug's) that keeps a client's connection open between
    requests instead of closing it after each answer.

    werkzeug's development server answers every request with `Connection: close`: it
    cannot tell where an unread request body ends, so it drains the socket and closes.
    Left so, every AWS call of every client pays a new TCP connection and a new server
    thread, and the server spends a fifth of its CPU accepting connections and starting
    threads. This handler reads a request's whole body first (its Content-Length: botocore
    always sends one, or none for no body), runs moto's WSGI app on that, answers with a
    Content-Length, and reads the next request from the same connection (HTTP/1.1
    keep-alive; one thread per connection). A chunked or `Expect: 100-continue` request
    has no length to read up to, so it goes through werkzeug's own path, which closes the
    connection after it. Answers go out through `send_response`, which writes the access
    log line of each request, as moto's own handler does, unless `access_log` is False
    (formatting and writing each line is a tenth of moto's CPU per DynamoDB call)."""
    import io

    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.exceptions import InternalServerError

    # moto is not followed by mypy (pyproject.toml: ~700 modules per run), so its base
    # class is Any here.
    class KeepAliveHandler(MotoRequestHandler):  # type: ignore[misc]
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            if access_log:
                super().log_request(code, size)

        def run_wsgi(self) -> None:
            headers = self.headers
            if "chunked" in headers.get("Transfer-Encoding", "").lower() or headers.get("Expect"):
                super().run_wsgi()
                return
            body = self.rfile.read(int(headers.get("Content-Length") or 0))
            environ = self.make_environ()
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            self.environ = environ
            answer: list[Any] = []

            def start_response(status: str, response_headers: Any, exc_info: Any = None) -> Any:
                answer[:] = [status, response_headers]
                return lambda data: None  # moto's app returns its body, never writes

            try:
                chunks = self.server.app(environ, start_response)
                try:
                    data = b"".join(chunks)
                finally:
                    if hasattr(chunks, "close"):
                        chunks.close()
            except Exception as exc:  # noqa: BLE001 (as werkzeug does: log it, answer 500)
                self.server.log("error", f"Error on request: {exc!r}")
                chunks = InternalServerError()(environ, start_response)
                data = b"".join(chunks)
                self.close_connection = True
            status, response_headers = answer
            code_text, _, message = status.partition(" ")
            code = int(code_text)
            self.send_response(code, message)
            sent_length = False
            for key, value in response_headers:
                if key.lower() == "connection":
                    continue
                sent_length = sent_length or key.lower() == "content-length"
                self.send_header(key, value)
            if not sent_length and code >= 200 and code not in NO_BODY_STATUSES:
                self.send_header("Content-Length", str(len(data)))
            # Headers and body in one write: a second small write on a kept-alive
            # connection would wait for the client's delayed ACK (Nagle), ~40 ms a call.
            self._headers_buffer.append(b"\r\n")
            if data and self.command != "HEAD":
                self._headers_buffer.append(data)
            self.flush_headers()

    return KeepAliveHandler


def serve_keep_alive(access_log: bool = True) -> None:
    """Have moto's server use `keep_alive_handler`, and not wait for the threads of
    open connections when it stops (in this process only)."""
    import moto.server
    from werkzeug.serving import ThreadedWSGIServer

    setattr(moto.server, "MotoRequestHandler", keep_alive_handler(access_log))  # noqa: B010
    # Idle keep-alive connections each hold a thread blocked on a read: a stop must not
    # wait for them (the threads are daemons; werkzeug's server would join them).
    setattr(ThreadedWSGIServer, "block_on_close", False)  # noqa: B010


NO_ACCESS_LOG = "--no-access-log"
"""This launcher's own option (the rest are moto.server's): write no line per request, for
a server whose output nobody reads."""


def main(argv: list[str] | None = None) -> None:
    args = list(argv if argv is not None else sys.argv[1:])
    access_log = NO_ACCESS_LOG not in args
    args = [a for a in args if a != NO_ACCESS_LOG]
    install()
    cache_module_list()
    cache_method_names()
    serve_keep_alive(access_log)
    from moto.server import main as moto_main

    moto_main(args)


if __name__ == "__main__":
    main()
