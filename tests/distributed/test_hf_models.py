"""Hugging Face ``transformers`` models under ``fully_shard``: the same training as one process.

A tiny ``GPT2LMHeadModel`` (tied input embedding and LM head) and a tiny ``LlamaForCausalLM``
(grouped-query attention, rotary embeddings, untied head), both built from configs (nothing is
downloaded), are wrapped the usual way (each decoder layer, then the root) and trained on 2 gloo
ranks for every strategy, with HF's own loss (``labels=``), two marked micro-batches per step
and AdamW. The reference is a ``copy.deepcopy`` of the same model, taken before wrapping and
trained in one process on the concatenation of both ranks' micro-batches (HF's loss is a mean
over tokens and every rank holds as many, so the reference's gradients are the rank-averaged
ones). Checked: every step's loss (rank mean against the reference's) and every parameter after
the last step (this rank's rows).

Variants per (model, strategy):

* ``plain``: fp32, no activation checkpointing;
* ``ckpt_reentrant`` / ``ckpt_non_reentrant``: HF activation checkpointing enabled before
  wrapping, with each ``use_reentrant`` setting HF can pass to ``torch.utils.checkpoint`` (HF
  checkpoints the decoder layer's ``forward``, inside the unit's hooks). The reference trains
  without checkpointing: recomputation must not change the numbers.
* ``ckpt_reentrant_after_wrap``: the same, enabled on the wrapped model through the older name
  ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``.
* ``bf16`` (a test of its own): ``MixedPrecisionPolicy(param_dtype=bf16)`` (fp32 main weights
  and gradients). Its reference emulates that precision in one process: a bf16 copy of the fp32
  weights runs each rank's micro-batch separately (the same shapes, hence the same bf16
  rounding), gradients are averaged in fp32, AdamW updates fp32 weights. The first step's
  losses must match to fp32 rounding of the rank mean; later steps to rtol 1e-5 and the fp32
  main weights to the fp32 tolerances (only the order the fp32 gradients are summed in
  differs, by strategy).

``transformers`` is a test dependency (``scripts/install.sh`` installs it); without it the file
is skipped. All tests share one pool of 2 ranks (``_pool.RankPools``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

pytest.importorskip(
    "transformers", reason="transformers is not installed (a test dependency: scripts/install.sh)"
)

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard  # noqa: E402

from _models import agree, assert_close_to_reference  # noqa: E402
from _pool import RankPools  # noqa: E402

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
MODELS = ["gpt2", "llama"]
WORLD = 2
STEPS = 3
MICRO = 2
PER_RANK = 2  # sequences per rank per micro-batch
SEQ = 12
VOCAB = 97  # odd: the embedding and head rows split unevenly over 2 ranks
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 280


# ------------------------------------------------------------------------------------------ models

def build_model(name: str, seed: int = 0) -> nn.Module:
    """A tiny HF causal LM from a config, in training mode, dropout off, eager attention."""
    import transformers

    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )
        model = transformers.GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2's head must be tied"
    elif name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=None,
            attn_implementation="eager",
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.train()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to wrap as units before the root."""
    base = getattr(model, "transformer", None) or model.model
    return list(base.h if hasattr(base, "h") else base.layers)


def enable_checkpointing(model: nn.Module, use_reentrant: bool, old_name: bool = False) -> None:
    """HF activation checkpointing of every decoder layer, with ``use_reentrant`` passed on to
    ``torch.utils.checkpoint``. ``gradient_checkpointing_enable`` is the long-standing name
    (``old_name``); transformers 5 calls it ``activation_checkpointing_enable`` and keeps the
    old one as a warning alias."""
    kwargs = {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and not old_name:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))


def wrap(model: nn.Module, strategy: str, **kw: Any) -> nn.Module:
    for layer in decoder_layers(model):
        fully_shard(layer, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def batches(seed: int = 0) -> list[list[list[torch.Tensor]]]:
    """batches[step][micro][rank] -> that rank's token ids; identical on every rank."""
    g = torch.Generator().manual_seed(1234 + seed)
    return [[[torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g) for _ in range(WORLD)]
             for _ in range(MICRO)] for _ in range(STEPS)]


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (labels shifted inside the model; mean over predicted tokens)."""
    return model(input_ids=ids, labels=ids).loss


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with ``eps=1e-4``. GPT-2's key bias has a gradient that is exactly zero in exact
    arithmetic (softmax ignores a shift shared by all keys); in floating point it is rounding
    noise (~1e-9) that differs between a rank's half batch and the reference's whole batch, and
    with the default ``eps=1e-8`` Adam scales that noise up to ~lr-sized steps. A larger eps keeps
    such steps below the tolerance and barely changes the steps of real gradients (~1e-2)."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1)


def rank_mean(x: torch.Tensor) -> float:
    import torch.distributed as dist

    t = x.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# ------------------------------------------------------------------------------------- fp32 cases

def _train_fp32(rank: int, name: str, strategy: str, checkpointing: str | None) -> None:
    model = build_model(name)
    ref = copy.deepcopy(model)
    if checkpointing is not None and not checkpointing.endswith("after_wrap"):
        enable_checkpointing(model, use_reentrant=checkpointing == "reentrant")
    wrap(model, strategy)
    if checkpointing == "reentrant_after_wrap":
        enable_checkpointing(model, use_reentrant=True, old_name=True)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    # Calls of one layer's MLP: twice per micro-batch when checkpointing recomputes it. (A
    # pre-hook: non-reentrant recomputation stops once the saved tensors are back, before the
    # MLP's forward returns.)
    calls = [0]
    decoder_layers(model)[0].mlp.register_forward_pre_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1))
    for step, micro in enumerate(batches()):
        loss_sum = ref_sum = 0.0
        for i, parts in enumerate(micro):
            model.set_is_last_backward(i == MICRO - 1)
            loss = hf_loss(model, parts[rank]) / MICRO
            loss.backward()
            ref_loss = hf_loss(ref, torch.cat(parts)) / MICRO
            ref_loss.backward()
            loss_sum += rank_mean(loss)
            ref_sum += ref_loss.item()
        agree(f"step {step} loss", lambda: torch.testing.assert_close(
            loss_sum, ref_sum, rtol=RTOL, atol=ATOL))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    agree("parameters after training", lambda: assert_close_to_reference(
        model, ref, rtol=RTOL, atol=ATOL))
    forwards = STEPS * MICRO * (1 if checkpointing is None else 2)
    agree("forwards of a checkpointed layer", lambda: _assert_equal(calls[0], forwards))
    if name == "gpt2":
        agree("tied head", lambda: _assert_tied(model))


def _assert_equal(got: int, expected: int) -> None:
    assert got == expected, f"{got} MLP forwards, expected {expected}"


def _assert_tied(model: nn.Module) -> None:
    assert model.lm_head.weight is model.transformer.wte.weight, (
        "GPT-2's LM head is no longer the input embedding's parameter after training")


_ELSEWHERE = "failed on another rank"  # ``agree``'s message on the ranks where a check passed

VARIANTS: dict[str, str | None] = {
    "plain": None, "ckpt_reentrant": "reentrant", "ckpt_non_reentrant": "non_reentrant",
    "ckpt_reentrant_after_wrap": "reentrant_after_wrap",
}


def _fp32_worker(rank: int, world: int, name: str, strategy: str) -> dict[str, str]:
    """Every fp32 variant; returns the failing ones (variant -> message) on every rank."""
    failures = {}
    for variant, checkpointing in VARIANTS.items():
        try:
            _train_fp32(rank, name, strategy, checkpointing)
        except AssertionError as e:  # agreed across ranks by ``agree``
            failures[variant] = str(e)
    return failures


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_matches_single_process(ranks: RankPools, name: str, strategy: str) -> None:
    per_rank = ranks.run(_fp32_worker, WORLD, name, strategy, timeout_s=TIMEOUT_S)
    report = [f"[{name} / {strategy} / {variant}] rank {r}: {msg}"
              for r, failures in enumerate(per_rank) for variant, msg in failures.items()
              if not msg.endswith(_ELSEWHERE)]
    assert not any(per_rank), "\n".join(report)


# -------------------------------------------------------------------------------------- bf16 case

def _bf16_worker(rank: int, world: int, name: str, strategy: str) -> None:
    master = build_model(name)
    model = copy.deepcopy(master)
    wrap(model, strategy, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    # The reference's compute copy: parameters in bf16, buffers (rotary frequencies) as they are,
    # as fully_shard leaves them.
    compute = copy.deepcopy(master)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt, ref_opt = adamw(model.parameters()), adamw(master.parameters())
    master_params = list(master.parameters())
    compute_params = list(compute.parameters())
    for step, micro in enumerate(batches()):
        with torch.no_grad():
            for c, m in zip(compute_params, master_params):
                c.copy_(m)
        grads = [torch.zeros_like(m) for m in master_params]
        loss_sum = ref_sum = 0.0
        for i, parts in enumerate(micro):
            model.set_is_last_backward(i == MICRO - 1)
            loss = hf_loss(model, parts[rank]) / MICRO
            loss.backward()
            loss_sum += rank_mean(loss)
            for r in range(world):
                ref_loss = hf_loss(compute, parts[r]) / MICRO
                ref_sum += ref_loss.item() / world
                for g, cg in zip(grads, torch.autograd.grad(ref_loss, compute_params)):
                    g += cg.float() / world
        for m, g in zip(master_params, grads):
            m.grad = g
        if step == 0:
            # Same bf16 weights, same per-rank shapes: the same bits (up to the fp32 rank mean).
            agree("step 0 loss", lambda: torch.testing.assert_close(
                loss_sum, ref_sum, rtol=1e-6, atol=0.0))
        else:
            agree(f"step {step} loss", lambda: torch.testing.assert_close(
                loss_sum, ref_sum, rtol=1e-5, atol=0.0))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    agree("fp32 main weights after training", lambda: assert_close_to_reference(
        model, master, rtol=RTOL, atol=ATOL))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_bf16_matches_emulated_reference(ranks: RankPools, name: str,
                                                  strategy: str) -> None:
    ranks.run(_bf16_worker, WORLD, name, strategy, timeout_s=TIMEOUT_S)


def test_package_does_not_import_transformers(fresh_python) -> None:
    """transformers is a test dependency: importing the package (and wrapping) must not need it."""
    code = ("import sys, megatron_fsdp_v2, megatron_fsdp_v2.checkpoint; "
            "sys.exit('transformers' in sys.modules)")
    proc = fresh_python.run(code, check=False)
    assert proc.returncode == 0, f"importing megatron_fsdp_v2 imported transformers {proc.stderr}"
