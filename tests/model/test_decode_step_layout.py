"""The decode step's ctypes mirrors against the library built from decode_step.cpp
(engine/model/decode_step.py's check_library): the real build agrees, and a mirror edited apart
from the C++ (a field swapped, added or retyped, a struct or an argument missing) is named."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from ppserve.engine.config import EngineConfig
from ppserve.engine.model import cpu_kernels, decode_step
from ppserve.engine.model.decode_step import STRUCTS, LayoutMismatch, check_library
from ppserve.engine.runtime.stage_runner import StageRunner

pytestmark = pytest.mark.skipif(
    cpu_kernels.decode_layers(torch.float32) is None, reason="the CPU kernels are not built here"
)


@pytest.fixture
def dll() -> ctypes.CDLL:
    library = cpu_kernels.load()
    assert library is not None
    return library


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """The check runs again (its answer is kept per library), and again after the test."""
    decode_step._agrees.cache_clear()
    yield
    decode_step._agrees.cache_clear()


def _layout(dll: ctypes.CDLL) -> str:
    check_library(dll)  # sets decode_step_layout's ctypes types
    text: bytes = dll.decode_step_layout()
    return text.decode()


def _drifted(name: str, fields: Sequence[tuple[Any, ...]], base: type[ctypes.Structure] = ctypes.Structure) -> type:
    """A Structure of `fields` (after `base`'s), for a mirror edited apart from decode_step.cpp."""
    return type(name, (base,), {"_fields_": fields})


def test_the_build_agrees(dll: ctypes.CDLL) -> None:
    check_library(dll)
    text = _layout(dll)
    # Every mirror is described, with its size and every field, and both steps and the callback.
    for name, mirror in STRUCTS.items():
        assert f"struct {name} {ctypes.sizeof(mirror)}\n" in text
        for field, *_ in mirror._fields_:
            assert f"field {name} {field} {getattr(mirror, field).offset} " in text
    assert "field Layer qkv 32 s56\n" in text and "field Dims eps 32 f4\n" in text
    assert "function decode_layers_f32 i4 p8 i8 p8 p8 p8 p8 p8 p8 i8 i8\n" in text
    assert "function LinearFn i8 i8 i8 i8\n" in text
    assert decode_step.mismatches(text, STRUCTS, {}) == [
        f"function {name}: ({sig}) in decode_step.cpp, (not called here) in its ctypes types"
        for name, sig in [
            ("LinearFn", "i8 i8 i8 i8"),
            ("decode_layers_bf16", "i4 p8 i8 p8 p8 p8 p8 p8 p8 i8 i8"),
            ("decode_layers_f32", "i4 p8 i8 p8 p8 p8 p8 p8 p8 i8 i8"),
        ]
    ]


def test_swapped_fields_are_named(dll: ctypes.CDLL) -> None:
    fields = list(decode_step._Gemm._fields_)
    fields[1], fields[2] = fields[2], fields[1]  # weight <-> scales: same size, same types
    with pytest.raises(LayoutMismatch) as e:
        check_library(dll, {**STRUCTS, "Gemm": _drifted("SwappedGemm", fields)})
    message = str(e.value)
    assert "struct Gemm, field 1: `weight` at 8 (p8) in decode_step.cpp, `scales` at 8 (p8) in SwappedGemm" in message
    assert "struct Gemm, field 2: `scales` at 16 (p8) in decode_step.cpp, `weight` at 16 (p8) in SwappedGemm" in message
    assert "bytes" not in message  # the sizes agree: only the order is wrong


def test_an_extra_field_is_named(dll: ctypes.CDLL) -> None:
    extra = _drifted("LongerDims", [("extra", ctypes.c_int64)], decode_step._Dims)
    with pytest.raises(LayoutMismatch) as e:
        check_library(dll, {**STRUCTS, "Dims": extra})
    assert "struct Dims: 40 bytes in decode_step.cpp, 48 in LongerDims" in str(e.value)
    assert "struct Dims, field 6: none in decode_step.cpp, `extra` at 40 (i8) in LongerDims" in str(e.value)


def test_a_retyped_field_is_named(dll: ctypes.CDLL) -> None:
    """eps as a double: its offset is the same, its type and the struct's size are not."""
    fields = [(name, ctypes.c_double if name == "eps" else t) for name, t, *_ in decode_step._Dims._fields_]
    with pytest.raises(LayoutMismatch) as e:
        check_library(dll, {**STRUCTS, "Dims": _drifted("DoubleEpsDims", fields)})
    assert "struct Dims, field 4: `eps` at 32 (f4) in decode_step.cpp, `eps` at 32 (f8) in DoubleEpsDims" in str(
        e.value
    )


def test_a_missing_mirror_and_a_wrong_signature_are_named(dll: ctypes.CDLL) -> None:
    step = dll.decode_layers_f32
    functions = {
        "decode_layers_f32": (step.restype, step.argtypes[:-1]),  # one argument short
        "decode_layers_bf16": (None, dll.decode_layers_bf16.argtypes),  # no result
        "LinearFn": (ctypes.c_int64, [ctypes.c_int64] * 3),
    }
    with pytest.raises(LayoutMismatch) as e:
        check_library(dll, {k: v for k, v in STRUCTS.items() if k != "Cache"}, functions)
    message = str(e.value)
    assert "struct Cache: no mirror here" in message
    assert "function decode_layers_f32: (i4 p8 i8 p8 p8 p8 p8 p8 p8 i8 i8) in decode_step.cpp, " in message
    assert "(i4 p8 i8 p8 p8 p8 p8 p8 p8 i8) in its ctypes types" in message
    assert "function decode_layers_bf16: (i4 " in message and "(v0 p8 i8 " in message
    assert "LinearFn" not in message


def test_a_library_that_disagrees_is_not_used(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_check: None
) -> None:
    """The step is not built (the layers run as modules), with an error that names the field."""
    fields = [*decode_step._Cache._fields_[:-1], ("max_blocks", ctypes.c_int32)]
    monkeypatch.setitem(STRUCTS, "Cache", _drifted("NarrowCache", fields))
    config = EngineConfig.create(checkpoints["llama"], pp_size=1, num_kv_blocks=16, block_size=4)
    with caplog.at_level(logging.ERROR, logger=decode_step.__name__):
        assert StageRunner(config, 0).model.decode_step is None
    [record] = [r for r in caplog.records if r.name == decode_step.__name__]
    assert record.levelno == logging.ERROR
    assert "struct Cache, field 5: `max_blocks` at 40 (i8) in decode_step.cpp" in record.getMessage()
    assert "The decode step runs as modules instead" in record.getMessage()
    monkeypatch.undo()
    decode_step._agrees.cache_clear()
    assert StageRunner(config, 0).model.decode_step is not None  # the same model with the real mirrors
