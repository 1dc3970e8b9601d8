"""What every node of a cluster must have in common: the checkpoint it loads.

Each node loads its stages from its own copy of the checkpoint, so node 0 compares fingerprints
when a node joins: config.json, and the weight index (the sharded index file, or the header of a
single model.safetensors: every tensor's name, dtype, shape and offset). Tensor values are not
read: that would mean reading every weight on every start. A GGUF checkpoint is named by its
file's fingerprint (engine/model/file_hash.py: its size, metadata and tensor table, and samples of
its data).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from ppserve.engine.model.gguf_checkpoint import gguf_fingerprint, is_prepared_gguf
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.weights import INDEX_FILE, SINGLE_FILE


def checkpoint_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """{"config.json": sha256, "weights": sha256} of the checkpoint in `model_dir`."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    try:
        config = (model_dir / "config.json").read_bytes()
        if is_prepared_gguf(model_dir):
            weights = gguf_fingerprint(model_dir).encode()
        elif index.is_file():
            weights = index.read_bytes()
        else:
            with open(model_dir / SINGLE_FILE, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                weights = f.read(size)
    except (OSError, struct.error) as e:
        raise ConfigError(f"cannot fingerprint the checkpoint in {model_dir}: {e}") from None
    return {"config.json": _sha(config), "weights": _sha(weights)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def describe_mismatch(mine: dict[str, str], theirs: dict[str, str]) -> str | None:
    """None if equal, else which parts differ, e.g. "config.json differs (1a2b... here, 3c4d... there)"."""
    parts = [
        f"{name} differs ({mine.get(name, '-')} here, {theirs.get(name, '-')} there)"
        for name in sorted(set(mine) | set(theirs))
        if mine.get(name) != theirs.get(name)
    ]
    return "; ".join(parts) or None
