"""Engine configuration: resolved once (no "auto" left inside), frozen, copied per stage."""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ppserve.engine.cluster.config import ClusterConfig
from ppserve.engine.cluster.devices import parse_gpu_ids, shares_a_gpu, stage_gpus
from ppserve.engine.cluster.ray_config import RayConfig
from ppserve.engine.disagg.faults import DisaggFaults
from ppserve.engine.environment import READERS
from ppserve.engine.environment import read as read_environment
from ppserve.engine.model.gguf_checkpoint import is_gguf_file, prepare_gguf
from ppserve.engine.model.kernel_choice import MODES as KERNEL_CHOICES
from ppserve.engine.model.kv_cache import kv_bytes_per_block, kv_pools, kv_window
from ppserve.engine.model.model_config import ConfigError, ModelConfig
from ppserve.engine.model.partition import partition_layers
from ppserve.engine.model.quantized import QUANTIZATIONS
from ppserve.engine.settings import default_of, problems, setting
from ppserve.scheduler.drafter import MODES as SPECULATIVE_MODES
from ppserve.scheduler.scheduler import SchedulerConfig
from ppserve.scheduler.window_kv import blocks_per_request
from ppserve.transport.channels import KINDS, resolve_kind

PAIR = "prefill/decode disaggregation (a router in front: `ppserve router`)"
MAX_SPECULATIVE_TOKENS = 32  # drafts per step: beyond this a step is a prefill chunk, not a decode
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# The scheduler declares the defaults of its settings; the engine's fields of the same names take
# them from here, so that a default is declared once (tests/engine/test_config_chain.py checks every layer).
_SCHEDULER = SchedulerConfig(num_blocks=1, block_size=1, pp_size=1)
# Fields that create() works out from the checkpoint and its other inputs; never given directly.
DERIVED = frozenset({"model", "model_config", "layer_ranges", "edge_transports", "stage_gpus", "kv_window"})


def parse_latency(text: str) -> tuple[float, float, float]:
    """`--synthetic-latency A,B,C`."""
    try:
        a, b, c = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected three numbers A,B,C, got {text!r}") from None
    return a, b, c


@dataclass(frozen=True)
class Inputs:
    """What `EngineConfig.create` takes that is no field of the config: it resolves them into
    fields (layer_ranges, num_kv_blocks, edge_transports, stage_gpus)."""

    layer_partition: str | None = setting(
        None, "layers per stage, e.g. 3,3,4", metavar="COUNTS", default_text="an even split"
    )
    kv_cache_gb: float = setting(
        1.0, "KV cache memory per stage, GiB (sizes the cache unless num_kv_blocks is given)", gt=0
    )
    tensor_transport: str = setting(
        "auto",
        "how activations travel between stages (auto: nccl on CUDA with a GPU per stage, shm within a node, else gloo)",
        choices=KINDS,
    )
    gpu_ids: tuple[int, ...] = setting(
        (),
        "CUDA devices for the stages, e.g. 2,3; stage k runs on the k-th, neighbouring stages share when there "
        "are fewer devices than stages",
        parse=parse_gpu_ids,
        metavar="IDS",
        default_text="every visible one",
    )


INPUTS = Inputs()


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine runs by, resolved: no "auto" left inside. Build it with `create`.
    Each setting is declared once, here (engine/settings.py): default, range, help and flag."""

    model: str
    model_config: ModelConfig
    layer_ranges: tuple[range, ...]  # per stage
    dtype: str = setting(
        MISSING, "auto | float32 | bfloat16 | float16", default_text="auto: float32 on CPU, the checkpoint's on CUDA"
    )  # resolved: a key of DTYPES
    # Per stage; every stage holds the same block ids for its own layers.
    num_kv_blocks: int = setting(MISSING, "KV blocks per stage", cli=False, ge=1, default_text="from kv_cache_gb")
    max_model_len: int = setting(MISSING, "context length", ge=1, default_text="the model's")
    pp_size: int = setting(1, "pipeline stages", ge=1)
    device: str = setting("cpu", "where the stages compute", choices=("cpu", "cuda"))
    block_size: int = setting(16, "tokens per KV block", ge=1)
    # Sliding-window layers keep only the blocks of their window, from a pool of their own
    # (engine/model/kv_cache.py): that group's window, from the model (None: no such group), and its
    # blocks (0: sized with num_kv_blocks from kv_cache_gb, or as many as num_kv_blocks where given).
    kv_window: int | None = _SCHEDULER.kv_window
    num_window_blocks: int = setting(
        _SCHEDULER.num_window_blocks, "KV blocks of the sliding-window layers per stage", cli=False, ge=0
    )
    quantization: str = setting(
        "auto",
        "weight-only quantized linears (engine/model/quantized.py): auto keeps a GGUF's Q8_0/Q4_0/Q4_1 weights "
        "quantized (int8, int4), none dequantizes every weight to --dtype, int8 quantizes every linear to int8",
        choices=QUANTIZATIONS,
    )
    # Runtime (pipeline) settings.
    edge_transports: tuple[str, ...] = ()  # per edge (stage i -> i + 1), resolved: shm | gloo | nccl | zmq
    max_running_requests: int = setting(_SCHEDULER.max_running_requests, "requests computed at once", ge=1)
    max_waiting_requests: int = setting(
        4096, "requests queued beyond the running ones; past it, new ones are refused (HTTP 503)", ge=1,
        commands=("serve",),
    )  # fmt: skip
    # Half the default max_running_requests: a newcomer finds a running slot.
    max_requests_per_client: int = setting(
        128,
        "running and waiting requests one client (an API key, or a connection where there is none) may hold; "
        "past it, its new requests are refused (HTTP 429), so that no client can fill the queue",
        ge=1,
        commands=("serve",),
    )
    max_batched_tokens: int = setting(
        _SCHEDULER.max_batched_tokens,
        "new tokens per micro-batch, all requests together: what sizes a stage's activations (raised to the "
        "prefill chunk size where that is larger)",
        ge=1,
    )
    chunked_prefill_size: int = setting(_SCHEDULER.chunked_prefill_size, "prompt tokens per prefill chunk", ge=1)
    dynamic_chunking: bool = setting(
        _SCHEDULER.dynamic_chunking,
        "shrink later prefill chunks of a long prompt so every chunk takes equal time (profiles at start-up)",
        aliases=("--enable-dynamic-chunking",),
    )
    chunk_smooth: float = setting(
        _SCHEDULER.chunk_smooth,
        "dynamic chunking: 0 = fixed chunks .. 1 = follow the latency model strictly",
        ge=0,
        le=1,
        aliases=("--dynamic-chunking-smooth-factor",),
        env="PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR",
    )
    enable_prefix_caching: bool = setting(
        _SCHEDULER.enable_prefix_caching,
        "reuse the KV of prompt prefixes seen before (a shared system prompt, a conversation's earlier turns)",
    )
    speculative: str = setting(
        _SCHEDULER.speculative,
        "speculative decoding with drafts from the text already seen (scheduler/speculation.py): ngram looks up "
        "the request's own prompt and output, suffix also recent requests' (per tenant); each request's draft "
        "length follows its acceptance and drops to 0 where the batch is compute-bound; output is as with off",
        choices=SPECULATIVE_MODES,
    )
    num_speculative_tokens: int = setting(
        _SCHEDULER.num_speculative_tokens, "drafts per request and step at most", ge=0, le=MAX_SPECULATIVE_TOKENS
    )
    # Stages that do no math but wait the time this model gives (engine/runtime/synthetic.py).
    synthetic_latency: tuple[float, float, float] | None = setting(
        None,
        "synthetic stages: no math, each micro-batch waits a*attention + b*tokens (whole model, split by layers) "
        "+ c seconds per stage; output is labelled synthetic",
        parse=parse_latency,
        metavar="A,B,C",
        default_text="off",
    )
    # Plans in flight beyond one per stage (why 0: scheduler.py).
    async_depth: int = setting(_SCHEDULER.async_depth, "plans in flight beyond one per stage", cli=False, ge=0)
    decode_ahead: bool = setting(
        _SCHEDULER.decode_ahead,
        "PP=1: a request's next decode step is planned before its token is back",
        cli=False,
        env="PPSERVE_DECODE_AHEAD",
    )
    threads_per_stage: int = setting(
        1, "compute threads per stage", cli=False, ge=1, default_text="the machine's cores, shared"
    )
    stage_start_timeout_s: float = setting(
        120.0,
        "how long the stages may take to start (load, build the CPU kernels, profile) before the start fails",
        gt=0,
        metavar="SECONDS",
    )
    # Stages send a heartbeat every 0.2 s: the floor leaves room for a few of them to be late.
    stage_timeout_s: float = setting(
        10.0,
        "a live stage silent this long is declared hung, killed and replaced (a dead process is noticed at once)",
        ge=1,
        metavar="SECONDS",
    )
    max_stage_restarts: int = setting(
        3, "failed stages replaced per restart window before the engine gives up (0: never replace)", ge=0
    )
    stage_restart_window_s: float = setting(600.0, "the window of max_stage_restarts", cli=False, gt=0)
    stage_gpus: tuple[int, ...] = ()  # on CUDA: each stage's device index on its node (engine/cluster/devices.py)
    cluster: ClusterConfig | None = None  # stages on several nodes (engine/cluster/config.py); None: one host
    ray: RayConfig | None = None  # stages as Ray actors, placed by Ray (engine/cluster/ray_config.py)
    # One side of a disaggregated pair (engine/disagg/rooms.py); "": both, colocated.
    disaggregation: str = setting(
        "",
        "serve one side of a disaggregated prefill/decode pair",
        flag="--disaggregation-mode",
        group=PAIR,
        choices=("", "prefill", "decode"),
        commands=("serve",),
        default_text="both, colocated",
    )
    disagg_host: str = "127.0.0.1"  # disaggregation sockets bind here (prefill: its bootstrap port too)
    disagg_port: int = setting(
        0,
        "prefill side: where decode servers reach it (0: any free port; /health says which)",
        flag="--disaggregation-bootstrap-port",
        group=PAIR,
        ge=0,
        le=65535,
        metavar="PORT",
        commands=("serve",),
    )
    disagg_bootstrap_timeout_s: float = setting(
        30.0,
        "a room's handshake, per state",
        flag="--disaggregation-bootstrap-timeout",
        group=PAIR,
        gt=0,
        metavar="SECONDS",
        commands=("serve",),
    )
    disagg_transfer_timeout_s: float = setting(
        30.0,
        "a room's KV transfer",
        flag="--disaggregation-transfer-timeout",
        group=PAIR,
        gt=0,
        metavar="SECONDS",
        commands=("serve",),
    )
    disagg_key: bytes | None = field(default=None, repr=False)  # the secret of the pair's sockets
    disagg_insecure: bool = False  # no secret: anyone who reaches the pair's sockets can drive them
    # From the environment unless given (engine/environment.py): read once, on the host, and
    # pickled to the stages with the rest, so that no process reads the environment later.
    disagg_faults: DisaggFaults | None = None  # injected PD faults (PPSERVE_DISAGG_FAULTS)
    pin_stages: bool = setting(
        False, "each stage on its own cores (engine/runtime/cpu_affinity.py)", cli=False, env="PPSERVE_PIN_STAGES"
    )
    compute_nice: int = setting(
        10,
        "the nice value of the stages' compute threads (engine/runtime/priority.py)",
        cli=False,
        ge=0,
        le=19,
        env="PPSERVE_COMPUTE_NICE",
    )
    cpu_kernels: bool = setting(
        True,
        "decode attention and fused norm, RoPE, SiLU in C++ (else torch ops)",
        cli=False,
        env="PPSERVE_CPU_KERNELS",
    )
    cache_dir: str = ""  # where built kernels live (PPSERVE_CACHE_DIR; engine/model/cache_dir.py)
    kernel_choice: str = setting(
        "invariant",
        "which kernel a float linear runs (engine/model/kernel_choice.py): invariant (rows independent of their "
        "batch, else the fastest), fastest (per row count, timed) or off (each dtype's default)",
        cli=False,
        choices=KERNEL_CHOICES,
        env="PPSERVE_KERNEL_CHOICE",
    )
    # Debug: stages report every event-loop callback that uses more CPU than this
    # (PPSERVE_DEBUG_LOOP_MS; engine/runtime/loop_watch.py).
    debug_loop_ms: float | None = None

    @classmethod
    def create(
        cls,
        model: str | Path,
        *,
        layer_partition: str | None = INPUTS.layer_partition,
        kv_cache_gb: float = INPUTS.kv_cache_gb,
        tensor_transport: str = INPUTS.tensor_transport,
        gpu_ids: tuple[int, ...] = INPUTS.gpu_ids,
        **settings: Any,
    ) -> EngineConfig:
        """Resolve a config for the checkpoint `model`. `settings` are fields by name; one left
        out (or None, for those that create() resolves) takes its declared default, or where the
        field says so, the environment's value. The named parameters are inputs that are no field:
        `layer_partition` ("3,3,4"), `kv_cache_gb` (sizes num_kv_blocks unless that is given),
        `tensor_transport` (resolved per edge) and `gpu_ids` (resolved per stage)."""
        given = _checked(settings)
        s = _settled(given, {"kv_cache_gb": kv_cache_gb, "tensor_transport": tensor_transport})
        if not Path(model).exists():
            raise ConfigError(
                f"model {str(model)!r} does not exist: give a Hugging Face checkpoint directory (config.json, "
                "safetensors, tokenizer.json) or a .gguf file"
            )
        if is_gguf_file(model):  # from here on, the prepared directory stands for the file
            model = prepare_gguf(model)
        model_config = ModelConfig.from_dir(model)
        device, pp_size = s["device"], s["pp_size"]
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA device is available")
        s["dtype"] = _resolve_dtype(s.get("dtype") or "auto", model_config, device)
        s["layer_ranges"] = partition_layers(model_config.num_layers, pp_size, layer_partition)
        _size_kv(s, model_config, kv_cache_gb)
        if given.get("max_batched_tokens") is None:  # room for a whole chunk
            s["max_batched_tokens"] = max(cls.max_batched_tokens, s["chunked_prefill_size"])
        if given.get("threads_per_stage") is None:
            s["threads_per_stage"] = max(1, (os.cpu_count() or 1) // pp_size)
        _validate(s)
        gpus, s["edge_transports"] = _placement(s, gpu_ids, tensor_transport)
        return cls(model=str(model), model_config=model_config, stage_gpus=gpus, **s)

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings: its fields are this config's fields of the same names."""
        shared = {f.name: getattr(self, f.name) for f in fields(SchedulerConfig) if f.name != "num_blocks"}
        return SchedulerConfig(num_blocks=self.num_kv_blocks, **shared)

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
        if self.cluster is not None:
            return self.cluster.key
        return self.ray.key if self.ray is not None else self.disagg_key

    @property
    def across_hosts(self) -> bool:
        """Whether stages may run on other machines than the host (the sockets are then TCP)."""
        return self.cluster is not None or self.ray is not None

    def disagg_address(self, port: int | None = None) -> str:
        """A ZeroMQ address on the disaggregation host: at `port`, else any free port."""
        host = f"[{self.disagg_host}]" if ":" in self.disagg_host else self.disagg_host
        return f"tcp://{host}:{port or '*'}"

    def cluster_settings(self) -> dict[str, str]:
        """What every node of a cluster must agree on (compared when a node joins)."""
        names = (
            "pp_size layer_ranges dtype quantization device block_size num_kv_blocks num_window_blocks max_model_len "
            "edge_transports max_batched_tokens async_depth decode_ahead dynamic_chunking synthetic_latency "
            "speculative num_speculative_tokens"
        ).split()
        settings = {name: str(getattr(self, name)) for name in names}
        settings["stage_nodes"] = str(self.cluster.stage_nodes if self.cluster else ())
        return settings


def _defaults() -> dict[str, Any]:
    """Each settable field's declared default (None for those create() resolves)."""
    return {f.name: default_of(f) for f in fields(EngineConfig) if f.name not in DERIVED}


def _checked(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` if every name is a settable field and every value has its field's type (as far as
    a default shows it), else a TypeError, as for any unexpected keyword argument."""
    defaults = _defaults()
    for name, value in settings.items():
        if name not in defaults:
            raise TypeError(f"EngineConfig.create() got an unexpected keyword argument {name!r}")
        default = defaults[name]
        if value is None or default is None:
            continue
        kind: tuple[type, ...] = (int, float) if type(default) is float else (type(default),)
        if not isinstance(value, kind) or (isinstance(value, bool) and not isinstance(default, bool)):
            raise TypeError(f"EngineConfig.create(): {name} must be {type(default).__name__}, got {value!r}")
    return settings


def _settled(given: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Every settable field's value: given, else the environment's where the field reads one, else
    its declared default (None, given or read, means "not set"); each checked against its range."""
    env = read_environment(
        name for name in READERS if given.get(name) is None and (name != "disagg_faults" or given.get("disaggregation"))
    )
    s = (
        _defaults()
        | {k: v for k, v in env.items() if v is not None}
        | {k: v for k, v in given.items() if v is not None}
    )
    if wrong := problems(EngineConfig, s) + problems(Inputs, inputs):  # every range, before anything is loaded
        raise ConfigError("; ".join(wrong))
    return s


def _size_kv(s: dict[str, Any], model_config: ModelConfig, kv_cache_gb: float) -> None:
    """The KV cache's blocks (from kv_cache_gb unless num_kv_blocks is given), its sliding window, and
    the context length they allow, into `s`."""
    block_size, ranges = s["block_size"], s["layer_ranges"]
    max_model_len = s.get("max_model_len")
    if max_model_len is None:
        max_model_len = model_config.max_position_embeddings
    elif max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len must be in [1, {model_config.max_position_embeddings}] "
            f"(the model's max_position_embeddings), got {max_model_len}"
        )
    num_kv_blocks = s.get("num_kv_blocks")
    budget = int(kv_cache_gb * 2**30) if num_kv_blocks is None else 0
    s["kv_window"] = window = kv_window(model_config.sliding_windows, max_model_len)
    if window is not None and s["disaggregation"]:
        raise ConfigError(
            "prefill/decode disaggregation does not transfer the KV of sliding-window layers, which this "
            f"model has (window {window})"
        )
    # Sized by the stage that needs most, so no stage uses more than kv_cache_gb.
    num_kv_blocks, num_window_blocks = kv_pools(
        model_config, ranges, window, kv_bytes_per_block(model_config, 1, block_size, DTYPES[s["dtype"]]),
        budget, num_kv_blocks, s["num_window_blocks"] or None, s["max_running_requests"], max_model_len,
        s["chunked_prefill_size"], block_size,
    )  # fmt: skip
    if num_kv_blocks < 1 or (window is not None and num_window_blocks < 1):
        got = f"{num_kv_blocks}" if window is None else f"{num_kv_blocks} and {num_window_blocks} (windowed layers)"
        raise ConfigError(f"the KV cache must hold at least one block, got {got}")
    s["num_kv_blocks"], s["num_window_blocks"] = num_kv_blocks, num_window_blocks
    # A single request must always fit: it can then finish after preempting all others.
    s["max_model_len"] = min(max_model_len, num_kv_blocks * block_size)
    if window is not None and num_window_blocks < blocks_per_request(window, s["chunked_prefill_size"], block_size):
        s["max_model_len"] = min(s["max_model_len"], num_window_blocks * block_size)


def _placement(
    s: dict[str, Any], gpu_ids: tuple[int, ...], tensor_transport: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Each stage's GPU (on CUDA) and each edge's tensor channel kind."""
    device, pp_size, cluster = s["device"], s["pp_size"], s["cluster"]
    if gpu_ids and device != "cuda":
        raise ConfigError("--gpu-ids needs --device cuda")
    if cluster is not None and len(cluster.stage_nodes) != pp_size:
        raise ConfigError(f"the cluster places {len(cluster.stage_nodes)} stages, but --pp-size is {pp_size}")
    if cluster is not None and s["ray"] is not None:
        raise ConfigError("--executor ray places the stages itself: it takes no --nnodes")
    # Under Ray, where a stage lands is known only once it is placed: every edge may cross nodes.
    nodes = cluster.stage_nodes if cluster is not None else tuple(range(pp_size)) if s["ray"] else (0,) * pp_size
    try:
        gpus: tuple[int, ...] = ()
        if device == "cuda" and s["ray"] is not None:
            gpus = (0,) * pp_size  # Ray gives each stage's actor one GPU of its own
        elif device == "cuda":  # each node numbers its own devices
            for node in sorted(set(nodes)):
                gpus += stage_gpus(nodes.count(node), torch.cuda.device_count(), gpu_ids)
        shared = shares_a_gpu([n * 1_000_000 + g for n, g in zip(nodes, gpus, strict=False)])
        resolve_kind(tensor_transport, device, same_host=True, shared_gpu=shared)  # checked even at PP=1
        edges = tuple(
            resolve_kind(tensor_transport, device, same_host=nodes[i] == nodes[i + 1], shared_gpu=shared)
            for i in range(pp_size - 1)
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return gpus, edges


def _validate(s: dict[str, Any]) -> None:
    """What the settings' own ranges (checked first, in create) cannot say: how they bear on each other."""
    if s["max_batched_tokens"] < s["chunked_prefill_size"]:
        raise ConfigError(
            f"max_batched_tokens ({s['max_batched_tokens']}) must be >= chunked_prefill_size "
            f"({s['chunked_prefill_size']})"
        )
    latency = s["synthetic_latency"]
    if latency is not None and (len(latency) != 3 or not all(math.isfinite(v) and v >= 0 for v in latency)):
        raise ConfigError(f"synthetic latency needs three finite numbers >= 0 (a, b, c), got {latency}")
    mode = s["disaggregation"]
    if mode and s["disagg_host"] in ("0.0.0.0", "::", ""):
        raise ConfigError("disaggregation sockets need this machine's address (--node-addr), not a wildcard")
    if mode and s["disagg_key"] is None and not s["disagg_insecure"]:
        raise ConfigError(
            "prefill/decode disaggregation needs a shared secret on both sides and the router: "
            "--cluster-key-file PATH or env PPSERVE_CLUSTER_KEY (or --insecure-cluster on a network you trust)"
        )
    if s["disagg_key"] is not None and s["disagg_insecure"]:
        raise ConfigError("--insecure-cluster and a cluster key exclude each other")


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
