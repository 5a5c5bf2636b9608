"""Importing the package has no effect on torch (no global optimizer hooks); the registry
forgets everything on ``reset``."""

from __future__ import annotations


def test_import_installs_no_optimizer_hooks(fresh_python) -> None:
    code = (
        "import torch.optim.optimizer as o\n"
        "before = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "import megatron_fsdp_v2\n"
        "after = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "assert before == after, (before, after)\n"
    )
    fresh_python.run(code)


def test_reset_forgets_hooks_and_caches() -> None:
    import torch.optim.optimizer as o

    from megatron_fsdp_v2 import _registry
    from megatron_fsdp_v2._runtime import _optimizer_hooks

    before = len(o._global_optimizer_pre_hooks)
    _optimizer_hooks.note_wrap()  # what the first fully_shard call does
    assert len(o._global_optimizer_pre_hooks) == before + 1
    _optimizer_hooks.note_wrap()  # installed once
    assert len(o._global_optimizer_pre_hooks) == before + 1
    _registry.reset()
    assert len(o._global_optimizer_pre_hooks) == before
    assert not _registry.optimizer_hook_handles and _registry.wrap_generation == [0]
