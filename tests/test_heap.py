"""The start-up heap frozen out of the cyclic garbage collector's passes (``teacher_server.heap``):
a full collection then walks only what was made after start-up; the server freezes its process
once the engine is ready and gives the objects back when it stops."""

from __future__ import annotations

import gc
import weakref

from conftest import LiveServer

from teacher_server.heap import freeze_start_up_heap, thaw_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # (reference counting alone never frees these)
    return weakref.ref(a)


def test_frozen_objects_are_left_alone_and_later_cycles_still_collected() -> None:
    try:
        before = _cycle()  # garbage at the freeze: the collection before it frees it
        n = freeze_start_up_heap("test")
        assert n > 1000 and before() is None  # (other threads may free frozen objects meanwhile: no equality)
        later = _cycle()
        assert later() is not None
        gc.collect()
        assert later() is None  # made after the freeze: the collector still sees it
        kept = _Node()
        kept.other = kept
        ref = weakref.ref(kept)
        freeze_start_up_heap("test")  # a second call: the new objects join the frozen ones
        assert gc.get_freeze_count() > n // 2
        del kept
        gc.collect()
        assert ref() is not None  # frozen: its cycle is not looked at
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # given back: collected


def test_server_freezes_once_ready_and_thaws_when_it_stops(tmp_path) -> None:
    from teacher_server.config import Config

    thaw_heap()
    cfg = Config(demo_model_dir=str(tmp_path / "m"), device="cpu", max_num_batched_tokens=256, num_kv_blocks=256,
                 max_model_len=1024)
    with LiveServer(cfg) as s:
        assert gc.get_freeze_count() > 1000
        with s.client() as c:
            r = c.post("/inference/v1/generate", json={"token_ids": [1, 2, 3, 4], "sampling_params": {
                "max_tokens": 1, "prompt_logprobs": 1}})
            assert r.status_code == 200, r.text
    assert gc.get_freeze_count() == 0
