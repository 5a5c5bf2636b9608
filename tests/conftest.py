"""Session-wide set-up shared by every test folder."""

from megatron_fsdp_v2.testing import preload_in_server

# Test-only dependencies that many ranks import (the Hugging Face model classes take about 3 s
# of CPU per process; torchao's float8 about 1 s): imported once by the rank pools' fork server
# instead of once per rank (see [Note: ranks fork from a preloaded server]). Missing packages
# are skipped there; the tests that need them skip themselves.
preload_in_server(
    "torchao.float8",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
)
