"""`--dist loadgroup` (pyproject's addopts) really groups: a test marked xdist_group runs
under a node id that carries its group, which is what the scheduler keys on.

pytest 9.2 with pytest-xdist 3.8 (pytest-dev/pytest-xdist#1386) dropped the suffix without
a word: every group's tests spread over all workers, the Spark module's JVM started once
per worker and the CPU-heavy tests waited on each other's lock on every worker, minutes
more for the whole run. pyproject.toml keeps pytest below 9.2 until that is fixed.
"""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("typescript")
def test_a_grouped_test_carries_its_group_under_loadgroup(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker under --dist loadgroup (e.g. -n 0)")
    assert request.node.nodeid.endswith("@typescript"), (
        f"{request.node.nodeid}: --dist loadgroup is not grouping with this pytest and "
        "pytest-xdist (see pyproject.toml's pin)"
    )
