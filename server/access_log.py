"""The access log, without the health checks: a router (or a load balancer) reads every server's
/health each second, and a line for each of those buried the lines of real traffic. A failed
check is still logged: it is news."""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_log import AccessLogger


class TrafficLogger(AccessLogger):
    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path == "/health" and response.status == 200:
            return
        super().log(request, response, time)
