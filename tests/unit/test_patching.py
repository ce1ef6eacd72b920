"""patching.Patches: the one mechanism the flight record and the step watcher wrap torch's functions with."""

from __future__ import annotations

import types

from cpdoctor.patching import Patches


def test_wrapped_then_restored_in_reverse_order():
    owner = types.SimpleNamespace(f=lambda x: x + 1)
    original = owner.f
    first, second = Patches(), Patches()
    assert first.wrap(owner, "f", lambda inner: lambda x: inner(x) * 10)
    assert second.wrap(owner, "f", lambda inner: lambda x: inner(x) - 1)
    assert owner.f(1) == 19 and first and second
    second.restore()
    assert owner.f(1) == 20
    first.restore()
    assert owner.f is original and not first


def test_an_outer_wrapper_installed_meanwhile_is_never_removed():
    # the flight record disarmed while the step watcher's wrapper sits over its own: the watcher's stays
    owner = types.SimpleNamespace(f=lambda: "torch")
    flight, watcher = Patches(), Patches()
    flight.wrap(owner, "f", lambda inner: lambda: "flight>" + inner())
    watcher.wrap(owner, "f", lambda inner: lambda: "watcher>" + inner())
    flight.restore()
    assert owner.f() == "watcher>flight>torch"
    watcher.restore()
    assert owner.f() == "flight>torch"


def test_a_class_attribute_is_read_from_its_own_dict_and_an_inherited_one_is_left():
    # wrapping Sub.m where only Base defines m would plant a copy of Base's on Sub that outlives the restore order
    class Base:
        def m(self) -> str:
            return "m"

    class Sub(Base):
        pass

    patches = Patches()
    assert not patches.wrap(Sub, "m", lambda inner: inner) and "m" not in Sub.__dict__
    assert patches.wrap(Base, "m", lambda inner: lambda self: "wrapped " + inner(self))
    assert Sub().m() == "wrapped m" and Base.m.__name__ == "m"
    patches.restore()
    assert Sub().m() == "m" and "m" not in Sub.__dict__
