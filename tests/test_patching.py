"""The one replace/wrap/restore helper behind every megatron_tah patch."""

from __future__ import annotations

import types

import pytest

from megatron_tah.megatron.patching import MARKER, Patches, is_ours, resolve


class Base:
    def greet(self):
        return "base"


class Child(Base):
    def own(self):
        return "own"


def make_module():
    module = types.ModuleType("fake_megatron_module")
    module.func = lambda x: x + 1
    return module


def test_wrap_marks_keeps_original_and_is_idempotent():
    module, patches = make_module(), Patches()
    original = module.func
    patches.wrap(module, "func", lambda f: lambda x: f(x) * 10)
    wrapped = module.func
    assert module.func(1) == 20 and wrapped.__wrapped__ is original and getattr(wrapped, MARKER)
    Patches().wrap(module, "func", lambda f: lambda x: 0)  # already ours: left alone
    assert module.func is wrapped and is_ours(module.func)
    patches.restore()
    assert module.func is original and not is_ours(module.func)
    patches.restore()  # no-op
    assert not patches


def test_restore_is_exact_and_newest_first_for_inherited_and_own_class_attributes():
    patches = Patches()
    own = Child.__dict__["own"]
    patches.replace(Child, "greet", lambda self: "shim")
    patches.replace(Child, "own", lambda self: "shim")
    patches.replace(Child, "own", lambda self: "shim2")
    assert Child().greet() == "shim" and Child().own() == "shim2"
    patches.restore()
    assert "greet" not in Child.__dict__ and Child().greet() == "base"  # inherited again
    assert Child.__dict__["own"] is own


def test_string_owners_are_imported_and_missing_things_are_named():
    assert resolve("megatron_tah.megatron.patching:Patches") is Patches
    with pytest.raises(RuntimeError, match="needs no_such_module_xyz"):
        Patches().replace("no_such_module_xyz", "x", 1)
    with pytest.raises(RuntimeError, match=r"fake_megatron_module\.add_megatron_arguments not found"):
        Patches().wrap(make_module(), "add_megatron_arguments", lambda original: original)
    with pytest.raises(RuntimeError, match="has no NoSuchClass"):
        resolve("megatron_tah.megatron.patching:NoSuchClass")
