"""``_backends``: the backend config strings torch stores for every way of naming a backend, and
the decisions the library takes from them (which backend runs a device's collectives, whether
the default mesh and the library's own tensors go on CUDA). No process group needed: the config
strings are the ones ``dist.get_backend_config`` returns for each ``init_process_group`` call
(see ``[Note: backend detection]``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_fsdp_v2._comm import _backends

# init_process_group(backend) -> what dist.get_backend_config() returns (torch 2.14.1), and
# whether the group then has a CUDA backend of its own.
CASES = [
    # (what the user passed, the stored config, native CUDA backend)
    ("nccl", "cuda:nccl", True),
    ("cuda:nccl", "cuda:nccl", True),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True),
    ("None on a GPU machine", "cuda:nccl", True),
    ("None on a CPU machine", "cpu:gloo", False),
    ("gloo", "cpu:gloo,cuda:gloo", False),
    ("cpu:gloo", "cpu:gloo", False),
    ("fake", "cpu:fake,cuda:fake,hpu:fake,xpu:fake", False),
    ("cpu:gloo,cuda:myplugin", "cpu:gloo,cuda:myplugin", True),
]


@pytest.mark.parametrize("given,config,native", CASES, ids=[c[0] for c in CASES])
def test_config_strings(given: str, config: str, native: bool) -> None:
    backends = _backends.parse_backend_config(config)
    assert _backends.moves_cuda_natively(backends) is native
    if "cpu" in backends:
        assert backends["cpu"] in ("gloo", "fake")
    if native:
        assert backends["cuda"] in ("nccl", "myplugin")


def test_parse_is_case_and_space_tolerant() -> None:
    assert _backends.parse_backend_config(" CPU:Gloo , cuda:NCCL") == {"cpu": "gloo",
                                                                        "cuda": "nccl"}


@pytest.mark.parametrize("config", ["nccl", "undefined", "cpu:", ":gloo", "cpu:gloo:x",
                                    "cpu:gloo,cpu:mpi", "cpu:gloo,"])
def test_parse_rejects_malformed(config: str) -> None:
    with pytest.raises(ValueError, match="backend config"):
        _backends.parse_backend_config(config)


def test_torch_config_repr_matches_the_cases() -> None:
    """The table above is what torch's BackendConfig gives for the explicit names (the two
    "None" rows depend on the machine's accelerator and are checked by the distributed test)."""
    for given, config, _ in CASES:
        if given.startswith("None") or "myplugin" in given:
            continue
        assert str(dist.distributed_c10d.BackendConfig(given)) == config, given


@pytest.mark.parametrize("config,cuda_available,expected", [
    ("cuda:nccl", True, "cuda"),
    ("cpu:gloo,cuda:nccl", True, "cuda"),
    ("cpu:gloo,cuda:nccl", False, "cpu"),
    ("cpu:gloo,cuda:gloo", True, "cpu"),
    ("cpu:gloo", True, "cpu"),
])
def test_collective_device_type(monkeypatch: pytest.MonkeyPatch, config: str,
                                cuda_available: bool, expected: str) -> None:
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(_backends.torch.cuda, "is_available", lambda: cuda_available)
    assert _backends.collective_device_type() == expected
    backends = _backends.parse_backend_config(config)
    assert _backends.backend_for(None, "cpu") == backends.get("cpu", "")
    assert _backends.backend_for(None, "cuda") == backends.get("cuda", "")
