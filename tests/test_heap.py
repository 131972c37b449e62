"""Loading runs without a full garbage collection and freezes what it loaded (gemmaspec.heap)."""

import gc

from gemmaspec.heap import startup_heap


def test_startup_heap_restores_the_collector_and_freezes():
    assert gc.isenabled()
    gc.unfreeze()
    try:
        with startup_heap():
            assert not gc.isenabled()
            with startup_heap():  # nested (the CLI's load around load_engine's): still off inside
                assert not gc.isenabled()
            assert not gc.isenabled()
            kept = [[] for _ in range(100)]
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
        gc.disable()
        with startup_heap():
            pass
        assert not gc.isenabled()  # left as it was found
        gc.enable()
    finally:
        gc.unfreeze()
        gc.enable()


def test_startup_heap_restores_after_an_error():
    try:
        with startup_heap():
            raise ValueError("bad model")
    except ValueError:
        pass
    assert gc.isenabled()
    gc.unfreeze()
