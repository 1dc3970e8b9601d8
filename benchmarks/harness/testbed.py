"""The tests' helpers that benchmarks use as well: network-namespace clusters (tests/netns.py),
a Ray cluster on them (tests/ray_cluster.py), the packet-delaying switch (tests/tun_switch.py) and
a served model (tests/live_server.py).

They import one another by bare name (`from netns import Cluster`), as pytest lets them: it puts
tests/ on the path. Here each is imported as `tests.NAME` (run from the repository root) and is
also registered under its bare name, after the helpers it imports, so that those imports find the
same modules.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mypy checks tests/ under the bare names
    from live_server import LiveServer
    from netns import Cluster, Node, Unavailable
    from ray_cluster import RayCluster
    from ray_cluster import env as ray_env
    from tun_switch import TunSwitch

__all__ = ["Cluster", "LiveServer", "Node", "RayCluster", "TunSwitch", "Unavailable", "helper", "ray_env"]

# Each name here: (its helper, its name there); imported on first use.
NAMES = {
    "Cluster": ("netns", "Cluster"),
    "Node": ("netns", "Node"),
    "Unavailable": ("netns", "Unavailable"),
    "RayCluster": ("ray_cluster", "RayCluster"),
    "ray_env": ("ray_cluster", "env"),
    "TunSwitch": ("tun_switch", "TunSwitch"),
    "LiveServer": ("live_server", "LiveServer"),
}
# The helpers each one imports by bare name, imported first.
NEEDS = {"ray_cluster": ("netns",), "live_server": ("procs",)}


def helper(name: str) -> ModuleType:
    """tests/NAME.py, imported once under both names."""
    if name in sys.modules:
        return sys.modules[name]
    for need in NEEDS.get(name, ()):
        helper(need)
    module = importlib.import_module(f"tests.{name}")
    sys.modules[name] = module
    return module


def __getattr__(name: str) -> Any:
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = NAMES[name]
    return getattr(helper(module), attr)
