"""Diff-only plans: the scheduler sends each block once, the stages keep the tables, and the
tables a stage rebuilds from the plans are, at every chunk, what the scheduler's request held
(across prefix caching, preemption, aborts, disaggregation and pipeline resets)."""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import pytest
import torch
from helpers import random_prompt
from scheduler_by_hand import complete, make, req

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.model.sampler import Sampler
from ppserve.engine.runtime.block_tables import BlockTables, UnknownRequestError
from ppserve.engine.runtime.prompt_logprobs import last_stage_outputs, prompt_rows
from ppserve.engine.runtime.stage_runner import StageRunner
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.transport.messages import Sampled, SeqChunk, StepPlan, StepResult


class Stage:
    """What a stage does with plans, checked against the scheduler's own tables at emission."""

    def __init__(self) -> None:
        self.tables = BlockTables(rows=2, width=2)  # small: growth is exercised too
        self.blocks_received = 0

    def apply(self, s: Scheduler, plan: StepPlan) -> None:
        self.tables.apply(plan)
        for c in plan.chunks:
            self.blocks_received += len(c.blocks)
            assert self.tables.table(c.request_id) == s.requests[c.request_id].block_table


def test_block_tables_grow_drop_and_reuse_rows() -> None:
    t = BlockTables(rows=1, width=1)
    t.append("a", [3, 4, 5])
    t.append("b", [7])
    t.append("a", [])
    t.append("a", [6])
    assert (t.table("a"), t.table("b"), len(t)) == ([3, 4, 5, 6], [7], 2)
    tables, lengths = t.lookup(["b", "a"])
    assert lengths == [1, 4] and tables.tolist() == [[7, 0, 0, 0], [3, 4, 5, 6]]  # zero padded
    t.drop("a")
    t.drop("a")  # unknown ids are ignored
    t.append("c", [9])
    assert t.table("c") == [9] and "a" not in t
    with pytest.raises(UnknownRequestError, match="'a'"):
        t.lookup(["c", "a"])
    t.clear()
    assert len(t) == 0 and t.lookup([])[1] == []


def test_decode_steps_carry_no_blocks_and_plans_stay_small() -> None:
    s = make(pp=1, blocks=64, chunk=64)
    prompt = 4 * 10  # ten full blocks of 4
    s.add(req("r", prompt, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)))
    stage = Stage()
    sent = []
    while (plan := s.schedule()) is not None:
        stage.apply(s, plan)
        sent.append(len(plan.chunks[0].blocks))
        complete(s, plan)
    # The prompt's ten blocks once, then one block per 4 decode steps (positions 40, 44).
    assert sent == [10, 1, 0, 0, 0, 1, 0, 0, 0] and stage.blocks_received == 12


def test_a_cached_prefix_is_sent_once_with_the_new_request() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, pp_size=1, enable_prefix_caching=True))
    prompt = list(range(10, 30))
    stage = Stage()
    for rid in ("a", "b"):
        s.add(Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
        while (plan := s.schedule()) is not None:
            stage.apply(s, plan)
            complete(s, plan)
    assert s.prefix_hits == 16  # b started from a's four cached blocks, and got all five in one chunk


def test_preempted_requests_are_dropped_then_sent_whole_again() -> None:
    s = make(pp=1, blocks=6, chunk=8, budget=64, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    s.add(req("a", 8, params))
    s.add(req("b", 8, params))
    stage = Stage()
    dropped: set[str] = set()
    restarted = 0
    for _ in range(100):
        plan = s.schedule()
        if plan is None:
            break
        dropped |= set(plan.preempted)
        stage.apply(s, plan)
        for c in plan.chunks:
            assert c.new_table == (c.start == 0)  # no prefix caching: a new table is a fresh start
            if c.request_id in dropped:
                dropped.discard(c.request_id)
                restarted += 1
        assert not any(rid in stage.tables for rid in dropped)  # dropped until it starts again
        complete(s, plan)
    assert not s.has_work and s.num_preemptions > 0 and restarted == s.num_preemptions
    s.add(req("c", 3))
    plan = s.schedule()
    assert plan is not None and plan.released  # the one that finished last
    stage.apply(s, plan)
    assert len(stage.tables) == 1  # the finished requests' tables are gone


def test_a_new_table_replaces_one_left_under_a_reused_id() -> None:
    t = BlockTables()
    t.append("x", [1, 2])  # from a scheduler that ended before it could release "x"
    t.apply(StepPlan(0, [SeqChunk("x", [5], 0, [9], True, new_table=True)]))
    assert t.table("x") == [9]
    with pytest.raises(UnknownRequestError, match="'y'"):
        t.apply(StepPlan(1, [SeqChunk("y", [5], 4, [], True)]))  # extends a table never started


def test_disaggregated_decode_sends_the_reserved_table_once() -> None:
    s = make(blocks=8)
    r = req("d", 9, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    reserved = s.handover.reserve(r)
    assert reserved is not None and s.handover.activate("d", 77) is r
    stage = Stage()
    first = True
    while (plan := s.schedule()) is not None:
        stage.apply(s, plan)
        if first:  # the prompt's three blocks (imported KV) and the one position 9 needs
            assert plan.chunks[0].blocks[:3] == reserved
            first = False
        complete(s, plan)
    assert stage.blocks_received == len(reserved) + 1  # positions up to 14 fit in 4 blocks


@pytest.mark.parametrize("seed", range(6))
def test_stage_tables_match_the_scheduler_through_resets(seed: int) -> None:
    """Random arrivals, aborts, preemptions (a small cache), prefix hits, results in any order,
    and pipeline resets: surviving stages clear their tables, a replaced one starts empty."""
    rng = random.Random(seed)
    s = Scheduler(
        SchedulerConfig(
            num_blocks=24, block_size=4, pp_size=2, chunked_prefill_size=8, enable_prefix_caching=seed % 2 == 0
        )
    )
    survivor, replaced = Stage(), Stage()
    inflight: list[StepPlan] = []
    prefix = [rng.randrange(50) for _ in range(12)]
    for i in range(400):
        op = rng.random()
        if op < 0.2 and len(s.requests) < 6:
            prompt = prefix[: rng.randrange(13)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            s.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)))
        elif op < 0.23 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        elif op < 0.25:
            s.reset_pipeline()
            inflight.clear()
            survivor.tables.clear()  # the Reset a surviving stage gets
            replaced = Stage()  # a fresh process
        while (plan := s.schedule()) is not None:
            survivor.apply(s, plan)
            replaced.apply(s, plan)
            inflight.append(plan)
        if inflight and rng.random() < 0.7:
            plan = inflight.pop(rng.randrange(len(inflight)))
            s.update(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], []))
    assert s.num_preemptions > 0


def _slots_reference(spans: list[tuple[int, int, list[int]]], block_size: int) -> list[int]:
    """The per-token loop the vectorized build replaced."""
    return [t[p // block_size] * block_size + p % block_size for start, n, t in spans for p in range(start, start + n)]


def test_vectorized_slots_and_positions_match_the_per_token_loop() -> None:
    rng = random.Random(5)
    spans = []
    for _ in range(40):
        start, n = rng.randrange(0, 60), rng.choice([1, 1, 1, 2, 5, 17])
        spans.append((start, n, rng.sample(range(200), -(-(start + n) // 4) + rng.randrange(3))))
    chunks = [SeqChunk(str(i), [0] * n, start, table, True) for i, (start, n, table) in enumerate(spans)]
    tables = BlockTables()
    for c in chunks:
        tables.append(c.request_id, c.blocks)
    block_tables, lengths = tables.lookup([c.request_id for c in chunks])
    md = AttentionMetadata.from_tables(
        [c.start for c in chunks], [c.num_new for c in chunks], block_tables, lengths, 4, torch.device("cpu")
    )
    assert md.slot_mapping.tolist() == _slots_reference(spans, 4)
    assert md.positions.tolist() == [p for start, n, _ in spans for p in range(start, start + n)]
    assert md.decode is not None
    for row, (start, n, table) in zip(md.decode.block_tables.tolist(), [sp for sp in spans if sp[1] == 1], strict=True):
        needed = -(-(start + n) // 4)
        assert row[:needed] == table[:needed] and not any(row[needed:])  # padding is block 0
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        AttentionMetadata.from_tables([0], [5], torch.tensor([[3]]), [1], 4, torch.device("cpu"))


# ---- a whole pipeline in one process, through a reset ------------------------------------


def _run(runners: list[StageRunner], sampler: Sampler, plan: StepPlan) -> StepResult:
    """Every stage runs the plan in turn, as the stage processes do; each one's kept tables are
    then what the scheduler's requests held when it built the plan."""
    out: torch.Tensor | None = None
    for runner in runners:
        out = runner.execute_plan(plan, out, prompt_rows=prompt_rows(plan))
    assert out is not None
    samples, scores, pooled = last_stage_outputs(sampler, plan, out, runners[-1].pooled)
    return StepResult(plan.mb_id, samples, [], scores, pooled)


def _serve(config: EngineConfig, reset_at: int | None) -> tuple[dict[str, list[int]], int]:
    runners = [StageRunner(config, i) for i in range(config.pp_size)]
    sampler = Sampler(config.model_config.vocab_size, torch.device("cpu"))
    s = Scheduler(
        SchedulerConfig(num_blocks=config.num_kv_blocks, block_size=4, pp_size=config.pp_size, chunked_prefill_size=8)
    )
    rng = random.Random(4)
    vocab = config.model_config.vocab_size
    requests = [
        Request(f"r{i}", random_prompt(rng, n, vocab), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        for i, n in enumerate((30, 9, 21, 14))
    ]
    for r in requests:
        s.add(r)
    inflight: deque[StepPlan] = deque()
    tables: dict[int, dict[str, list[int]]] = {}  # per plan: the scheduler's tables when built
    step, preempted, after_reset = 0, 0, False
    while s.has_work or inflight:
        while (plan := s.schedule()) is not None:
            inflight.append(plan)
            tables[plan.mb_id] = {c.request_id: list(s.requests[c.request_id].block_table) for c in plan.chunks}
            if after_reset:  # the stages hold nothing: every request starts a whole table again
                assert all(c.new_table and c.blocks == tables[plan.mb_id][c.request_id] for c in plan.chunks)
                after_reset = False
        if step == reset_at:
            preempted = s.reset_pipeline()
            inflight.clear()
            sampler.clear()
            for runner in runners[::2]:  # stages 0 and 2 survive: the Reset they get
                runner.clear_tables()
            runners[1] = StageRunner(config, 1)  # stage 1 is replaced: a fresh one, empty
            after_reset = True
        elif inflight:
            plan = inflight.popleft()
            s.update(_run(runners, sampler, plan))
            expected = tables.pop(plan.mb_id)
            for runner in runners:
                assert all(runner.tables.table(rid) == table for rid, table in expected.items())
        step += 1
        assert step < 5_000
    return {r.request_id: r.output_token_ids for r in requests}, preempted


def test_a_reset_pipeline_gets_the_whole_state_again_and_outputs_do_not_change(llama_dir: Path) -> None:
    """Too few KV blocks for all four requests (preemptions), and once the pipeline is reset
    mid-run: surviving stages forget their tables, the replaced one starts empty, and the
    scheduler sends every table whole again. Greedy outputs are those of a run without reset."""
    config = EngineConfig.create(llama_dir, pp_size=3, num_kv_blocks=16, block_size=4)
    plain, _ = _serve(config, reset_at=None)
    reset, preempted = _serve(config, reset_at=12)
    assert preempted > 0 and reset == plain
