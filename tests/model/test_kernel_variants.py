"""Every instruction-set variant of the CPU kernels that this CPU can run (PPSERVE_CPU_ISA,
engine/model/cpu_kernels.py: native; avx2, AVX2 without AVX-512; scalar, no SIMD intrinsics)
against torch, so that a machine tests the paths other CPUs take, not only its own. Each variant
is built and checked in a process of its own (tests/kernel_variant_checks.py), all at once, in a
temporary cache; their GGUF linears agree bitwise where they run the same code."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_variant_checks import CHECKS
from live_server import ROOT

from ppserve.engine.model import cpu_kernels

HELPER = ROOT / "tests" / "kernel_variant_checks.py"
VARIANTS = [v for v in cpu_kernels.ISA_FLAGS if cpu_kernels.can_run(v)]
# (variant, check) -> what is wrong with that variant's code. Not strict: whether it shows depends
# on the compiler's choices (a fix shows as XPASS in the summary).


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Variant -> what its process found (kernel_variant_checks.main's OUT), or its exit and output
    where it did not finish."""
    root = tmp_path_factory.mktemp("variants")
    procs = {}
    for variant in VARIANTS:
        env = {**os.environ, cpu_kernels.ISA_ENV: variant, "PPSERVE_CACHE_DIR": str(root / "cache")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HELPER.parent / "model"), env.get("PYTHONPATH")]))
        cmd = [sys.executable, str(HELPER), str(root / f"{variant}.pt")]
        procs[variant] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results: dict[str, dict[str, Any]] = {}
    try:
        for variant, proc in procs.items():
            output, _ = proc.communicate(timeout=300)
            if proc.returncode == 0:
                results[variant] = torch.load(root / f"{variant}.pt", weights_only=True)
            else:
                results[variant] = {"exit": proc.returncode, "output": output}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if all(run.get("library", "") is None for run in results.values()):
        pytest.skip("no C++ compiler: no kernels to test")
    return results


def _run(runs: dict[str, dict[str, Any]], variant: str) -> dict[str, Any]:
    run = runs[variant]
    assert "exit" not in run, f"{variant}: exit {run.get('exit')}\n{run.get('output', '')[-4000:]}"
    return run


def test_each_variant_is_its_own_build(runs: dict[str, dict[str, Any]]) -> None:
    """A process loads the variant it asks for, each a library of its own in the cache."""
    libraries = {variant: Path(_run(runs, variant)["library"]) for variant in VARIANTS}
    for variant, library in libraries.items():
        assert _run(runs, variant)["isa"] == variant
        assert library.name.startswith(f"cpu_kernels-{variant}-") and library.parent.name == "kernels"
    assert len(set(libraries.values())) == len(VARIANTS)


@pytest.mark.parametrize(("variant", "check"), [(v, c) for v in VARIANTS for c in CHECKS])
def test_kernels_match_torch(runs: dict[str, dict[str, Any]], variant: str, check: str) -> None:
    if (reason := _run(runs, variant)["skipped"].get(check)) is not None:
        pytest.skip(f"{variant}: {reason}")
    failure = _run(runs, variant)["failures"].get(check)
    assert failure is None, f"{variant}: {check} failed:\n{failure}"


def test_gguf_linear_agrees_across_variants(runs: dict[str, dict[str, Any]]) -> None:
    """native and avx2 run the same AVX2 code of gguf_gemm.cpp (it has no AVX-512 path): bitwise
    equal. scalar sums in another order: each within the bound of its exact value, so the two
    within twice that."""
    outputs = {v: _run(runs, v)["outputs"] for v in VARIANTS}
    if len(outputs) < 2:
        pytest.skip("one variant only on this CPU")
    native = outputs["native"]
    assert native, "native's gguf_linear check made no outputs"
    for key, y in native.items():
        if key.endswith("-bound"):
            continue
        if "avx2" in outputs:
            assert torch.equal(outputs["avx2"][key], y), key
        if "scalar" in outputs:
            bound = native[key.rsplit("-", 1)[0] + "-bound"][: y.shape[0]]
            assert ((outputs["scalar"][key].double() - y.double()).abs() <= 2 * bound).all(), key


@pytest.fixture
def fresh_variants() -> Iterator[None]:
    """`_variant` forgets its answers (one warning per value a process asks for), before and after."""
    cpu_kernels._variant.cache_clear()
    yield
    cpu_kernels._variant.cache_clear()


def test_unknown_or_unrunnable_variant_builds_native_with_one_warning(
    fresh_variants: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=cpu_kernels.__name__)
    assert cpu_kernels._variant("avx9") == cpu_kernels._variant("avx9") == "native"
    assert len(caplog.records) == 1 and "avx9" in caplog.records[0].getMessage()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags\t\t: fpu sse sse2 avx")  # an x86 CPU of 2011
    assert not cpu_kernels.can_run("avx2") and cpu_kernels.can_run("scalar")
    assert cpu_kernels._variant("avx2") == "native" and cpu_kernels._variant("scalar") == "scalar"
    assert "avx2 bmi1" in caplog.records[-1].getMessage() and len(caplog.records) == 2
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "")  # not x86 (or no /proc/cpuinfo)
    cpu_kernels._variant.cache_clear()
    assert [cpu_kernels._variant(v) for v in cpu_kernels.ISA_FLAGS] == ["native"] * 3
