"""Atomic saves of DCP checkpoints to a local directory: the temporary directory, the agreement
of every rank, and the commit that replaces a checkpoint as a whole.

[Note: atomic saves and checksums]
``checkpoint.save`` to a local directory never leaves a half-written checkpoint at its path.
After the ranks agree that they can start (the state dict built, the path usable, leftovers of
an earlier failed save removed), every rank writes into ``<path>.incomplete`` and reads back the
files it wrote to CRC32 each stored item (``_checksums.py``). The coordinator (DCP's,
the group's rank 0) gathers every rank's outcome and checksums; only if all succeeded does it
write ``checksums.json``, move an existing checkpoint aside to ``<path>.old``, rename the
temporary directory to ``<path>`` and remove the old one; then it broadcasts its verdict, so
every rank raises together or returns after the commit. A failure before the rename leaves the
old checkpoint untouched; a crash between the two renames leaves it whole at ``<path>.old``, and
the next save to ``<path>`` puts it back first. ``checkpoint.load`` checks every item against
``checksums.json`` (when the file exists and belongs to the same save, by DCP's ``save_id``)
before ``dcp.load`` touches the model, the files split across ranks. DCP's
``CheckpointException`` (a ``BaseException``, which escapes ``except Exception``) never leaves
``save``/``load``: it becomes a chained ``RuntimeError``. Every collective here runs on the
group DCP gets (see ``[Note: checkpoint collectives]`` in ``_group.py``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from . import _group
from ._checksums import checksum_items, write_checksum_file, writer_rank

__all__ = ["atomic_save", "interrupted_commit_hint", "local_dir"]

_INCOMPLETE_SUFFIX = ".incomplete"
_OLD_SUFFIX = ".old"


def local_dir(checkpoint_id: str | os.PathLike | None, storage: Any) -> Path | None:
    """The local directory a checkpoint lives in, or ``None`` when it is elsewhere (a URL, a
    custom storage reader or writer): atomic saves and checksums need a local filesystem."""
    if storage is not None and not isinstance(getattr(storage, "fs", None), FileSystem):
        return None
    if checkpoint_id is None:
        checkpoint_id = getattr(storage, "path", None)
    if checkpoint_id is None or "://" in str(checkpoint_id):
        return None
    return Path(checkpoint_id)


def _sibling(path: Path, suffix: str) -> Path:
    # Derived from the path alone, so every rank agrees on it without communication.
    return path.with_name(path.name + suffix)


def interrupted_commit_hint(root: Path) -> str:
    """For a load that found no checkpoint at ``root``: where an interrupted commit left the
    previous one, or ``""``."""
    old = _sibling(root, _OLD_SUFFIX)
    if root.exists() or not old.is_dir():
        return ""
    return (f"; a save was interrupted while committing and left the previous checkpoint at "
            f"'{old}' (the next save to this path puts it back, or rename it)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (best effort: not every platform can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _untouched(root: Path, old: Path) -> str:
    """What a failed save left, for its error message."""
    if not root.exists() and old.is_dir():  # the commit could not even put it back
        return f"nothing was committed; the previous checkpoint is at '{old}'"
    return "nothing was committed and the previous checkpoint, if any, is unchanged"


def _prepare_directory(root: Path, tmp: Path, old: Path) -> None:
    """Coordinator only: repair what an interrupted save left behind, then create an empty
    temporary directory to write into."""
    if old.exists():
        if root.exists():
            _remove(old)  # a crash after the commit's rename: the new checkpoint is in place
        else:
            os.rename(old, root)  # a crash between the commit's renames: put the old one back
    if tmp.exists() or tmp.is_symlink():
        _remove(tmp)  # a failed or interrupted earlier attempt
    tmp.mkdir(parents=True)


def _commit(root: Path, tmp: Path, old: Path) -> None:
    """Coordinator only: replace ``root`` by the complete checkpoint in ``tmp``. ``root`` is
    never a mix of the two: the old checkpoint moves aside whole and comes back whole if the
    second rename fails."""
    moved = root.exists()
    if moved:
        os.rename(root, old)
    try:
        os.rename(tmp, root)
    except BaseException:
        if moved:
            os.rename(old, root)
        raise
    _fsync_dir(root.parent)
    if moved:
        try:
            shutil.rmtree(old)
        except OSError as exc:  # the new checkpoint is committed; the next save removes it
            warnings.warn(f"checkpoint.save: could not remove the previous checkpoint at "
                          f"'{old}': {exc}", stacklevel=4)


def atomic_save(
    build_state: Callable[[], dict[str, Any]],
    root: Path,
    storage_writer: Any,
    process_group: dist.ProcessGroup | None,
    checksums: bool,
) -> Metadata:
    """Write ``build_state()`` into ``<root>.incomplete``, agree, checksum, commit (see the note
    at the top). Every rank of ``process_group`` (DCP's group) calls it."""
    rank, size = _group.rank_and_size(process_group)
    tmp, old = _sibling(root, _INCOMPLETE_SUFFIX), _sibling(root, _OLD_SUFFIX)
    where = f"checkpoint.save to '{root}'"

    # 1. Checks, the state dict and a clean temporary directory, agreed before DCP's first
    # collective: a rank that failed here would otherwise leave the others waiting in it.
    failure: _group.Failure | None = None
    cause: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        if (root.exists() or root.is_symlink()) and not root.is_dir():
            failure = (ValueError, f"{where}: the path exists and is not a directory")
        elif not getattr(storage_writer, "overwrite", True) and (root / ".metadata").exists():
            failure = (ValueError, f"{where}: a checkpoint exists there and the storage "
                                   "writer has overwrite=False")
        else:
            state = build_state()
            if rank == 0:
                _prepare_directory(root, tmp, old)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        failure, cause = (RuntimeError, f"{where} failed before writing: "
                                        f"{_group.describe(exc, rank)}"), exc
    failures = _group.all_gather(failure, process_group)
    if rank == 0 and any(f is not None for f in failures) and failure is None:
        shutil.rmtree(tmp, ignore_errors=True)
    _group.raise_first(failures, cause)

    # 2. Every rank writes into the temporary directory and checksums the files it wrote.
    writer = storage_writer if storage_writer is not None else dcp.FileSystemWriter(tmp)
    metadata: Metadata | None = None
    entries: list[dict[str, Any]] = []
    try:
        metadata = dcp.save(state, checkpoint_id=tmp, storage_writer=writer,
                            process_group=process_group)
        if checksums:
            files = {info.relative_path for info in metadata.storage_data.values()}
            entries = checksum_items(tmp, metadata, (n for n in files
                                                     if writer_rank(n, size) == rank))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised on every rank below
        failure, cause = (RuntimeError, f"{where} failed, {_untouched(root, old)}: "
                                        f"{_group.describe(exc, rank)}"), exc
    finally:
        if storage_writer is not None:
            storage_writer.reset(root)  # the caller's writer points at the checkpoint again

    # 3. The coordinator collects the verdicts and checksums (one gather); if every rank
    # succeeded it writes the checksum file and commits. Its verdict (one broadcast) also keeps
    # every rank from returning before the checkpoint is in place.
    results = _group.gather_to_coordinator((failure, entries), process_group)
    verdict: _group.Failure | None = None
    if rank == 0:
        assert results is not None
        verdict = next((f for f, _ in results if f is not None), None)
        try:
            if verdict is None:
                assert metadata is not None
                if checksums:
                    write_checksum_file(tmp, metadata, [e for _, es in results for e in es])
                _commit(root, tmp, old)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            verdict, cause = (RuntimeError, f"{where} failed while committing, "
                                            f"{_untouched(root, old)}: "
                                            f"{_group.describe(exc, rank)}"), exc
        if verdict is not None:  # every rank is past its writes: nothing writes into tmp
            shutil.rmtree(tmp, ignore_errors=True)
    _group.raise_first([_group.broadcast_from_coordinator(verdict, process_group)], cause)
    assert metadata is not None
    return metadata
