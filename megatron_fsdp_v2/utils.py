"""Training helpers that understand sharded DTensor gradients: ``clip_grad_norm_`` and
``get_total_norm`` for fully_shard parameters (implemented in ``_runtime/_clipping.py``)."""

from __future__ import annotations

from ._runtime._clipping import clip_grad_norm_, get_total_norm

__all__ = ["clip_grad_norm_", "get_total_norm"]
