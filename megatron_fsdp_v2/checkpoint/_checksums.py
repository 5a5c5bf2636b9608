"""Per-item CRC32 checksums of a DCP checkpoint on a local filesystem: computed by ``save`` over
the files each rank wrote, stored in ``checksums.json`` next to ``.metadata``, verified by
``load`` before anything is read into the model (the files split across ranks by size). See
``[Note: atomic saves and checksums]`` in ``_files.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
import warnings
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ._process_group import rank_and_size

__all__ = ["CHECKSUM_FILE", "checksum_items", "find_unreadable_item", "verify_checksums",
           "write_checksum_file", "writer_rank"]

CHECKSUM_FILE = "checksums.json"
_CHECKSUM_FORMAT = "megatron_fsdp_v2.checksums"
_CHECKSUM_VERSION = 1
_READ_CHUNK = 16 << 20  # bytes read at a time while checksumming: bounds the memory used


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


def writer_rank(relative_path: str, size: int) -> int:
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


def checksum_items(
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


def write_checksum_file(root: Path, metadata: Metadata, entries: list[dict[str, Any]]) -> None:
    record = {
        "format": _CHECKSUM_FORMAT,
        "version": _CHECKSUM_VERSION,
        "algorithm": "crc32",
        # Ties the file to this .metadata: a later plain dcp.save into the same directory
        # writes a new save_id, and the then stale checksums are ignored, not misreported.
        "save_id": getattr(metadata.storage_meta, "save_id", None),
        "items": sorted(entries, key=lambda e: (e["file"], e["start"])),
    }
    path = root / CHECKSUM_FILE
    with open(path, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def verify_checksums(
    root: Path, metadata: Metadata, process_group: dist.ProcessGroup | None,
    read_from: Path | None = None,
) -> str | None:
    """Check this rank's share (within ``process_group``) of a checkpoint's items against its
    ``checksums.json``; the error for the first bad item, or ``None``. No collective: the
    caller agrees on the result. A checkpoint without the file (written by plain
    ``dcp.save``) or with a file of another save passes unverified. ``read_from``: where to
    read the files (a pinned path of ``root``, see ``pinned_directory``); messages name
    ``root``."""
    read_root = root if read_from is None else read_from
    path = read_root / CHECKSUM_FILE
    if not path.exists():
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("format") != _CHECKSUM_FORMAT or record.get("algorithm") != "crc32":
            raise ValueError(f"not a {_CHECKSUM_FORMAT} crc32 file")
        items = record["items"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"cannot read the checksum file '{root / CHECKSUM_FILE}': {exc}"
    if record.get("save_id") != getattr(metadata.storage_meta, "save_id", None):
        warnings.warn(f"'{root / CHECKSUM_FILE}' belongs to another save than "
                      f"'{root / '.metadata'}' (the "
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
    rank, size = rank_and_size(process_group)
    sizes = {name: sum(e["length"] for e in es) for name, es in by_file.items()}
    for name in sorted(_split_files(sizes, size)[rank]):
        entries = sorted(by_file[name], key=lambda e: e["start"])
        try:
            crcs = _crc32_ranges(read_root / name, [(e["start"], e["length"]) for e in entries])
        except (OSError, EOFError) as exc:
            return (f"checkpoint '{root}' is corrupted: cannot read key '{entries[0]['fqn']}' "
                    f"from file '{name}': {exc}")
        for e, crc in zip(entries, crcs):
            if crc != e["crc32"]:
                return (f"checkpoint '{root}' is corrupted: key '{e['fqn']}' in file '{name}' "
                        f"(bytes {e['start']}..{e['start'] + e['length']}) has crc32 "
                        f"{crc:#010x}, expected {e['crc32']:#010x}")
    return None


def find_unreadable_item(
    root: Path, metadata: Metadata, process_group: dist.ProcessGroup | None,
    read_from: Path | None = None,
) -> str | None:
    """After a failed ``dcp.load``: the first item of this rank's share of the files (split
    as for checksums) that cannot be read back, as an error naming its key and file, or
    ``None``. Reads every item's bytes (a file that ends early is named) and deserializes each
    tensor item DCP stored with ``torch.save`` (a damaged header is named), one item at a
    time. No collective: the caller agrees on the result. ``read_from`` as for
    :func:`verify_checksums`."""
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    rank, size = rank_and_size(process_group)
    sizes = {name: sum(info.length for _, info in items) for name, items in by_file.items()}
    for name in sorted(_split_files(sizes, size)[rank]):
        try:
            with open((root if read_from is None else read_from) / name, "rb") as f:
                for fqn, info in sorted(by_file[name], key=lambda item: item[1].offset):
                    f.seek(info.offset)
                    data = f.read(info.length)
                    if len(data) != info.length:
                        return (f"file '{name}' of checkpoint '{root}' is truncated: it ends "
                                f"{info.length - len(data)} bytes before the end of key "
                                f"'{fqn}'")
                    plain = not getattr(info, "transform_descriptors", None)
                    tensor = isinstance(metadata.state_dict_metadata.get(fqn),
                                        TensorStorageMetadata)
                    if plain and tensor:
                        try:
                            torch.load(io.BytesIO(data), weights_only=True)
                        except Exception as exc:  # noqa: BLE001 - reported, not raised
                            return (f"file '{name}' of checkpoint '{root}' is corrupted: key "
                                    f"'{fqn}' (bytes {info.offset}..{info.offset + info.length})"
                                    f" cannot be read: {type(exc).__name__}: {exc}")
        except OSError as exc:
            return f"file '{name}' of checkpoint '{root}' cannot be read: {exc}"
    return None
