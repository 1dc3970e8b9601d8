"""Which GPU each pipeline stage runs on.

Stages are contiguous slices of the model, so stages that must share GPUs (more stages than
GPUs) share with their neighbours: 4 stages on 2 GPUs are 0, 0, 1, 1. NCCL refuses two ranks on
one GPU, so a pipeline with a shared GPU moves activations another way (see `resolve_kind`).
"""

from __future__ import annotations

from collections.abc import Sequence


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    """`--gpu-ids 2,3`: distinct CUDA device indices."""
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--gpu-ids: expected comma-separated device indices such as 0,1, got {text!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpu-ids: device indices must be distinct and >= 0, got {text!r}")
    return ids


def stage_gpus(pp_size: int, available: int, gpu_ids: Sequence[int] = ()) -> tuple[int, ...]:
    """The CUDA device index of each stage: stage k on the k-th of `gpu_ids` (default: every
    visible device, 0 .. available-1); with fewer devices than stages, neighbours share."""
    ids = tuple(gpu_ids) or tuple(range(available))
    if not ids:
        raise ValueError("no CUDA device is visible")
    if missing := [i for i in ids if not 0 <= i < available]:
        raise ValueError(f"--gpu-ids names device(s) {missing}, but {available} are visible")
    used = min(len(ids), pp_size)
    return tuple(ids[stage * used // pp_size] for stage in range(pp_size))


def shares_a_gpu(gpus: Sequence[int]) -> bool:
    return len(set(gpus)) < len(gpus)
