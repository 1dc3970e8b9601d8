"""/openapi.json: a valid OpenAPI 3.1 document that describes every route the app has.

(tests/server/test_fuzz.py checks the server against it, request by request.)
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from live_server import LiveServer
from openapi_spec_validator import validate

from ppserve.engine.config import EngineConfig
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.app import OPEN_PATHS, create_app
from ppserve.server.errors import ApiError
from ppserve.server.openapi import openapi_schema
from ppserve.server.responses import ErrorResponse

METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def test_is_valid_openapi_3_1() -> None:
    doc = openapi_schema()
    assert doc["openapi"].startswith("3.1.")
    validate(doc)  # raises on any violation of the OpenAPI 3.1 schema, or a $ref that leads nowhere


def test_documents_every_route_and_only_those(llama_dir: Path) -> None:
    app = create_app(EngineConfig.create(llama_dir))  # builds the routes; the engine starts only with the app
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    # aiohttp answers HEAD for every GET by itself; HEAD is implied by GET in HTTP, not documented.
    routes -= {("head", path) for method, path in routes if method == "get"}
    paths = openapi_schema()["paths"]
    documented = {(method, path) for path, item in paths.items() for method in item if method in METHODS}
    assert routes == documented


def test_every_operation_documents_its_answers() -> None:
    doc = openapi_schema()
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            assert operation.get("operationId") and operation.get("summary"), (method, path)
            codes = set(operation["responses"])
            assert "200" in codes or "101" in codes, (method, path)
            open_ = operation.get("security") == []
            assert open_ == (path in OPEN_PATHS), (method, path)
            if not open_:  # with --api-key set, a wrong key is a 401 with the error body
                assert codes >= {"401"}, (method, path)
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearerAuth": []}]


def test_error_shape_is_what_the_server_sends() -> None:
    for status in (400, 401, 404, 413, 500, 503):
        msgspec.convert(ApiError(status, "message", "field").body(), ErrorResponse)
        msgspec.convert(ApiError(status, "message").body(), ErrorResponse)


def test_prompt_has_its_real_union() -> None:
    prompt = openapi_schema()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    shapes = [
        (b["type"], b.get("items", {}).get("type"), b.get("items", {}).get("items", {}).get("type"))
        for b in prompt["anyOf"]
    ]
    assert shapes == [
        ("string", None, None),
        ("array", "string", None),
        ("array", "integer", None),
        ("array", "array", "integer"),
    ]


def test_documented_ranges_are_those_of_sampling_params() -> None:
    """Each bound in the schema of sampling_params is one SamplingParams takes, and the value
    just beyond it is one SamplingParams refuses."""
    sampling = openapi_schema()["components"]["schemas"]["NativeSampling"]["properties"]
    checked = 0
    for name, prop in sampling.items():
        for branch in [prop, *prop.get("anyOf", [])]:
            step = {"integer": 1, "number": 1e-9}.get(branch.get("type", ""))
            if step is None:
                continue
            bounds = [(branch[k], k == "minimum") for k in ("minimum", "maximum") if k in branch]
            for bound, is_min in bounds:
                SamplingParams(**{name: bound})
                with pytest.raises(ValueError, match=name):
                    SamplingParams(**{name: bound - step if is_min else bound + step})
                checked += 1
            if "exclusiveMinimum" in branch:
                with pytest.raises(ValueError, match=name):
                    SamplingParams(**{name: branch["exclusiveMinimum"]})
                SamplingParams(**{name: branch["exclusiveMinimum"] + step})
                checked += 1
    assert checked >= 10  # temperature, top_k, top_p, min_p, the penalties, seed, max_tokens, logprobs


@pytest.mark.slow
def test_served_without_api_key(live_server: LiveServer) -> None:
    status, headers, body = live_server.request("GET", "/openapi.json", headers={"Authorization": ""})
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == openapi_schema()
