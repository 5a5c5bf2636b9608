"""Smoke tests for examples/: train.py and train_hf.py (train_hf.py's losses against a
single-process run of the same model and data; train.py --fp8's all-gathered bytes against its
bf16 run), their ``--help`` (printed once, every default shown), and the collective byte counter
the examples and benchmarks/bench_training.py rely on (it must see DDP's C++ reducer as well as
our library).

Two runs go through torchrun, for what only the launched script shows: train.py's own process
group, teardown and exit status (``test_train_example_runs``), and ``--help`` parsed by every
rank (``test_train_example_help_prints_once_under_torchrun``); torchrun starts each rank as a
``python`` forked from a server that imported torch and the library (the ``launched_python``
fixture of tests/conftest.py). The other runs (FP8, HSDP mesh,
the Hugging Face models) call the example's ``main(argv)`` on forked ranks of a rank pool (see
[Note: rank pools] in megatron_fsdp_v2/testing/_pool.py), in the pool's process group as a
harness or a user's own launcher would, and check every rank's printed output: the same
training code as under torchrun, without a launcher and an interpreter importing torch per rank
(seconds of CPU each)."""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from megatron_fsdp_v2.testing import RankPools, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)


# ZeRO-3 in bf16 on a 1-D mesh of 2 ranks, without and with --fp8: the same tiny GPT, sized so
# that the blocks' linears (FP8 with --fp8) dominate what is gathered; the tied embedding, the
# position embedding, the norms and the biases stay bf16 in both runs.
_ZERO3 = ["--strategy", "optim_grads_params", "--steps", "3", "--micro-batches", "2",
          "--batch-size", "2", "--seq-len", "16", "--dim", "64", "--layers", "3", "--heads", "2",
          "--vocab", "16", "--bf16"]
_ZERO3_RUNS: list[subprocess.CompletedProcess] = []


def _zero3_run(launched_python: str) -> subprocess.CompletedProcess:
    """The bf16 run of ``_ZERO3`` under torchrun, once per session (the launch test's run, and
    the FP8 test's reference bytes: the counter counts the same under any launcher)."""
    if not _ZERO3_RUNS:
        _ZERO3_RUNS.append(_torchrun(launched_python, "train.py", _ZERO3, timeout=240))
    proc = _ZERO3_RUNS[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _steps(stdout: str) -> list[tuple[int, float, float, int]]:
    """(step, loss, comm MiB/rank, all-gathered bytes) of each printed step."""
    found = re.findall(r"step\s+(\d+)/3 \| loss ([0-9.]+) .* comm\s+([0-9.]+) MiB/rank "
                       r"\(.*; all-gathered ([0-9,]+) B\)", stdout)
    return [(int(s), float(loss), float(c), int(b.replace(",", ""))) for s, loss, c, b in found]


def test_train_example_runs(launched_python: str) -> None:
    """ZeRO-3 on a 1-D mesh of 2 ranks. train.py passes ``--strategy`` to fully_shard as given
    (no branch of its own), so one strategy proves the example's 1-D path; the HSDP run below is
    the ``optim_grads`` run (every strategy's training is proven in tests/distributed)."""
    proc = _zero3_run(launched_python)
    steps = _steps(proc.stdout)
    assert [s for s, *_ in steps] == [1, 2, 3], proc.stdout
    assert all(math.isfinite(loss) for _, loss, _, _ in steps)
    assert all(comm > 0 and gathered > 0 for _, _, comm, gathered in steps), \
        "no collective bytes counted"
    assert "memory_report rank 1:" in proc.stdout


@pytest.fixture(scope="module")
def pools() -> Iterator[RankPools]:
    """Gloo rank pools, one per world size, for the cases that call an example's ``main``."""
    pools = RankPools()
    yield pools
    pools.close()


def _main_worker(rank: int, world: int, script: str, argv: list[str]) -> str:
    """``script``'s ``main(argv)`` on a pool rank, inside the pool's process group (which it
    must leave alone); what it printed."""
    module = importlib.import_module(script.removesuffix(".py"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(argv)
    assert torch.distributed.is_initialized(), f"{script} destroyed its caller's process group"
    return out.getvalue()


def _run_main(pools: RankPools, script: str, argv: list[str], nproc: int = 2,
              timeout: float = 240) -> str:
    """Every rank's output of ``script``'s ``main(argv)`` on ``nproc`` pool ranks, in rank
    order (what torchrun would have collected). A rank that raises (``SystemExit`` included)
    or exits fails the case."""
    return "".join(pools.run(_main_worker, nproc, script, argv, timeout_s=timeout))


def test_train_example_fp8(pools: RankPools, launched_python: str) -> None:
    """``--fp8`` under ZeRO-3: torchao float8 linears with FP8 all-gathers train (finite,
    decreasing loss), and each step all-gathers at most 0.52x the bytes of the same run in bf16
    (the example's byte counter: the collectives issued, FP8 moved as 1 byte per element)."""
    pytest.importorskip("torchao")
    stdout = _run_main(pools, "train.py", [*_ZERO3, "--fp8"])
    assert "float8 linears (FP8 all-gathers)" in stdout, stdout
    steps = _steps(stdout)
    assert [s for s, *_ in steps] == [1, 2, 3], stdout
    losses = [loss for _, loss, _, _ in steps]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    bf16 = _steps(_zero3_run(launched_python).stdout)
    ratios = [fp8[3] / ref[3] for fp8, ref in zip(steps, bf16)]
    assert len(ratios) == 3 and all(r <= 0.52 for r in ratios), (ratios, steps, bf16)


def test_train_example_muon(pools: RankPools) -> None:
    """``--optimizer muon``: torch.optim.Muon on the blocks' matrices (AdamW on the rest) trains
    under ZeRO-3 at 3 ranks (uneven rows: matrices split across ranks), its step's two
    all-to-alls counted, and the loss goes down."""
    stdout = _run_main(pools, "train.py",
                       ["--optimizer", "muon", "--strategy", "optim_grads_params", "--steps",
                        "3", "--batch-size", "2", "--seq-len", "16", "--dim", "32", "--layers",
                        "2", "--heads", "2", "--vocab", "64", "--muon-lr", "0.05"], nproc=3)
    steps = re.findall(r"step\s+(\d+)/3 \| loss ([0-9.]+) .*all_to_all=(\d+)", stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], stdout
    assert all(int(n) == 2 for _, _, n in steps), stdout
    losses = [float(loss) for _, loss, _ in steps]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert "with Muon:" in stdout and "with AdamW:" in stdout, stdout


def test_train_example_hsdp_mesh(pools: RankPools) -> None:
    """``--mesh 2,2``: HSDP (2 replicas x 2 shards, outer no_shard) on 4 CPU ranks."""
    stdout = _run_main(pools, "train.py",
                       ["--mesh", "2,2", "--strategy", "optim_grads", "--steps", "3",
                        "--micro-batches", "2", "--batch-size", "2", "--seq-len", "16",
                        "--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64"],
                       nproc=4)
    assert "mesh=2x2" in stdout, stdout
    steps = re.findall(r"step\s+(\d+)/3 \| loss ([0-9.]+) .* comm\s+([0-9.]+) MiB/rank",
                       stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], stdout
    assert all(math.isfinite(float(loss)) for _, loss, _ in steps)
    assert all(float(comm) > 0 for _, _, comm in steps), "no collective bytes counted"
    assert "memory_report rank 3:" in stdout


def _torchrun(launched_python: str, script: str, args: list[str], nproc: int = 2,
              timeout: float = 180) -> subprocess.CompletedProcess:
    """``script`` under torchrun, each rank a ``python`` with torch and the library imported
    (the ``launched_python`` fixture of tests/conftest.py)."""
    cmd = [launched_python, "-m", "torch.distributed.run", "--standalone", "--no-python",
           f"--nproc_per_node={nproc}", launched_python, os.path.join(EXAMPLES, script), *args]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _help_and_error(script: str, rank: str, monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture[str]) -> tuple[str, str, int]:
    """(--help output, usage-error output, number of options) of ``script`` parsed in this
    process as torchrun rank ``rank`` would."""
    module = __import__(script.removesuffix(".py"))
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as ok:
        module.parse_args(["--help"])
    assert ok.value.code == 0
    help_text = capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        module.parse_args(["--strategy", "zero9"])
    assert bad.value.code == 2
    captured = capsys.readouterr()
    options = sum(1 for a in module.make_parser()._actions
                  if a.option_strings and a.dest != "help")
    return help_text, captured.out + captured.err, options


@pytest.mark.parametrize("script", ["train.py", "train_hf.py", "train_moe.py"])
def test_example_help_shows_every_default_on_rank_0_only(
        script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    help_text, error, options = _help_and_error(script, "0", monkeypatch, capsys)
    assert help_text.count("usage:") == 1, help_text
    assert "(default: optim_grads_params)" in help_text, help_text
    assert help_text.count("(default:") == options, help_text  # every option, once
    assert "invalid choice: 'zero9'" in error, error
    assert _help_and_error(script, "1", monkeypatch, capsys)[:2] == ("", "")


def test_train_example_help_prints_once_under_torchrun(launched_python: str) -> None:
    """Every rank parses the command line; ``--help`` still prints once."""
    proc = _torchrun(launched_python, "train.py", ["--help"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("usage:") == 1, proc.stdout
    assert "(default: optim_grads_params)" in proc.stdout, proc.stdout


_HF_ARGS = ["--steps", "3", "--micro-batches", "2", "--batch-size", "2", "--seq-len", "12",
            "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "61"]


def _hf_reference_losses(argv: list[str], world: int) -> list[float]:
    """train_hf.py's training in one process on the concatenation of every rank's micro-batches:
    the same model (seed), data, AdamW, clipping and loss; the mean loss of every step."""
    import train_hf

    from model import synthetic_batch

    args = train_hf.parse_args(argv)
    torch.manual_seed(args.seed)
    model = train_hf.build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(args.steps):
        total = 0.0
        for i in range(args.micro_batches):
            tokens = torch.cat([
                synthetic_batch(args.batch_size, args.seq_len - 1, args.vocab, seed=args.seed,
                                step=step, micro=i, rank=r) for r in range(world)])
            loss = train_hf.hf_loss(model, tokens) / args.micro_batches
            loss.backward()
            total += loss.item()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("model, extra", [
    ("gpt2", ["--strategy", "optim_grads_params"]),
    ("llama", ["--strategy", "optim", "--checkpointing"]),
], ids=["gpt2-optim_grads_params", "llama-optim-checkpointing"])
def test_train_hf_example_matches_single_process(pools: RankPools, model: str,
                                                 extra: list[str]) -> None:
    pytest.importorskip("transformers",
                        reason="transformers is not installed (a test dependency: "
                               "scripts/install.sh)")
    argv = ["--model", model, *_HF_ARGS, *extra]
    stdout = _run_main(pools, "train_hf.py", argv, timeout=180)
    steps = re.findall(r"step\s+(\d+)/3 \| loss ([0-9.]+) .* comm\s+([0-9.]+) MiB/rank",
                       stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], stdout
    assert all(float(comm) > 0 for _, _, comm in steps), "no collective bytes counted"
    assert "memory_report rank 1:" in stdout and "optimizer_state=" in stdout
    expected = _hf_reference_losses(argv, world=2)
    got = [float(loss) for _, loss, _ in steps]
    # Printed with 4 decimals.
    assert got == pytest.approx(expected, abs=1.5e-4), (got, expected, stdout)


def _counter_worker(rank: int, world: int) -> dict[str, float]:
    import megatron_fsdp_v2 as mfsdp

    from comm_counter import CommCounter
    from model import GPT, GPTConfig, lm_loss, synthetic_batch

    cfg = GPTConfig(vocab=64, seq_len=16, dim=32, layers=2, heads=2)
    out = {}
    for system in ("ddp", "optim_grads_params"):
        torch.manual_seed(0)
        model = GPT(cfg)
        numel = model.num_params()
        if system == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            for block in model.blocks:
                mfsdp.fully_shard(block, sharding_strategy=system)
            mfsdp.fully_shard(model, sharding_strategy=system)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counter = CommCounter()
        for step in range(3):
            with counter:
                batch = synthetic_batch(2, 16, 64, seed=0, step=step, micro=0, rank=rank)
                lm_loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
            stats = counter.reset()
        out[system] = stats.total_wire_bytes / (4 * numel * (world - 1) / world)
    return out


def test_comm_counter_sees_ddp_and_fully_shard() -> None:
    """Steady-state bytes per step, in units of one ring pass over the fp32 parameters: DDP's
    reducer all-reduce is 2, ZeRO-3's 2 all-gathers + 1 reduce-scatter is 3 (padding aside)."""
    results = run_distributed(_counter_worker, 2, timeout_s=180)
    for r in results:
        assert r["ddp"] == pytest.approx(2.0, rel=1e-6), r
        assert r["optim_grads_params"] == pytest.approx(3.0, rel=0.02), r
