"""Meta-device construction with initializers that cover a subtree ([Note: initializers that
cover a subtree] in ``_init_order.py``): a parent's ``reset_parameters`` that re-initializes its
children is reproduced bitwise (values and the random stream), nested and with tied weights;
what cannot be reproduced (Hugging Face's ``_init_weights``, a covered parameter nobody wrote)
raises ``RuntimeError`` before anything is drawn.

Reference: the same model built on the device with the same seed. World 3 (uneven shards).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_v2 import checkpoint, fully_shard

from _models import agree, wrap_blocks
from _pool import RankPools

WORLD = 3
TIMEOUT_S = 240
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class RMSNorm(nn.Module):
    """A norm with no ``reset_parameters``: its block's ``reset_parameters`` sets it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ScaledBlock(nn.Module):
    """Re-initializes its children at the end of ``__init__`` (Megatron/GPT-2 style scaled
    init), draws for a parameter of its own after them, and sets its norm."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.gate = nn.Parameter(torch.empty(dim))
        self.norm = RMSNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc1.weight, std=0.02)
        nn.init.zeros_(self.fc1.bias)
        nn.init.normal_(self.fc2.weight, std=0.02 / (2 * self.depth) ** 0.5)
        nn.init.zeros_(self.fc2.bias)
        nn.init.ones_(self.norm.weight)
        nn.init.uniform_(self.gate, -1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.fc2(F.gelu(self.fc1(self.norm(x))))


class CoveredLM(nn.Module):
    """A root whose own ``reset_parameters`` covers everything (nested covering: the blocks
    cover their children first) and re-draws the tied embedding/head weight."""

    def __init__(self, vocab: int = 29, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ScaledBlock(dim, layers) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.tok.weight, std=0.5)  # the head's weight too: they are tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class HFStyle(nn.Module):
    """Hugging Face ``PreTrainedModel``-style: ``post_init()`` applies ``_init_weights`` to
    every module after construction; the children are torch layers with reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.lin = nn.Linear(8, 8)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def post_init(self) -> None:
        with torch.no_grad():
            self.apply(self._init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(idx))


class Forgetful(nn.Module):
    """Covers its subtree but never sets its norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8)
        self.lin = nn.Linear(8, 8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return checkpoint.get_full_state_dict(model, rank0_only=False)


def _bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} differs from the device-built value"


def _covering(rank: int, world: int, strategy: str, model_name: str) -> None:
    make = {"ScaledBlock": lambda: ScaledBlock(8, 2), "CoveredLM": CoveredLM}[model_name]
    torch.manual_seed(3)
    ref = make()
    after_ref = torch.rand(4)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = make()
    model = wrap_blocks(model, strategy)
    x = (torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
         if model_name == "ScaledBlock" else torch.arange(10).view(2, 5) % 29)
    out = model(x)  # materializes
    after_meta = torch.rand(4)
    agree(f"{strategy} {model_name}: random stream",
          lambda: torch.testing.assert_close(after_meta, after_ref, rtol=0, atol=0))
    agree(f"{strategy} {model_name}: parameters",
          lambda: _bitwise_equal(_full(model), ref.state_dict()))
    agree(f"{strategy} {model_name}: forward",
          lambda: torch.testing.assert_close(out, ref(x), rtol=0, atol=0))


@pytest.mark.parametrize("model_name", ["ScaledBlock", "CoveredLM"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_covering_reset_parameters_bitwise(ranks: RankPools, strategy: str,
                                           model_name: str) -> None:
    """A parent's reset_parameters re-initializing its children (nested, tied, with a child
    norm that has no reset_parameters): bitwise the device-built model."""
    ranks.run(_covering, WORLD, strategy, model_name, timeout_s=TIMEOUT_S)


def _refused(rank: int, world: int, case: str) -> None:
    make, pattern = {
        "hf_init_weights": (HFStyle, r"'?HFStyle'? .*_init_weights\(\).*param_init_fn"),
        "covered_param_not_written": (
            Forgetful, r"'norm\.weight'.*RMSNorm.*did not write it"),
    }[case]
    with torch.device("meta"):
        model = fully_shard(make())
    torch.manual_seed(0)
    try:
        model(torch.ones(2, 8) if case != "hf_init_weights" else torch.zeros(2, dtype=torch.long))
    except RuntimeError as e:
        import re
        assert re.search(pattern, str(e), re.S), str(e)
    else:
        raise AssertionError(f"{case}: materialized without an error")
    if case == "hf_init_weights":  # refused before anything was drawn
        agree("random stream untouched", lambda: torch.testing.assert_close(
            torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0))))


@pytest.mark.parametrize("case", ["hf_init_weights", "covered_param_not_written"])
def test_unreproducible_init_refused(ranks: RankPools, case: str) -> None:
    ranks.run(_refused, WORLD, case, timeout_s=TIMEOUT_S)


def _hf_bert(rank: int, world: int) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=31, hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    model = fully_shard(model)
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    except RuntimeError as e:
        assert "_init_weights" in str(e) or "init_weights" in str(e), str(e)
    else:
        raise AssertionError("a Hugging Face model built on meta was materialized with torch's "
                             "default init instead of its _init_weights")


def test_hugging_face_model_on_meta_refused(ranks: RankPools) -> None:
    """A real Hugging Face model (BERT: only torch layers, so every module has an initializer)
    built on meta: refused, not materialized with torch's defaults."""
    pytest.importorskip("transformers")
    ranks.run(_hf_bert, WORLD, timeout_s=TIMEOUT_S)
