"""The sha256 of a large file, computed once per version of it.

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
