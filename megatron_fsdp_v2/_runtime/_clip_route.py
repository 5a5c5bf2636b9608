"""The route torch's ``clip_grad_norm_`` and ``get_total_norm`` take once patched
(``_torch_patches/_clip_grad.py``): to this library's clipping (``_clipping.py``) for lists of
fully_shard parameters or gradients, to torch's own function (passed in) otherwise."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _registry
from .._dtensor._uneven_meshes import mesh_is_registered
from ._clipping import clip_grad_norm_, get_total_norm

__all__ = ["routed_clip_grad_norm_", "routed_get_total_norm"]


# [Note: torch clip_grad_norm_ route]
# ``torch.nn.utils.clip_grad_norm_`` on fully_shard parameters cannot work by itself: it drops
# parameters whose ``.grad`` is None, and a rank whose shard of a parameter is empty (or who did
# not use it) has None there, so ranks stack different numbers of partial norms and the
# all-reduce DTensor issues mismatches (gloo aborts, NCCL hangs or mixes data). So the first
# fully_shard call replaces ``torch.nn.utils.clip_grad_norm_`` (both the ``torch.nn.utils``
# and ``torch.nn.utils.clip_grad`` attributes; ``_torch_patches/_clip_grad.py``, which
# ``_registry.reset`` undoes) with a wrapper (:func:`routed_clip_grad_norm_`) that sends a list
# holding any fully_shard parameter to ``megatron_fsdp_v2.clip_grad_norm_`` with every argument
# as given (any p-norm, ``error_if_nonfinite``, ``foreach``; its collectives depend on the
# parameters only, see [Note: clipping collectives]) and anything else to torch's function
# unchanged. The decision is taken from the parameters, before any collective, so it is the
# same on every rank given the same list. An empty list (say, filtered by ``p.grad is not
# None`` on a rank whose shards are all empty) holds no fully_shard parameter and goes to
# torch's function, which issues nothing while the peers all-reduce: pass
# ``model.parameters()`` unfiltered, or call ``megatron_fsdp_v2.clip_grad_norm_``, which
# handles that case.
#
# ``torch.nn.utils.get_total_norm`` (torchtitan's clipping: the norm of ``[p.grad for p in
# params if p.grad is not None]``, then ``torch.nn.utils.clip_grads_with_norm_``, which is
# local and works on our gradients as it is) is replaced likewise: a list holding a DTensor on a
# fully_shard mesh goes to ``megatron_fsdp_v2.utils.get_total_norm`` (see [Note: total norm of
# gradient lists]), which all-reduces on every library group whatever the list holds; a list
# holding no such DTensor (empty, FSDP2's or tensor parallelism's DTensors, plain tensors) goes
# to torch's, so code that has nothing to do with the model (``get_total_norm([])`` on one rank)
# issues no collective over the library's groups. A rank's filtered list
# (``[p.grad for p in params if p.grad is not None]``) is never empty while its peers' are not:
# every rank holds a gradient of every parameter any rank used, with zero rows where its shard
# is empty. A name bound before the first fully_shard call (``from
# torch.nn.utils import clip_grad_norm_``) keeps torch's function.

def routed_clip_grad_norm_(
    torch_fn: Callable[..., torch.Tensor], parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``clip_grad_norm_`` by the route of the note: ours for a list holding a fully_shard
    parameter, ``torch_fn`` (torch's function) otherwise."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not any(_registry.record_of(p) is not None for p in params):
        return torch_fn(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


def _is_library_gradient_list(tensors: list[torch.Tensor]) -> bool:
    """Whether ``get_total_norm`` of ``tensors`` is ours (see the note above): decided from the
    DTensors' meshes and placements, before any collective; a list without them is torch's."""
    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    if any(
        not mesh_is_registered(t.device_mesh)
        or not all(isinstance(pl, (Shard, Replicate)) for pl in t.placements)
        for t in dtensors
    ):
        return False
    return bool(dtensors)


def routed_get_total_norm(
    torch_fn: Callable[..., torch.Tensor], tensors: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None,
) -> torch.Tensor:
    """``get_total_norm`` by the route of the note: ours for our gradient lists, ``torch_fn``
    (torch's function) otherwise."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not _is_library_gradient_list(tensors):
        return torch_fn(tensors, norm_type, error_if_nonfinite, foreach)
    return get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
