"""The AMX tiles (Intel's matrix units), which oneDNN's bfloat16 and int8 kernels use where the kernel
chooser picks them (engine/model/kernel_choice.py): whether this process may use them.

Linux (5.16 on) grants a process the tiles' state only on request: arch_prctl(2)'s
ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, before the first tile instruction.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

from ppserve.engine.model import cpu_kernels

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _request_tiles() -> int:
    """arch_prctl's answer to the request for the tiles' state: 0, or the errno of its refusal."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0 else ctypes.get_errno()


@functools.cache  # one request, and one warning, a process
def amx() -> bool:
    """Whether this process can use the AMX tiles: the CPU has them and Linux grants their state.
    Where it refuses (an old kernel, a seccomp policy), oneDNN runs its AVX-512 code instead: one
    warning says so."""
    if "amx_tile" not in cpu_kernels.cpu_flags().split():
        return False
    if error := _request_tiles():
        log.warning(
            "this CPU has AMX, but Linux refused this process its tile state (arch_prctl: %s): oneDNN's "
            "bfloat16 and int8 kernels run without it", os.strerror(error),
        )  # fmt: skip
        return False
    return True
