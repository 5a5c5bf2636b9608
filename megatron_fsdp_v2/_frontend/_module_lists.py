"""``fully_shard([m1, m2, ...])``: several modules as one unit (FSDP2's list argument), checked and
held by one internal module the unit state is built over.

[Note: several modules as one unit]
FSDP2 accepts a list of modules as one unit: one flat group (one gather, one reduction),
its state shared by every module of the list, its hooks on each of them, and each module's
class changed to ``FSDP<Class>``. torchtitan relies on it for ``fully_shard([model.norm,
model.output], reshard_after_forward=False)``, where its chunked loss calls the head outside
the model's forward, after the root's forward has returned.

Here the unit is built over a :class:`UnitModules` (an ``nn.ModuleList`` of the members, never
part of the model and never called): everything that walks a unit's modules (its registered
parameters, buffers, the cross-rank signature) walks the members through it, and the parameter
names of the unit are ``"<index>.<name>"``. The unit state is registered for the holder and
for each member (so the root's wrap leaves their parameters alone, ``state_of(member)`` and
``isinstance(member, FSDPModule)`` hold, and state-dict hooks on each member find it), and
the forward hooks are on each member: each call of a member gathers the unit's weights if they
are not gathered (ZeRO-3) and registers its post-backward on its inputs; the unit counts every
call of every member, so its gradients are reduced once, after the backward of the last call
to finish, whichever member it was (FSDP2 reduces once per call instead). With
``reshard_after_forward=False`` the gathered weights stay from the first member's forward to
the backward, so the head called after the root's forward gathers nothing. Each member keeps
its own parent in the model; nothing may nest (one member inside another is a ``ValueError``).
Members built on the meta device (torchtitan's flow) are materialized with the root's pass,
in construction order, since the holder is never in a model's tree (``_pass_roots`` in
``_init/_materialize.py``), or left to ``to_empty`` and the user's init.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from .. import _registry

__all__ = ["UnitModules", "members_of", "resolve_modules_argument"]


class UnitModules(nn.ModuleList):
    """The members of a unit wrapped from a list of modules (see [Note: several modules as one
    unit]); internal, never called."""

    def forward(self, *args: object, **kwargs: object) -> None:  # pragma: no cover - guard
        raise RuntimeError(
            "the modules of a fully_shard([...]) unit are called one by one, by the model"
        )


def resolve_modules_argument(module: object) -> tuple[nn.Module, list[nn.Module] | None]:
    """The module the unit is built over, and the members when ``module`` is a list or tuple of
    modules (``None`` for a single module). ``TypeError``/``ValueError`` for a bad list; no
    collective."""
    if not isinstance(module, (list, tuple)):
        return module, None  # type: ignore[return-value]
    members = list(module)
    if not members:
        raise ValueError("fully_shard of an empty list: pass at least one module")
    for index, member in enumerate(members):
        if not isinstance(member, nn.Module):
            raise TypeError(
                f"fully_shard of a list: item {index} is a {type(member).__name__}, not an "
                "nn.Module; pass a module or a list of modules"
            )
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            if i != j and any(m is b for m in a.modules()):
                what = "twice" if a is b else f"inside item {i} ({type(a).__name__})"
                raise ValueError(
                    f"fully_shard of a list: item {j} ({type(b).__name__}) is {what}; list "
                    "each module once and none inside another (a module's submodules belong "
                    "to its unit anyway)"
                )
    for index, member in enumerate(members):
        if _registry.state_of(member) is not None:
            raise ValueError(
                f"fully_shard of a list: item {index} ({type(member).__name__}) is already "
                "wrapped by fully_shard; wrap each module once"
            )
    return UnitModules(members), members


def members_of(module: nn.Module, members: Sequence[nn.Module] | None) -> list[nn.Module]:
    """The modules that carry the unit's hooks, state and ``FSDP<Class>``."""
    return list(members) if members is not None else [module]
