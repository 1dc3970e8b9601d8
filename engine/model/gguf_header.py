"""A GGUF file's header, read by a small reader that trusts nothing in it.

A GGUF file begins with counts and lengths that say how much follows: how many metadata keys and
tensors, how long each string, how many elements each array. A reader that allocates from them
before checking them can be made to allocate far more than the file holds (gguf-py's GGUFReader
builds Python objects per array element). This reader checks every count and length against the
bytes left in the file *before* it builds anything from it, and against fixed caps that bound
the work later readers do per element (transformers' tokenizer conversion reads the file again).
Then it checks the tensor table: known types, sane dimensions, data aligned, inside the file and
not overlapping. All arithmetic is on Python ints, so no offset can wrap around.

Nothing here knows about models: that is `gguf_check.py`, on the header this returns.
"""

from __future__ import annotations

import itertools
import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ppserve.engine.model.model_config import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits, and gguf-py reads neither it nor later ones
DEFAULT_ALIGNMENT = 32  # the spec's, when general.alignment is absent
MAX_ALIGNMENT = 1 << 24
# Caps far above any published model, low enough that what gguf-py and transformers build per
# element stays well within a host's memory.
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_KEY_BYTES = 1 << 16  # the spec's limit on a key
MAX_NAME_BYTES = 64  # llama.cpp's GGML_MAX_NAME, including its terminating zero
MAX_STRING_BYTES = 1 << 24
MAX_ARRAY_ITEMS = 1 << 20
MAX_TOTAL_ITEMS = 3 << 20  # all arrays together: a vocabulary, its token types and merges at most
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types (gguf.GGUFValueType): struct format and dtype of the fixed-size ones.
STRING, ARRAY = 8, 9
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT_TYPES = frozenset({6, 12})
BOOL = 7
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
}
# The fewest bytes an entry can take: a key or name length, a type, and the smallest value.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


class GGUFError(ConfigError):
    """A GGUF file that is malformed, declares more than it holds, or describes a model that
    cannot be right. The message names the file, the field and the problem."""


@dataclass(frozen=True)
class GGUFArray:
    item_type: int
    count: int
    # The elements: numbers always (as stored, a compact copy), strings only for the keys the
    # caller asked to keep (the others are walked and checked, not kept).
    items: np.ndarray | list[str] | None


@dataclass(frozen=True)
class GGUFValue:
    type: int  # a GGUF value type, e.g. STRING
    value: int | float | bool | str | GGUFArray


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the fastest-moving dimension first
    type: GGMLQuantizationType
    offset: int  # of its data, from the start of the file
    nbytes: int

    @property
    def shape(self) -> list[int]:
        """torch order: the slowest-moving dimension first."""
        return list(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    file: str  # the file's name, for messages
    size: int
    alignment: int
    data_start: int
    fields: dict[str, GGUFValue]
    tensors: tuple[TensorInfo, ...]  # in the file's order


def read_header(path: Path, keep: Collection[str] = ()) -> GGUFHeader:
    """The checked header of the GGUF file `path`, keeping the string arrays named in `keep`.
    Raises GGUFError for any field out of range; allocates at most what the file holds."""
    try:
        size = path.stat().st_size
        if size < 24:  # magic, version and the two counts
            raise GGUFError(f"{path.name} is not a readable GGUF file: {size} bytes is too short for a GGUF header")
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Reader(data, path.name, size, set(keep)).header()
    except OSError as e:
        raise GGUFError(f"{path.name} cannot be read: {e}") from None


class _Reader:
    def __init__(self, data: mmap.mmap, name: str, size: int, keep: set[str]) -> None:
        self.data, self.name, self.size, self.keep = data, name, size, keep
        self.pos = 0
        self.items = 0  # array elements read so far, against MAX_TOTAL_ITEMS

    def fail(self, problem: str) -> NoReturn:
        raise GGUFError(f"{self.name}: {problem}")

    def take(self, n: int, what: str) -> int:
        """Where the next `n` bytes start; they must lie inside the file."""
        if n > self.size - self.pos:
            self.fail(f"{what} at offset {self.pos} runs past the end of the file ({self.size} bytes): truncated?")
        pos = self.pos
        self.pos += n
        return pos

    def unpack(self, fmt: str, what: str) -> int | float | bool:
        value: int | float | bool = struct.unpack_from("<" + fmt, self.data, self.take(struct.calcsize(fmt), what))[0]
        return value

    def count(self, n: int, item_bytes: int, cap: int, claim: str) -> None:
        """`n` items of at least `item_bytes` each must fit in what is left of the file, and under `cap`."""
        left = self.size - self.pos
        if n * item_bytes > left:
            self.fail(f"{claim}, but the {left} bytes left in the file hold at most {left // item_bytes}")
        if n > cap:
            self.fail(f"{claim}; at most {cap} are supported")

    def string(self, what: str, cap: int) -> str:
        n = int(self.unpack("Q", f"the length of {what}"))
        if n > cap:
            self.fail(f"{what} is {n} bytes long; at most {cap} are supported")
        pos = self.take(n, what)
        try:
            return self.data[pos : pos + n].decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def header(self) -> GGUFHeader:
        if self.data[:4] != MAGIC:
            raise GGUFError(f"{self.name} is not a readable GGUF file: it does not start with the GGUF magic")
        self.pos = 4
        version = int(self.unpack("I", "the version"))
        if version not in VERSIONS and int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            self.fail("a big-endian GGUF file; only little-endian files are supported")
        if version not in VERSIONS:
            self.fail(f"GGUF version {version} is not supported (only {' and '.join(map(str, VERSIONS))})")
        tensor_count = int(self.unpack("Q", "the tensor count"))
        kv_count = int(self.unpack("Q", "the metadata key count"))
        self.count(kv_count, _MIN_KV_BYTES, MAX_KEYS, f"the header declares {kv_count} metadata keys")
        self.count(tensor_count, _MIN_TENSOR_INFO_BYTES, MAX_TENSORS, f"the header declares {tensor_count} tensors")
        fields: dict[str, GGUFValue] = {}
        for i in range(kv_count):
            key = self.string(f"the key of metadata entry {i}", MAX_KEY_BYTES)
            if key in fields:
                self.fail(f"metadata key {key!r} appears twice")
            fields[key] = self.value(key, int(self.unpack("I", f"the type of metadata {key!r}")))
        infos = [self.tensor_info(i) for i in range(tensor_count)]
        alignment = self.alignment(fields.get("general.alignment"))
        data_start = -(-self.pos // alignment) * alignment
        tensors = tuple(self.placed(info, data_start, alignment) for info in infos)
        self.no_overlap(tensors)
        return GGUFHeader(self.name, self.size, alignment, data_start, fields, tensors)

    def value(self, key: str, vtype: int) -> GGUFValue:
        if vtype in _SCALARS:
            return GGUFValue(vtype, self.unpack(_SCALARS[vtype], f"metadata {key!r}"))
        if vtype == STRING:
            return GGUFValue(vtype, self.string(f"metadata {key!r}", MAX_STRING_BYTES))
        if vtype != ARRAY:
            self.fail(f"metadata {key!r} has unknown value type {vtype}")
        item_type = int(self.unpack("I", f"the element type of metadata {key!r}"))
        n = int(self.unpack("Q", f"the length of metadata {key!r}"))
        if item_type == ARRAY:
            self.fail(f"metadata {key!r} is an array of arrays; not supported")
        if item_type not in _SCALARS and item_type != STRING:
            self.fail(f"metadata {key!r} is an array of unknown value type {item_type}")
        item_bytes = 8 if item_type == STRING else struct.calcsize(_SCALARS[item_type])
        claim = f"metadata {key!r} declares an array of {n} {TYPE_NAMES[item_type]} elements"
        self.count(n, item_bytes, MAX_ARRAY_ITEMS, claim)
        self.items += n
        if self.items > MAX_TOTAL_ITEMS:
            self.fail(f"the metadata arrays hold more than {MAX_TOTAL_ITEMS} elements in all (at {key!r})")
        if item_type != STRING:
            pos = self.take(n * item_bytes, f"metadata {key!r}")
            dtype = np.dtype("<" + _SCALARS[item_type])
            return GGUFValue(vtype, GGUFArray(item_type, n, np.frombuffer(self.data, dtype, n, pos).copy()))
        kept: list[str] | None = [] if key in self.keep else None
        for j in range(n):
            s = self.string(f"element {j} of metadata {key!r}", MAX_STRING_BYTES)
            if kept is not None:
                kept.append(s)
        return GGUFValue(vtype, GGUFArray(STRING, n, kept))

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        """(name, dims, type, offset from the data section), as stored; checked by `placed`."""
        name = self.string(f"the name of tensor {i}", MAX_NAME_BYTES - 1)
        n_dims = int(self.unpack("I", f"the dimension count of tensor {name!r}"))
        if not 1 <= n_dims <= MAX_DIMS:
            self.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are valid)")
        dims = struct.unpack_from(f"<{n_dims}Q", self.data, self.take(8 * n_dims, f"the shape of tensor {name!r}"))
        ggml_type = int(self.unpack("I", f"the type of tensor {name!r}"))
        offset = int(self.unpack("Q", f"the data offset of tensor {name!r}"))
        return name, tuple(int(d) for d in dims), ggml_type, offset

    def alignment(self, field: GGUFValue | None) -> int:
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != 4:  # uint32, as the spec, gguf-py and llama.cpp all require
            self.fail(f"general.alignment must be a uint32, not {TYPE_NAMES.get(field.type, field.type)}")
        value = int(field.value)  # type: ignore[arg-type]  # a uint32, so an int
        if not 8 <= value <= MAX_ALIGNMENT or value & (value - 1):
            self.fail(f"general.alignment {value} must be a power of two between 8 and {MAX_ALIGNMENT}")
        return value

    def placed(self, info: tuple[str, tuple[int, ...], int, int], data_start: int, alignment: int) -> TensorInfo:
        name, dims, ggml_type, offset = info
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self.fail(f"tensor {name!r} has unknown GGML type {ggml_type}")
        if 0 in dims:
            self.fail(f"tensor {name!r} has an empty dimension (shape {list(dims)})")
        if dims[0] % block:
            self.fail(f"tensor {name!r}: its row of {dims[0]} values is not whole {qtype.name} blocks of {block}")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * type_bytes
        if offset % alignment:
            self.fail(f"tensor {name!r} data at offset {offset} is not aligned to {alignment} bytes")
        start = data_start + offset
        if start + nbytes > self.size:
            self.fail(
                f"tensor {name!r} data at offset {offset} ({nbytes} bytes from byte {start}) "
                f"lies past the end of the file ({self.size} bytes): truncated or corrupt"
            )
        return TensorInfo(name, dims, qtype, start, nbytes)

    def no_overlap(self, tensors: tuple[TensorInfo, ...]) -> None:
        seen: set[str] = set()
        for t in tensors:
            if t.name in seen:
                self.fail(f"tensor {t.name!r} appears twice")
            seen.add(t.name)
        ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
        for before, after in itertools.pairwise(ordered):
            if after.offset < before.offset + before.nbytes:
                self.fail(
                    f"tensor {after.name!r} data at byte {after.offset} overlaps tensor {before.name!r} "
                    f"(bytes {before.offset} to {before.offset + before.nbytes})"
                )
