"""What optimizers that need whole matrices use on ``fully_shard`` parameters.

``torch.optim.Muon`` needs nothing from here: its step on managed parameters runs with each
matrix orthogonalized whole on one rank (see [Note: distributed Muon] in
``_runtime/_muon.py``). A matrix optimizer of your own (a Shampoo-style preconditioner, an
exact polar factor, a spectral norm) uses :class:`WholeMatrices` the same way Muon does::

    plan = WholeMatrices(params)                     # once: owners, balanced, no collective
    wholes = plan.to_owners([p.grad for p in params])  # one all-to-all per process group
    results = {i: my_update(w) for i, w in wholes.items()}   # whole matrices this rank owns
    rows = plan.from_owners(results)                 # this rank's rows of every result
    for p, r in zip(params, rows):
        p.to_local().add_(r, alpha=-lr)

``examples/whole_matrix_optimizer.py`` is a complete, tested optimizer written this way (see
[Note: whole-matrix exchange] in ``_runtime/_whole_matrices.py`` for the plan and its costs).
"""

from __future__ import annotations

from ._runtime._whole_matrices import WholeMatrices, newton_schulz_flops

__all__ = ["WholeMatrices", "newton_schulz_flops"]
