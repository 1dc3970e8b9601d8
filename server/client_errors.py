"""Client mistakes are not server errors: keep them out of the ERROR log.

aiohttp answers malformed HTTP (garbage on the port, a bad request line or header) with a 400,
then logs it at ERROR with a traceback, and does the same for a client that disconnects while
a handler writes to it. Anyone who can reach the port can fill the log that way, and bury real
errors. This filter turns those records into one INFO line; everything else passes unchanged.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

_SERVER_LOGGER = "aiohttp.server"  # where aiohttp's request handler logs
# What writing to or reading from a connection the client has dropped raises (aiohttp's
# ClientConnectionResetError is a ConnectionResetError). Not ConnectionRefusedError: a client
# never causes that one.
CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _ClientErrorsAsInfo(logging.Filter):
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
        record.msg, record.args = "%s", (what,)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text = None, None
        # The logger let the record through as an ERROR; as INFO it must pass the level again.
        return logging.getLogger(_SERVER_LOGGER).isEnabledFor(logging.INFO)


def quiet_client_errors() -> None:
    """Install the filter on aiohttp's server logger (once per process)."""
    logger = logging.getLogger(_SERVER_LOGGER)
    if not any(isinstance(f, _ClientErrorsAsInfo) for f in logger.filters):
        logger.addFilter(_ClientErrorsAsInfo())
