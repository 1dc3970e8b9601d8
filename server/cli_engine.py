"""The `ppserve` flags that set the engine (generate and serve), and the EngineConfig.create
keywords they make (kept apart from cli.py, which is about the commands)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import Field
from typing import Any

from ppserve.engine.cluster.config import ClusterInputs
from ppserve.engine.config import EngineConfig, Inputs
from ppserve.engine.settings import Setting, declared, default_of
from ppserve.server.cli_cluster import cluster_config, disaggregation_options, ray_config

# The settings with flags (engine/settings.py): EngineConfig's own fields and create()'s inputs,
# which create() resolves (a flag left out is None there), and where the stages run.
SOURCES = (EngineConfig, Inputs)


def flag_settings(command: str, sources: tuple[type, ...] = SOURCES) -> list[tuple[Field[Any], Setting]]:
    """The settings `ppserve COMMAND` has flags for, in their declared order."""
    return [(f, s) for cls in sources for f, s in declared(cls) if s.cli and command in s.commands]


def add_engine_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The engine's flags, generated from the declaration of each setting: name, type, default,
    range and help are written once, in engine/config.py and engine/cluster/config.py."""
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory, a .gguf file, or tiny-random (a small random model for tests) "
        "(default: the demo model, SmolLM2-135M-Instruct, downloaded once)",
    )
    groups: dict[str, Any] = {"": p}
    for sources, resolved in ((SOURCES, True), ((ClusterInputs,), False)):
        for f, s in flag_settings(command, sources):
            if s.group not in groups:
                groups[s.group] = p.add_argument_group(s.group)
            flags = (s.flag_name(f.name), *s.aliases)
            groups[s.group].add_argument(*flags, dest=f.name, **_argument(f, s, resolved))


def _argument(f: Field[Any], s: Setting, resolved: bool) -> dict[str, Any]:
    """argparse's keywords for one setting. `resolved`: a flag left out is None, so that create()
    applies the declared default, or the environment's value where the setting reads one; else the
    flag's default is the declared one."""
    kw: dict[str, Any] = {"default": None if resolved else default_of(f), "help": f"{s.help} ({flag_note(f, s)})"}
    if isinstance(default_of(f), bool):
        return {**kw, "action": argparse.BooleanOptionalAction}
    if s.metavar:
        kw["metavar"] = s.metavar
    if s.choices:
        kw["choices"] = [c for c in s.choices if c]  # "" is no choice: the flag left out
    if s.parse is not None:
        return {**kw, "type": _flag_type(s.parse)}
    kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0])
    return {**kw, "type": kind} if kind is not None else kw


def flag_note(f: Field[Any], s: Setting) -> str:
    """What a flag's help says in parentheses: the setting's range, default and environment variable."""
    default = default_of(f)
    shown = s.default_text or ("on" if default is True else "off" if default is False else f"{default}")
    return "; ".join(filter(None, (s.range(), f"default: {shown}", s.env and f"env {s.env}")))


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its ValueError turned into argparse's usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("--gpu-ids: ")) from None

    return convert


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig.create's keywords from the parsed flags (a command's own flags only)."""
    given = {f.name: getattr(args, f.name) for f, _ in flag_settings(args.command)}
    settings = {k: v for k, v in given.items() if v is not None}  # left out: create()'s default
    if not settings.get("disaggregation"):  # a pair's settings count only on one side of a pair
        settings = {k: v for k, v in settings.items() if not k.startswith("disagg")}
    return {**settings, "cluster": cluster_config(args), "ray": ray_config(args), **disaggregation_options(args)}
