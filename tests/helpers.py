"""Small helpers shared by tests (not fixtures)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from procs import children, read

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.config import EngineConfig
from ppserve.engine.offline import OfflineEngine
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import SeqChunk

GREEDY_TOKENS = 32

# A valid config.json of a tiny llama.
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (dead for our purposes; its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def spawned_children(pid: int) -> list[int]:
    """The live multiprocessing (spawn) children of `pid`: its stage processes."""
    return [c for c in children(pid) if b"spawn_main" in read(c, "cmdline") and alive(c)]


def random_prompt(rng: random.Random, length: int, vocab: int = 512) -> list[int]:
    return [rng.randrange(6, vocab) for _ in range(length)]  # skip the special tokens


def pipeline(model_dir: Path, pp_size: int = 1, **kwargs: object) -> OfflineEngine:
    kwargs.setdefault("num_kv_blocks", 256)
    return OfflineEngine(EngineConfig.create(model_dir, pp_size=pp_size, **kwargs))  # type: ignore[arg-type]


# Sixteen prompts of 1 to 64 tokens, for runs of an AsyncEngine.
PROMPTS = [
    random_prompt(random.Random(i), n) for i, n in enumerate([1, 2, 3, 5, 8, 9, 13, 16, 17, 24, 31, 33, 40, 47, 52, 64])
]


def engine_config(model_dir: Path, pp: int, transport: str = "shm", **kw: object) -> EngineConfig:
    """An AsyncEngine's config for the tests of the pipeline: small chunks, one thread a stage."""
    kw.setdefault("chunked_prefill_size", 8)  # many chunks per prompt
    kw.setdefault("num_kv_blocks", 512)
    return EngineConfig.create(model_dir, pp_size=pp, tensor_transport=transport, threads_per_stage=1, **kw)  # type: ignore[arg-type]


async def collect(engine: AsyncEngine, prompt: list[int] | str, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params):
        tokens += out.token_ids
    return tokens


async def wait_until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def prefill_here(pipe: OfflineEngine, prompt: list[int], params: SamplingParams) -> tuple[Request, int]:
    """A prefill server's part of a request: the prompt and its first token, the KV kept for a
    transfer (`KvHandover.release` gives it back). Returns the request and that token."""
    r = pipe.request(prompt, replace(params, max_tokens=1))
    r.hold_kv = True
    pipe.run([r])
    return r, r.output_token_ids[0]


def prompt_logits(pipe: OfflineEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, [len(prompt), vocab], in one prefill."""
    blocks = pipe.allocator.allocate(pipe.allocator.blocks_for(len(prompt)))
    try:
        return pipe.executor.forward([SeqChunk("p", prompt, 0, blocks, True)], all_logits=True)
    finally:
        pipe.allocator.free(blocks)


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers, recomputing the whole sequence each step (no cache,
    no generation config): the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def hf_log_softmax(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every prompt position, [len(prompt), vocab]: row i
    scores the token at i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
