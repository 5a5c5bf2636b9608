"""Checkpointing ``fully_shard`` models: sharded state dicts for ``torch.distributed.checkpoint``
(DCP) that reshard across world sizes and strategies, and full (unsharded) state dicts for a
single-file ``torch.save`` or inference hand-off.

Sharded (every rank, no gather)::

    from megatron_fsdp_v2 import checkpoint as mckpt

    mckpt.save(model, optimizer, checkpoint_id="ckpt/step100")   # dcp.save, checksums, commit
    mckpt.load(model, optimizer, checkpoint_id="ckpt/step100")   # validate, verify, dcp.load, apply

or, with DCP directly::

    msd, osd = mckpt.get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    ...
    msd, osd = mckpt.get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    mckpt.set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

Full::

    sd = mckpt.get_full_state_dict(model)              # rank 0: plain fp32 CPU tensors
    if rank == 0: torch.save(sd, "model.pt")
    mckpt.load_full_state_dict(model, torch.load("model.pt"))   # every rank passes it, or
    mckpt.load_full_state_dict(model, sd if rank == 0 else None, broadcast_from_rank0=True)

See ``design.md`` (§7 Checkpoints) for the format. The model entries are the optimizer-facing
main weights (fp32 when a separate main buffer exists), under the original parameter names.

[Note: atomic saves and checksums]
:func:`save` to a local directory never leaves a half-written checkpoint at its path. After the
ranks agree that they can start (the state dict built, the path usable, leftovers of an earlier
failed save removed), every rank writes into ``<path>.incomplete`` and reads back the files it
wrote to CRC32 each stored item. The coordinator (DCP's, the group's rank 0) gathers every
rank's outcome and checksums; only if all succeeded does it write ``checksums.json``, move an
existing checkpoint aside to ``<path>.old``, rename the temporary directory to ``<path>`` and
remove the old one; then it broadcasts its verdict, so every rank raises together or returns
after the commit. A failure before the rename leaves the old checkpoint untouched; a crash
between the two renames leaves it whole at ``<path>.old``, and the next save to ``<path>`` puts
it back first. :func:`load` checks every item against ``checksums.json`` (when the file exists
and belongs to the same save, by DCP's ``save_id``) before ``dcp.load`` touches the model, the
files split across ranks. DCP's ``CheckpointException`` (a ``BaseException``, which escapes
``except Exception``) never leaves ``save``/``load``: it becomes a chained ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _dsd
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from . import _state_dict as _sd

__all__ = [
    "get_state_dict",
    "set_state_dict",
    "save",
    "load",
    "get_full_state_dict",
    "load_full_state_dict",
]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None

_MODEL_KEY = "model"
_OPTIM_KEY = "optim"


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if optimizers is None:
        return ()
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _check_options(options: _dsd.StateDictOptions | None, api: str) -> _dsd.StateDictOptions:
    options = options if options is not None else _dsd.StateDictOptions()
    bad = [
        name for name in ("full_state_dict", "cpu_offload", "broadcast_from_rank0")
        if getattr(options, name)
    ]
    if bad:
        raise ValueError(
            f"megatron_fsdp_v2.checkpoint.{api} does not support StateDictOptions({bad[0]}=True): "
            "torch's gather and CPU offload assume torch.chunk shards, which fully_shard's "
            "uneven shards are not. Use get_full_state_dict / load_full_state_dict for full "
            "state dicts"
        )
    return options


# ---------------------------------------------------------------------- optimizer entries

def _optim_entries(osd: dict[str, Any]) -> Iterable[tuple[str, str, dict[str, Any], str]]:
    """``(param_fqn, state_name, container, container_key)`` of every per-parameter optimizer
    state entry, in the nested (``osd["state"][fqn][name]``) or the flattened
    (``osd["state.<fqn>.<name>"]``) layout."""
    state = osd.get("state")
    if isinstance(state, dict):
        for fqn, entries in state.items():
            if isinstance(entries, dict):
                for name in list(entries):
                    yield fqn, name, entries, name
        return
    for key in list(osd):
        if key.startswith("state."):
            fqn, _, name = key[len("state.") :].rpartition(".")
            yield fqn, name, osd, key


def _prepare_optim_state_dict(model: nn.Module, osd: dict[str, Any]) -> None:
    """Replace each state tensor by a detached alias (same storage, so ``dcp.load`` still writes
    into the optimizer's state; the optimizer's own tensors stay unmarked) and attach true-row
    chunk metadata to the DTensor states of sharded parameters. Plain tensor states (e.g. Adam's
    ``step``) of parameters this rank holds no rows of are marked not to be written by this
    rank (they still load).

    A rank with an empty shard never steps that parameter, so its copy of such a state may be
    stale (e.g. after resuming at another world size); every rank that holds rows has the same,
    current value, and DCP's de-duplication of plain tensors then only picks a current copy."""
    slots = _sd.dist_param_slots(model)
    for fqn, name, container, key in list(_optim_entries(osd)):
        param = slots.get(fqn)
        if param is None:
            continue
        group, index = _sd.param_slot(param)
        value = container[key]
        if not isinstance(value, torch.Tensor):
            continue
        value = container[key] = value.detach()
        if isinstance(value, DTensor):
            _sd.attach_chunk_metadata(value, group, index, f"state.{fqn}.{name}")
        elif group.strategy.shards_main_weights:
            lo, hi = group.local_row_range(index)
            if hi == lo:
                _sd.skip_on_save(value)


def _validate_optim_state_dict(model: nn.Module, osd: dict[str, Any]) -> str | None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for fqn, name, container, key in _optim_entries(osd):
        if fqn not in params:
            return (
                f"optimizer state dict has state '{name}' for '{fqn}', which is not a parameter "
                "of the model; it was saved from a different model"
            )
        value, shape = container[key], params[fqn].shape
        if isinstance(value, DTensor) and tuple(value.shape) != tuple(shape):
            return (
                f"optimizer state entry 'state.{fqn}.{name}' has shape {tuple(value.shape)} but "
                f"the parameter has shape {tuple(shape)}"
            )
    return None


# ---------------------------------------------------------------------- sharded state dicts

def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    options: _dsd.StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` for ``fully_shard`` models,
    ready for ``dcp.save`` / ``dcp.load``.

    Returns ``(model_state_dict, optim_state_dict)`` (the latter ``{}`` without optimizers),
    keyed by the original parameter names. Values of managed parameters are DTensors viewing
    the main weights (no copy; fp32 when a separate main buffer exists); optimizer states
    shaped like their parameter are DTensors sharded the same way. Every sharded DTensor carries
    chunk metadata at its true global row offset (shards are uneven and may be empty), so DCP
    writes and reads the right rows. Plain optimizer states (Adam's ``step``) of a parameter
    this rank holds no rows of are not written by this rank (see the design notes).
    ``options`` may set ``ignore_frozen_params``, ``strict``, ``flatten_optimizer_state_dict``;
    full/CPU-offloaded state dicts come from :func:`get_full_state_dict`. No collectives; an
    optimizer whose state is still empty is first initialized by a zero-learning-rate step
    (torch's behaviour), so that every state entry exists to load into.
    """
    options = _check_options(options, "get_state_dict")
    optims = _as_tuple(optimizers)
    if optims:
        msd, osd = _dsd.get_state_dict(model, optims, options=options)
        _prepare_optim_state_dict(model, osd)
    else:
        msd, osd = _dsd.get_model_state_dict(model, options=options), {}
    # model.state_dict() already attached chunk metadata (the unit's state_dict post-hook);
    # attach again in case a hook-less path built these DTensors.
    slots = _sd.dist_param_slots(model)
    for key, value in msd.items():
        param = slots.get(key)
        if param is not None and isinstance(value, DTensor):
            _sd.attach_chunk_metadata(value, *_sd.param_slot(param), key)
    return msd, osd


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any] | None = None,
    options: _dsd.StateDictOptions | None = None,
) -> Any:
    """Load what :func:`get_state_dict` returned (typically filled by ``dcp.load``) into the
    model and optimizers, through ``torch.distributed.checkpoint.state_dict.set_state_dict``.

    Keys and shapes are checked first, on every rank, and a ``ValueError`` naming the first
    mismatching key (expected vs found shape) is raised on all ranks before anything is
    written. Afterwards every unit refreshes its compute weights from the loaded main weights
    before the next forward. Returns ``(missing_keys, unexpected_keys)`` like torch.
    """
    options = _check_options(options, "set_state_dict")
    optims = _as_tuple(optimizers)
    found = {
        k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in model_state_dict.items()
    }
    error = _sd.first_mismatch(_sd.expected_entries(model), found, strict=options.strict)
    if error is None and optims and optim_state_dict:
        error = _validate_optim_state_dict(model, optim_state_dict)
    _sd.raise_if_any_rank(error)
    if optims and optim_state_dict:
        # Non-strict: a rank that holds no rows of a parameter never gives it a gradient, so
        # its optimizer may have no state for it. Entries were checked against the model above.
        _dsd.set_optimizer_state_dict(
            model, optims, optim_state_dict, options=dataclasses.replace(options, strict=False)
        )
        for optim in optims:  # it may have adopted the (marked) tensors it was given
            _sd.strip_metadata(optim.state)
    result = _dsd.set_model_state_dict(model, model_state_dict, options=options)
    # load_state_dict's post-hooks already marked every unit; this also covers entries DCP
    # wrote in place into the main weights.
    _sd.mark_all_loaded(model)
    return result


def _validate_against_metadata(
    flat: dict[str, Any], metadata: Any, prefix: str, *, strict: bool
) -> str | None:
    """Check the tensors a load would read against a DCP checkpoint's metadata."""
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if md is None:
            if strict:
                return (
                    f"checkpoint has no entry '{key}' (the model expects shape "
                    f"{tuple(value.shape)}); it was saved from a different model or without "
                    "this state"
                )
            continue
        if not isinstance(md, TensorStorageMetadata):
            return f"checkpoint entry '{key}' is not a tensor; expected shape {tuple(value.shape)}"
        if tuple(md.size) != tuple(value.shape):
            return (
                f"checkpoint entry '{key}' has shape {tuple(md.size)} but the model expects "
                f"{tuple(value.shape)}"
            )
    return None


# ---------------------------------------------------------------------- atomic save, checksums
# See [Note: atomic saves and checksums] at the top of this file.

_CHECKSUM_FILE = "checksums.json"
_CHECKSUM_FORMAT = "megatron_fsdp_v2.checksums"
_CHECKSUM_VERSION = 1
_INCOMPLETE_SUFFIX = ".incomplete"
_OLD_SUFFIX = ".old"
_READ_CHUNK = 16 << 20  # bytes read at a time while checksumming: bounds the memory used
# A rank-local failure, agreed across ranks: the exception type to raise and its message.
_Failure = tuple[type[Exception], str]


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in rank order (one ``all_gather_object``; none on a single rank)."""
    _, size = _rank_and_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def _coordinator(group: dist.ProcessGroup | None) -> int:
    """Global rank of the group's rank 0: DCP's coordinator, which writes ``.metadata``."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _gather_to_coordinator(obj: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on the group's rank 0, ``None`` elsewhere."""
    rank, size = _rank_and_size(group)
    if size == 1:
        return [obj]
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(obj, out, dst=_coordinator(group), group=group)
    return out


def _broadcast_from_coordinator(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """The group's rank-0 ``obj`` on every rank."""
    if _rank_and_size(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_coordinator(group), group=group)
    return box[0]


def _raise_first(failures: Iterable[_Failure | None], cause: BaseException | None = None) -> None:
    """Raise the lowest rank's failure, if any, chained to this rank's own exception."""
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        kind, message = first
        raise kind(message) from cause


def _describe(exc: BaseException, rank: int) -> str:
    """One line per failing rank. A ``CheckpointException`` already carries every failing rank
    (DCP raises the same one on all ranks), so it is listed as such, not as this rank's."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items())
        )
    return f"rank {rank}: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _no_checkpoint_exception(what: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into a chained ``RuntimeError``: it derives from
    ``BaseException``, so it would escape callers' ``except Exception`` (and retry loops)."""
    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"{what} failed: {_describe(exc, -1)}") from exc


def _local_dir(checkpoint_id: str | os.PathLike | None, storage: Any) -> Path | None:
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


def _crc32_ranges(path: Path, ranges: list[tuple[int, int]]) -> list[int]:
    """``zlib.crc32`` of each ``(offset, length)`` byte range of the file at ``path``."""
    out: list[int] = []
    buf = memoryview(bytearray(min(_READ_CHUNK, max((n for _, n in ranges), default=0))))
    with open(path, "rb") as f:
        for offset, length in ranges:
            f.seek(offset)
            crc, left = 0, length
            while left:
                n = f.readinto(buf[: min(left, len(buf))])
                if not n:
                    raise EOFError(f"the file ends {left} bytes before the end of the item")
                crc, left = zlib.crc32(buf[:n], crc), left - n
            out.append(crc)
    return out


def _writer_rank(relative_path: str, size: int) -> int:
    """The rank that wrote a DCP file (``__<rank>_<n>.distcp``), so that it reads back its own
    files; any other name goes to a rank chosen by a hash of the name."""
    m = re.match(r"__(\d+)_", relative_path)
    if m is not None and int(m.group(1)) < size:
        return int(m.group(1))
    return zlib.crc32(relative_path.encode()) % size


def _split_files(sizes: dict[str, int], size: int) -> list[list[str]]:
    """Files per rank for verification, balanced by bytes; the same on every rank."""
    load = [0] * size
    out: list[list[str]] = [[] for _ in range(size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(size), key=lambda r: (load[r], r))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def _checksum_items(
    root: Path, metadata: Metadata, files: Iterable[str]
) -> list[dict[str, Any]]:
    """A checksum entry for every stored item of ``files`` (relative to ``root``)."""
    wanted = set(files)
    by_file: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path in wanted:
            by_file.setdefault(info.relative_path, []).append((index, info))
    entries: list[dict[str, Any]] = []
    for name in sorted(by_file):
        items = sorted(by_file[name], key=lambda item: item[1].offset)
        crcs = _crc32_ranges(root / name, [(info.offset, info.length) for _, info in items])
        for (index, info), crc in zip(items, crcs):
            entries.append({
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": name,
                "start": info.offset,
                "length": info.length,
                "crc32": crc,
            })
    return entries


def _write_checksum_file(root: Path, metadata: Metadata, entries: list[dict[str, Any]]) -> None:
    record = {
        "format": _CHECKSUM_FORMAT,
        "version": _CHECKSUM_VERSION,
        "algorithm": "crc32",
        # Ties the file to this .metadata: a later plain dcp.save into the same directory
        # writes a new save_id, and the then stale checksums are ignored, not misreported.
        "save_id": getattr(metadata.storage_meta, "save_id", None),
        "items": sorted(entries, key=lambda e: (e["file"], e["start"])),
    }
    path = root / _CHECKSUM_FILE
    with open(path, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def _verify_checksums(
    root: Path, metadata: Metadata, group: dist.ProcessGroup | None
) -> str | None:
    """Check this rank's share of a checkpoint's items against its ``checksums.json``; the
    error for the first bad item, or ``None``. A checkpoint without the file (written by plain
    ``dcp.save``) or with a file of another save passes unverified."""
    path = root / _CHECKSUM_FILE
    if not path.exists():
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("format") != _CHECKSUM_FORMAT or record.get("algorithm") != "crc32":
            raise ValueError(f"not a {_CHECKSUM_FORMAT} crc32 file")
        items = record["items"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"cannot read the checksum file '{path}': {exc}"
    if record.get("save_id") != getattr(metadata.storage_meta, "save_id", None):
        warnings.warn(f"'{path}' belongs to another save than '{root / '.metadata'}' (the "
                      "directory was overwritten by another writer); not verifying", stacklevel=3)
        return None
    # Every rank checks that the file describes exactly the items of .metadata (no I/O) ...
    storage = metadata.storage_data
    by_file: dict[str, list[dict[str, Any]]] = {}
    seen: set[MetadataIndex] = set()
    for e in items:
        index = MetadataIndex(e["fqn"], e["offset"], e["index"])
        info = storage.get(index)
        if info is None or (info.relative_path, info.offset, info.length) != (
            e["file"], e["start"], e["length"]
        ):
            return (f"checkpoint '{root}' is corrupted: its checksum file and .metadata disagree "
                    f"on key '{e['fqn']}' (file '{e['file']}')")
        seen.add(index)
        by_file.setdefault(e["file"], []).append(e)
    for index, info in storage.items():
        if index not in seen:
            return (f"checkpoint '{root}' is corrupted: key '{index.fqn}' (file "
                    f"'{info.relative_path}') has no checksum")
    # ... and reads its share of the files.
    rank, size = _rank_and_size(group)
    sizes = {name: sum(e["length"] for e in es) for name, es in by_file.items()}
    for name in sorted(_split_files(sizes, size)[rank]):
        entries = sorted(by_file[name], key=lambda e: e["start"])
        try:
            crcs = _crc32_ranges(root / name, [(e["start"], e["length"]) for e in entries])
        except (OSError, EOFError) as exc:
            return (f"checkpoint '{root}' is corrupted: cannot read key '{entries[0]['fqn']}' "
                    f"from file '{name}': {exc}")
        for e, crc in zip(entries, crcs):
            if crc != e["crc32"]:
                return (f"checkpoint '{root}' is corrupted: key '{e['fqn']}' in file '{name}' "
                        f"(bytes {e['start']}..{e['start'] + e['length']}) has crc32 "
                        f"{crc:#010x}, expected {e['crc32']:#010x}")
    return None


def _missing_extra(extra: dict[str, Any], metadata: Metadata) -> str | None:
    """The error for ``extra`` keys the checkpoint lacks, listing the ones it has."""
    flat, mapping = flatten_state_dict(extra)
    saved = metadata.state_dict_metadata
    missing = sorted({str(mapping[k][0]) for k in flat if k not in saved})
    if not missing:
        return None
    # DCP's default planner stores each flattened key's path: the top-level names it had.
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tops = {str(paths[k][0]) if k in paths else k.split(".")[0] for k in saved}
    have = sorted(tops - {_MODEL_KEY, _OPTIM_KEY})
    return (f"checkpoint has no extra entry {', '.join(repr(k) for k in missing)} (asked for "
            f"in extra=); its extra entries are: "
            f"{', '.join(repr(k) for k in have) if have else 'none'}")


def _build_state(
    model: nn.Module, optimizers: Optimizers, extra: dict[str, Any] | None
) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {_MODEL_KEY: msd}
    if _as_tuple(optimizers):
        state[_OPTIM_KEY] = osd
    if extra:
        state.update(extra)
    return state


def _atomic_save(
    model: nn.Module,
    optimizers: Optimizers,
    root: Path,
    storage_writer: Any,
    group: dist.ProcessGroup | None,
    extra: dict[str, Any] | None,
    checksums: bool,
) -> Metadata:
    """Write into ``<root>.incomplete``, agree, checksum, commit (see the note at the top)."""
    rank, size = _rank_and_size(group)
    tmp, old = _sibling(root, _INCOMPLETE_SUFFIX), _sibling(root, _OLD_SUFFIX)
    where = f"checkpoint.save to '{root}'"

    # 1. Checks, the state dict and a clean temporary directory, agreed before DCP's first
    # collective: a rank that failed here would otherwise leave the others waiting in it.
    failure: _Failure | None = None
    cause: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        if (root.exists() or root.is_symlink()) and not root.is_dir():
            failure = (ValueError, f"{where}: the path exists and is not a directory")
        elif not getattr(storage_writer, "overwrite", True) and (root / ".metadata").exists():
            failure = (ValueError, f"{where}: a checkpoint exists there and the storage "
                                   "writer has overwrite=False")
        else:
            state = _build_state(model, optimizers, extra)
            if rank == 0:
                _prepare_directory(root, tmp, old)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        failure, cause = (RuntimeError, f"{where} failed before writing: "
                                        f"{_describe(exc, rank)}"), exc
    failures = _all_gather(failure, group)
    if rank == 0 and any(f is not None for f in failures) and failure is None:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_first(failures, cause)

    # 2. Every rank writes into the temporary directory and checksums the files it wrote.
    writer = storage_writer if storage_writer is not None else dcp.FileSystemWriter(tmp)
    metadata: Metadata | None = None
    entries: list[dict[str, Any]] = []
    try:
        metadata = dcp.save(state, checkpoint_id=tmp, storage_writer=writer, process_group=group)
        if checksums:
            files = {info.relative_path for info in metadata.storage_data.values()}
            entries = _checksum_items(tmp, metadata, (n for n in files
                                                      if _writer_rank(n, size) == rank))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised on every rank below
        failure, cause = (RuntimeError, f"{where} failed, {_untouched(root, old)}: "
                                        f"{_describe(exc, rank)}"), exc
    finally:
        if storage_writer is not None:
            storage_writer.reset(root)  # the caller's writer points at the checkpoint again

    # 3. The coordinator collects the verdicts and checksums (one gather); if every rank
    # succeeded it writes the checksum file and commits. Its verdict (one broadcast) also keeps
    # every rank from returning before the checkpoint is in place.
    results = _gather_to_coordinator((failure, entries), group)
    verdict: _Failure | None = None
    if rank == 0:
        assert results is not None
        verdict = next((f for f, _ in results if f is not None), None)
        try:
            if verdict is None:
                assert metadata is not None
                if checksums:
                    _write_checksum_file(tmp, metadata, [e for _, es in results for e in es])
                _commit(root, tmp, old)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            verdict, cause = (RuntimeError, f"{where} failed while committing, "
                                            f"{_untouched(root, old)}: {_describe(exc, rank)}"), exc
        if verdict is not None:  # every rank is past its writes: nothing writes into tmp
            shutil.rmtree(tmp, ignore_errors=True)
    _raise_first([_broadcast_from_coordinator(verdict, group)], cause)
    assert metadata is not None
    return metadata


def save(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    process_group: dist.ProcessGroup | None = None,
    extra: dict[str, Any] | None = None,
    checksums: bool = True,
) -> Any:
    """``dcp.save({"model": ..., "optim": ...})`` of :func:`get_state_dict`'s result (plus any
    ``extra`` entries, e.g. ``{"step": 100}``). Every rank of ``process_group`` (default: all)
    calls it and writes its own rows; returns DCP's metadata.

    To a local directory (a path ``checkpoint_id``, or a ``dcp.FileSystemWriter``) the save is
    atomic: the ranks write into ``<path>.incomplete``, agree on success, and one rank then
    replaces ``<path>`` as a whole. If any rank fails, every rank raises a ``RuntimeError`` and
    ``<path>`` still holds the complete previous checkpoint (or nothing); never a mix. With
    ``checksums`` (the default) a ``checksums.json`` with the CRC32 of every stored item is
    committed with it, which :func:`load` verifies. A ``checkpoint_id`` that is an existing
    regular file raises a ``ValueError`` on every rank before anything is written. Other
    storage (URLs, custom writers) is written by plain ``dcp.save``, with DCP's
    ``CheckpointException`` turned into a ``RuntimeError``. Assumes that every rank sees the
    same filesystem, as a later load does.
    """
    root = _local_dir(checkpoint_id, storage_writer)
    if root is not None:
        return _atomic_save(model, optimizers, root, storage_writer, process_group, extra,
                            checksums)
    state = _build_state(model, optimizers, extra)
    with _no_checkpoint_exception(f"checkpoint.save to {checkpoint_id!r}"):
        return dcp.save(
            state, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
            process_group=process_group,
        )


def load(
    model: nn.Module,
    optimizers: Optimizers = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: Any = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    extra: dict[str, Any] | None = None,
    checksums: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`, from any world size and sharding strategy.

    First reads the checkpoint's metadata and checks every model (and optimizer) tensor the
    load would read: a shape mismatch, or with ``strict`` a missing entry or an extra model
    entry, makes every rank raise a ``ValueError`` naming the first mismatching key, before
    anything is read into the model. (``strict=False`` keeps the current values of entries the
    checkpoint lacks.) ``extra`` holds entries to read back (e.g. ``{"step": 0}``); with
    ``strict`` a key the checkpoint lacks raises a ``ValueError`` naming it and listing the
    extra entries the checkpoint has (without, the given value is returned). With ``checksums``
    (the default) and a local checkpoint that has a ``checksums.json`` (see :func:`save`),
    every stored item is verified too, the files split across ranks: a corrupted item raises a
    ``ValueError`` naming its key and file, before anything is read into the model. Then
    ``dcp.load`` and :func:`set_state_dict`; the next forward uses the loaded weights. Returns
    ``extra`` updated. A failure inside ``dcp.load`` raises a ``RuntimeError`` (chained to
    DCP's ``CheckpointException``). Every rank of ``process_group`` (default: all) calls it.
    """
    root = _local_dir(checkpoint_id, storage_reader)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("load needs a checkpoint_id or a storage_reader")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    extra = dict(extra or {})
    state = _build_state(model, optimizers, extra)
    error: str | None
    try:
        metadata = storage_reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        metadata, error = None, f"cannot read checkpoint metadata of {checkpoint_id!r}: {exc}"
        if root is not None and not root.exists() and _sibling(root, _OLD_SUFFIX).is_dir():
            error += (f"; a save was interrupted while committing and left the previous "
                      f"checkpoint at '{_sibling(root, _OLD_SUFFIX)}' (the next save to this "
                      "path puts it back, or rename it)")
    if metadata is not None:
        flat, _ = flatten_state_dict(state)
        error = _validate_against_metadata(flat, metadata, _MODEL_KEY + ".", strict=strict)
        if error is None:
            error = _validate_against_metadata(flat, metadata, _OPTIM_KEY + ".", strict=strict)
        if error is None and strict:
            for key in metadata.state_dict_metadata:
                if key.startswith(_MODEL_KEY + ".") and key not in flat:
                    error = f"checkpoint has an unexpected entry '{key}' the model does not have"
                    break
        if error is None and strict and extra:
            error = _missing_extra(extra, metadata)
        if error is None and checksums and root is not None:
            error = _verify_checksums(root, metadata, process_group)
    _sd.raise_if_any_rank(error, process_group)
    with _no_checkpoint_exception(f"checkpoint.load of {checkpoint_id!r}"):
        dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                 process_group=process_group,
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_state_dict(
        model, optimizers, model_state_dict=state[_MODEL_KEY],
        optim_state_dict=state.get(_OPTIM_KEY),
        options=_dsd.StateDictOptions(strict=strict),
    )
    return {k: state[k] for k in extra}


# ---------------------------------------------------------------------- full state dicts

@torch.no_grad()
def get_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The unsharded state dict: plain tensors under the original names (tied parameters under
    each of theirs, as ``nn.Module.state_dict`` does), managed parameters as their main weights
    (fp32 when a separate main buffer exists). Loadable into the unwrapped model class.

    Every rank must call it (one all-gather per parameter group, one group at a time). With
    ``rank0_only`` (default) only global rank 0 gets the tensors and the others return ``{}``;
    ``cpu_offload`` (default) moves them to CPU as they are gathered.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    full = _sd.gather_full_params(model, keep=keep, cpu_offload=cpu_offload)
    slots = _sd.dist_param_slots(model)
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        param = slots.get(key)
        if param is not None:
            group, index = _sd.param_slot(param)
            value = full.get((id(group), index))
        elif isinstance(value, DTensor):
            # A DTensor fully_shard does not manage (e.g. an ignored tensor-parallel weight):
            # its own gather, run on every rank in the same order.
            value = value.full_tensor()
            value = value.cpu() if cpu_offload else value
        elif isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", copy=True) if cpu_offload else value.detach().clone()
        out[key] = value
    return out if keep else {}


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module,
    full_state_dict: dict[str, Any] | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> Any:
    """Load an unsharded state dict (e.g. from :func:`get_full_state_dict`, or an unwrapped
    model's ``state_dict()``) into a wrapped model of any world size and strategy.

    By default every rank passes the full state dict and keeps only its own rows (no
    collective besides the agreement on errors). With ``broadcast_from_rank0=True`` only global
    rank 0 needs it (others may pass ``None``); it is broadcast one tensor at a time and each
    rank keeps only its rows, so no rank but 0 ever holds the whole model.

    Keys (``strict``) and shapes are checked first; a mismatch raises a ``ValueError`` naming
    the first mismatching key on every rank before anything is written. The next forward uses
    the loaded weights. Returns ``(missing_keys, unexpected_keys)``.
    """
    expected = _sd.expected_entries(model)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    is_source = not broadcast_from_rank0 or not distributed or dist.get_rank() == 0
    error: str | None = None
    if is_source:
        if full_state_dict is None:
            error = "load_full_state_dict got no state dict" + (
                " on rank 0" if broadcast_from_rank0 else ""
            )
        else:
            found = {
                k: (v.shape if isinstance(v, torch.Tensor) else None)
                for k, v in full_state_dict.items()
            }
            error = _sd.first_mismatch(expected, found, strict=strict)
    _sd.raise_if_any_rank(error)
    if broadcast_from_rank0 and distributed:
        full_state_dict = _broadcast_rows(model, full_state_dict)
    assert full_state_dict is not None
    # load_state_dict's pre-hooks turn full tensors into each rank's rows; its post-hooks mark
    # the units for a compute-weight refresh.
    result = model.load_state_dict(full_state_dict, strict=strict)
    _sd.mark_all_loaded(model)
    return result


def _broadcast_rows(model: nn.Module, full_state_dict: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's state dict on every rank, managed parameters reduced to each rank's rows."""
    is_source = dist.get_rank() == 0
    if is_source:
        assert full_state_dict is not None
        header: list[Any] = [[
            (k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
             None if isinstance(v, torch.Tensor) else v)
            for k, v in full_state_dict.items()
        ]]
    else:
        header = [None]
    dist.broadcast_object_list(header, src=0)
    slots = _sd.dist_param_slots(model)
    targets = model.state_dict(keep_vars=True)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {}
    for key, meta, obj in header[0]:
        if meta is None:
            out[key] = obj
            continue
        shape, dtype = meta
        if is_source:
            assert full_state_dict is not None
            tensor = full_state_dict[key].detach().to(device=device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        param = slots.get(key)
        if param is not None:
            # Keep a copy of this rank's rows only, not the whole broadcast tensor.
            out[key] = _sd.local_rows_dtensor(param, tensor, copy=True)
        else:
            target = targets.get(key)
            out[key] = tensor.to(target.device) if isinstance(target, torch.Tensor) else tensor
    return out
