"""Stages on GPUs: which device each stage gets, and which channel joins stages that share one.
The mapping and the choice are pure and tested here; tests/cluster/test_cuda.py runs the pipeline on
GPUs where there are some."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppserve.engine.cluster.devices import parse_gpu_ids, shares_a_gpu, stage_gpus
from ppserve.engine.config import EngineConfig
from ppserve.engine.model.model_config import ConfigError
from ppserve.transport.channels import resolve_kind


@pytest.mark.parametrize(
    ("pp_size", "available", "gpu_ids", "expected"),
    [
        (2, 2, (), (0, 1)),  # stage k on cuda:k
        (2, 8, (), (0, 1)),
        (4, 2, (), (0, 0, 1, 1)),  # fewer GPUs than stages: neighbours share
        (3, 2, (), (0, 0, 1)),
        (2, 1, (), (0, 0)),  # a one-GPU box
        (2, 4, (2, 3), (2, 3)),  # --gpu-ids
        (3, 4, (3, 1), (3, 3, 1)),
    ],
)
def test_stage_gpus(pp_size: int, available: int, gpu_ids: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert stage_gpus(pp_size, available, gpu_ids) == expected


def test_stage_gpus_errors() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        stage_gpus(2, 0)
    with pytest.raises(ValueError, match=r"device\(s\) \[4\], but 4 are visible"):
        stage_gpus(2, 4, (1, 4))


def test_parse_gpu_ids() -> None:
    assert parse_gpu_ids("2,3") == (2, 3)
    for bad in ("", "a", "1,,2", "-1", "1,1"):
        with pytest.raises(ValueError, match="--gpu-ids"):
            parse_gpu_ids(bad)


def test_channel_for_shared_gpus() -> None:
    assert not shares_a_gpu((0, 1)) and shares_a_gpu((0, 0, 1))
    assert resolve_kind("auto", "cuda", same_host=True) == "nccl"
    assert resolve_kind("auto", "cuda", same_host=True, shared_gpu=True) == "shm"  # NCCL refuses two ranks on one GPU
    assert resolve_kind("auto", "cuda", same_host=False, shared_gpu=True) == "zmq"
    assert resolve_kind("auto", "cpu", same_host=False) == "gloo"
    with pytest.raises(ValueError, match="each stage on its own GPU"):
        resolve_kind("nccl", "cuda", same_host=True, shared_gpu=True)
    assert resolve_kind("auto", "cpu", same_host=True) == "shm"


def test_gpu_ids_need_cuda(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--gpu-ids needs --device cuda"):
        EngineConfig.create(llama_dir, pp_size=2, gpu_ids=(0, 1))
    assert EngineConfig.create(llama_dir, pp_size=2).stage_gpus == ()


@pytest.mark.parametrize(
    ("pp_size", "threads", "cores", "expected"),
    [
        (2, 1, [0, 1], [{0}, {1}]),  # one core per stage
        (2, 2, [0, 1, 2, 3], [{0, 1}, {2, 3}]),
        (2, 1, [4, 6], [{4}, {6}]),  # the cores this process may use, not 0..n
        (4, 1, [0, 1], [None] * 4),  # more stages than cores: the OS shares them
        (1, 2, [0, 1], [None]),  # one stage: every core anyway
    ],
)
def test_stage_cores(
    monkeypatch: pytest.MonkeyPatch,
    llama_dir: Path,
    pp_size: int,
    threads: int,
    cores: list[int],
    expected: list[set[int] | None],
) -> None:
    from ppserve.engine.runtime import cpu_affinity

    monkeypatch.setattr(cpu_affinity.os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.delenv("PPSERVE_PIN_STAGES", raising=False)
    config = EngineConfig.create(llama_dir, pp_size=pp_size, num_kv_blocks=4)
    assert cpu_affinity.stage_cores(config, 0, threads) is None  # opt-in
    monkeypatch.setenv("PPSERVE_PIN_STAGES", "1")  # read when the config is made
    config = EngineConfig.create(llama_dir, pp_size=pp_size, num_kv_blocks=4)
    assert [cpu_affinity.stage_cores(config, s, threads) for s in range(pp_size)] == expected
