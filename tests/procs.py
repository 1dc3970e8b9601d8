"""The process tree from /proc, for tests that check what a server started and what it left."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of `pid` that exist now."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children(found[-1])
    return found


def read(pid: int, name: str) -> bytes:
    """/proc/<pid>/<name> (`comm`, `cmdline`, ...), or b"" if the process is gone."""
    try:
        return (Path("/proc") / str(pid) / name).read_bytes()
    except OSError:
        return b""
