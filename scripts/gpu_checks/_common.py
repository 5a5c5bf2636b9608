"""What the GPU check programs share: the model, the configurations, the training loop, the
world-1 process group, and bitwise comparison. See scripts/gpu_check.sh.

Every program takes ``--device cuda`` (on the GPU machine) or ``--device cpu`` (the dry run:
gloo, the same code, the CUDA-only assertions reported as not applicable), so that a CPU run
exercises everything but the GPU itself.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The library of this checkout, not an installed copy: `python scripts/gpu_checks/x.py` puts
# only this folder on sys.path. Spawned ranks inherit sys.path.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import megatron_fsdp_v2 as mfsdp  # noqa: E402

# Re-exported: the check programs get the library through this module.
from megatron_fsdp_v2.testing import run_distributed as run_distributed  # noqa: E402

# torch's DTensor.full_tensor still calls the deprecated name (torch 2.14): noise in the logs.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class CheckFailed(AssertionError):
    """A check found a defect; its message says which and where."""


# ---------------------------------------------------------------------------------- the model

class Block(nn.Module):
    """LayerNorm + MLP with a residual; ``checkpointed`` recomputes the body in backward."""

    def __init__(self, dim: int, checkpointed: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.checkpointed = checkpointed

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class TinyLM(nn.Module):
    """A small language model: embedding, MLP blocks, an output head with a bias. The odd vocab
    (97 rows, a 97-long head bias) puts a parameter of odd length in the flat buffers, as a
    GPT-2 vocabulary (50257) does. No attention: scaled_dot_product_attention's CUDA backward
    is not bitwise reproducible, which the overlap on/off comparison needs."""

    def __init__(self, vocab: int = 97, dim: int = 64, layers: int = 3,
                 checkpointed: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, checkpointed) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (fp32 logits, whatever the compute dtype)."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class Config:
    """Which options a run turns on, besides the strategy."""

    name: str
    bf16: bool = False
    trace_pool: bool = False
    buckets: bool = False
    checkpointed: bool = False

    def fully_shard_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {"enable_trace_pool": self.trace_pool}
        if self.bf16:
            kwargs["mp_policy"] = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if self.buckets:
            # Small enough that the model's groups fill several buckets.
            kwargs["reduce_bucket_size_mb"] = 0.05
            kwargs["refresh_bucket_size_mb"] = 0.05
        return kwargs


PLAIN = Config("fp32")
FULL = Config("bf16+trace_pool+buckets+checkpoint", bf16=True, trace_pool=True, buckets=True,
              checkpointed=True)
CONFIGS = (PLAIN, FULL)


def build(strategy: str, config: Config, device: torch.device, *, overlap: bool = True,
          mesh: object | None = None, seed: int = 0, layers: int = 3, dim: int = 64
          ) -> tuple[nn.Module, nn.Module]:
    """The model wrapped per block and at the root, and an unwrapped copy with the same initial
    weights (the single-process reference)."""
    torch.manual_seed(seed)
    model = TinyLM(dim=dim, layers=layers, checkpointed=config.checkpointed).to(device)
    reference = copy.deepcopy(model)
    kwargs = dict(config.fully_shard_kwargs(), sharding_strategy=strategy, overlap=overlap)
    if mesh is not None:
        kwargs["mesh"] = mesh
    for block in model.blocks:
        mfsdp.fully_shard(block, **kwargs)  # type: ignore[arg-type]
    mfsdp.fully_shard(model, **kwargs)  # type: ignore[arg-type]
    return model, reference


def make_batches(steps: int, micro: int, world: int, device: torch.device, *, batch: int = 2,
                 seq: int = 17, vocab: int = 97, seed: int = 1) -> list[list[list[torch.Tensor]]]:
    """``batches[step][micro_batch][rank]``: token ids, the same on every rank and process."""
    generator = torch.Generator().manual_seed(seed)
    return [[[torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
              for _ in range(world)] for _ in range(micro)] for _ in range(steps)]


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW (exercises the local optimizer step), or SGD with momentum for comparisons with
    a tolerance: its update is linear in the gradient, so rounding stays small, while AdamW's
    normalized update turns a rounding difference in a near-zero gradient into a full step."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: Sequence[torch.Tensor], *, set_to_none: bool = True
               ) -> list[torch.Tensor]:
    """One optimizer step over ``micro_batches`` (the last one marked), with clipping. Returns
    the micro-batch losses as device tensors: no host synchronization anywhere in the step."""
    losses = []
    for i, tokens in enumerate(micro_batches):
        model.set_is_last_backward(i == len(micro_batches) - 1)  # type: ignore[operator]
        loss = lm_loss(model, tokens) / len(micro_batches)
        loss.backward()
        losses.append(loss.detach())
    mfsdp.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return losses


def train(model: nn.Module, batches: list[list[list[torch.Tensor]]], rank: int = 0,
          optimizer: str = "adamw") -> torch.Tensor:
    """Train on this rank's share of ``batches``; the losses of every micro-batch, stacked."""
    opt = make_optimizer(model, optimizer)
    losses: list[torch.Tensor] = []
    for step in batches:
        losses += train_step(model, opt, [micro[rank] for micro in step])
    return torch.stack(losses)


def train_reference(reference: nn.Module, batches: list[list[list[torch.Tensor]]],
                    optimizer: str = "adamw") -> torch.Tensor:
    """Single-process training on every rank's data: each micro-batch's loss is the mean over
    the ranks' losses, which is what data parallelism with averaged gradients computes."""
    opt = make_optimizer(reference, optimizer)
    losses = []
    for step in batches:
        for micro in step:
            loss = sum(lm_loss(reference, tokens) for tokens in micro) / (len(micro) * len(step))
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return torch.stack(losses)


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter (a DTensor's local tensor), detached."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.detach().clone()
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gathered to its full value (every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def assert_bitwise(what: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Raise naming the first entry whose bits differ."""
    if a.keys() != b.keys():
        raise CheckFailed(f"{what}: different parameters {sorted(a)} vs {sorted(b)}")
    for name in a:
        if not torch.equal(a[name], b[name]):
            diff = (a[name].float() - b[name].float()).abs().max()
            raise CheckFailed(f"{what}: '{name}' differs bitwise (max abs diff {diff})")


def assert_same_training(what: str, *, losses: torch.Tensor, ref_losses: torch.Tensor,
                         params: dict[str, torch.Tensor], ref_params: dict[str, torch.Tensor],
                         initial: dict[str, torch.Tensor], tolerance: float) -> float:
    """Training matched the reference: every loss within ``tolerance`` (relative), and every
    parameter moved from ``initial`` as the reference's did, within ``tolerance`` of the
    reference's displacement (relative L2 norm). A missing or stale gradient, or a stale
    weight, moves a parameter differently by about the whole update, far beyond it. Returns
    the largest relative error found."""
    losses, ref_losses = losses.float().cpu(), ref_losses.float().cpu()
    if not torch.allclose(losses, ref_losses, rtol=tolerance, atol=0.0):
        raise CheckFailed(f"{what}: losses {losses.tolist()} != reference "
                          f"{ref_losses.tolist()} (rtol {tolerance})")
    worst = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    for name, start in initial.items():
        moved = params[name].float().cpu() - start.float().cpu()
        ref_moved = ref_params[name].float().cpu() - start.float().cpu()
        error = float((moved - ref_moved).norm() / ref_moved.norm().clamp_min(1e-12))
        if error > tolerance:
            raise CheckFailed(f"{what}: '{name}' moved differently from the reference "
                              f"(relative error {error:.2e} > {tolerance})")
        worst = max(worst, error)
    return worst


# ----------------------------------------------------------------------- process and device

def parse_args(description: str, extra: Sequence[tuple[str, dict[str, object]]] = ()
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: the GPU check (NCCL); cpu: the dry run (gloo)")
    for flag, options in extra:
        parser.add_argument(flag, **options)  # type: ignore[arg-type]
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu for a dry run)")
    return args


def setup_device(device_type: str) -> torch.device:
    """The device to run on; on CUDA the deterministic settings the bitwise comparisons need."""
    if device_type == "cpu":
        torch.set_num_threads(1)  # the dry run shares a small machine
        return torch.device("cpu")
    # cuBLAS picks reproducible kernels only with a fixed workspace (read at its first use).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def single_rank_group(device: torch.device) -> Iterator[None]:
    """A world-1 default process group: NCCL on CUDA, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        kwargs: dict[str, object] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1, **kwargs)  # type: ignore[arg-type]
        try:
            yield
        finally:
            dist.destroy_process_group()


class SideStreamSleep:
    """Race amplifier: wraps the library's one launch point for asynchronous collectives,
    ``CommStreams.run`` in ``megatron_fsdp_v2/_collectives.py`` (every gather, refresh and
    reduction of the step goes through it, see [Note: asynchronous collectives]), so that on
    CUDA each collective is preceded on its side stream by ``torch.cuda._sleep(cycles)``: the
    collective lands late, and a consumer that reads its output, or a free that reuses its
    buffer, without waiting on the collective's event sees wrong bits. Synchronous launches
    (``overlap=False``) and gloo launches on CPU are passed through unchanged. ``count`` is the
    number of collectives launched on a side stream (delayed when ``cycles`` > 0); a CUDA run
    that launched none there proves nothing."""

    def __init__(self, cycles: int) -> None:
        from megatron_fsdp_v2._comm import _collectives

        self.cycles = cycles
        self.count = 0
        self._streams_class = _collectives.CommStreams
        self._original = _collectives.CommStreams.run
        original = self._original
        amplifier = self

        def run(streams, launch, *, async_op, reduce):  # type: ignore[no-untyped-def]
            if not (async_op and streams.is_cuda):
                return original(streams, launch, async_op=async_op, reduce=reduce)

            def delayed(flag):  # type: ignore[no-untyped-def]
                current = torch.cuda.current_stream(streams.device)
                if current not in (streams.all_gather_stream, streams.reduce_stream):
                    raise CheckFailed(
                        "CommStreams.run launched a collective outside its side streams: the "
                        "sleep injection would delay the wrong stream; update SideStreamSleep"
                    )
                amplifier.count += 1
                if amplifier.cycles > 0:
                    torch.cuda._sleep(amplifier.cycles)
                return launch(flag)

            return original(streams, delayed, async_op=async_op, reduce=reduce)

        self._streams_class.run = run  # type: ignore[method-assign]

    def remove(self) -> None:
        self._streams_class.run = self._original  # type: ignore[method-assign]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def finish(name: str, failures: list[str]) -> None:
    """Print the verdict and exit non-zero on any failure."""
    if failures:
        print(f"[{name}] FAILED:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        sys.exit(1)
    print(f"[{name}] all passed")
