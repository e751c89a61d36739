"""moto server for the embedded stack, with item ordering that does not grow slower per item.

    python -m triage_cli.motoserver -H 127.0.0.1 -p PORT     (moto.server's arguments)

moto answers every DynamoDB Query and Scan by sorting the whole table in Python, and it
sorts with `DynamoType` objects as keys: each comparison builds `Decimal`s for numbers
and runs four Python methods. On 100,000 dead letters one Query of the console's first
page took 3-9 s, most of it in those comparisons. This launcher replaces the two sort
keys (`Table.all_items` and `Table.sorted_items`) with the comparable values themselves
(`DynamoType.cast_value`, which is what `DynamoType`'s comparisons compare), so Python
sorts plain strings and Decimals in C. It also reads moto's list of its own modules once
(`cache_module_list`) instead of on every request. Nothing else about moto changes: the same items
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


def main(argv: list[str] | None = None) -> None:
    install()
    cache_module_list()
    from moto.server import main as moto_main

    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
