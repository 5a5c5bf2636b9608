"""torchtitan's own training loop with megatron_fsdp_v2's ``fully_shard`` in place of FSDP2's.

What it checks: that megatron_fsdp_v2 is a drop-in for FSDP2 in an unmodified torchtitan
(issue 24): torchtitan 0.3.0's trainer, llama3 debug model, on CPU over gloo, trains with our
``fully_shard`` to the same per-step losses as with FSDP2's (1e-5 by default). Nothing in
torchtitan's files is changed; this launcher only

* rebinds the name ``fully_shard`` in ``torchtitan.distributed.fsdp`` (the one module that
  calls it for llama3: ``apply_fsdp_to_decoder``) to ``megatron_fsdp_v2.fully_shard``, as a
  user switching libraries would (``--fully-shard mfsdp``; ``torch`` leaves FSDP2 in place);
* on a machine without an accelerator, works around what torchtitan 0.3.0 lacks on CPU, the
  same for both runs: it falls back to ``"cuda"`` and NCCL (the CPU and gloo are taken
  instead, with stand-ins for the CUDA memory statistics it logs), and its language models
  only take FlexAttention, which has no CPU backward (a dense masked-softmax stand-in computes
  the same block-causal attention);
* lets FSDP2 (the reference run) reduce on gloo: torchtitan's ``set_gradient_divide_factor(1.0)``
  makes FSDP2 issue ``PREMUL_SUM``, which gloo lacks, so the FSDP2 run also gets FSDP2's own
  ``set_force_sum_reduction_for_comms(True)`` (a SUM times 1: the same numbers);
* records the loss, max loss and gradient norm that torchtitan's ``MetricsProcessor.log``
  receives each step (full precision; the printed log rounds them) into ``--losses-out``.

Install torchtitan without touching torch (its wheel pins nothing of torch's; every
dependency is installed with ``--no-deps`` so pip never replaces torch)::

    python -m venv --system-site-packages /tmp/ttvenv
    /tmp/ttvenv/bin/pip install --no-deps torchtitan-0.3.0-py3-none-any.whl \\
        tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 einops==0.8.2 \\
        spmd_types==0.2.3 torch_checkpointing==0.1.1 torchdata==0.11.0 \\
        datasets==4.7.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.0 multiprocess==0.70.18 \\
        xxhash==4.1.0 fsspec==2026.2.0 huggingface_hub==1.33.0 httpx==0.29.0 \\
        httpcore==1.0.9 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 \\
        frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 \\
        tensorboard==2.21.0 tensorboard-data-server==0.7.2 protobuf==7.36.2 \\
        grpcio==1.85.3 absl-py==2.5.1 Markdown==3.11.3
    /tmp/ttvenv/bin/python -c "import torch; print(torch.__version__)"   # unchanged

torchtitan reads its tokenizer and its ``c4_test`` data set relative to the working
directory (``./tests/assets/tokenizer``, ``./tests/assets/c4_test``): run from a folder that
holds them (torchtitan's repository has both; ``make-assets DIR`` writes a stand-in
``c4_test/data.json`` from the text of Python's own ``pydoc_data`` topics when the real one is
not at hand, and the tokenizer must still be copied from torchtitan's ``tests/assets``).

Run both and compare (from the folder holding ``tests/assets``)::

    PYTHONPATH=/path/to/megatron_fsdp_v2 /tmp/ttvenv/bin/python \\
        /path/to/scripts/torchtitan_dropin.py compare --runs fsdp,hsdp,pp,float8,resume,tp
    # one configuration by its sizes: ... compare --nproc 2 --steps 8 [--tp 2]

``compare`` first has one unsharded rank write torchtitan's seed checkpoint (step 0, once per
model config), then runs ``torchrun`` twice per comparison (FSDP2, then ours) with the same
seed, data and settings, both loading that checkpoint (torchtitan's own way to compare
parallelisms from the same weights; through torch's distributed state dict and DCP), prints a
per-step table (loss, gradient norm, all-gathers of the step) and a summary line per run, and
exits 1 when a loss differs by more than ``--tol`` (2 when a run failed; the other runs still
go). The named runs (``SUITE``): ``fsdp`` (2 ranks), ``hsdp`` (replicate 2 x shard 2),
``tp`` (shard 2 x tp 2, torchtitan's default ``spmd_types`` backend), ``pp`` (pp 2 x shard 2,
torchtitan's default 1F1B), ``float8`` (torchtitan's ``llama3_debugmodel_float8``, torchao
emulated, clipping off), ``resume`` (checkpoints every ``--resume-at`` steps; then the same
folder resumed from that step: each library's resumed losses against its uninterrupted run and
against FSDP2's). Losses, norms and counts are the last rank's (under PP it holds the last
stage); the all-gathers are counted at the dispatcher with the test suite's
``CollectiveCounts``, the same witness for both libraries (``--no-count-collectives`` skips it).
``--no-seed-checkpoint`` lets each library initialize its sharded weights itself (ours draw
what one process draws; FSDP2's sharded draws on CPU do not, so step 1 differs). Defaults: 8
steps, local batch 2, sequence 256, fp32, seed 42. One run alone::

    torchrun --nproc_per_node 2 scripts/torchtitan_dropin.py run --fully-shard mfsdp \\
        --losses-out /tmp/mfsdp.json -- --module llama3 --config llama3_debugmodel ...

Not a test (it needs torchtitan, which the project does not install): nothing collects it.

Measured (2026-12-04, 2 CPU cores, ``compare --runs``, ``make-assets``' stand-in data and the
tokenizer of torchtitan's main branch; README "torchtitan" has the table): fsdp, hsdp, pp and
resume within 1e-6 of FSDP2's losses over 8 steps, resumed steps 5-8 bitwise each library's
uninterrupted run, float8 bitwise; all-gathers per step equal (17), except PP's last stage (9
against FSDP2's 8: the ``[norm, lm_head]`` unit is gathered again in the second micro-batch's
forward: torchtitan's chunked loss ends that unit's gradient window at every micro-batch's last
chunk, and a window's end marks the main weights updated, so the weights kept from the first
micro-batch's backward count as stale). The gradient norms torchtitan logs differ by about 6e-5
(relative): every gradient agrees with FSDP2's to 1e-9 (the norms of their ``full_tensor()``,
in float64; measured 2026-12-02), and FSDP2's norm (torch's ``get_total_norm`` over the local
shards, in float32 on CPU) is off the float64 norm of its own gradients by that much, ours is
not. Through the clip coefficient that moves fp32 losses by at most 1e-6, but float8's rounding
amplifies it: float8 with clipping on (``max_norm 1``) differs by up to 2.2e-4 by step 8, hence
``max_norm 1e9`` in its run. With ``-- --training.mixed_precision_param bfloat16`` (6 steps,
2026-12-02) step 1 is equal and the losses then drift apart by up to 2.4e-4 the same way.

``tp`` (measured 2026-12-05, ``compare --runs fsdp,tp,pp``; fsdp and pp gave the numbers
above again): within 9.5e-7 of FSDP2's losses over 8 steps (steps 1-7 bitwise), gradient norms
within 6.1e-7 (relative; here FSDP2's norm is not off by the 6e-5 of the 1-D runs, not traced
why), all-gathers per step equal (55; 54 in step 1). torchtitan calls its random
``init_weights`` on the wrapped model before the seed checkpoint is loaded: our ``nn.init.*``
on the dp x tp DTensors draws the single-process values (``_dtensor/_random_init.py``), and its
fused-QKV init's ``copy_`` of a ``Replicate()`` DTensor into the sharded weight keeps each
rank's piece (``_dtensor/_redistribute.py``); both raised ``NotImplementedError`` before. With
``--no-seed-checkpoint`` (each library initializing its sharded weights itself) our tp run's
losses and norms are bitwise those of our run from the seed checkpoint, which one unsharded
process wrote with the same seed; FSDP2's differ from step 1 (8.16e-2; its sharded draws on CPU
are per rank). torchtitan's other SPMD backends (``compare --nproc 4 --tp 2 -- --parallelism.
spmd_backend partial_dtensor`` or ``full_dtensor``, 2026-12-05): losses bitwise FSDP2's over 8
steps, norms within 5.2e-7; all-gathers per step 55 / 55 under both (``full_dtensor``, whose
activations are DTensors on the SPMD mesh ``fully_shard`` registered, issued 55 / 219 until
``_dtensor/_redistribute.py`` decided by tensor: [Note: deciding by tensor];
reduce-scatters 35 / 42, all-reduces 43 / 43, FSDP2 / ours). HSDP x TP
(``compare --nproc 4 --tp 2 -- --parallelism.data_parallel_shard_degree 1
--parallelism.data_parallel_replicate_degree 2``, with the seed checkpoint of a plain run copied
into the dump folder, since the extra arguments reach the 1-rank seed run too): losses and
norms bitwise FSDP2's; all-gathers 55 / 38 (ours / FSDP2): ours issues its 17 per step over the
size-1 shard dim too (trivial ones), FSDP2 skips them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any


def _use_cpu_when_no_accelerator() -> None:
    """torchtitan 0.3.0 takes ``"cuda"`` when torch finds no accelerator; take the CPU.

    ``torchtitan.tools.utils`` computes ``device_type``/``device_module`` at import and the
    other modules import them by name, so they are set here, before any of those is imported.
    The backend then follows torch's map for ``"cpu"``: gloo.
    """
    import torch
    import torchtitan.tools.utils as tt_utils

    if torch._utils._get_available_device_type() is None:
        tt_utils.device_type = "cpu"
        tt_utils.device_module = _CpuDeviceModule()


class _CpuDeviceModule:
    """``torch.cpu`` plus the memory-monitor calls torchtitan makes on ``torch.cuda``.

    CPU memory statistics do not exist in torch; they read as 0 (torchtitan logs them only).
    """

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        import types

        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE")
                                     * os.sysconf("SC_PHYS_PAGES"))

    def current_device(self) -> int:
        # torch.cpu's is the string "cpu"; torchtitan passes it to barrier(device_ids=[...]).
        return 0

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _eager_flex_attention_on_cpu() -> None:
    """torch's FlexAttention has no backward on CPU; compute the same attention densely.

    torchtitan 0.3.0's language models accept only FlexAttention (block-causal masks built
    from per-document positions). Here its compiled kernel is replaced, for both runs alike,
    by the textbook computation: the BlockMask's ``mask_mod`` evaluated densely, masked
    softmax, log-sum-exp when asked for. A CPU-only workaround, nothing of FSDP's.
    """
    import torch

    if torch._utils._get_available_device_type() is not None:
        return
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    def dense_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             score_mod: Any = None, block_mask: Any = None,
                             scale: float | None = None, enable_gqa: bool = False,
                             return_aux: Any = None, kernel_options: Any = None) -> Any:
        if score_mod is not None:
            raise NotImplementedError("the CPU stand-in for FlexAttention takes no score_mod")
        batch, heads, q_len, head_dim = q.shape
        if enable_gqa and k.shape[1] != heads:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        scores = (q @ k.transpose(-2, -1)) * (head_dim ** -0.5 if scale is None else scale)
        if block_mask is not None:
            mask = create_mask(block_mask.mask_mod, batch, None, q_len, k.shape[2],
                               device=q.device)
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.softmax(scores, dim=-1) @ v
        want_lse = return_aux is not None and getattr(return_aux, "lse", False)
        return out, AuxOutput(lse=lse if want_lse else None)

    FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)


def _substitute_fully_shard(which: str) -> None:
    """Rebind the name ``fully_shard`` where torchtitan's llama3 path calls it."""
    import torchtitan.distributed.fsdp as tt_fsdp

    if which == "mfsdp":
        import megatron_fsdp_v2

        tt_fsdp.fully_shard = megatron_fsdp_v2.fully_shard
    elif which == "torch":
        _fsdp2_sum_on_gloo(tt_fsdp)
    else:
        raise ValueError(f"--fully-shard must be 'torch' or 'mfsdp', got {which!r}")


def _fsdp2_sum_on_gloo(tt_fsdp: Any) -> None:
    """FSDP2 (the reference run) on gloo: reduce with SUM, not PREMUL_SUM.

    torchtitan turns FSDP2's gradient division off with ``set_gradient_divide_factor(1.0)``;
    FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM``, which gloo lacks ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). ``set_force_sum_reduction_for_comms(True)`` (FSDP2's own
    switch, which torchtitan sets itself for symmetric memory) makes it a SUM and a multiply
    by 1: the same numbers. Our library needs nothing here (it always sums, then scales).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division

    def disable_division(model: Any) -> None:
        original(model)
        if dist.get_backend() == "gloo":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division


def _is_last_rank() -> bool:
    """The rank that writes the records: the last, which under torchtitan's PP holds the last
    stage (its pp coordinate is the mesh's outermost), so it logs the real loss (the other
    stages log a placeholder); without PP every rank logs the same global numbers."""
    return int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1


def _record_metrics(path: str) -> None:
    """Keep what ``MetricsProcessor.log`` receives each step; the last rank writes it at exit."""
    import atexit

    from torchtitan.components.metrics import MetricsProcessor

    rows: list[dict[str, Any]] = []
    original = MetricsProcessor.log

    def log(self: Any, step: int, global_avg_loss: float, global_max_loss: float,
            grad_norm: float, extra_metrics: dict[str, Any] | None = None) -> Any:
        rows.append({"step": step, "loss": float(global_avg_loss),
                     "max_loss": float(global_max_loss), "grad_norm": float(grad_norm)})
        return original(self, step, global_avg_loss, global_max_loss, grad_norm,
                        extra_metrics=extra_metrics)

    MetricsProcessor.log = log  # type: ignore[method-assign]

    def dump() -> None:
        if _is_last_rank():
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)

    atexit.register(dump)


def _emulate_float8() -> None:
    """torchtitan's float8 converter refuses a machine without SM89+ unless ``emulate`` is set.

    Its ``Float8LinearConverter.Config.emulate`` (torchao's ``Float8LinearConfig(emulate=True)``:
    the same float8 casts and scales, the matmul done in high precision) is not reachable from
    the command line (the converter sits in the model spec), so it is set here, for both runs.
    """
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    original = Float8LinearConverter.__init__

    def init(self: Any, config: Any) -> None:
        config.emulate = True
        original(self, config)

    Float8LinearConverter.__init__ = init  # type: ignore[method-assign]


def _count_collectives(path: str) -> None:
    """Count the collectives each ``Trainer.train_step`` dispatches; the last rank writes them.

    The witness is the test suite's ``CollectiveCounts`` (a dispatch-level observer counting
    what ``CommDebugMode`` counts), so both libraries are counted the same way, from outside.
    """
    import atexit

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests", "distributed"))
    from torchtitan.trainer import Trainer

    from _comm_counts import COLLECTIVE_KINDS, CollectiveCounts

    steps: list[dict[str, int]] = []
    original = Trainer.train_step

    def train_step(self: Any, *a: Any, **kw: Any) -> Any:
        with CollectiveCounts() as comm:
            out = original(self, *a, **kw)
        counts = {str(k).rsplit(".", 1)[-1].rstrip("_"): v
                  for k, v in comm.get_comm_counts().items()}
        steps.append({kind: sum(counts.get(name, 0) for name in names)
                      for kind, names in COLLECTIVE_KINDS.items()})
        return out

    Trainer.train_step = train_step  # type: ignore[method-assign]

    def dump() -> None:
        if _is_last_rank():
            with open(path, "w") as f:
                json.dump(steps, f, indent=1)

    atexit.register(dump)


def _run(args: argparse.Namespace, titan_args: list[str]) -> None:
    _use_cpu_when_no_accelerator()
    _eager_flex_attention_on_cpu()
    _substitute_fully_shard(args.fully_shard)
    if args.float8_emulate:
        _emulate_float8()
    if args.losses_out:
        _record_metrics(args.losses_out)
    if args.collectives_out:
        _count_collectives(args.collectives_out)
    from torchtitan.train import main

    sys.argv = [sys.argv[0], *titan_args]
    main()


@dataclass(frozen=True)
class _Setup:
    """One comparison: a torchtitan configuration trained by FSDP2, then by ours."""

    nproc: int
    titan: tuple[str, ...]  # torchtitan's --parallelism.* (and other) arguments of this run
    config: str = "llama3_debugmodel"
    float8: bool = False  # torchtitan's float8 linears, emulated (no SM89+ here)
    resume: bool = False  # checkpoint mid-run, resume, compare with the uninterrupted run


def _dims(shard: int, replicate: int = 1, tp: int = 1, pp: int = 1) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.data_parallel_replicate_degree", str(replicate),
            "--parallelism.tensor_parallel_degree", str(tp),
            "--parallelism.pipeline_parallel_degree", str(pp))


# The named runs of ``compare --runs``; 4 ranks where two parallelisms are combined.
SUITE: dict[str, _Setup] = {
    "fsdp": _Setup(2, _dims(shard=2)),
    "hsdp": _Setup(4, _dims(shard=2, replicate=2)),
    "tp": _Setup(4, _dims(shard=2, tp=2)),
    # torchtitan refuses PP unless its CUDA graphs are off (they are not used on CPU anyway).
    "pp": _Setup(4, (*_dims(shard=2, pp=2), "--training.disable_cuda_graphs")),
    # Clipping off: the clip coefficient divides by the gradient norm, which FSDP2 computes
    # about 6e-5 (relative) off on CPU (see the docstring); float8's rounding turns that into
    # loss differences of ~2e-4 by step 8 (measured), while without clipping the losses are
    # bitwise FSDP2's. The norms are still compared in the table.
    "float8": _Setup(2, (*_dims(shard=2), "--training.max_norm", "1e9"),
                     config="llama3_debugmodel_float8", float8=True),
    "resume": _Setup(2, _dims(shard=2), resume=True),
}


def _titan_args(args: argparse.Namespace, setup: _Setup, steps: int | None = None) -> list[str]:
    return [
        "--module", "llama3", "--config", setup.config,
        "--training.steps", str(args.steps if steps is None else steps),
        "--training.local_batch_size", str(args.batch),
        "--training.seq_len", str(args.seq_len),
        # fp32 compute: CPU bf16 is slow and the comparison is of the sharding, not of rounding.
        "--training.mixed_precision_param", "float32",
        *setup.titan,
        "--debug.seed", "42",
        # Not --debug.deterministic: it puts torch.compile'd FlexAttention back in place of
        # the CPU stand-in; CPU kernels and gloo are run-to-run deterministic anyway.
        "--metrics.log_freq", "1",
        *args.extra,
    ]


def _torchrun(args: argparse.Namespace, setup: _Setup, nproc: int, which: str, name: str,
              titan_args: list[str], out_prefix: str = "") -> bool:
    """One torchrun; with ``out_prefix``, the last rank writes ``<prefix>.losses.json`` and
    ``<prefix>.collectives.json`` (per step)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", os.path.abspath(__file__), "run", "--fully-shard", which,
    ]
    if out_prefix:
        cmd += ["--losses-out", out_prefix + ".losses.json"]
        if args.count_collectives:
            cmd += ["--collectives-out", out_prefix + ".collectives.json"]
    if setup.float8:
        cmd.append("--float8-emulate")
    cmd += ["--", *titan_args]
    print("+", " ".join(cmd), flush=True)
    log_path = os.path.join(args.dump_folder, f"log_{name}.txt")
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        print(f"{name} run failed (exit {rc}); log: {log_path}")
    return rc == 0


def _read(prefix: str) -> list[dict[str, Any]]:
    """The per-step rows a run recorded: loss, max_loss, grad_norm (and all_gather, ... when
    counted)."""
    with open(prefix + ".losses.json") as f:
        rows: list[dict[str, Any]] = json.load(f)
    if os.path.exists(prefix + ".collectives.json"):
        with open(prefix + ".collectives.json") as f:
            for row, counts in zip(rows, json.load(f)):
                row.update(counts)
    return rows


def _seed_args(args: argparse.Namespace, setup: _Setup) -> list[str] | None:
    """Arguments that load torchtitan's seed checkpoint of ``setup.config`` (written once).

    torchtitan's way to start runs of different parallelisms from the same weights (its
    loss-comparison flow): one unsharded rank initializes and saves step 0; both runs load it
    (through torch's distributed state dict and DCP). Without it each library's initialization
    of sharded weights draws its own values. ``None`` when the seed run failed.
    """
    if not args.seed_checkpoint:
        return []
    seed_dir = os.path.join(args.dump_folder, f"seed_{setup.config}")
    step0 = os.path.join(seed_dir, "checkpoint", "step-0")
    if not os.path.isdir(step0):
        unsharded = _Setup(1, _dims(shard=1), setup.config, setup.float8)
        seed = [*_titan_args(args, unsharded), "--dump_folder", seed_dir,
                "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
        shutil.rmtree(seed_dir, ignore_errors=True)
        if not _torchrun(args, unsharded, 1, "torch", f"seed_{setup.config}", seed):
            return None
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", step0]


def _train(args: argparse.Namespace, setup: _Setup, name: str,
           load: list[str]) -> dict[str, list[dict[str, Any]]] | None:
    """FSDP2's run, then ours (each from a fresh folder); for ``resume`` also each one's
    resumed run. Returns rows by run key, ``None`` if a run failed."""
    results: dict[str, list[dict[str, Any]]] = {}
    for which in ("torch", "mfsdp"):
        folder = os.path.join(args.dump_folder, f"{name}_{which}")
        shutil.rmtree(folder, ignore_errors=True)  # a checkpoint left there would be resumed
        titan = [*_titan_args(args, setup), "--dump_folder", folder, *load]
        if setup.resume:
            # Full checkpoints (model, optimizer, lr scheduler, data loader) every k steps.
            titan += ["--checkpoint.interval", str(args.resume_at)]
        else:
            titan += ["--checkpoint.load_only"]
        prefix = os.path.join(args.dump_folder, f"{name}_{which}")
        if not _torchrun(args, setup, setup.nproc, which, f"{name}_{which}", titan, prefix):
            return None
        results[which] = _read(prefix)
        if setup.resume:
            # The same folder, told to load step k: torchtitan restores it and trains k+1..N.
            resumed = [*titan, "--checkpoint.load_step", str(args.resume_at)]
            prefix += "_resumed"
            if not _torchrun(args, setup, setup.nproc, which, f"{name}_{which}_resumed",
                             resumed, prefix):
                return None
            results[which + "_resumed"] = _read(prefix)
    return results


def _gathers(row: dict[str, Any]) -> str:
    return str(row["all_gather"]) if "all_gather" in row else "-"


def _report(name: str, results: dict[str, list[dict[str, Any]]], tol: float) -> dict[str, Any]:
    """Print the run's per-step table and summary line; return the summary."""
    ref, ours = results["torch"], results["mfsdp"]
    if [r["step"] for r in ref] != [r["step"] for r in ours] or not ref:
        print(f"{name}: the runs logged different steps:", [r["step"] for r in ref],
              [r["step"] for r in ours])
        return {"name": name, "ok": False, "failed": True}
    worst = worst_norm = 0.0
    print(f"\n### {name}\n")
    print("| step | FSDP2 loss | megatron_fsdp_v2 loss | abs diff | FSDP2 grad norm "
          "| ours grad norm | rel diff | all-gathers FSDP2 / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for a, b in zip(ref, ours):
        diff = abs(a["loss"] - b["loss"])
        norm_diff = abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-30)
        worst, worst_norm = max(worst, diff), max(worst_norm, norm_diff)
        print(f"| {a['step']} | {a['loss']:.8f} | {b['loss']:.8f} | {diff:.2e} "
              f"| {a['grad_norm']:.6f} | {b['grad_norm']:.6f} | {norm_diff:.1e} "
              f"| {_gathers(a)} / {_gathers(b)} |")
    worst_resume = 0.0
    if "torch_resumed" in results:
        # Each library's resumed steps against its own uninterrupted run and against FSDP2's.
        print("\n| step | FSDP2 | FSDP2 resumed | ours | ours resumed | max abs diff |")
        print("|---|---|---|---|---|---|")
        by_step = {r["step"]: r["loss"] for r in ref}
        by_step_ours = {r["step"]: r["loss"] for r in ours}
        ref_resumed, ours_resumed = results["torch_resumed"], results["mfsdp_resumed"]
        if [r["step"] for r in ref_resumed] != [r["step"] for r in ours_resumed] \
                or not ref_resumed or any(r["step"] not in by_step for r in ref_resumed):
            print(f"{name}: the resumed runs logged steps", [r["step"] for r in ref_resumed],
                  [r["step"] for r in ours_resumed])
            return {"name": name, "ok": False, "failed": True}
        for a, b in zip(ref_resumed, ours_resumed):
            step = a["step"]
            losses = (by_step[step], a["loss"], by_step_ours[step], b["loss"])
            diff = max(losses) - min(losses)
            worst_resume = max(worst_resume, diff)
            print(f"| {step} | " + " | ".join(f"{x:.8f}" for x in losses) + f" | {diff:.2e} |")
    ok = max(worst, worst_resume) <= tol
    per_step = (f"{_gathers(ref[-1])} / {_gathers(ours[-1])}" if "all_gather" in ref[-1]
                else "not counted")
    line = (f"{name}: {len(ref)} steps, max |loss diff| {worst:.2e}, grad norm rel diff "
            f"{worst_norm:.1e}, all-gathers in the last step (FSDP2 / ours) {per_step}")
    if "torch_resumed" in results:
        line += f", resumed vs uninterrupted (both libraries) {worst_resume:.2e}"
    print(f"{line}: {'OK' if ok else 'ABOVE'} tol {tol:g}")
    return {"name": name, "ok": ok, "failed": False, "line": line}


def _compare(args: argparse.Namespace) -> int:
    """Run each named comparison (or the one given by --nproc/--tp); 1 on a difference above
    --tol, 2 if a run failed (the other comparisons still run)."""
    os.makedirs(args.dump_folder, exist_ok=True)
    if args.runs:
        unknown = [n for n in args.runs.split(",") if n not in SUITE]
        if unknown:
            raise SystemExit(f"--runs: unknown {unknown}; choose from {','.join(SUITE)}")
        setups = {n: SUITE[n] for n in args.runs.split(",")}
    else:
        setups = {"compare": _Setup(args.nproc, _dims(shard=args.nproc // args.tp, tp=args.tp))}
    summaries = []
    for name, setup in setups.items():
        load = _seed_args(args, setup)
        results = None if load is None else _train(args, setup, name, load)
        if results is None:
            summaries.append({"name": name, "ok": False, "failed": True})
            continue
        summaries.append(_report(name, results, args.tol))
    print("\n## summary")
    for summary in summaries:
        print(summary.get("line", f"{summary['name']}: FAILED (see its log)"),
              "" if summary["failed"] else ("OK" if summary["ok"] else "ABOVE TOL"))
    if any(s["failed"] for s in summaries):
        return 2
    return 0 if all(s["ok"] for s in summaries) else 1


def _make_assets(folder: str) -> None:
    """A stand-in for torchtitan's ``tests/assets/c4_test/data.json`` (c4's json-lines format)."""
    from pydoc_data.topics import topics

    path = os.path.join(folder, "tests", "assets", "c4_test")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "data.json"), "w") as f:
        for key in sorted(topics):
            f.write(json.dumps({"text": topics[key], "timestamp": "2019-04-22T00:00:00Z",
                                "url": f"pydoc://{key}"}) + "\n")
    print("wrote", os.path.join(path, "data.json"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="one torchtitan run (under torchrun)")
    run.add_argument("--fully-shard", choices=("torch", "mfsdp"), required=True)
    run.add_argument("--losses-out", default="")
    run.add_argument("--collectives-out", default="",
                     help="count each step's collectives (FSDP2's and ours alike) into this file")
    run.add_argument("--float8-emulate", action="store_true",
                     help="torchtitan's float8 converter with emulate=True (no SM89+ here)")
    run.add_argument("titan_args", nargs=argparse.REMAINDER)
    cmp = sub.add_parser("compare", help="FSDP2 run, then ours; compare the losses")
    cmp.add_argument("--runs", default="",
                     help=f"comma-separated named comparisons ({','.join(SUITE)}); "
                          "replaces --nproc/--tp")
    cmp.add_argument("--nproc", type=int, default=2)
    cmp.add_argument("--tp", type=int, default=1)
    cmp.add_argument("--steps", type=int, default=8)
    cmp.add_argument("--batch", type=int, default=2)
    cmp.add_argument("--seq-len", type=int, default=256)
    cmp.add_argument("--tol", type=float, default=1e-5)
    cmp.add_argument("--resume-at", type=int, default=4,
                     help="resume: the step checkpointed and resumed from")
    cmp.add_argument("--no-count-collectives", dest="count_collectives", action="store_false",
                     help="do not count each step's collectives (counting slows the runs)")
    cmp.add_argument("--dump-folder", default="/tmp/torchtitan_dropin")
    cmp.add_argument("--no-seed-checkpoint", dest="seed_checkpoint", action="store_false",
                     help="start each run from its own library's random initialization")
    cmp.add_argument("extra", nargs=argparse.REMAINDER,
                     help="after --: more torchtitan arguments for both runs")
    assets = sub.add_parser("make-assets", help="write a stand-in c4_test data set")
    assets.add_argument("folder")
    args = parser.parse_args()
    if args.cmd == "run":
        titan_args = args.titan_args[1:] if args.titan_args[:1] == ["--"] else args.titan_args
        _run(args, titan_args)
        return 0
    if args.cmd == "compare":
        if args.extra[:1] == ["--"]:
            args.extra = args.extra[1:]
        return _compare(args)
    _make_assets(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
