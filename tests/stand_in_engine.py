"""An engine that computes nothing, for tests of the HTTP layer alone."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.engine.outputs import RequestOutput
from ppserve.scheduler.sampling_params import SamplingParams


class StandInEngine:
    """Stands in for AsyncEngine: records each request's prompt ids and params, answers one token."""

    healthy, recovering, unavailable, error, stage_nodes = True, False, None, None, ()

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def check_request(self, ids: list[int], params: SamplingParams, *_: Any) -> None:
        self.prompts.append(list(ids))
        self.params.append(params)

    async def generate(
        self, ids: list[int], params: SamplingParams, request_id: str, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        yield RequestOutput(request_id, "ok", [5], True, "length", len(ids), 1)

    async def drain(self, timeout: float) -> bool:
        return True

    async def close(self) -> None:
        self.tokenizer.close()  # as AsyncEngine.close does: a chat template rendering ends now
