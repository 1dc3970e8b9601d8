"""One config chain: flags -> EngineConfig.create -> EngineConfig -> SchedulerConfig. A default is
declared once; these tests fail when a layer says otherwise, or when the environment is read
anywhere but into the config."""

from __future__ import annotations

import argparse
import inspect
import pickle
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
from live_server import ROOT

from ppserve.engine import environment
from ppserve.engine.cluster.config import ClusterConfig, ClusterInputs
from ppserve.engine.config import EngineConfig
from ppserve.engine.disagg.faults import ENV as FAULTS_ENV
from ppserve.engine.disagg.faults import DisaggFaults
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.settings import default_of
from ppserve.scheduler.scheduler import SchedulerConfig
from ppserve.server.cli import build_parser
from ppserve.server.cli_engine import engine_settings, flag_settings

ENGINE_ENV: tuple[str, ...] = (
    environment.SMOOTH_ENV,
    environment.PIN_STAGES_ENV,
    environment.CPU_KERNELS_ENV,
    environment.COMPUTE_NICE_ENV,
    environment.DECODE_AHEAD_ENV,
    FAULTS_ENV,
)
# Where the PPSERVE_* variables may be read (engine/environment.py says why each is where it is).
ENV_READERS = {"engine/environment.py", "engine/model/cache_dir.py", "engine/disagg/faults.py"}
ENV_READERS |= {"engine/model/cpu_kernels.py", "transport/cluster_key.py", "server/cli_clients.py"}


@pytest.fixture
def base(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> EngineConfig:
    """The config of no settings at all, in a clean environment."""
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    return EngineConfig.create(llama_dir)


def _field_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def _options(command: str) -> dict[str, argparse.Action]:
    """The options of `ppserve COMMAND`, by dest."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions if a.option_strings}


def test_the_scheduler_and_the_engine_declare_the_same_defaults() -> None:
    engine = _field_defaults(EngineConfig)
    scheduler = _field_defaults(SchedulerConfig)
    assert scheduler, "SchedulerConfig declares the scheduler's defaults"
    for name, default in scheduler.items():
        assert engine.get(name, MISSING) == default, f"{name}: EngineConfig {engine.get(name)!r}, scheduler {default!r}"
    # Every scheduler field comes from the engine config: none is left to its own default there.
    assert {f.name for f in fields(SchedulerConfig)} - {"num_blocks"} <= {f.name for f in fields(EngineConfig)}


def test_create_resolves_to_the_declared_defaults(base: EngineConfig) -> None:
    resolved_by_create = {"threads_per_stage", "cache_dir"}  # from the machine and its environment
    for name, default in _field_defaults(EngineConfig).items():
        if name not in resolved_by_create:
            assert getattr(base, name) == default, f"create() makes {name}={getattr(base, name)!r}, not {default!r}"
    assert base.scheduler_config() == SchedulerConfig(
        num_blocks=base.num_kv_blocks, block_size=base.block_size, pp_size=base.pp_size
    )


def test_create_takes_fields_by_name_and_checks_them(llama_dir: Path) -> None:
    config = EngineConfig.create(llama_dir, pp_size=2, num_kv_blocks=8, async_depth=1, enable_prefix_caching=False)
    assert (config.pp_size, config.num_kv_blocks, config.async_depth) == (2, 8, 1)
    sched = config.scheduler_config()
    assert (sched.num_blocks, sched.pp_size, sched.async_depth, sched.enable_prefix_caching) == (8, 2, 1, False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'pp_sise'"):
        EngineConfig.create(llama_dir, pp_sise=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'layer_ranges'"):  # derived, never given
        EngineConfig.create(llama_dir, layer_ranges=(range(2),))
    with pytest.raises(TypeError, match="pp_size must be int"):
        EngineConfig.create(llama_dir, pp_size="2")
    with pytest.raises(TypeError, match="enable_prefix_caching must be bool"):
        EngineConfig.create(llama_dir, enable_prefix_caching=1)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_flag_is_its_settings_declaration(base: EngineConfig, llama_dir: Path, command: str) -> None:
    """The flags are generated from the settings' declarations: each says its field's default and
    range, and a flag left out is None, so that create() applies the default (or the environment's)."""
    options = _options(command)
    params = inspect.signature(EngineConfig.create).parameters
    settings = flag_settings(command)
    assert {"pp_size", "kv_cache_gb", "speculative", "stage_timeout_s"} <= {f.name for f, _ in settings}
    for f, s in settings:
        action = options[f.name]
        assert action.default is None, f"{action.option_strings}: {action.default!r}"
        assert s.flag_name(f.name) in action.option_strings and set(s.aliases) <= set(action.option_strings)
        default = params[f.name].default if f.name in params else default_of(f)
        if f.name not in params and default is not None:  # what create() makes of the flag left out
            assert getattr(base, f.name) == default, f"--{f.name}: the config has {getattr(base, f.name)!r}"
        help = action.help or ""
        if s.default_text is None:
            said = re.search(r"default: ([^;)]+)", help)
            assert said, f"{action.option_strings} shows no default"
            word = {True: "on", False: "off"}.get(default) if isinstance(default, bool) else str(default)
            assert said[1] == word, f"{action.option_strings} says {said[1]}, the field {default!r}"
        assert s.range() in help


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cluster_flags_are_their_settings_declaration(command: str) -> None:
    """Where the stages run: each flag defaults to its declared setting and says so, and a command
    without them makes no cluster."""
    options = _options(command)
    settings = flag_settings(command, (ClusterInputs,))
    assert {f.name for f, _ in settings} >= {"nnodes", "node_rank", "executor", "placement_strategy"}
    for f, s in settings:
        action = options[f.name]
        assert action.default == default_of(f), f"{action.option_strings}: {action.default!r}"
        assert s.flag_name(f.name) in action.option_strings and s.range() in (action.help or "")
        assert "default: " in (action.help or "")
    args = build_parser().parse_args([command] + (["--prompt", "x"] if command == "generate" else []))
    assert engine_settings(args)["cluster"] is None and engine_settings(args)["ray"] is None
    with pytest.raises(ConfigError, match="--nnodes must be >= 1"):
        ClusterConfig.create(nnodes=0, node_rank=0, pp_size=1, dist_init_addr=None)


def _outside(s: Any) -> float | None:
    """A value just outside a setting's range (None: it has none)."""
    if s.ge is not None:
        return s.ge - 1
    if s.gt is not None:
        return s.gt
    return s.le + 1 if s.le is not None else None


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_range_is_checked_by_create(llama_dir: Path, command: str) -> None:
    checked = 0
    for f, s in flag_settings(command):
        value = _outside(s)
        if value is None or f.name.startswith("disagg"):
            continue
        outside: Any = int(value) if "int" in str(f.type) else float(value)
        with pytest.raises(ConfigError, match=re.escape(f"{f.name} ({s.flag_name(f.name)}) must be {s.range()}")):
            EngineConfig.create(llama_dir, **{f.name: outside})
        checked += 1
    assert checked >= 10


def test_help_shows_every_default() -> None:
    for command in ("generate", "serve"):
        for action in _options(command).values():
            if action.dest in ("help", "prompt", "input_ids", "prompts_file") or action.nargs == 0:
                continue  # switches, and the prompt's sources (one of them is required)
            if isinstance(action, argparse._AppendAction):
                continue  # repeatable: none unless given
            if action.dest in {"seed", "logprobs", "prompt_logprobs", "json_schema", "regex", "grammar"}:
                continue  # sampling: off unless given (server/cli_sampling.py)
            assert "default" in (action.help or ""), f"ppserve {command} {action.option_strings[0]}"


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_a_command_without_flags_makes_the_default_config(
    base: EngineConfig, llama_dir: Path, command: list[str]
) -> None:
    args = build_parser().parse_args([*command, "--model", str(llama_dir)])
    assert EngineConfig.create(llama_dir, **engine_settings(args)) == base


def test_the_environment_is_read_once_into_the_config(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(environment.SMOOTH_ENV, "0.4")
    monkeypatch.setenv(environment.PIN_STAGES_ENV, "1")
    monkeypatch.setenv(environment.CPU_KERNELS_ENV, "0")
    monkeypatch.setenv(environment.DECODE_AHEAD_ENV, "0")
    monkeypatch.setenv(environment.COMPUTE_NICE_ENV, "3")
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(FAULTS_ENV, "fail_transfer=1,seed=4")
    pd: dict[str, Any] = {"disaggregation": "prefill", "disagg_insecure": True}
    config = EngineConfig.create(llama_dir, **pd)
    expected = (0.4, True, False, str(tmp_path), DisaggFaults(fail_transfer=1.0, seed=4))
    assert (config.chunk_smooth, config.pin_stages, config.cpu_kernels, config.cache_dir, config.disagg_faults) == (
        expected
    )
    assert not config.decode_ahead and not config.scheduler_config().decode_ahead
    assert config.compute_nice == 3
    assert EngineConfig.create(llama_dir).disagg_faults is None  # only a disaggregated engine injects faults
    given = EngineConfig.create(llama_dir, chunk_smooth=0.2, pin_stages=False, cpu_kernels=True, decode_ahead=True)
    assert (given.chunk_smooth, given.pin_stages, given.cpu_kernels, given.decode_ahead) == (0.2, False, True, True)
    for name in (*ENGINE_ENV, "PPSERVE_CACHE_DIR"):
        monkeypatch.delenv(name)
    # What a stage process gets: the same values, with nothing left to read.
    assert pickle.loads(pickle.dumps(config)) == config
    monkeypatch.setenv(FAULTS_ENV, "seed=x")
    with pytest.raises(ValueError, match=f"{FAULTS_ENV}: 'seed=x'"):  # parsed when the config is made
        EngineConfig.create(llama_dir, **pd)


def test_no_other_module_reads_a_ppserve_variable() -> None:
    readers = set()
    for package in ("engine", "scheduler", "transport", "server"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if re.search(r"os\.(environ|getenv)", text) and "PPSERVE_" in text:
                readers.add(path.relative_to(ROOT).as_posix())
    assert readers <= ENV_READERS, sorted(readers - ENV_READERS)
