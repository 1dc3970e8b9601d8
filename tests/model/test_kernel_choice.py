"""The per-shape kernel choice of float linears (engine/model/kernel_choice.py): it picks what is
fastest by timing, keeps its table for the next start, and a linear runs the kernel of each call's
row count without changing a model's greedy output."""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from helpers import random_prompt

from ppserve import SamplingParams
from ppserve.engine.config import EngineConfig
from ppserve.engine.model import amx, cpu_kernels, kernel_choice
from ppserve.engine.model.kernel_choice import ROWS, KernelChooser, bucket, choose, time_kernels
from ppserve.engine.model.linear import KERNELS, Linear, candidates
from ppserve.engine.model.model import DecoderLayer
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.offline import OfflineEngine

CPU = torch.device("cpu")


def _slowed(delays: Mapping[str, Callable[[int], float]]) -> dict[str, Callable[[int], object]]:
    """Candidates that do nothing but sleep: delays[name](rows) seconds a call."""
    return {name: functools.partial(lambda d, n: time.sleep(d(n)), delay) for name, delay in delays.items()}


def test_each_row_count_takes_the_nearest_timed_one() -> None:
    """A call takes the choice of the timed row count nearest it on a log scale."""
    assert [ROWS[bucket(n)] for n in (1, 2, 3, 4, 8, 9, 16, 32, 33, 64, 128, 129, 256, 10_000)] == [
        1, 1, 4, 4, 4, 16, 16, 16, 64, 64, 64, 256, 256, 256,
    ]  # fmt: skip


def test_the_slowed_candidate_is_not_chosen() -> None:
    """Two candidates, one with an injected delay: the other runs at every row count, whichever of
    the two is slowed; a kernel slow at many rows and another slow at few make a table of both."""
    fast, slow = (lambda n: 0.0), (lambda n: 0.003)
    assert choose(time_kernels(_slowed({"a": slow, "b": fast}))) == ("b",) * len(ROWS)
    assert choose(time_kernels(_slowed({"a": fast, "b": slow}))) == ("a",) * len(ROWS)
    few = {"few": lambda n: 0.003 if n > 16 else 0.0, "many": lambda n: 0.0 if n > 16 else 0.003}
    assert choose(time_kernels(_slowed(few))) == ("few", "few", "few", "many", "many")


def test_a_second_kernel_only_where_it_saves_a_fifth() -> None:
    """The kernel nearest the best over all row counts runs everywhere, but where another takes at
    most SECOND_GAIN of its time: a second layout of the weight is not held for a few percent."""
    assert choose({"a": [1.0] * 5, "b": [0.9] * 4 + [1.1]}) == ("b",) * 5
    assert choose({"a": [1.0] * 5, "b": [2.0] * 4 + [0.7]}) == ("a",) * 4 + ("b",)
    # the third kernel wins at the last row count, but by less than the second one saves there
    three = {"a": [1.0] * 5, "b": [2.0] * 4 + [0.5], "c": [3.0] * 4 + [0.6]}
    assert choose(three) == ("a",) * 4 + ("b",)


def test_the_table_is_kept_and_read_at_the_next_start(tmp_path: Path) -> None:
    """The first chooser times and writes the table; a second one (the next start, or another stage)
    reads it and times nothing. An entry naming a kernel that is not a candidate here, or a file
    that is not a table, is timed again."""
    timed: list[str] = []

    def run(delays: Mapping[str, Callable[[int], float]]) -> Callable[[], dict[str, Callable[[int], object]]]:
        def make() -> dict[str, Callable[[int], object]]:
            timed.append(",".join(delays))
            return _slowed(delays)

        return make

    fast, slow = (lambda n: 0.0), (lambda n: 0.002)
    first = KernelChooser(tmp_path / "choices.json")
    assert first.kernels("f32 8x8", ["x", "y"], run({"x": slow, "y": fast})) == ("y",) * len(ROWS)
    assert timed == ["x,y"]
    assert json.loads((tmp_path / "choices.json").read_text()) == {"f32 8x8": ["y"] * len(ROWS)}

    again = KernelChooser(tmp_path / "choices.json")
    assert again.kernels("f32 8x8", ["x", "y"], run({"x": fast, "y": slow})) == ("y",) * len(ROWS)
    assert timed == ["x,y"] and again.chosen == {"f32 8x8": ("y",) * len(ROWS)}
    assert "f32 8x8: y y y y y" in again.report()

    assert again.kernels("f32 8x8", ["x", "z"], run({"x": slow, "z": fast})) == ("z",) * len(ROWS)
    (tmp_path / "choices.json").write_text("[not a table")
    assert again.kernels("f32 8x8", ["x", "z"], run({"x": fast, "z": slow})) == ("x",) * len(ROWS)
    assert timed == ["x,y", "x,z", "x,z"]


def test_the_table_is_per_machine_and_build(tmp_path: Path) -> None:
    """The table's file is named by what decides the timings: another kernel library (or CPU, torch,
    thread count) starts a table of its own."""
    a, b = (KernelChooser.for_machine(tmp_path, name).path for name in ("lib-a.so", "lib-b.so"))
    assert a != b and a.parent == b.parent == tmp_path / "kernels"
    assert KernelChooser.for_machine(tmp_path, "lib-a.so").path == a


def _two_kernels(dtype: torch.dtype) -> tuple[str, str]:
    """Two kernels that run `dtype` here as themselves, the one-row kernel first."""
    names = candidates(CPU, dtype, 64)
    if len(names) < 2:
        pytest.skip(f"one kernel runs {dtype} here")
    return names[0], names[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_a_linear_runs_each_row_count_on_its_kernel(dtype: torch.dtype, gated: bool) -> None:
    """A table of two kernels: the weight is laid out for both, and each call's output is bitwise
    that of a linear of its row count's kernel alone (gated: with the SiLU applied either way)."""
    few, many = _two_kernels(dtype)
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(128, 64, generator=gen).to(dtype), torch.randn(128, generator=gen).to(dtype)
    table = (few, few, few, many, many)
    linear = Linear(w, b, table, gated)
    assert linear.kernels == table and linear.kernel == few and len(linear.layouts) == 2
    alone = {name: Linear(w, b, name, gated) for name in (few, many)}
    for rows in (1, 7, 32, 33, 300):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        want = alone[table[bucket(rows)]]
        y = want(x)
        if linear.silu and not want.silu:
            y = cpu_kernels.silu_mul(y)
        assert torch.equal(linear(x), y), rows


def test_greedy_output_unchanged_by_the_fastest_choice(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `fastest` mode: float32 greedy tokens of the tiny llama at PP 1 and 2 are the same
    whatever the timings made the table: ppserve's GEMM everywhere, torch's everywhere, or each at
    its row counts (the decode step then runs only where every linear has its one-row kernel)."""
    few, many = _two_kernels(torch.float32)
    prompts = [random_prompt(random.Random(i), 6 + 9 * i) for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tables = {"few": (few,) * len(ROWS), "many": (many,) * len(ROWS), "both": (few, few, many, many, many)}
    runs = {}
    for name, table in tables.items():
        for pp in (1, 2):
            # each run a table of its own: timings that always come out as `table`
            monkeypatch.setattr(kernel_choice, "choose", lambda times, per_rows=True, t=table: t)
            path = tmp_path / f"{name}-{pp}.json"
            monkeypatch.setattr(
                KernelChooser, "for_machine", classmethod(lambda cls, cache, lib, mode, p=path: cls(p, mode))
            )
            config = EngineConfig.create(llama_dir, pp_size=pp, num_kv_blocks=256, kernel_choice="fastest")
            pipe = OfflineEngine(config)
            runner = pipe.executor.runners[0]
            assert runner.kernels.rows == list(ROWS)
            assert runner.kernels.linears and all(ks == list(table) for ks in runner.kernels.linears.values())
            step = runner.model.decode_step
            if step is not None:
                assert step.buckets == {i for i, k in enumerate(table) if k == table[0]}
            runs[name, pp] = [g.token_ids for g in pipe.generate(prompts, params)]
            pipe.close()
    assert len({str(r) for r in runs.values()}) == 1, runs


def test_invariant_by_default_untimed_where_ppserve_runs(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default mode: where ppserve's GEMM is a candidate (its rows independent of their batch)
    it runs every linear, at every row count, and nothing is timed; its one kernel per shape
    elsewhere (test_a_second_kernel_only_where_it_saves_a_fifth's `per_rows`)."""
    monkeypatch.setattr(kernel_choice, "time_kernels", lambda run: pytest.fail("timed"))
    pipe = OfflineEngine(EngineConfig.create(llama_dir, num_kv_blocks=64))
    linears = pipe.executor.runners[0].kernels.linears
    pipe.close()
    if "ppserve" not in candidates(CPU, torch.float32, 64):
        pytest.skip("no ppserve GEMM here")
    assert linears and all(ks == ["ppserve"] * len(ROWS) for ks in linears.values())
    assert choose({"a": [1.0] * 5, "b": [2.0] * 4 + [0.5]}, per_rows=False) == ("a",) * 5
    with pytest.raises(ConfigError, match=r"must be one of invariant, fastest, off; got 'fast'"):
        EngineConfig.create(llama_dir, kernel_choice="fast")


def test_switched_off_the_defaults_run(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PPSERVE_KERNEL_CHOICE=off: nothing is timed, every linear runs its dtype's default kernel."""
    monkeypatch.setenv("PPSERVE_KERNEL_CHOICE", "off")
    monkeypatch.setattr(kernel_choice, "time_kernels", lambda run: pytest.fail("timed"))
    pipe = OfflineEngine(EngineConfig.create(llama_dir, num_kv_blocks=64))
    runner = pipe.executor.runners[0]
    assert runner.kernels.linears == {}
    layer = runner.model.model.layers["0"]
    assert isinstance(layer, DecoderLayer)
    qkv = layer.self_attn.qkv
    assert isinstance(qkv, Linear) and qkv.kernel in KERNELS and len(set(qkv.kernels)) == 1
    pipe.close()


def test_amx_refused_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A CPU with AMX whose Linux refuses the tiles' state (arch_prctl): not used, one warning; one
    that grants it: used; a CPU without AMX asks nothing."""
    asked: list[int] = []

    def refuse() -> int:
        asked.append(1)
        return 1  # EPERM

    monkeypatch.setattr(amx, "_request_tiles", refuse)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags\t\t: avx512f amx_bf16 amx_tile amx_int8")
    amx.amx.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=amx.__name__):
            assert not amx.amx() and not amx.amx()
        assert asked == [1] and len(caplog.records) == 1 and "refused" in caplog.records[0].getMessage()
        monkeypatch.setattr(amx, "_request_tiles", lambda: 0)
        amx.amx.cache_clear()
        assert amx.amx()
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags\t\t: avx2 fma")
        monkeypatch.setattr(amx, "_request_tiles", lambda: pytest.fail("asked"))
        amx.amx.cache_clear()
        assert not amx.amx()
    finally:
        amx.amx.cache_clear()
