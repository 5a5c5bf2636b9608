"""Atomic saves of DCP checkpoints to a local directory: the temporary directory, the agreement
of every rank, and the commit that replaces a checkpoint as a whole.

[Note: atomic saves and checksums]
``checkpoint.save`` to a local directory never leaves a half-written checkpoint at its path, and
never one made of two saves' files. After the ranks agree that they can start (the state dict
built, the path usable, a save id drawn by the coordinator and shared with that agreement), every
rank writes into ``<path>.<save id>.incomplete``, a directory only this save writes to, and reads
back the files it wrote to CRC32 each stored item (``_checksums.py``). The coordinator (DCP's,
the group's rank 0) gathers every rank's outcome and checksums; only if all succeeded does it
write ``checksums.json``, move an existing checkpoint aside to ``<path>.<save id>.old``, rename
the temporary directory to ``<path>`` and remove the old one; then it broadcasts its verdict, so
every rank raises together or returns after the commit. A failure before the rename leaves the
old checkpoint untouched; a crash between the two renames leaves it whole at
``<path>.<save id>.old``, and the next save to ``<path>`` puts it back first.

Two saves to one path at once (two jobs, or a job restarted while its predecessor still writes)
each write their own directory, so neither can overwrite, remove or add to the other's files.
Their commits are renames of whole directories: a rename of the temporary directory onto a
``<path>`` that another commit has just filled fails (POSIX ``rename`` does not replace a
non-empty directory), and moving aside a ``<path>`` that another commit has just moved fails,
so the later commit either replaces the earlier checkpoint whole or fails with an error naming
the concurrent save; ``<path>`` always holds exactly one save's files. Leftovers of other saves'
directories are never removed (they may still be writing), only the fixed-name ones of earlier
versions (``<path>.incomplete``, ``<path>.old``); a crashed save's ``<path>.<id>.incomplete``
stays until removed by hand.

A load reads through one opened directory (``pinned_directory``): a commit during the load
renames directories but cannot change which files the load reads, and the ranks check that they
opened the same save (DCP's ``save_id``), so a load never mixes two saves' files either.

``checkpoint.load`` checks every item against ``checksums.json`` (when the file exists and
belongs to the same save, by DCP's ``save_id``) before ``dcp.load`` reads anything, the files
split across ranks; ``dcp.load`` then reads into a staging copy, never into the model (see
``_staging.py``). DCP's ``CheckpointException`` (a ``BaseException``, which escapes ``except
Exception``) never leaves ``save``/``load``: it becomes a chained ``RuntimeError``. Every
collective here runs on the group DCP gets (see ``[Note: checkpoint collectives]`` in
``_process_group.py``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from . import _process_group
from ._checksums import checksum_items, write_checksum_file, writer_rank

__all__ = ["atomic_save", "interrupted_commit_hint", "local_dir", "pinned_directory"]

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


def _sibling(path: Path, suffix: str, save_id: str | None = None) -> Path:
    """``<path>.<save_id><suffix>``: a directory of one save only (see the note at the top);
    without ``save_id`` the fixed name earlier versions used, removed as a leftover."""
    middle = "" if save_id is None else f".{save_id}"
    return path.with_name(path.name + middle + suffix)


def _old_checkpoints(root: Path) -> list[Path]:
    """Checkpoints that interrupted commits moved aside (this version's and earlier
    versions' names), newest first."""
    candidates = [_sibling(root, _OLD_SUFFIX),
                  *root.parent.glob(f"{glob.escape(root.name)}.*{_OLD_SUFFIX}")]
    found = [p for p in set(candidates) if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _new_save_id() -> str:
    # Unique across jobs and hosts sharing the filesystem (random, not pid or time based).
    return uuid.uuid4().hex[:16]


def interrupted_commit_hint(root: Path) -> str:
    """For a load that found no checkpoint at ``root``: where an interrupted commit left the
    previous one, or ``""``."""
    if root.exists():
        return ""
    olds = _old_checkpoints(root)
    if not olds:
        return ""
    return (f"; a save was interrupted while committing and left the previous checkpoint at "
            f"'{olds[0]}' (the next save to this path puts it back, or rename it)")


@contextlib.contextmanager
def pinned_directory(root: Path) -> Iterator[Path]:
    """A path that keeps naming the directory at ``root`` as it is on entry, even after a
    concurrent save's commit renamed it away and another checkpoint into ``root``: the
    directory opened once, read through ``/proc/self/fd/<fd>`` (Linux). A load that reads
    through it reads one save's files only (or fails, when that save's files were removed
    since); ``root`` itself where the platform has no such path or ``root`` cannot be opened
    (the metadata read then reports it)."""
    proc = Path("/proc/self/fd")
    if not proc.is_dir() or not hasattr(os, "O_DIRECTORY"):
        yield root
        return
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield root
        return
    try:
        yield proc / str(fd)
    finally:
        os.close(fd)


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


def _prepare_directory(root: Path, tmp: Path) -> None:
    """Coordinator only: repair what an interrupted save left behind, then create this save's
    own, new temporary directory to write into."""
    if not root.exists():
        olds = _old_checkpoints(root)
        if olds:
            # A crash between a commit's renames: put the newest old checkpoint back. (A
            # concurrent commit between its renames then fails its second rename: one whole.)
            try:
                os.rename(olds[0], root)
            except OSError:
                pass  # another save put one back, or committed, first
    # Fixed names of earlier versions: no save of this version writes to them.
    legacy_tmp, legacy_old = _sibling(root, _INCOMPLETE_SUFFIX), _sibling(root, _OLD_SUFFIX)
    if legacy_tmp.exists() or legacy_tmp.is_symlink():
        _remove(legacy_tmp)
    if root.exists() and (legacy_old.exists() or legacy_old.is_symlink()):
        _remove(legacy_old)  # a crash after a commit's rename: the new checkpoint is in place
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()  # exclusive: a save id that exists already is an error, never shared


def _commit(root: Path, tmp: Path, old: Path) -> None:
    """Coordinator only: replace ``root`` by the complete checkpoint in ``tmp``. ``root`` is
    never a mix of the two: the old checkpoint moves aside whole and comes back whole if the
    second rename fails. A concurrent commit to ``root`` makes one of the renames fail (see the
    note at the top): this save then raises, and ``root`` holds the other save whole."""
    moved = root.exists()
    try:
        if moved:
            os.rename(root, old)
    except FileNotFoundError as exc:
        raise RuntimeError(f"another save to '{root}' committed at the same time (its "
                           "checkpoint moved away while this one committed); this save was "
                           "not committed") from exc
    try:
        os.rename(tmp, root)
    except BaseException as exc:
        # Whether another commit put a checkpoint at root since: ours could not go there.
        taken = not moved and root.exists()
        if moved:
            try:
                os.rename(old, root)
            except OSError:  # a concurrent commit filled root: its checkpoint stays
                taken = True
                _remove(old)
        if isinstance(exc, OSError) and taken:
            raise RuntimeError(f"another save to '{root}' committed at the same time (a "
                               "checkpoint appeared there while this one committed); this "
                               "save was not committed") from exc
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
    """Write ``build_state()`` into ``<root>.<save id>.incomplete``, agree, checksum, commit
    (see the note at the top). Every rank of ``process_group`` (DCP's group) calls it."""
    rank, size = _process_group.rank_and_size(process_group)
    # Drawn by the coordinator, shared with the agreement below: names this save's directories.
    save_id = _new_save_id() if rank == 0 else None
    where = f"checkpoint.save to '{root}'"

    # 1. Checks, the state dict and a clean temporary directory, agreed before DCP's first
    # collective: a rank that failed here would otherwise leave the others waiting in it.
    failure: _process_group.Failure | None = None
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
                assert save_id is not None
                _prepare_directory(root, _sibling(root, _INCOMPLETE_SUFFIX, save_id))
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        failure, cause = (RuntimeError, f"{where} failed before writing: "
                                        f"{_process_group.describe(exc, rank)}"), exc
    agreed = _process_group.all_gather((failure, save_id), process_group)
    save_id = agreed[0][1]
    tmp = _sibling(root, _INCOMPLETE_SUFFIX, save_id)
    old = _sibling(root, _OLD_SUFFIX, save_id)
    failures = [f for f, _ in agreed]
    if rank == 0 and any(f is not None for f in failures) and failure is None:
        shutil.rmtree(tmp, ignore_errors=True)
    _process_group.raise_first(failures, cause)

    # 2. Every rank writes into the temporary directory and checksums the files it wrote.
    writer = storage_writer if storage_writer is not None else dcp.FileSystemWriter(tmp)
    metadata: Metadata | None = None
    entries: list[dict[str, Any]] = []
    try:
        dcp.save(state, checkpoint_id=tmp, storage_writer=writer, process_group=process_group)
        # What the coordinator wrote, not dcp.save's return value: torch 2.11's returns metadata
        # whose ``storage_data`` is ``None`` (its writer's ``finish`` fills a copy). Every rank
        # is past DCP's final collective here, so ``.metadata`` is on disk.
        metadata = dcp.FileSystemReader(tmp).read_metadata()
        if checksums:
            files = {info.relative_path for info in metadata.storage_data.values()}
            entries = checksum_items(tmp, metadata, (n for n in files
                                                     if writer_rank(n, size) == rank))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised on every rank below
        failure, cause = (RuntimeError, f"{where} failed, {_untouched(root, old)}: "
                                        f"{_process_group.describe(exc, rank)}"), exc
    finally:
        if storage_writer is not None:
            storage_writer.reset(root)  # the caller's writer points at the checkpoint again

    # 3. The coordinator collects the verdicts and checksums (one gather); if every rank
    # succeeded it writes the checksum file and commits. Its verdict (one broadcast) also keeps
    # every rank from returning before the checkpoint is in place.
    results = _process_group.gather_to_coordinator((failure, entries), process_group)
    verdict: _process_group.Failure | None = None
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
                                            f"{_process_group.describe(exc, rank)}"), exc
        if verdict is not None:  # every rank is past its writes: nothing writes into tmp
            shutil.rmtree(tmp, ignore_errors=True)
    agreed_verdict = _process_group.broadcast_from_coordinator(verdict, process_group)
    _process_group.raise_first([agreed_verdict], cause)
    assert metadata is not None
    return metadata
