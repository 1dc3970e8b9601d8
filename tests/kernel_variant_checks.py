"""The checks of one build of the CPU kernels against torch, in a process of its own:
`python tests/kernel_variant_checks.py OUT` with PPSERVE_CPU_ISA naming the variant and
PPSERVE_CACHE_DIR a cache to build it in (tests/model/test_kernel_variants.py runs one per variant,
all at once). A process loads one variant: the library, and gguf_quant's handles into it, are kept
for the process's life.

A check is either a test of tests/model/test_fast_paths.py or test_gguf_quant.py, run with every
parameter it has (what native passes, every variant passes; not where its skipif holds for this
variant, as the prefill kernel's for a build without one), or one of the functions below. OUT
(torch.save) gets the variant that was loaded, a traceback per failed check, the checks skipped and
why, and the GGUF linears' outputs with their error bounds, for comparing the variants."""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.gguf_quant import BLOCKS, GGUFLinear

DTYPES = (torch.float32, torch.bfloat16)
# Check -> (test module in tests/model/, test function): the kernels whose tests hold for every
# variant as they are.
REUSED = {
    "decode_attention": ("test_fast_paths", "test_kernel_matches_sdpa"),
    "prefill_attention": ("test_fast_paths", "test_prefill_kernel_matches_reference"),
    "gated_mul": ("test_fast_paths", "test_gated_mul_kernel_matches_torch"),
    "rope_write_kv": ("test_fast_paths", "test_rope_write_kv_kernel_equals_torch"),
    "argmax": ("test_fast_paths", "test_argmax_kernel_equals_torch"),
    "gguf_embedding": ("test_gguf_quant", "test_embedding_rows_are_gguf_py_dequantization"),
}
GGUF_ROWS = (1, 7, 32, 300)  # one row, a few (each block unpacked into registers), many (tiles)
GGUF_SHAPE = (70, 512)  # [out, in]: 70 rows end in a tile of two


def _cases(test: Callable[..., None]) -> list[dict[str, Any]]:
    """The parameter sets of a test's pytest.mark.parametrize marks (their product, as pytest runs it)."""
    cases: list[dict[str, Any]] = [{}]
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        # A pytest.param's values are a tuple whatever the number of names; a bare value is one.
        rows = [v.values if type(v).__name__ == "ParameterSet" else v if len(names) > 1 else (v,) for v in values]
        cases = [{**c, **dict(zip(names, row, strict=True))} for c in cases for row in rows]
    return cases


def _skip_reason(test: Callable[..., None]) -> str | None:
    """The reason of a test's pytest.mark.skipif that holds in this process (its variant), if any."""
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "skipif" and mark.args and mark.args[0]:
            return str(mark.kwargs.get("reason", "skipped"))
    return None


def rms_norm(outputs: dict[str, torch.Tensor]) -> None:
    """The residual add is torch's, bitwise; the norm is torch's RMSNorm up to the order of its sum of
    squares: float32 within 8 ulps, and each bfloat16 output is weight * norm as torch rounds them,
    for a scale within a float32 sum's worst-case error of torch's. (test_fast_paths holds bfloat16
    to one ulp, which needs the norm rounded to bfloat16 as torch rounds it: an order of the sum
    further from torch's, as the scalar build's, moves a scale by a few float32 ulps, flips that
    rounding for a value near a tie, and the weight's multiply can round that to two bfloat16 steps.)"""
    from test_fast_paths import _ulps

    eps, dim = 1e-5, 576
    for dtype in DTYPES:
        for rows in (1, 7, 300):
            gen = torch.Generator().manual_seed(rows)
            weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
            h = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
            add = torch.randn(rows, dim, generator=gen).to(dtype)
            summed = h + add
            got = cpu_kernels.rms_norm(h, add, weight, eps)
            assert torch.equal(h, summed), f"{dtype}, {rows} rows: the residual add"
            assert torch.equal(cpu_kernels.rms_norm(summed.clone(), None, weight, eps), got)
            x = summed.float()
            inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            if dtype == torch.float32:
                assert _ulps(got, weight * (x * inv)) <= 8, f"{rows} rows"
                continue
            lo, hi = (weight * (x * (inv * (1 + f * dim * 2.0**-24))).to(dtype) for f in (-1, 1))
            bad = (got != lo) & (got != hi)
            assert not bad.any(), (
                f"bfloat16, {rows} rows: {int(bad.sum())} values, first at {bad.nonzero()[0].tolist()}"
            )


def gguf_linear(outputs: dict[str, torch.Tensor]) -> None:
    """GGUFLinear of every type with a bias, at 1, 7, 32 and 300 rows, against the dequantized
    weights times the int8-rounded activations (test_gguf_quant's bound); the outputs and bounds
    go to `outputs`."""
    from test_gguf_quant import _int8_activations, _weight

    gen = torch.Generator().manual_seed(11)
    x32 = torch.randn(max(GGUF_ROWS), GGUF_SHAPE[1], generator=gen)
    bias = torch.randn(GGUF_SHAPE[0], generator=gen)
    for seed, type_name in enumerate(BLOCKS):
        w, ref = _weight(type_name, GGUF_SHAPE, seed=seed)
        for dtype in DTYPES:
            linear, x = GGUFLinear([w], bias, dtype), x32.to(dtype)
            xq = _int8_activations(x.float())
            expected = xq @ ref.double().T + bias.to(dtype).double()
            unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
            bound = unit * (xq.abs() @ ref.abs().double().T + bias.abs().double())
            outputs[f"{type_name}-{dtype}-bound"] = bound
            for rows in GGUF_ROWS:
                y = outputs[f"{type_name}-{dtype}-{rows}"] = linear(x[:rows])
                assert y.shape == (rows, GGUF_SHAPE[0]) and y.dtype == dtype
                err = (y.double() - expected[:rows]).abs() - bound[:rows]
                assert (err <= 0).all(), f"{type_name}, {dtype}, {rows} rows: over the bound by {float(err.max())}"


def float_gemm(outputs: dict[str, torch.Tensor]) -> None:
    """ppserve's float32 and bfloat16 GEMMs (engine/model/linear.py), where this build has them (any
    with AVX2 or AVX-512; the scalar one leaves linears to oneDNN and torch): test_fast_paths's
    bounds at 1, 7, 32 and 300 rows, the gate/up linear with its SiLU, and rows that do not depend
    on their batch."""
    import test_fast_paths as t

    cpu = torch.device("cpu")
    built = [dtype for dtype in DTYPES if cpu_kernels.float_gemm_available(cpu, dtype)]
    if cpu_kernels.isa() == "avx2":
        assert built == list(DTYPES), f"the avx2 build has no ppserve GEMM for {set(DTYPES) - set(built)}"
    tests: dict[torch.dtype, list[Callable[..., None]]] = {
        torch.float32: [t.test_float_gemm_within_float32_bound, t.test_gate_up_with_silu_equals_gemm_then_silu_mul],
        torch.bfloat16: [t.test_bfloat16_gemm_within_bound],
    }
    for dtype in built:
        for test in tests[dtype]:
            for case in _cases(test):
                test(**case)
        t.test_float_gemm_row_does_not_depend_on_batch(dtype)


def gguf_linear_batch_invariance(outputs: dict[str, torch.Tensor]) -> None:
    """A row's GGUF linear output does not depend on its batch (gguf_gemm.cpp promises it, so that
    a request's tokens do not depend on how the pipeline batched it): gguf_linear's first rows at
    1, 7 and 32 rows are bitwise those of its 300."""
    bad = []
    for type_name in BLOCKS:
        for dtype in DTYPES:
            full = outputs[f"{type_name}-{dtype}-{max(GGUF_ROWS)}"]
            for rows in GGUF_ROWS[:-1]:
                y = outputs[f"{type_name}-{dtype}-{rows}"]
                if not torch.equal(y, full[:rows]):
                    bad.append(f"{type_name} {dtype} {rows} rows: {int((y != full[:rows]).sum())} values")
    assert not bad, "rows differ from the same rows in a batch of 300: " + "; ".join(bad)


# Check -> function (of the outputs, which gguf_linear fills and the one after it reads).
OWN: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
    "rms_norm": rms_norm,
    "gguf_linear": gguf_linear,
    "gguf_linear_batch_invariance": gguf_linear_batch_invariance,
    "float_gemm": float_gemm,
}
CHECKS = [*REUSED, *OWN]


def main(out: str) -> None:
    torch.set_num_threads(2)  # as tests/conftest.py: the kernels' threads are torch's
    dll = cpu_kernels.load()  # built here, for the variant this process was given
    outputs: dict[str, torch.Tensor] = {}
    failures: dict[str, str] = {}
    skipped: dict[str, str] = {}  # check -> why this variant has nothing to check (a kernel it lacks)
    if dll is not None:
        for check in CHECKS:
            try:
                if check in REUSED:
                    module, name = REUSED[check]
                    test = getattr(importlib.import_module(module), name)
                    if (reason := _skip_reason(test)) is not None:
                        skipped[check] = reason
                        continue
                    for case in _cases(test):
                        try:
                            test(**case)
                        except AssertionError as e:
                            raise AssertionError(f"{name}({case})") from e
                else:
                    OWN[check](outputs)
            except Exception:
                failures[check] = traceback.format_exc()
    library = None if dll is None else str(dll._name)
    found = {"failures": failures, "skipped": skipped, "outputs": outputs}
    torch.save({"isa": cpu_kernels.isa(), "library": library, **found}, out)


if __name__ == "__main__":  # with tests/model (the test modules of REUSED) on PYTHONPATH
    main(sys.argv[1])
