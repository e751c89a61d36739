"""moto server for the embedded stack: moto with cheaper sorts and item handling, same answers.

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
instead of on every request. Three of moto's steps cost time quadratic in an item's
attributes or a walk of the service model per value, and are replaced by linear ones:
making an item (`item_init`), projecting it on attribute names (`project`) and writing
its values into an answer (`fast_attribute_values`). Nothing else about moto changes: the
same items come back in the same order, with the same attributes and the same bytes
(tests/unit/test_motoserver.py checks the sorts against moto's own keys, and items,
projections and answers against moto's own), and the embedded stack still speaks
DynamoDB's HTTP API through moto.

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


def project(item: Any, projection_expressions: list[list[str]]) -> Any:
    """`Item.project` for a projection of top-level attribute names (what an index's
    projection and every ProjectionExpression Triage sends are): each named attribute
    converted once. moto's own converts the whole item to plain JSON once per name, so
    projecting an item of n attributes on m names cost n x m conversions, a third of
    each Query's CPU on dead-letter items. Any other projection (a nested path, a list
    element) goes to moto's own."""
    from moto.dynamodb.models.dynamo_type import Item, deserializer, serializer

    if not all(len(path) == 1 and "[" not in path[0] for path in projection_expressions):
        own = vars(Item).get("_triage_own_project", Item.project)
        return own(item, projection_expressions)
    attrs = item.attrs
    result: dict[str, Any] = {}
    for (name,) in projection_expressions:
        if name in attrs and name not in result:
            result[name] = deserializer.deserialize(attrs[name].to_regular_json())
    return Item(
        hash_key=item.hash_key,
        range_key=item.range_key,
        attrs=serializer.serialize(result)["M"],
    )


ITEM_SIZE_LIMIT = 405_000
"""Bytes of names and values above which moto refuses an item (`LimitedSizeDict`)."""


def item_init(item: Any, hash_key: Any, range_key: Any, attrs: dict[str, Any]) -> None:
    """`Item.__init__` that sizes each attribute once. moto's own stores attributes in a
    `LimitedSizeDict`, whose every insert sizes every attribute already in it, so making
    an item of n attributes sized n x n / 2 of them: half a Query's CPU on dead-letter
    items (each answer's items are made anew by its projection). The item is refused
    (ItemSizeTooLarge) exactly when moto's would be: its inserts refuse the first
    attribute that takes the running total over the limit, which happens if and only if
    the total of all of them is over it. An attribute name that is not a string goes to
    moto's own."""
    from moto.dynamodb.exceptions import ItemSizeTooLarge
    from moto.dynamodb.models.dynamo_type import DynamoType, Item, LimitedSizeDict
    from moto.dynamodb.models.utilities import bytesize

    if not all(type(name) is str for name in attrs):
        vars(Item).get("_triage_own_init", Item.__init__)(item, hash_key, range_key, attrs)
        return
    item.hash_key = hash_key
    item.range_key = range_key
    typed = LimitedSizeDict.__new__(LimitedSizeDict)
    dict.__init__(typed)
    total = 0
    for name, value in attrs.items():
        typed_value = DynamoType(value)
        total += bytesize(name) + typed_value.size()
        if total > ITEM_SIZE_LIMIT:
            raise ItemSizeTooLarge
        dict.__setitem__(typed, name, typed_value)
    item.attrs = typed


def install() -> None:
    """Give moto's `Table` the two sorts, `DynamoType` its equality and `Item` its
    constructor and projection (in this process only); idempotent."""
    from moto.dynamodb.models.dynamo_type import DynamoType, Item
    from moto.dynamodb.models.table import Table

    if getattr(Table, "_triage_sorts", False):
        return
    setattr(Item, "_triage_own_project", Item.project)  # noqa: B010
    setattr(Item, "project", project)  # noqa: B010
    setattr(Item, "_triage_own_init", Item.__init__)  # noqa: B010
    setattr(Item, "__init__", item_init)  # noqa: B010
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


ATTRIBUTE_VALUE = "AttributeValue"
"""DynamoDB's shape of one typed value ({"S": "text"}, {"N": "1"}, {"M": {...}}, ...)."""
ATTRIBUTE_VALUE_MEMBERS = ("S", "N", "B", "SS", "NS", "BS", "M", "L", "NULL", "BOOL")
"""Its members, in the service model's order (`fast_attribute_values` checks it)."""
_MEMBER_SET = frozenset(ATTRIBUTE_VALUE_MEMBERS)


def attribute_value_json(base64: Callable[[Any], str], value: Any) -> dict[str, Any] | None:
    """What moto's JSON serializer writes for `value` as an AttributeValue, or None for a
    value this function does not take (then moto's own path serializes it).

    moto's serializer walks the service model for every value: ten members looked up
    through five alias providers each, for every attribute of every item, which made it
    most of a Query's or Scan's CPU (90 ms of a 200-item answer). Items are plain dicts
    of exactly these members, so this writes them as the serializer would: strings and
    booleans as they are, blobs through the serializer's own `base64`, maps and lists
    member by member, in the model's order."""
    if type(value) is not dict or not value.keys() <= _MEMBER_SET:
        return None
    out: dict[str, Any] = {}
    for name in ATTRIBUTE_VALUE_MEMBERS:
        member = value.get(name)
        if member is None:
            continue
        if name == "S" or name == "N":
            if type(member) is not str:
                return None
            out[name] = member
        elif name == "B":
            if not isinstance(member, (str, bytes)):
                return None
            out[name] = base64(member)
        elif name == "SS" or name == "NS":
            if type(member) is not list or any(type(x) is not str for x in member):
                return None
            out[name] = list(member)
        elif name == "BS":
            if type(member) is not list or not all(isinstance(x, (str, bytes)) for x in member):
                return None
            out[name] = [base64(x) for x in member]
        elif name == "M":
            if type(member) is not dict:
                return None
            entries: dict[str, Any] = {}
            for key, entry in member.items():
                written = attribute_value_json(base64, entry)
                if written is None:
                    return None
                entries[key] = written
            out[name] = entries
        elif name == "L":
            if type(member) is not list:
                return None
            elements: list[Any] = []
            for element in member:
                written = attribute_value_json(base64, element)
                if written is None:
                    return None
                elements.append(written)
            out[name] = elements
        else:  # NULL, BOOL
            if type(member) is not bool:
                return None
            out[name] = member
    return out


def fast_attribute_values() -> None:
    """Have moto's JSON serializer write AttributeValues with `attribute_value_json` (in
    this process only); idempotent. Left as it is when the service model's AttributeValue
    is not the one this module knows."""
    from moto.core.serialize import BaseJSONSerializer
    from moto.core.utils import get_service_model

    own = BaseJSONSerializer._serialize_type_structure
    if getattr(own, "_triage_fast", False):
        return
    shape = get_service_model("dynamodb").shape_for(ATTRIBUTE_VALUE)
    if tuple(shape.members) != ATTRIBUTE_VALUE_MEMBERS:
        return

    def serialize_structure(self: Any, serialized: Any, value: Any, shape: Any, key: str) -> None:
        if key and shape.name == ATTRIBUTE_VALUE:
            transformers = getattr(self._value_picker, "response_transformers", None)
            written = None if transformers else attribute_value_json(self._base64, value)
            if written is not None:
                self._default_serialize(serialized, written, shape, key)
                return
        own(self, serialized, value, shape, key)

    setattr(serialize_structure, "_triage_fast", True)  # noqa: B010
    setattr(BaseJSONSerializer, "_serialize_type_structure", serialize_structure)  # noqa: B010


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
    from triage_proxy.gctuning import freeze_startup_heap, set_collection_policy

    args = list(argv if argv is not None else sys.argv[1:])
    access_log = NO_ACCESS_LOG not in args
    args = [a for a in args if a != NO_ACCESS_LOG]
    set_collection_policy()  # the proxy's (gctuning.py): this server keeps every item too
    install()
    cache_module_list()
    cache_method_names()
    fast_attribute_values()
    serve_keep_alive(access_log)
    from moto.server import main as moto_main

    freeze_startup_heap()
    moto_main(args)


if __name__ == "__main__":
    main()
