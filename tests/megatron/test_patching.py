"""The one replace/wrap/restore helper behind every megatron_tah patch."""

from __future__ import annotations

import types

import pytest

from megatron_tah.megatron.patching import MARKER, Entry, Patches, is_ours, resolve


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


def test_entries_say_what_is_replaced_how_why_and_by_whom_until_restored():
    module, patches = make_module(), Patches()
    patches.wrap(module, "func", lambda f: lambda x: f(x) * 10, why="ten times")
    patches.replace(Child, "greet", lambda self: "shim", why="a greeting")
    assert patches.entries() == [Entry("fake_megatron_module.func", "wraps", "ten times", __name__),
                                 Entry(f"{__name__}.Child.greet", "replaces", "a greeting", __name__)]
    Patches().wrap(module, "func", lambda f: f, why="again")  # already ours: nothing replaced, nothing listed
    patches.restore()
    assert patches.entries() == []


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


def test_the_patches_page_is_the_generated_one_and_every_patch_says_why():
    """docs/PATCHES.md is what ``scripts/write_patches.py`` writes from the installers (every megatron-core and
    Megatron-LM attribute they replace, with its line), and every ``wrap`` / ``replace`` call of the patch layer
    gives its line (``why=``), so a patch made only while a run goes on is on the page too."""
    from scripts import write_patches

    calls = write_patches.patch_calls()
    assert len(calls) > 30 and not [c for c in calls if c.why == ""]
    assert not [e for entries in write_patches.installed_entries().values() for e in entries if not e.why]
    page = write_patches.page()
    assert write_patches.PAGE.read_text() == page, "docs/PATCHES.md is stale: run python scripts/write_patches.py"
    for target in ("megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops",
                   "megatron.training.training.training_log", "megatron.training.arguments.validate_args",
                   "megatron.core.distributed.param_and_grad_buffer._coalescing_manager"):
        assert f"`{target}`" in page, target
    assert all(f"| {c.why} |" in page for c in calls if c.why is not None)
