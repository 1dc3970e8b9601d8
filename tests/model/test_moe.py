"""Mixtures of experts (engine/model/moe.py): Qwen3-MoE and Mixtral routed as transformers routes
them, each active expert one GEMM over its tokens, through the pipeline's features, and their load
on /metrics (engine/runtime/expert_load.py). Exactness against transformers and across PP sizes,
with chunked batches, is test_model_exactness.py's, which runs conftest's MoE checkpoints too."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from disagg_pair import collect as pd_collect
from disagg_pair import engine as pd_engine
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from helpers import GREEDY_TOKENS, collect, engine_config, hf_greedy, pipeline, prompt_logits, random_prompt, wait_until
from transformers import AutoModelForCausalLM

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.model.gguf_quant import GGUFLinear
from ppserve.engine.model.model import MLP, DecoderLayer
from ppserve.engine.model.model_config import ConfigError, ModelConfig
from ppserve.engine.model.moe import MoE
from ppserve.engine.model.quantized import QuantLinear
from ppserve.engine.offline import OfflineEngine
from ppserve.engine.runtime.expert_load import WINDOW_S, ExpertLoad
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.metrics import _engine_families

MOE = ("qwen3-moe", "mixtral")
GREEDY = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)


def _layer(checkpoint: Path, index: int = 0) -> DecoderLayer:
    return _layer_of(pipeline(checkpoint), index)


def _layer_of(pipe: OfflineEngine, index: int) -> DecoderLayer:
    """Layer `index` of the pipeline's stage that has it."""
    runner = next(r for r in pipe.executor.runners if index in r.layers)
    layer = runner.model.model.layers[str(index)]
    assert isinstance(layer, DecoderLayer)
    return layer


def _blocks(checkpoint: Path) -> tuple[Any, MoE]:
    """Layer 0's mixture: transformers' and ours, loaded from the same checkpoint."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = _layer(checkpoint).mlp
    assert isinstance(ours, MoE)
    return hf.model.layers[0].mlp, ours


def _check(hf: Any, ours: MoE, x: torch.Tensor, what: str) -> torch.Tensor:
    """Our layer routes `x` to transformers' experts and sums their outputs to within float32's
    rounding of transformers' (the experts' GEMMs are ours); returns the experts chosen."""
    experts, _ = ours.route(x)
    assert torch.equal(experts, hf.gate(x)[2]), what  # the router returns (logits, weights, experts)
    want = hf(x[None])[0]
    got = ours(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), what
    return experts


@pytest.mark.parametrize("arch", MOE)
def test_a_layer_equals_transformers_whatever_the_routing(checkpoints: dict[str, Path], arch: str) -> None:
    """Layer 0's mixture against transformers' on the same input: a few tokens (most experts get
    none), one token, every token routed alike, many tokens, and a router whose two experts score
    exactly alike (a tie, which torch's top-k breaks the same way for both)."""
    hf, ours = _blocks(checkpoints[arch])
    gen = torch.Generator().manual_seed(0)
    few = torch.randn(3, ours.gate.in_features, generator=gen)
    many = torch.randn(200, ours.gate.in_features, generator=gen)
    with torch.no_grad():
        assert len(_check(hf, ours, few, "few").unique()) < ours.cfg.num_experts  # some experts get no token
        _check(hf, ours, few[:1], "one")
        assert len(_check(hf, ours, few[:1].repeat(40, 1), "alike").unique()) == ours.cfg.top_k
        _check(hf, ours, many, "many")
        for router in (hf.gate, ours.gate):  # expert 1 scores exactly as expert 0
            router.weight[1] = router.weight[0]
        experts = _check(hf, ours, many, "tie")
        assert ((experts == 0) | (experts == 1)).any()


@pytest.mark.parametrize("arch", MOE)
def test_only_the_routed_experts_run_once_each(checkpoints: dict[str, Path], arch: str) -> None:
    """One token runs its k experts and no other; a batch runs each expert it routes to once, on all
    its tokens at once (one GEMM each for gate/up and down)."""
    moe = _layer(checkpoints[arch]).mlp
    assert isinstance(moe, MoE)
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: calls.append((e, args[0].shape[0])))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        x = torch.randn(1, moe.gate.in_features, generator=gen)
        experts, _ = moe.route(x)
        moe(x)
        assert sorted(calls) == sorted((int(e), 1) for e in experts[0])
        calls.clear()
        x = torch.randn(50, moe.gate.in_features, generator=gen)
        experts, _ = moe.route(x)
        moe(x)
    counts = torch.bincount(experts.flatten(), minlength=moe.cfg.num_experts)
    assert calls == [(e, int(n)) for e, n in enumerate(counts) if n]


def test_sparse_layers_follow_the_config(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-MoE's decoder_sparse_step and mlp_only_layers place the experts (the tiny checkpoint's
    layer 2 is dense); values that would be ignored are refused."""
    raw = json.loads((checkpoints["qwen3-moe"] / "config.json").read_text())
    moe = ModelConfig.from_dict(raw).moe
    assert moe is not None and moe.sparse_layers == (True, True, False, True) and moe.norm_topk_prob
    assert isinstance(_layer(checkpoints["qwen3-moe"], 2).mlp, MLP)
    stepped = ModelConfig.from_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe
    assert stepped is not None and stepped.sparse_layers == (False, True, False, False)
    mixtral = ModelConfig.from_dict(json.loads((checkpoints["mixtral"] / "config.json").read_text())).moe
    assert mixtral is not None and mixtral.sparse_layers == (True,) * 4 and not mixtral.weights_in_hidden_dtype
    cases: list[tuple[dict[str, Any], str]] = [
        ({"mlp_only_layers": [9]}, "mlp_only_layers"),
        ({"mlp_only_layers": "2"}, "mlp_only_layers"),
        ({"num_experts_per_tok": 9}, "more than the 8 experts"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"num_local_experts": 1 << 20}, "experts a layer"),
    ]
    for bad, message in cases:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_dict({**raw, **bad})


@pytest.mark.parametrize("arch", MOE)
def test_prefix_cache_and_chunks_equal_transformers(checkpoints: dict[str, Path], arch: str) -> None:
    """PP 3, prompts chunked by 8 that share a prefix, served twice (the second time from the prefix
    cache): every continuation is transformers' greedy one."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    rng = random.Random(3)
    shared = random_prompt(rng, 24)
    prompts = [shared + random_prompt(rng, n) for n in (3, 11, 20)]
    pipe = pipeline(checkpoints[arch], pp_size=3, chunked_prefill_size=8, enable_prefix_caching=True)
    expected = [hf_greedy(hf, p, GREEDY_TOKENS) for p in prompts]
    for _ in range(2):
        assert [g.token_ids for g in pipe.generate(prompts, GREEDY)] == expected
    assert pipe.scheduler.prefix_hits >= 2 * 16  # the second round found the shared blocks
    pipe.close()


@pytest.mark.parametrize("arch", MOE)
def test_gguf_equals_the_checkpoint(gguf_sources: dict[str, Path], tmp_path: Path, arch: str) -> None:
    """The checkpoint written as a GGUF the way llama.cpp writes it (each projection of all of a
    layer's experts in one 3-D tensor, the router F32): in F32 the same logits and tokens as the
    safetensors checkpoint, at PP 1 and 2."""
    source = gguf_sources[arch]
    path = write_gguf(source, tmp_path / "m.gguf")
    prompt = random_prompt(random.Random(5), 30)
    reference = pipeline(source)
    want, tokens = prompt_logits(reference, prompt), reference.generate([prompt], GREEDY)[0].token_ids
    reference.close()
    for pp in (1, 2):
        pipe = pipeline(path, pp_size=pp)
        assert pipe.config.model_config.architecture == reference.config.model_config.architecture
        assert torch.allclose(prompt_logits(pipe, prompt), want, rtol=1e-5, atol=1e-5)
        assert pipe.generate([prompt], GREEDY)[0].token_ids == tokens
        pipe.close()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", MOE)
def test_gguf_experts_kept_quantized(gguf_sources: dict[str, Path], tmp_path: Path, arch: str, qtype: Q) -> None:
    """Experts in Q8_0 or Q4_0 stay so (each expert's rows of the 3-D tensor, a view of the mapped
    file), the router a float linear. Each MoE layer routes an input as the dequantized model's does
    (its router is the same floats) and its output is that layer's within the rounding of int8
    activations; the model's tokens are the same at PP 1 and 2. (The whole model's logits are not
    compared with the dequantized model's: a token whose two experts score within that rounding of
    each other may go to the other one, and the positions after it see that.)"""
    path = write_gguf(gguf_sources[arch], tmp_path / "m.gguf", qtype)
    floats = pipeline(path, quantization="none")
    x = torch.randn(40, floats.config.model_config.hidden_size, generator=torch.Generator().manual_seed(7))
    prompt = random_prompt(random.Random(6), 30)
    tokens = []
    for pp in (1, 2):
        pipe = pipeline(path, pp_size=pp, quantization="auto")
        for index in pipe.executor.runners[0].layers:
            moe, reference = (_layer_of(p, index).mlp for p in (pipe, floats))
            assert isinstance(moe, MoE) and isinstance(reference, MoE) and moe.gate.weight.dtype == torch.float32
            assert all(isinstance(e.gate_up, (GGUFLinear, QuantLinear)) for e in moe.experts)
            with torch.no_grad():
                assert torch.equal(moe.route(x)[0], reference.route(x)[0])
                got, want = moe(x), reference(x)
            assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item(), index
        tokens.append(pipe.generate([prompt], GREEDY)[0].token_ids)
        pipe.close()
    floats.close()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", MOE)
def test_grouped_kernel_equals_the_loop(
    gguf_sources: dict[str, Path], tmp_path: Path, arch: str, dtype: torch.dtype
) -> None:
    """GGUF experts run in one call of the library's grouped kernel (gguf_gemm.cpp's gguf_moe): bitwise
    the loop over the experts' GEMMs, products and sums rounded alike, at 1 to 300 tokens."""
    path = write_gguf(gguf_sources[arch], tmp_path / "m.gguf", Q.Q4_0, mix={"ffn_down": Q.Q8_0})
    moe = _layer_of(pipeline(path, dtype=str(dtype).removeprefix("torch.")), 0).mlp
    assert isinstance(moe, MoE)
    if moe.grouped is None:
        pytest.skip("no CPU kernel library here: the loop runs")
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for n in (1, 3, 40, 300):
            x = torch.randn(n, moe.gate.in_features, generator=gen).to(dtype)
            grouped = moe(x)
            kernel, moe.grouped = moe.grouped, None
            loop = moe(x)
            moe.grouped = kernel
            assert torch.equal(grouped, loop), n


def test_expert_load_windows_and_replaced_stages() -> None:
    """Counts in the window, totals that go on across a replaced stage's restart from zero, and
    reports that do not fit the model (a layer of another stage, the wrong number of experts)
    dropped."""
    load = ExpertLoad({0: 4, 1: 4, 3: 4}, [range(0, 2), range(2, 4)])
    load.report(0, 0.0, {0: [1, 1, 1, 1], 1: [0, 0, 0, 0]})
    load.report(0, 1.0, {0: [5, 1, 1, 1], 1: [0, 0, 0, 8]})
    layers = {x.layer: x for x in load.layers()}
    assert layers[0].routed == 8 and layers[0].imbalance == 4 / 1 and layers[0].idle == 3
    assert layers[1].imbalance == 4.0 and layers[1].idle == 3
    load.report(0, 2.0, {0: [1, 0, 0, 0]})  # a new process, told by its counts
    assert {x.layer: x for x in load.layers()}[0].routed == 9
    load.report(0, 3.0 + WINDOW_S, {0: [1, 0, 0, 0]})  # nothing routed for a window
    assert {x.layer: x for x in load.layers()}[0] == type(layers[0])(0, 9, 0.0, 4)
    load.report(0, 20.0, {3: [1, 1, 1, 1]})  # stage 0 has no layer 3
    load.report(1, 20.0, {3: [1, 1]})
    assert 3 not in {x.layer for x in load.layers()}
    # Told by its process id: a replacement whose counts have already passed the old process's.
    by_pid = ExpertLoad({0: 4}, [range(0, 1)])
    by_pid.report(0, 0.0, {0: [3, 1, 0, 0]}, process=7)
    by_pid.report(0, 1.0, {0: [5, 1, 1, 1]}, process=8)
    assert by_pid.layers()[0].routed == 4 + 8


@pytest.mark.slow
async def test_a_stage_killed_mid_stream_and_the_expert_load(checkpoints: dict[str, Path]) -> None:
    """Qwen3-MoE at PP 3: the first stage (two MoE layers) killed mid-decode is replaced, and every
    request's tokens are those of a run without the fault; the experts' load of each MoE layer
    then reaches /metrics, its totals going on past the replaced stage's."""
    model = checkpoints["qwen3-moe"]
    prompts = [random_prompt(random.Random(i), n) for i, n in enumerate((5, 17, 33, 40))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    config = engine_config(model, 3, layer_partition="2,1,1")
    async with AsyncEngine(config) as engine:
        fault_free = await asyncio.gather(*[collect(engine, p, params) for p in prompts])
    async with AsyncEngine(config) as engine:
        assert engine._pool is not None
        old = engine._pool.procs[0].pid
        assert old is not None
        tasks = asyncio.gather(*[collect(engine, p, params) for p in prompts])
        running = engine.scheduler.running
        await wait_until(lambda: running and all(r.output_token_ids for r in running), timeout_s=60)
        os.kill(old, signal.SIGKILL)
        await wait_until(lambda: engine.recovering)
        assert await asyncio.wait_for(tasks, timeout=120) == fault_free  # a guard against a hang
        assert engine.stage_restarts == [1, 0, 0]
        least = 2 * sum(len(p) for p in prompts)  # top 2 of every prompt token, at least

        def reported() -> list[int]:
            """The MoE layers whose reports have all the prompts' tokens, and traffic in their window
            (the stages report once a second: the tokens after the recovery may not be in yet, and a
            slow recovery leaves a window of none)."""
            return [x.layer for x in engine.stats().moe if x.routed >= least and x.imbalance >= 1]

        await wait_until(lambda: reported() == [0, 1, 3], 10)
        families = {f.name: f for f in _engine_families(engine.stats())}
    imbalance = families["ppserve_moe_expert_imbalance"].samples
    assert [s.labels["layer"] for s in imbalance] == ["0", "1", "3"] and all(s.value >= 1 for s in imbalance)
    assert len(families["ppserve_moe_routed_tokens"].samples) == len(families["ppserve_moe_idle_experts"].samples) == 3


@pytest.mark.slow
async def test_disaggregated_prefill_and_decode(checkpoints: dict[str, Path]) -> None:
    """Prefill at PP 2 and decode at PP 1 on another engine, the KV handed over: the tokens of one
    engine alone."""
    model = checkpoints["qwen3-moe"]
    prompts = [[(i * 13 + j) % 500 for j in range(n)] for i, n in enumerate((5, 40, 100))]  # 100: chunked
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [g.token_ids for g in pipeline(model).generate(prompts, params)]
    async with pd_engine(model, "prefill", 2) as p, pd_engine(model, "decode", 1) as d:
        assert p.rooms is not None
        assert [await pd_collect(d, prompt, params, p.rooms.address) for prompt in prompts] == expected
