"""``python -m megatron_fsdp_v2.estimator``: every strategy side by side for one model preset."""

from ._cli import main

main()
