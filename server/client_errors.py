"""Client mistakes are not server errors: keep them out of the ERROR log.

aiohttp answers malformed HTTP (garbage on the port, a bad request line or header) with a 400,
then logs it at ERROR with a traceback, and does the same for a client that disconnects while
a handler writes to it. Anyone who can reach the port can fill the log that way, and bury real
errors. This filter turns those records into one INFO line, at most LOG_BURST of them per
LOG_EVERY_S (the next line says how many were left out); everything else passes unchanged.
The servers and the router install it alike.
"""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

_SERVER_LOGGER = "aiohttp.server"  # where aiohttp's request handler logs
# What writing to or reading from a connection the client has dropped raises (aiohttp's
# ClientConnectionResetError is a ConnectionResetError). Not ConnectionRefusedError: a client
# never causes that one.
CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
# A client can make one of these per connection, as fast as it can connect: a few in a row say
# what happened, the rest are counted.
LOG_BURST = 10
LOG_EVERY_S = 10.0


class _ClientErrorsAsInfo(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._window_ends, self._logged, self._unlogged = 0.0, 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            # aiohttp's own words up to the first blank line; the echo of the client's bytes stays out.
            reason = " ".join(line.strip() for line in str(exc.message).strip().split("\n\n")[0].splitlines())
            what = f"{record.getMessage()}: bad HTTP ({reason})"
        elif isinstance(exc, CLIENT_GONE):
            what = f"{record.getMessage()}: the client went away ({exc})"
        else:
            return True
        if not self._admit():
            return False
        if self._unlogged:
            what += f" ({self._unlogged} more client mistakes not logged since the last line)"
            self._unlogged = 0
        record.msg, record.args = "%s", (what,)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text = None, None
        # The logger let the record through as an ERROR; as INFO it must pass the level again.
        return logging.getLogger(_SERVER_LOGGER).isEnabledFor(logging.INFO)

    def _admit(self) -> bool:
        now = time.monotonic()
        if now >= self._window_ends:
            self._window_ends, self._logged = now + LOG_EVERY_S, 0
        if self._logged >= LOG_BURST:
            self._unlogged += 1
            return False
        self._logged += 1
        return True


def quiet_client_errors() -> None:
    """Install the filter on aiohttp's server logger (once per process)."""
    logger = logging.getLogger(_SERVER_LOGGER)
    if not any(isinstance(f, _ClientErrorsAsInfo) for f in logger.filters):
        logger.addFilter(_ClientErrorsAsInfo())
