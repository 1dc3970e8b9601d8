"""Chat templates rendered in a child process, which a runaway template cannot take down with it.

The sandbox (`chat_template.py`) stops most runaway templates with a clear error, but not all
of them: a loop can avoid every hook, one operation in C (a huge `%` format, a concatenation
that doubles a string) can run long or allocate gigabytes, and Python cannot interrupt a thread.
So templates render here, in a process of their own (`python -m` this module; it imports jinja2
and msgspec, not torch or transformers), one render at a time:

- the worker's own timer (SIGALRM) stops a render at its deadline and answers the error, and
  the worker lives on;
- a memory limit (set before each render) turns a huge allocation into MemoryError, answered the same way;
- a CPU limit, reset before each render, ends a worker stuck in C even if its parent is gone;
- the parent waits for the answer until the deadline plus a grace period, then kills the
  worker and starts another on the next render. `close` kills it at once (server shutdown),
  which ends a wait in progress: a render never holds up shutdown.

Requests and replies are msgspec msgpack frames over the worker's stdin and stdout.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from ppserve.engine.model.chat_template import DEFAULT_BUDGET, RenderBudget, TemplateBudgetError, TemplateError, render

GRACE_S = 5.0  # past the render's deadline: the worker's start, the transfer, a loaded machine
_HEADER = struct.Struct(">I")  # a frame's payload length
_BIG_INT = 1  # msgpack ext code: an int past 64 bits (JSON allows them), as its decimal digits


class _Alarm(BaseException):
    """The render's deadline, raised by SIGALRM (a BaseException: no `except Exception` in the
    template machinery may swallow it)."""


def _placeholder(obj: Any) -> Any:
    """What the worker gets for a value msgpack cannot carry: an int past 64 bits as itself (an
    extension), anything else as the placeholder transformers shows templates (`<Decimal>`)."""
    if isinstance(obj, int):
        return msgspec.msgpack.Ext(_BIG_INT, str(obj).encode())
    return f"<{type(obj).__name__}>"


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_placeholder)


def _ext(code: int, data: memoryview) -> Any:
    if code != _BIG_INT:
        raise ValueError(f"unknown msgpack extension {code}")
    return int(bytes(data).decode())


_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext)


def _encode(value: Any) -> bytes:
    try:
        return _ENCODER.encode(value)
    except OverflowError:  # an int past 64 bits: msgpack has no room for it, the ext hook has
        return _ENCODER.encode(_big_ints(value))


def _big_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {_big_ints(k): _big_ints(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_big_ints(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return _placeholder(value)
    return value


def _write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd, or None at end of file; TimeoutError past `deadline` (None: none)."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None = None) -> bytes | None:
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    return _read_exact(fd, _HEADER.unpack(header)[0], deadline)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


class ChatTemplateWorker:
    """The parent's side: `render` sends a template and its variables to the worker process
    (started on first use, and again after one was killed or died) and waits for the text."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s  # how long past a render's deadline its answer may take
        self._lock = threading.Lock()  # one render at a time: the worker has one thread
        self._starting = threading.Lock()  # `_proc` and `_closed` change together (close does not wait for renders)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaper: weakref.finalize[Any, Any] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The thread that async callers render in: renders queue here, one at a time as the
        worker takes them, without holding the event loop's default threads while they wait."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="chat-template")
        return self._executor

    @property
    def pid(self) -> int | None:
        """The worker process's id, while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def render(self, template: str, variables: dict[str, Any], budget: RenderBudget = DEFAULT_BUDGET) -> str:
        """`chat_template.render` in the worker. TemplateError if the template failed,
        TemplateBudgetError if it ran past `budget` or its worker died or was stopped."""
        request = _encode(
            {
                "template": template,
                "variables": variables,
                "seconds": budget.seconds,
                "iterations": budget.iterations,
                "chars": budget.chars,
                "memory_bytes": budget.memory_bytes,
            }
        )
        with self._lock:
            proc = self._send(request)
            assert proc.stdout is not None
            try:
                payload = _read_frame(proc.stdout.fileno(), time.monotonic() + budget.seconds + self.grace_s)
            except TimeoutError:
                self._stop(proc)
                raise TemplateBudgetError(
                    "time", f"the chat template ran for more than {budget.seconds:g} s (its process was stopped)"
                ) from None
            except OSError:  # closed under us by `close`
                payload = None
            if payload is None:
                self._stop(proc)
                why = "the server is shutting down" if self._closed else f"exit status {proc.returncode}"
                raise TemplateBudgetError("crash", f"the chat template's process ended ({why})")
        reply = _DECODER.decode(payload)
        if "text" in reply:
            return str(reply["text"])
        if reply["kind"] == "template":
            raise TemplateError(reply["error"])
        raise TemplateBudgetError(reply["what"], reply["error"])

    def _send(self, request: bytes) -> subprocess.Popen[bytes]:
        """The worker, with `request` sent to it; a worker that died since its last render is
        replaced once."""
        for attempt in (1, 2):
            if self._proc is not None and self._proc.poll() is not None:
                self._stop(self._proc)
            proc = self._proc or self._start()
            assert proc.stdin is not None
            try:
                _write_frame(proc.stdin.fileno(), request)
                return proc
            except OSError as e:
                self._stop(proc)
                if attempt == 2:
                    raise TemplateBudgetError("crash", f"the chat template's process cannot be reached: {e}") from None
        raise AssertionError("unreachable")

    def _start(self) -> subprocess.Popen[bytes]:
        with self._starting:
            if self._closed:
                raise TemplateBudgetError("crash", "chat templates are closed (the server is shutting down)")
            proc = subprocess.Popen(
                [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
            )
            # Gone with its owner (or at exit), even if nobody calls `close`; the finalizer holds
            # the process, never self.
            self._proc, self._reaper = proc, weakref.finalize(self, _kill, proc)
            return proc

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        _kill(proc)
        if self._proc is proc:
            if self._reaper is not None:
                self._reaper.detach()
            self._proc = self._reaper = None

    def close(self) -> None:
        """Kill the worker now: a render waiting for it ends with an error, later ones fail."""
        with self._starting:
            self._closed = True
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # its pipes are closed by whoever holds the lock (a render reading them)
        if self._lock.acquire(blocking=False):
            try:
                if self._proc is not None:
                    self._stop(self._proc)
            finally:
                self._lock.release()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


# ---- the worker process -------------------------------------------------------------------


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Alarm


def _set_limit(which: int, soft: int) -> None:
    hard = resource.getrlimit(which)[1]
    if hard == resource.RLIM_INFINITY or soft <= hard:
        resource.setrlimit(which, (soft, hard))


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    budget = RenderBudget(request["seconds"], request["iterations"], request["chars"], request["memory_bytes"])
    _set_limit(resource.RLIMIT_AS, budget.memory_bytes)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _set_limit(resource.RLIMIT_CPU, math.ceil(usage.ru_utime + usage.ru_stime + budget.seconds) + 2)
    try:
        signal.setitimer(signal.ITIMER_REAL, budget.seconds)
        try:
            return {"text": render(request["template"], request["variables"], budget)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Alarm:
        return {"kind": "budget", "what": "time", "error": f"the chat template ran for more than {budget.seconds:g} s"}
    except TemplateBudgetError as e:
        return {"kind": "budget", "what": e.what, "error": str(e)}
    except TemplateError as e:
        return {"kind": "template", "error": str(e)}


def main() -> None:
    with contextlib.suppress(OSError):  # how `ps` and `top` name it (Linux)
        Path("/proc/self/comm").write_text("ppserve-jinja")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's whole group: the parent decides
    signal.signal(signal.SIGALRM, _on_alarm)
    _set_limit(resource.RLIMIT_CORE, 0)  # a render killed by the CPU limit leaves no core file
    replies = os.dup(1)
    os.dup2(2, 1)  # stdout carries the replies: anything else printed goes to stderr
    while (payload := _read_frame(0)) is not None:  # end of file: the parent is gone
        _write_frame(replies, _encode(_serve(_DECODER.decode(payload))))


if __name__ == "__main__":
    main()
