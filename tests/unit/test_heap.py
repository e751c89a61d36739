"""The proxy process's GC policy (gctuning.py): what each call leaves behind."""

from __future__ import annotations

import asyncio
import gc

from triage_proxy.gctuning import YOUNG_THRESHOLD, freeze_when_ready, set_collection_policy


def test_collection_policy_raises_only_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        set_collection_policy()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.set_threshold(*before)


def test_the_heap_is_frozen_once_ready_and_not_before() -> None:
    async def scenario() -> tuple[int, int]:
        ready = asyncio.Event()
        task = asyncio.create_task(freeze_when_ready(ready))
        await asyncio.sleep(0)
        waiting = gc.get_freeze_count()
        ready.set()
        await task
        return waiting, gc.get_freeze_count()

    gc.unfreeze()
    try:
        waiting, frozen = asyncio.run(scenario())
        assert waiting == 0
        assert frozen > 0
    finally:
        gc.unfreeze()
