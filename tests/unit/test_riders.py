"""Riders: flags carried by another component's all-reduce (one process: the group is
the same object, so no process group is needed to match it)."""

from __future__ import annotations

from steadfast import riders
from steadfast.riders import Rider


def test_a_carried_slot_is_up_when_any_rider_is_and_each_takes_the_count_once() -> None:
    up = {"a": False, "b": False}
    a, b = Rider(lambda: up["a"]), Rider(lambda: up["b"])
    try:
        assert a.take() is None  # nothing carried it yet: agree another way
        first = riders.carry()
        assert first.up == 0.0
        first.deliver(0.0)
        up["b"] = True
        second = riders.carry()
        assert second.up == 1.0
        second.deliver(3.0)  # the slot's sum over the ranks
        assert a.take() == 3 and b.take() == 3  # the largest since the last take
        assert a.take() is None
    finally:
        a.close()
        b.close()
    assert riders.carry().up == 0.0  # left: the slot stays, empty


def test_a_rider_over_another_group_is_not_carried() -> None:
    other = object()  # a group that is not the world
    r = Rider(lambda: True, other)
    try:
        assert riders.carry().up == 0.0
        assert riders.carry(other).up == 1.0
    finally:
        r.close()
