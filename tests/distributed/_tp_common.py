"""What the FSDP x TP test files share: a tiny tensor-parallel language model (row-wise
embedding, two blocks of colwise/rowwise Linears with a sequence-parallel LayerNorm, a
sequence-parallel final norm and a colwise head), its TP plan, the dp x tp mesh, the three ways
of training it (fully_shard, FSDP2 as control, single process), and full-value comparisons."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from megatron_fsdp_v2 import clip_grad_norm_, fully_shard

from _models import all_ranks_ok

# Odd TP-local row counts (vocab 26 -> 13, ffn 22 -> 11 per TP rank): uneven rows over dp.
VOCAB, DIM, FFN, SEQ, LAYERS = 26, 16, 22, 4, 2
CLIP = 0.5  # below the gradient norms of these steps: clipping changes the update
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(seed: int = 0) -> TPModel:
    torch.manual_seed(seed)
    model = TPModel()
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make its gradients matter
        for block in [*model.blocks, model]:
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.uniform_(-0.1, 0.1)
    return model


def apply_tp(model: TPModel, tp_mesh: DeviceMesh) -> TPModel:
    """Megatron-style TP with sequence parallelism, as torchtitan writes it."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    return model


def dp_tp_mesh(dp: int = 2, tp: int = 2) -> DeviceMesh:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def wrap_ours(model: nn.Module, dp_mesh: DeviceMesh, strategy: str, **kw: object) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=dp_mesh, sharding_strategy=strategy, **kw)  # type: ignore[arg-type]
    return fully_shard(model, mesh=dp_mesh, sharding_strategy=strategy, **kw)  # type: ignore[arg-type]


def wrap_fsdp2(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2_fully_shard(block, mesh=dp_mesh)
    fsdp2_fully_shard(model, mesh=dp_mesh)
    return model


def batches(steps: int, micro: int, dp: int, per_rank: int = 2, seed: int = 1) -> torch.Tensor:
    """Tokens [steps, micro, dp, per_rank, SEQ + 1] (inputs and shifted targets)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, micro, dp, per_rank, SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model: nn.Module, data: torch.Tensor, dp_rank: int | None, *,
          mark: bool = False, lr: float = 1e-2,
          clip: Callable[[nn.Module], torch.Tensor] | None = None) -> list[float]:
    """AdamW steps over ``data``; ``dp_rank`` None: the single-process reference on the global
    batch. Returns the losses (each the mean over the global batch), followed by the gradient
    norms ``clip`` returned, if any."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    micro = data.shape[1]
    losses, norms = [], []
    for step in range(data.shape[0]):
        total = torch.zeros(())
        for i in range(micro):
            if mark:
                model.set_is_last_backward(i == micro - 1)  # type: ignore[operator]
            tokens = (data[step, i].reshape(-1, SEQ + 1) if dp_rank is None
                      else data[step, i, dp_rank])
            loss = loss_of(model, tokens) / micro
            loss.backward()
            total += loss.detach()
        if clip is not None:
            norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad()
        if dp_rank is not None:  # the mean over dp ranks (tp ranks hold the same loss)
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses + norms


def clip_ours(model: nn.Module) -> torch.Tensor:
    return clip_grad_norm_(model.parameters(), CLIP)


def clip_torch(model: nn.Module) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (``full_tensor()`` of DTensors)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def torch_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def reference_of(model: TPModel) -> TPModel:
    return copy.deepcopy(model)


def compare(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
            rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Fail on every rank when any value differs on any rank."""
    err = ""
    if sorted(got) != sorted(want):
        err = f"keys {sorted(got)} vs {sorted(want)}"
    else:
        for name in want:
            try:
                torch.testing.assert_close(got[name].float(), want[name].float(), rtol=rtol,
                                           atol=atol)
            except AssertionError as e:
                err = f"{name}: {e}"
                break
    if not all_ranks_ok(not err):
        raise AssertionError(f"{what}: {err or 'differs on another rank'}")


def compare_losses(what: str, got: list[float], want: list[float], tol: float = 1e-5) -> None:
    ok = len(got) == len(want) and all(abs(a - b) <= tol * max(1.0, abs(b))
                                       for a, b in zip(got, want))
    if not all_ranks_ok(ok):
        raise AssertionError(f"{what}: losses {got} vs {want}")
