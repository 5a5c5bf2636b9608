"""``MemoryReport`` arithmetic and text (no processes; the byte counts themselves are checked
against the ZeRO formula in tests/distributed/test_counts_and_memory.py)."""

from __future__ import annotations

from megatron_fsdp_v2 import MemoryReport

MiB = 1 << 20


def test_aliased_main_weights_are_named_and_not_added_to_total() -> None:
    r = MemoryReport(model_weights=4 * MiB, main_weights_aliased=2 * MiB, main_grads=2 * MiB)
    assert r.total == 6 * MiB
    text = str(r)
    assert "main_weights=aliases model_weights" in text, text
    assert "main_weights=0.00MiB" not in text, text


def test_separate_main_weights_print_their_size() -> None:
    r = MemoryReport(model_weights=MiB, main_weights=2 * MiB)
    assert "main_weights=2.00MiB " in str(r), str(r)
    assert "aliases" not in str(r)


def test_mixed_groups_print_both() -> None:
    r = MemoryReport(main_weights=2 * MiB, main_weights_aliased=MiB)
    assert "main_weights=2.00MiB(+1.00MiB aliasing model_weights)" in str(r), str(r)
    assert r.total == 2 * MiB


def test_optimizer_state_is_in_total_and_text_only_when_counted() -> None:
    assert "optimizer_state" not in str(MemoryReport(model_weights=MiB))
    r = MemoryReport(model_weights=MiB, optimizer_state=3 * MiB)
    assert "optimizer_state=3.00MiB" in str(r), str(r)
    assert r.total == 4 * MiB
