"""The sha256 of a large file, computed once per version of it; and a model file's fingerprint.

Checkpoints are keyed by their content's hash; hashing gigabytes on every start would cost
seconds, so the digest is remembered in the cache directory against the file's path, size and
modification time, and computed again only when one of them changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ppserve.engine.model.cache_dir import cache_dir

_CHUNK = 1 << 22
# A model file's fingerprint reads its head (a GGUF's metadata and tensor table, a large vocabulary
# included) and samples of the rest, so that a node never reads gigabytes to name its checkpoint.
_HEAD = 1 << 24
_SAMPLE, _SAMPLES = 1 << 16, 64


def file_sha256(path: str | Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    memo = cache_dir() / "sha256" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        known = json.loads(memo.read_text())
        if known.get("key") == key:
            return str(known["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    sha = hash_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "sha256": sha}))
    os.replace(tmp, memo)
    return sha


def hash_file(path: str | Path) -> str:
    """The sha256 of the file's bytes, read now."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_fingerprint(path: str | Path) -> str:
    """A sha256 over the file's size, its first 16 MiB and 64 KiB at each of 64 evenly spaced offsets
    (the last ending at the file's end): what names a model file, and tells two nodes' copies
    apart, without reading all of it (at most 20 MiB are read)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        digest.update(f.read(_HEAD))
        if size > _HEAD:
            step = (size - _HEAD - _SAMPLE) / (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(_HEAD + max(0, int(i * step)))
                digest.update(f.read(_SAMPLE))
    return digest.hexdigest()
