"""`mmrl.heap`: the garbage collector paused around a process's heavy imports, then the heap frozen."""

from __future__ import annotations

import gc

import pytest

from mmrl.heap import imports_without_gc


@pytest.fixture()
def collector():
    """The collector enabled, nothing frozen, and left as found (tests/conftest.py freezes the
    test process's heap once collected)."""
    was, frozen = gc.isenabled(), gc.get_freeze_count() > 0
    gc.enable()
    gc.unfreeze()
    yield
    (gc.enable if was else gc.disable)()
    if frozen:
        gc.freeze()


def test_the_collector_is_paused_inside_then_back_with_what_was_built_frozen(collector):
    with imports_without_gc():
        assert not gc.isenabled()
        built = [[k] for k in range(1000)]  # lists: objects the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(built)


def test_an_error_inside_still_turns_the_collector_back_on(collector):
    with pytest.raises(ImportError), imports_without_gc():
        raise ImportError("no such module")
    assert gc.isenabled()


def test_a_nested_block_leaves_it_to_the_outermost_and_a_disabled_collector_stays_so(collector):
    with imports_without_gc():
        with imports_without_gc():
            pass
        assert not gc.isenabled() and gc.get_freeze_count() == 0  # the inner block froze nothing
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.disable()
    with imports_without_gc():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0  # someone else's choice, kept


def test_tests_run_with_the_collector_on_and_the_collected_heap_frozen():
    """tests/conftest.py keeps the collector off while the test process imports and collects,
    then freezes that heap and turns it back on: every test runs with it on."""
    assert gc.isenabled()
    assert gc.get_freeze_count() > 100_000  # torch, transformers and the test modules
