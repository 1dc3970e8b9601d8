"""Engine configuration: resolved once (no "auto" left inside), frozen, copied per stage."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ppserve.engine.cluster import ClusterConfig
from ppserve.engine.devices import shares_a_gpu, stage_gpus
from ppserve.engine.gguf_checkpoint import is_gguf_file, prepare_gguf
from ppserve.engine.kv_cache import kv_bytes_per_block
from ppserve.engine.model_config import ConfigError, ModelConfig
from ppserve.engine.partition import partition_layers
from ppserve.transport.tensor_channel import resolve_kind

SMOOTH_ENV = "PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR"
LOOP_WATCH_ENV = "PPSERVE_DEBUG_LOOP_MS"  # engine/loop_watch.py
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    pp_size: int
    layer_ranges: tuple[range, ...]  # per stage
    dtype: str  # a key of DTYPES
    device: str  # "cpu" or "cuda"
    block_size: int
    num_kv_blocks: int  # per stage; every stage holds the same block ids for its own layers
    max_model_len: int
    # Runtime (pipeline) settings.
    edge_transports: tuple[str, ...] = ()  # per edge (stage i -> i + 1), resolved: shm | gloo | nccl | zmq
    max_running_requests: int = 256
    max_waiting_requests: int = 4096  # queued beyond this: new requests are refused (HTTP 503)
    max_batched_tokens: int = 2048  # new tokens per micro-batch
    chunked_prefill_size: int = 512  # new tokens of one request per micro-batch (the first chunk, if dynamic)
    dynamic_chunking: bool = False  # size later chunks of a prompt from a prefill latency model
    chunk_smooth: float = 0.75  # how strictly chunk sizes follow the model (0: fixed, 1: strictly)
    enable_prefix_caching: bool = True  # shared prompt prefixes are computed once (scheduler/block_allocator.py)
    # Stages that do no math but wait the time this model gives: (a, b, c) of a*attention + b*tokens
    # + c seconds for the whole model (see engine/synthetic.py). For studying scheduling at any pp size.
    synthetic_latency: tuple[float, float, float] | None = None
    # Plans in flight beyond one per stage. 0: a spare plan would hide the host's turnaround, but
    # decodes would then split into pp_size + 1 smaller micro-batches; on CPUs the smaller GEMMs
    # cost more than the turnaround (scripts/bench_peers.py: +6% tokens/s at PP=1 and PP=2).
    async_depth: int = 0
    threads_per_stage: int = 1
    stage_start_timeout_s: float = 120.0
    stage_timeout_s: float = 10.0  # a live stage silent this long is hung: it is killed and replaced
    max_stage_restarts: int = 3  # stage replacements allowed per window; past that the engine is dead
    stage_restart_window_s: float = 600.0
    stage_gpus: tuple[int, ...] = ()  # on CUDA: each stage's device index on its node (engine/devices.py)
    cluster: ClusterConfig | None = None  # stages on several nodes (engine/cluster.py); None: one host
    disaggregation: str = ""  # "prefill" | "decode": one side of a disaggregated pair; "": both in one
    disagg_host: str = "127.0.0.1"  # disaggregation sockets bind here (prefill: its bootstrap port too)
    disagg_port: int = 0  # the prefill side's bootstrap port (0: any free one)
    disagg_bootstrap_timeout_s: float = 30.0  # per state before the transfer (engine/disagg.py)
    disagg_transfer_timeout_s: float = 30.0
    disagg_key: bytes | None = field(default=None, repr=False)  # the secret of the pair's sockets
    disagg_insecure: bool = False  # no secret: anyone who reaches the pair's sockets can drive them
    # Debug: stages report every event-loop callback that uses more CPU than this (engine/loop_watch.py).
    debug_loop_ms: float | None = None

    @classmethod
    def create(
        cls,
        model: str | Path,
        *,
        pp_size: int = 1,
        layer_partition: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        kv_cache_gb: float = 1.0,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        tensor_transport: str = "auto",
        max_running_requests: int = 256,
        max_waiting_requests: int = 4096,
        max_batched_tokens: int | None = None,
        chunked_prefill_size: int = 512,
        dynamic_chunking: bool = False,
        chunk_smooth: float | None = None,
        enable_prefix_caching: bool = True,
        synthetic_latency: tuple[float, float, float] | None = None,
        async_depth: int = 0,
        threads_per_stage: int | None = None,
        stage_start_timeout_s: float = 120.0,
        stage_timeout_s: float = 10.0,
        max_stage_restarts: int = 3,
        stage_restart_window_s: float = 600.0,
        gpu_ids: tuple[int, ...] = (),
        cluster: ClusterConfig | None = None,
        disaggregation: str = "",
        disagg_host: str = "127.0.0.1",
        disagg_port: int = 0,
        disagg_bootstrap_timeout_s: float = 30.0,
        disagg_transfer_timeout_s: float = 30.0,
        disagg_key: bytes | None = None,
        disagg_insecure: bool = False,
    ) -> EngineConfig:
        if is_gguf_file(model):  # from here on, the prepared directory stands for the file
            model = prepare_gguf(model)
        model_config = ModelConfig.from_dir(model)
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA device is available")
        resolved_dtype = _resolve_dtype(dtype, model_config, device)
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        ranges = partition_layers(model_config.num_layers, pp_size, layer_partition)
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        elif not 1 <= max_model_len <= model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len must be in [1, {model_config.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {max_model_len}"
            )
        if num_kv_blocks is None:
            if not math.isfinite(kv_cache_gb) or kv_cache_gb <= 0:
                raise ConfigError(f"kv_cache_gb must be a positive number, got {kv_cache_gb}")
            # Sized by the stage with the most layers, so no stage uses more than kv_cache_gb.
            per_block = kv_bytes_per_block(
                model_config, max(len(r) for r in ranges), block_size, DTYPES[resolved_dtype]
            )
            num_kv_blocks = int(kv_cache_gb * 2**30) // per_block
        if num_kv_blocks < 1:
            raise ConfigError(f"the KV cache must hold at least one block, got {num_kv_blocks}")
        # A single request must always fit: it can then finish after preempting all others.
        max_model_len = min(max_model_len, num_kv_blocks * block_size)
        for name, value in (
            ("max_running_requests", max_running_requests),
            ("max_waiting_requests", max_waiting_requests),
            ("chunked_prefill_size", chunked_prefill_size),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if max_batched_tokens is None:
            max_batched_tokens = max(2048, chunked_prefill_size)
        if max_batched_tokens < chunked_prefill_size:
            raise ConfigError(
                f"max_batched_tokens ({max_batched_tokens}) must be >= chunked_prefill_size ({chunked_prefill_size})"
            )
        if chunk_smooth is None:
            chunk_smooth = _env_float(SMOOTH_ENV, 0.75)
        if not 0.0 <= chunk_smooth <= 1.0:
            raise ConfigError(f"the dynamic chunking smooth factor must be in [0, 1], got {chunk_smooth}")
        if synthetic_latency is not None and (
            len(synthetic_latency) != 3 or not all(math.isfinite(v) and v >= 0 for v in synthetic_latency)
        ):
            raise ConfigError(f"synthetic latency needs three finite numbers >= 0 (a, b, c), got {synthetic_latency}")
        if async_depth < 0:
            raise ConfigError(f"async_depth must be >= 0, got {async_depth}")
        if threads_per_stage is None:
            threads_per_stage = max(1, (os.cpu_count() or 1) // pp_size)
        if threads_per_stage < 1:
            raise ConfigError(f"threads_per_stage must be >= 1, got {threads_per_stage}")
        for name, seconds in (
            ("stage_start_timeout_s", stage_start_timeout_s),
            ("stage_restart_window_s", stage_restart_window_s),
        ):
            if not math.isfinite(seconds) or seconds <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {seconds}")
        # Stages send a heartbeat every 0.2 s: leave room for a few of them to be late.
        if not (math.isfinite(stage_timeout_s) and stage_timeout_s >= 1.0):
            raise ConfigError(f"stage_timeout_s must be at least 1 second, got {stage_timeout_s}")
        if max_stage_restarts < 0:
            raise ConfigError(f"max_stage_restarts must be >= 0, got {max_stage_restarts}")
        if disaggregation not in ("", "prefill", "decode"):
            raise ConfigError(f"disaggregation mode must be prefill or decode, got {disaggregation!r}")
        if disaggregation and disagg_host in ("0.0.0.0", "::", ""):
            raise ConfigError("disaggregation sockets need this machine's address (--node-addr), not a wildcard")
        if not 0 <= disagg_port < 65536:
            raise ConfigError(f"the disaggregation bootstrap port must be in [0, 65535], got {disagg_port}")
        for name, seconds in (
            ("disaggregation bootstrap timeout", disagg_bootstrap_timeout_s),
            ("disaggregation transfer timeout", disagg_transfer_timeout_s),
        ):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"the {name} must be a positive number of seconds, got {seconds}")
        if disaggregation and disagg_key is None and not disagg_insecure:
            raise ConfigError(
                "prefill/decode disaggregation needs a shared secret on both sides and the router: "
                "--cluster-key-file PATH or env PPSERVE_CLUSTER_KEY (or --insecure-cluster on a network you trust)"
            )
        if disagg_key is not None and disagg_insecure:
            raise ConfigError("--insecure-cluster and a cluster key exclude each other")
        # A debug switch, from the environment only: no flag of its own.
        debug_loop_ms = _env_float(LOOP_WATCH_ENV, 0.0)
        if not (math.isfinite(debug_loop_ms) and debug_loop_ms >= 0):
            raise ConfigError(f"{LOOP_WATCH_ENV} must be a number of milliseconds >= 0, got {debug_loop_ms}")
        if gpu_ids and device != "cuda":
            raise ConfigError("--gpu-ids needs --device cuda")
        if cluster is not None and len(cluster.stage_nodes) != pp_size:
            raise ConfigError(f"the cluster places {len(cluster.stage_nodes)} stages, but --pp-size is {pp_size}")
        nodes = cluster.stage_nodes if cluster is not None else (0,) * pp_size
        try:
            gpus: tuple[int, ...] = ()
            if device == "cuda":  # each node numbers its own devices
                for node in sorted(set(nodes)):
                    gpus += stage_gpus(nodes.count(node), torch.cuda.device_count(), gpu_ids)
            shared = shares_a_gpu([n * 1_000_000 + g for n, g in zip(nodes, gpus, strict=False)])
            resolve_kind(tensor_transport, device, same_host=True, shared_gpu=shared)  # checked even at PP=1
            transports = tuple(
                resolve_kind(tensor_transport, device, same_host=nodes[i] == nodes[i + 1], shared_gpu=shared)
                for i in range(pp_size - 1)
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return cls(
            model=str(model),
            model_config=model_config,
            pp_size=pp_size,
            layer_ranges=ranges,
            dtype=resolved_dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            edge_transports=transports,
            max_running_requests=max_running_requests,
            max_waiting_requests=max_waiting_requests,
            max_batched_tokens=max_batched_tokens,
            chunked_prefill_size=chunked_prefill_size,
            dynamic_chunking=dynamic_chunking,
            chunk_smooth=chunk_smooth,
            enable_prefix_caching=enable_prefix_caching,
            synthetic_latency=synthetic_latency,
            async_depth=async_depth,
            threads_per_stage=threads_per_stage,
            stage_start_timeout_s=stage_start_timeout_s,
            stage_timeout_s=stage_timeout_s,
            max_stage_restarts=max_stage_restarts,
            stage_restart_window_s=stage_restart_window_s,
            stage_gpus=gpus,
            cluster=cluster,
            disaggregation=disaggregation,
            disagg_host=disagg_host,
            disagg_port=disagg_port,
            disagg_bootstrap_timeout_s=disagg_bootstrap_timeout_s,
            disagg_transfer_timeout_s=disagg_transfer_timeout_s,
            disagg_key=disagg_key,
            disagg_insecure=disagg_insecure,
            debug_loop_ms=debug_loop_ms or None,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tensor_transport(self) -> str:
        """The edges' channel kind(s), e.g. "shm", or "gloo+shm" across nodes ("none" at PP=1)."""
        return "+".join(sorted(set(self.edge_transports))) or "none"

    @property
    def process_group(self) -> str | None:
        """The torch.distributed backend every stage joins, if any edge uses one."""
        return next((k for k in self.edge_transports if k in ("gloo", "nccl")), None)

    @property
    def socket_key(self) -> bytes | None:
        """The secret that guards this engine's sockets across machines (a cluster's, else a
        disaggregated pair's), if one was given."""
        return self.cluster.key if self.cluster is not None else self.disagg_key

    def disagg_address(self, port: int | None = None) -> str:
        """A ZeroMQ address on the disaggregation host: at `port`, else any free port."""
        host = f"[{self.disagg_host}]" if ":" in self.disagg_host else self.disagg_host
        return f"tcp://{host}:{port or '*'}"

    def cluster_settings(self) -> dict[str, str]:
        """What every node of a cluster must agree on (compared when a node joins)."""
        names = (
            "pp_size layer_ranges dtype device block_size num_kv_blocks max_model_len edge_transports "
            "max_batched_tokens async_depth dynamic_chunking synthetic_latency"
        ).split()
        settings = {name: str(getattr(self, name)) for name in names}
        settings["stage_nodes"] = str(self.cluster.stage_nodes if self.cluster else ())
        return settings


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None


def _resolve_dtype(dtype: str, model_config: ModelConfig, device: str) -> str:
    if dtype == "auto":
        # The checkpoint's dtype on GPUs; float32 on CPU, where half-precision matmuls are slow.
        if device == "cpu":
            return "float32"
        dtype = model_config.dtype
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return dtype
