"""The estimator in one process under the fake process group: arguments, no state left behind,
no allocation at scale, the strategy contract at large world sizes, the presets and the CLI.
Exactness against real runs is tests/distributed/test_estimate_exact.py."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import MixedPrecisionPolicy, _registry, estimate
from megatron_fsdp_v2.estimator._cli import main
from megatron_fsdp_v2.estimator._presets import GPTBlock, GPTDecoder, LlamaBlock, LlamaDecoder

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)


def _small_llama() -> nn.Module:
    return LlamaDecoder(layers=4, dim=64, ffn=160, vocab=300, heads=4, kv_heads=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_contract_counts_at_large_world(strategy: str) -> None:
    """Per group and iteration (see test_counts_and_memory._expected): no_shard one all-reduce,
    optim one all-gather and one reduce-scatter, optim_grads one all-gather and N
    reduce-scatters, optim_grads_params 2N all-gathers and N reduce-scatters."""
    for micro in (1, 4):
        est = estimate(_small_llama, world_size=512, wrap=(LlamaBlock,), micro_batches=micro,
                       sharding_strategy=strategy, mp_policy=BF16, rank=511)
        n = est.memory.num_groups
        ag, rs, ar = {
            "no_shard": (0, 0, 1), "optim": (1, 1, 0), "optim_grads": (1, micro, 0),
            "optim_grads_params": (2 * micro, micro, 0),
        }[strategy]
        counts = tuple(est.collectives[k][0] for k in ("all_gather", "reduce_scatter",
                                                      "all_reduce"))
        assert counts == (ag * n, rs * n, ar * n), (strategy, micro, counts, n)
        # Payload: every collective covers a group's full (padded) buffer.
        assert est.collectives["all_gather"][1] % 2 == 0
        assert est.bytes_communicated > 0


def test_sharded_sizes_follow_the_layout_at_every_rank() -> None:
    """Rank r of a fake world holds rank r's rows: the shards tile each group's buffer."""
    world = 5
    spans = [estimate(_small_llama, world_size=world, wrap=(LlamaBlock,), rank=r,
                      sharding_strategy="optim_grads_params").shards for r in range(world)]
    for index, group in enumerate(spans[0]):
        pieces = sorted(s[index].main_weight_span for s in spans)
        assert pieces[0][0] == 0 and pieces[-1][1] == group.total_numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), pieces


def test_memory_ordering_and_optimizer_state() -> None:
    ests = {s: estimate(_small_llama, world_size=8, wrap=(LlamaBlock,), sharding_strategy=s,
                        mp_policy=BF16) for s in STRATEGIES}
    persistent = [e.memory.model_weights + e.memory.main_weights + e.memory.main_grads
                  for e in ests.values()]
    assert persistent == sorted(persistent, reverse=True) and len(set(persistent)) == 4
    params = len(list(_small_llama().parameters()))
    for e in ests.values():
        # fp32 main weights of their own; the optimizer's buffers cover the parameters' rows,
        # not the padding.
        main = e.memory.main_weights
        momentum = e.optimizer_state["sgd_momentum"]
        assert e.optimizer_state["sgd"] == 0
        assert main - e.memory.padding * 2 <= momentum <= main
        assert 2 * momentum < e.optimizer_state["adamw"] <= 2 * momentum + 4 * params
        assert e.memory.optimizer_state == e.optimizer_state["adamw"]
    # no_shard reduces its fp32 main gradients in place; ZeRO-3 gathers into buckets.
    assert ests["no_shard"].memory.temporary_peak == 0
    assert ests["optim_grads_params"].memory.temporary_peak > 0


def test_no_state_left_and_no_allocation_at_scale() -> None:
    """A 70B Llama-style model at world size 1024: nothing allocated (a no_shard replica alone
    would be 280 GB), and afterwards no process group and no library state remain."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def llama70b() -> nn.Module:
        return LlamaDecoder(layers=80, dim=8192, ffn=28672, vocab=128256, heads=64, kv_heads=8)

    with pytest.warns(UserWarning, match="padded"):
        est = estimate(llama70b, world_size=1024, wrap=(LlamaBlock,), mp_policy=BF16,
                       sharding_strategy="no_shard")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 4 << 20, f"estimate grew the process by {grown} KiB"
    assert est.memory.main_weights > 250 * 2**30  # the replica it did not allocate
    assert not dist.is_initialized()
    assert not _registry._states and not _registry.process_groups and not _registry.meta_buffers[0]


def test_gpt_preset_and_predicate_wrap() -> None:
    def gpt() -> nn.Module:
        return GPTDecoder(layers=3, dim=32, ffn=128, vocab=100, heads=2, seq=16)

    by_class = estimate(gpt, world_size=4, wrap=(GPTBlock,))
    by_predicate = estimate(gpt, world_size=4, wrap=lambda m: isinstance(m, GPTBlock))
    assert by_class.memory == by_predicate.memory
    assert {s.unit for s in by_class.shards} == {"<root>", "blocks.0", "blocks.1", "blocks.2"}


def test_bad_arguments_raise_before_anything() -> None:
    with pytest.raises(ValueError, match="rank must be"):
        estimate(_small_llama, world_size=4, rank=4)
    with pytest.raises(ValueError, match="micro_batches"):
        estimate(_small_llama, world_size=4, micro_batches=0)
    with pytest.raises(ValueError, match="mesh_shape"):
        estimate(_small_llama, world_size=8, mesh_shape=(3, 2))
    with pytest.raises(ValueError, match="optimizer"):
        estimate(_small_llama, world_size=8, optimizer="lion")
    with pytest.raises(TypeError, match="wrap must be"):
        estimate(_small_llama, world_size=8, wrap=LlamaBlock)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharding strategy|sharding_strategy|zero"):
        estimate(_small_llama, world_size=8, sharding_strategy="zero9")
    with pytest.raises(ValueError, match="real device"):
        estimate(lambda: nn.Linear(4, 4, device="cpu"), world_size=2)
    assert not dist.is_initialized() and not _registry._states


def test_refuses_inside_an_initialized_process() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="before init_process_group"):
            estimate(_small_llama, world_size=2)
        assert dist.is_initialized()  # the caller's group is untouched
    finally:
        dist.destroy_process_group()


def test_hsdp_mesh() -> None:
    est = estimate(_small_llama, world_size=8, mesh_shape=(2, 4), wrap=(LlamaBlock,),
                   sharding_strategy="optim_grads_params")
    n = est.memory.num_groups
    # Inner ZeRO-3 over 4 ranks, plus one outer all-reduce per group and window.
    assert est.collectives["all_reduce"][0] == n
    assert est.collectives["all_gather"][0] == 2 * n


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "llama", "--layers", "2", "--dim", "64", "--ffn", "160", "--vocab", "300",
          "--heads", "4", "--kv-heads", "2", "--world-size", "16", "--mesh", "2x8"])
    out = capsys.readouterr().out
    for label in STRATEGIES + ["hsdp 2x8 no_shard", "hsdp 2x8 optim_grads_params +outer optim"]:
        assert label in out
    assert out.count("\n* ") == 1  # exactly one configuration marked
    assert "not modelled: activations" in out
    main(["--model", "gpt", "--layers", "2", "--dim", "64", "--ffn", "256", "--vocab", "300",
          "--heads", "4", "--world-size", "8", "--budget-gib", "0.0000001"])
    out = capsys.readouterr().out
    assert "nothing fits" in out and "\n* " not in out
    # --reshard-to: ZeRO-3 with reshard_after_forward=N as a row of its own (wire bytes below
    # the default schedule's; exactness: tests/distributed/test_reshard_to_int.py).
    main(["--model", "gpt", "--layers", "2", "--dim", "64", "--ffn", "256", "--vocab", "300",
          "--heads", "4", "--world-size", "8", "--reshard-to", "2"])
    out = capsys.readouterr().out
    assert "optim_grads_params reshard to 2" in out, out
    # --cpu-offload: ZeRO-3 with CPUOffloadPolicy as a row of its own and a host column
    # (exactness of the offloaded bytes: tests/distributed/test_cpu_offload.py).
    main(["--model", "gpt", "--layers", "2", "--dim", "64", "--ffn", "256", "--vocab", "300",
          "--heads", "4", "--world-size", "8", "--cpu-offload"])
    out = capsys.readouterr().out
    assert "optim_grads_params + CPU offload" in out and "    host" in out, out
    assert "not counted against the budget" in out, out


def test_fp8_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    """``float8=True`` (``--param-dtype fp8``): the blocks' linears are gathered as 1 byte per
    element, their scales counted (one fp32 each, one stacked storage), and the scale
    precompute adds one all-reduce; another subclass and FP8 with --tp are refused. Exactness
    against real runs: tests/distributed/test_estimate_fp8.py."""
    pytest.importorskip("torchao")

    def llama() -> nn.Module:  # 7 linears per block, every dim a multiple of 16
        return LlamaDecoder(layers=2, dim=64, ffn=128, vocab=96, heads=4, kv_heads=2)

    plain = estimate(llama, world_size=4, wrap=(LlamaBlock,), mp_policy=BF16)
    fp8 = estimate(llama, world_size=4, wrap=(LlamaBlock,), mp_policy=BF16, float8=True)
    assert fp8.memory.fp8_scales == 2 * 7 * 4 and fp8.memory.fp8_weights == 0
    linears = sum(m.weight.numel() for b in llama().blocks for m in b.modules()
                  if isinstance(m, nn.Linear))
    # ZeRO-3, one micro-batch: each linear gathered twice, 1 byte per element instead of 2 (up
    # to the layouts' padding, which differs once the linears form groups of their own).
    saved = plain.collectives["all_gather"][1] - fp8.collectives["all_gather"][1]
    assert abs(saved - 2 * linears) <= 0.02 * linears, (saved, linears)
    assert fp8.collectives["all_reduce"] == (1, 2 * 7 * 4)  # the amaxes, fp32
    main(["--layers", "1", "--dim", "64", "--ffn", "128", "--vocab", "96", "--heads", "4",
          "--kv-heads", "2", "--world-size", "4", "--mesh", "2x2", "--param-dtype", "fp8"])
    out = capsys.readouterr().out
    assert "float8 linears gathered in FP8" in out and "+outer optim" in out, out
    with pytest.raises(SystemExit):
        main(["--world-size", "4", "--tp", "2", "--param-dtype", "fp8"])
    assert not dist.is_initialized()


def test_tp_presets_divide_the_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp: the preset's plan leaves each TP rank about 1/tp of the block weights."""
    def llama() -> nn.Module:
        return LlamaDecoder(2, 64, 128, 96, 4, 2)

    from megatron_fsdp_v2.estimator._presets import tp_plan

    for model, block, name in ((llama, LlamaBlock, "llama"),
                               (lambda: GPTDecoder(2, 64, 128, 96, 4, 16), GPTBlock, "gpt")):
        whole = estimate(model, world_size=2, wrap=(block,), sharding_strategy="no_shard")
        split = estimate(model, world_size=4, tp=2, tp_plan=tp_plan(name), wrap=(block,),
                         sharding_strategy="no_shard")
        assert whole.memory.model_weights / 2 < split.memory.model_weights
        assert split.memory.model_weights < 0.6 * whole.memory.model_weights
    main(["--world-size", "4", "--tp", "2", "--layers", "1", "--dim", "64", "--ffn", "128",
          "--vocab", "96", "--heads", "4", "--kv-heads", "2"])
    assert "tp 2 (dp 2)" in capsys.readouterr().out
