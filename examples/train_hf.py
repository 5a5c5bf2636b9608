"""Train a tiny Hugging Face causal LM (GPT-2 or Llama, built from a config) with megatron_fsdp_v2.

    torchrun --nproc_per_node=4 examples/train_hf.py --model gpt2 --strategy optim_grads
    torchrun --nproc_per_node=4 examples/train_hf.py --model llama --checkpointing

The model is made from a ``transformers`` config (nothing is downloaded) with the same seed on
every rank; each decoder layer is wrapped with ``fully_shard``, then the root, exactly as a
hand-written model; the loss is the model's own (``labels=``). Training, data and output are
``examples/train.py``'s (its ``train`` loop and options): rank 0 prints the loss (mean over
ranks), throughput, the bytes this rank communicated and memory per rank every step. Needs
``transformers`` (``pip install transformers``; ``scripts/install.sh`` installs it for the tests).

GPT-2 ties its LM head to the input embedding; Llama has grouped-query attention (``--kv-heads``)
and an untied head. ``--checkpointing`` turns on HF's activation checkpointing of each decoder
layer (``use_reentrant=False`` unless ``--reentrant``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import build_parser, setup_distributed, teardown_distributed, train  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = build_parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama"],
                   help="GPT2LMHeadModel (tied head) or LlamaForCausalLM (GQA, untied head)")
    p.add_argument("--dim", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads (llama; must divide --heads)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--checkpointing", action="store_true",
                   help="HF activation checkpointing of every decoder layer")
    p.add_argument("--reentrant", action="store_true",
                   help="with --checkpointing: use_reentrant=True instead of False")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.model == "llama" and args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The HF model of ``args``, dropout off, eager attention, in training mode."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("examples/train_hf.py needs transformers: pip install transformers") \
            from None
    # No KV cache: training only (HF would switch it off under checkpointing, with a warning).
    common = dict(vocab_size=args.vocab, bos_token_id=0, eos_token_id=0, use_cache=False,
                  attn_implementation="eager")
    if args.model == "gpt2":
        config = transformers.GPT2Config(
            n_positions=args.seq_len, n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=args.dim, intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.seq_len, **common)
        model = transformers.LlamaForCausalLM(config)
    if args.checkpointing:
        kwargs = {"use_reentrant": args.reentrant}
        # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # The loss HF would fall back to anyway, named so that it does not warn about guessing it.
    model.loss_type = "ForCausalLM"
    return model.train()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """GPT-2's ``transformer.h`` or Llama's ``model.layers``."""
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return list(model.model.layers)


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss: it shifts ``labels`` by one inside."""
    return model(input_ids=tokens, labels=tokens).loss


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, created = setup_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    extra = f" kv_heads={args.kv_heads}" if args.model == "llama" else ""
    ckpt = (f" checkpointing(use_reentrant={args.reentrant})" if args.checkpointing else "")
    title = (f"{type(model).__name__} {num_params / 1e6:.2f}M params (dim={args.dim} "
             f"layers={args.layers} heads={args.heads}{extra} vocab={args.vocab} "
             f"seq={args.seq_len}){ckpt}")
    # synthetic_batch(..., seq_len - 1) gives seq_len tokens: the model sees seq_len positions.
    train(model, decoder_layers(model), args, device, title=title, loss_fn=hf_loss,
          batch_len=args.seq_len - 1, vocab=args.vocab)
    teardown_distributed(created)


if __name__ == "__main__":
    main()
