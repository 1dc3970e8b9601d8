"""The host's grammar checks, in a worker process where a crash or a runaway cannot take the
server with it.

A grammar comes from a client, and compiling one is work that the client chooses: llguidance's
compiler recurses along chains of rules (a 2,700-rule chain overflowed an 8 MiB thread stack and
killed the process), and some regexes build hundreds of MB of lexer before their first mask. So
the host never compiles: it sends each new grammar to a worker process (`python -m
ppserve.engine.model.grammar_check VOCAB`; the model's tokenizer is its first message, so it
imports neither torch nor transformers) that compiles it and computes its first masks on a thread
with a known stack (CHECK_STACK_BYTES), then says whether it passed and what its compiled form
costs in memory. The host watches the worker while it compiles and kills it when a
budget runs out: CPU time (COMPILE_CPU_S), wall time (CHECK_TIMEOUT_S), memory (COMPILE_BYTES). A
worker that dies (stack overflow, abort) is started again for the next check.

Only grammars that passed reach a last stage, whose threads have stacks many times the worker's
(STAGE_STACK_BYTES, set as a stage process starts): a compile that fit in the worker's stack fits
there, and in any thread with the default stack (an engine run in one process). The verdicts are
remembered by the grammar's digest (bounded), so a hostile grammar sent again is refused at once,
and a good one is not compiled twice here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import os
import signal
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

COMPILE_CPU_S = 3.0  # CPU seconds one grammar may take to compile and compute its first mask
CHECK_TIMEOUT_S = 10.0  # the host's longest wait for one check, the worker's start excluded
COMPILE_BYTES = 256 << 20  # memory one grammar may take to compile (the stage keeps it cached)
# The worker compiles on a thread with this stack, a quarter of a thread's default (8 MiB), and
# stage processes give their threads STAGE_STACK_BYTES: whatever compiled there compiles anywhere.
CHECK_STACK_BYTES = 2 << 20
STAGE_STACK_BYTES = 64 << 20
START_TIMEOUT_S = 120.0  # loading the tokenizer in a new worker
VERDICTS = 4096  # grammars whose verdict is remembered (digests: a few hundred kB at most)
WORKER_NICE = 5  # below the host's event loop: a compile must not slow the tokens it carries
_POLL_S = 0.02


class Verdict(msgspec.Struct, array_like=True):
    error: str = ""  # empty: the grammar compiled
    cost: int = 0  # bytes the compiled grammar and its first mask took
    # Whether the verdict is the grammar's own, to remember: not where the wall clock ran out (a
    # busy machine) or the checker was closing.
    lasting: bool = True


class GrammarChecker:
    """Checks grammars for one model in a worker process, one at a time (see the module's doc)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: the model's transformers fast tokenizer; `vocab_size`: its logits' width."""
        self._argv = [sys.executable, "-m", __name__, str(vocab_size)]
        self._tokenizer = tokenizer
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()
        self._closed = False
        self.compiles = 0  # grammars the worker compiled (not known before)

    async def check(self, grammar: str) -> int:
        """The bytes `grammar`'s compiled form costs; ValueError naming the reason or the limit
        unless it compiles within the budget."""
        key = hashlib.sha256(grammar.encode()).digest()
        verdict = self._known(key)
        if verdict is None:
            async with self._lock:  # one compile at a time: the worker has one thread for them
                verdict = self._known(key) or await self._compile(grammar)
                if verdict.lasting and not self._closed:
                    self._verdicts[key] = verdict
                while len(self._verdicts) > VERDICTS:
                    self._verdicts.popitem(last=False)
        if verdict.error:
            raise ValueError(verdict.error)
        return verdict.cost

    def _known(self, key: bytes) -> Verdict | None:
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
        return verdict

    async def _compile(self, grammar: str) -> Verdict:
        proc = await self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        self.compiles += 1
        proc.stdin.write(_frame(grammar.encode()))
        reply = asyncio.ensure_future(_read_frame(proc.stdout))
        cpu0, rss0, start = _cpu_seconds(proc.pid), _rss(proc.pid), time.monotonic()
        try:
            while not reply.done():
                await asyncio.wait({reply}, timeout=_POLL_S)
                if reply.done():
                    break
                if _cpu_seconds(proc.pid) - cpu0 > COMPILE_CPU_S:
                    return self._kill(f"the grammar needs more than {COMPILE_CPU_S:g} s of CPU to compile (the limit)")
                if _rss(proc.pid) - rss0 > COMPILE_BYTES:
                    return self._kill(f"the grammar needs more than {COMPILE_BYTES >> 20} MiB to compile (the limit)")
                if time.monotonic() - start > CHECK_TIMEOUT_S:
                    verdict = self._kill(f"the grammar took longer than {CHECK_TIMEOUT_S:g} s to compile (the limit)")
                    verdict.lasting = False
                    return verdict
            frame = reply.result()
        finally:
            reply.cancel()
        if frame is None:  # the worker died on it: a stack overflow or an abort inside the compiler
            self._kill("")
            log.warning("the grammar worker died compiling a grammar of %d characters", len(grammar))
            return Verdict("the grammar compiler failed on this grammar (too deeply nested or too large)")
        return msgspec.msgpack.decode(frame, type=Verdict)

    def _kill(self, why: str) -> Verdict:
        """Stop the worker (it is started again for the next check); a verdict refusing with `why`."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc = None
        return Verdict(why)

    async def _worker(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        if self._closed:
            raise RuntimeError("the engine is shut down")
        proc = await asyncio.create_subprocess_exec(
            *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        assert proc.stdin is not None and proc.stdout is not None
        from ppserve.engine.model.grammar import tokenizer_json

        proc.stdin.write(_frame(msgspec.msgpack.encode(tokenizer_json(self._tokenizer))))
        try:
            ready = await asyncio.wait_for(_read_frame(proc.stdout), START_TIMEOUT_S)
        except TimeoutError:
            ready = None
        if ready != b"ready":
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError("the grammar worker could not start")
        self._proc = proc
        return proc

    async def close(self) -> None:
        self._closed = True
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One frame, or None at the end of the stream (the worker died)."""
    try:
        (size,) = struct.unpack("<I", await reader.readexactly(4))
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` (Linux's /proc; 0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss(pid: int | str = "self") -> int:
    """Resident bytes of process `pid` (0 where /proc cannot be read)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


# ---- the worker process ---------------------------------------------------------------------


def _worker_main(vocab_size: int) -> None:
    from ppserve.engine.model.grammar import check_compiles, llg_tokenizer

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the host
    os.nice(WORKER_NICE)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    text, eos = msgspec.msgpack.decode(_read(inp) or b"", type=tuple[str, int | None])
    tokenizer = llg_tokenizer(text, eos, vocab_size)
    trim = _malloc_trim()
    out.write(_frame(b"ready"))
    out.flush()
    while (frame := _read(inp)) is not None:
        grammar = frame.decode()
        verdict: list[Verdict] = []

        def compile_one(grammar: str = grammar, verdict: list[Verdict] = verdict) -> None:
            trim()  # what earlier compiles freed goes back, so that the growth is this grammar's
            before = _rss()
            try:
                compiled = check_compiles(tokenizer, grammar)  # compiles, and computes the first masks
                verdict.append(Verdict(cost=max(_rss() - before, 1)))  # while it is alive
                del compiled
            except ValueError as e:
                verdict.append(Verdict(str(e)))

        thread = threading.Thread(target=compile_one)  # with CHECK_STACK_BYTES (set below)
        thread.start()
        thread.join()
        out.write(_frame(msgspec.msgpack.encode(verdict[0])))
        out.flush()


def _read(inp: Any) -> bytes | None:
    """One frame from the host, or None at the end of its pipe (the host is gone)."""
    header = inp.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack("<I", header)
    return bytes(inp.read(size))


def _malloc_trim() -> Callable[[], object]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return lambda: libc.malloc_trim(0)
    except OSError:
        return lambda: None


if __name__ == "__main__":
    threading.stack_size(CHECK_STACK_BYTES)
    _worker_main(int(sys.argv[1]))
