"""The disk tier's files: one per block of a KV-cache group, under a folder named for what the
blocks belong to (the model, dtypes, block size and each group's layout: its ``fingerprint``).

A file is ``MAGIC``, a 4-byte little-endian header length, a JSON header (the fingerprint, the
group, the block's key in hex, its token ids, the payload's length and CRC-32) and the payload:
the block of each layer of the group, keys then values (a latent cache once), as the host pool
holds them. A file is written under a temporary name and renamed into place, so a process
killed while writing leaves at most a temporary file, which the next start removes. At start-up
every file is read back and checked (``scan``): one with a bad header, a short or corrupt
payload or another fingerprint is skipped and counted, never loaded. The KV manager decides
every write, read and drop (``engine.core.kv_tiers``); this module only carries them out, in
order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path

import torch

from engine.core.config import GIB, split_memory
from models.kv_spec import KVCacheGroup

log = logging.getLogger("kvserve")

MAGIC = b"KVSERVE-BLOCK-1\n"
SUFFIX = ".kvblock"
# A header's bytes beyond its token ids (the fingerprint, names, numbers), and per token id.
HEADER_BYTES = 4096
HEADER_BYTES_PER_TOKEN = 12

Caches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V)


def file_overhead(block_size: int) -> int:
    """Bytes a block's file may take beyond its payload."""
    return len(MAGIC) + 4 + HEADER_BYTES + HEADER_BYTES_PER_TOKEN * block_size


def disk_pool_sizes(
    groups: list[KVCacheGroup], gib: float, block_size: int, max_model_len: int
) -> tuple[int, ...]:
    """Blocks per group that ``gib`` of files hold, each file's header counted."""
    return split_memory(
        groups, int(gib * GIB), block_size, max_model_len, file_overhead(block_size)
    )


def fingerprint(model: str, dtype: str, block_size: int, groups: list[KVCacheGroup]) -> dict:
    """What a block belongs to: a block is loaded only into a server that agrees on all of it."""
    return {
        "format": 1,
        "model": model,
        "dtype": dtype,
        "block_size": block_size,
        "groups": [{"spec": repr(g.spec), "layers": list(g.layer_ids)} for g in groups],
    }


class DiskStore:
    def __init__(
        self,
        folder: str | Path,
        identity: dict,
        groups: list[KVCacheGroup],
        host: Caches,
        device: Caches,
    ):
        """``host``: the host pool's caches, the blocks' way up and down; ``device``: the
        device pool's, which a block spilled and written down in one step is read from."""
        self.identity, self.groups = identity, groups
        self.caches = {"host": host, "device": device}
        name = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.root = Path(folder) / name
        self.root.mkdir(parents=True, exist_ok=True)
        # Each group's payload: its tensors of a block (all blocks are alike).
        self.payload_bytes = [sum(t.numel() for t in self._tensors(g, ("host", 0)))
                              for g in range(len(groups))]  # fmt: skip

    def _path(self, group: int, key: bytes) -> Path:
        return self.root / f"g{group}-{key.hex()}{SUFFIX}"

    # -- start-up ---------------------------------------------------------------------------

    def scan(self) -> tuple[list[tuple[int, bytes, tuple[int, ...]]], int]:
        """The blocks a previous run left, (group, key, token ids) least recently written first,
        and how many files were skipped (removed: cut off, corrupt, or not this store's)."""
        found, skipped = [], 0
        for path in self.root.iterdir():
            if not path.name.endswith(SUFFIX):
                path.unlink(missing_ok=True)  # a write cut short
                continue
            entry = self._check(path)
            if entry is None:
                skipped += 1
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, entry))
        found.sort(key=lambda item: item[0])
        if skipped:
            log.warning("disk KV tier %s: skipped %d unreadable block files", self.root, skipped)
        return [entry for _, entry in found], skipped

    def _check(self, path: Path) -> tuple[int, bytes, tuple[int, ...]] | None:
        try:
            header, payload = split_file(path.read_bytes())
            group, key = header["group"], bytes.fromhex(header["key"])
            ok = (
                header["fingerprint"] == self.identity
                and path.name == self._path(group, key).name
                and len(payload) == header["payload"]
                and zlib.crc32(payload) == header["crc32"]
                and len(payload) == self.payload_bytes[group]
            )
        except (ValueError, KeyError, TypeError, IndexError, OSError):
            return None
        return (group, key, tuple(header["tokens"])) if ok else None

    # -- a step's operations ------------------------------------------------------------------

    def apply(self, ops: list[tuple]) -> None:
        """Carry out the step's disk operations in order."""
        for op in ops:
            if op[0] == "write":
                _, group, source, key, tokens = op
                payload = torch.cat(self._tensors(group, source)).cpu().numpy().tobytes()
                self._write(group, key, tokens, payload)
            elif op[0] == "read":
                _, group, key, block = op
                self._read(group, key, block)
            else:
                self._path(op[1], op[2]).unlink(missing_ok=True)

    def _tensors(self, group: int, source: tuple[str, int]) -> list[torch.Tensor]:
        """A block's tensors of every layer of the group, as bytes: (tier, block)."""
        caches, block = self.caches[source[0]], source[1]
        out = []
        for layer in self.groups[group].layer_ids:
            k, v = caches[layer]
            shared = v.data_ptr() == k.data_ptr()  # MLA: the values are the latent part of K
            for t in (k,) if shared else (k, v):
                out.append(t[block].view(torch.uint8).reshape(-1))
        return out

    def _write(self, group: int, key: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
        header = json.dumps({
            "fingerprint": self.identity, "group": group, "key": key.hex(),
            "tokens": list(tokens), "payload": len(payload), "crc32": zlib.crc32(payload),
        }).encode()  # fmt: skip
        path = self._path(group, key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(payload)
        os.replace(tmp, path)

    def _read(self, group: int, key: bytes, block: int) -> None:
        header, payload = split_file(self._path(group, key).read_bytes())
        if len(payload) != header["payload"] or zlib.crc32(payload) != header["crc32"]:
            raise OSError(f"disk KV tier: the block file of {key.hex()} changed on disk")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t in self._tensors(group, ("host", block)):
            t.copy_(data[offset : offset + t.numel()])
            offset += t.numel()


def split_file(raw: bytes) -> tuple[dict, bytes]:
    """A file's header and payload; ValueError if it does not start as a block file does."""
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 4:
        raise ValueError("not a block file")
    (n,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(raw[start : start + n])
    return header, raw[start + n :]
