"""A disaggregated deployment as a user starts it: a prefill server, a decode server and the
router in front, each its own `ppserve` process, over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import pipeline
from live_server import LiveServer

from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.addresses import free_ports
from ppserve.transport.cluster_key import route_proof

pytestmark = pytest.mark.slow
KEY = "pd-test-key"
CLUSTER = {"PPSERVE_CLUSTER_KEY": "the-pair-and-router-secret"}  # the servers' and the router's


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[LiveServer, LiveServer, LiveServer]]:
    common = ["--kv-cache-gb", "0.02", "--no-playground", "--served-model-name", "m"]
    port = str(free_ports(1)[0])  # --disaggregation-bootstrap-port: the address printed and in /health
    prefill = LiveServer(
        llama_dir, *common, "--pp-size", "2", "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", port, "--disaggregation-transfer-timeout", "20",
        "--disaggregation-bootstrap-timeout", "20", api_key=KEY, env=CLUSTER,
    )  # fmt: skip
    decode = LiveServer(llama_dir, *common, "--disaggregation-mode", "decode", api_key=KEY, env=CLUSTER)
    router = LiveServer(
        None, "--prefill", prefill.url, "--decode", decode.url, api_key=None, command="router", env=CLUSTER
    )
    router.api_key = KEY  # forwarded to the servers
    try:
        router.wait_until(lambda: router.request("GET", "/health")[0] == 200, what="both sides healthy")
        assert json.loads(prefill.request("GET", "/health")[2])["disaggregation"]["bootstrap"].endswith(f":{port}")
        yield prefill, decode, router
    finally:
        for server in (router, decode, prefill):
            server.stop()


def test_completions_through_the_router_match_one_colocated_engine(
    deployment: tuple[LiveServer, LiveServer, LiveServer], llama_dir: Path
) -> None:
    prefill, decode, router = deployment
    assert any(
        re.search(r"prefill side of a disaggregated pair; bootstrap at tcp://127.0.0.1:\d+$", line)
        for line in prefill.output
    )
    assert json.loads(prefill.request("GET", "/health")[2])["disaggregation"]["bootstrap"].startswith(
        "tcp://127.0.0.1:"
    )
    prompt = "The pipeline stage hands its cache"
    ids = Tokenizer(llama_dir).encode(prompt)
    expected = pipeline(llama_dir).generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    body = {"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    status, _, raw = router.request("POST", "/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == Tokenizer(llama_dir).decode(expected.token_ids)
    status, headers, raw = router.request("POST", "/v1/completions", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == Tokenizer(llama_dir).decode(expected.token_ids)
    health = json.loads(router.request("GET", "/health")[2])
    assert health["status"] == "ok" and health["prefill"][0]["healthy"] and health["decode"][0]["healthy"]
    metrics = router.request("GET", "/metrics")[2].decode()
    assert f'ppserve_router_requests_total{{backend="{decode.url}",side="decode"}} 2' in metrics
    assert f'backend="{prefill.url}"' in metrics and "ppserve_kv_blocks" in metrics


def test_errors_have_the_servers_shape(deployment: tuple[LiveServer, LiveServer, LiveServer]) -> None:
    prefill, decode, router = deployment
    status, _, raw = router.request("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"  # the decode server's answer
    # A client (even one with the API key) cannot make the decode server connect anywhere: the
    # prefill server's address counts only with the router's proof of the cluster key.
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    for proof in ({}, {"X-PPServe-Prefill-Proof": "0" * 64}):
        status, _, raw = decode.request(
            "POST", "/v1/completions", body, headers={"X-PPServe-Prefill": "tcp://h:1", **proof}
        )
        assert status == 403 and "X-PPServe-Prefill-Proof" in json.loads(raw)["error"]["message"]
    key = CLUSTER["PPSERVE_CLUSTER_KEY"].encode()
    signed = {"X-PPServe-Prefill": "nonsense", "X-PPServe-Prefill-Proof": route_proof(key, "nonsense")}
    status, _, raw = decode.request("POST", "/v1/completions", body, headers=signed)
    assert status == 400 and "X-PPServe-Prefill" in json.loads(raw)["error"]["message"]
    status, _, raw = prefill.request(
        "POST", "/v1/completions", {"model": "m", "prompt": "x"}, headers={"X-PPServe-Prefill": "tcp://h:1"}
    )
    assert status == 400 and "for decode servers" in json.loads(raw)["error"]["message"]


def test_the_router_with_no_prefill_server_up(llama_dir: Path) -> None:
    down = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    router = LiveServer(None, *down, api_key=None, command="router", env=CLUSTER)
    try:
        router.wait_until(lambda: "leaves the rotation" in "".join(router.output), what="a failed check")
        status, _, raw = router.request("POST", "/v1/completions", {"model": "m", "prompt": "x"})
        error = json.loads(raw)["error"]
        assert status == 503 and error["type"] == "service_unavailable" and "is healthy" in error["message"]
        assert router.request("GET", "/health")[0] == 503
    finally:
        assert router.stop() == 0


def test_the_router_routes_around_a_dead_decode_server(llama_dir: Path) -> None:
    common = ["--kv-cache-gb", "0.02", "--no-playground", "--served-model-name", "m", "--disaggregation-mode"]
    insecure = "--insecure-cluster"  # on loopback, and said in the log
    prefill = LiveServer(llama_dir, *common, "prefill", insecure, api_key=None)
    decodes = [LiveServer(llama_dir, *common, "decode", insecure, api_key=None) for _ in range(2)]
    router = LiveServer(
        None, "--prefill", prefill.url, "--decode", *(d.url for d in decodes), insecure,
        api_key=None, command="router",
    )  # fmt: skip
    try:
        router.wait_until(lambda: router.request("GET", "/health")[0] == 200, what="both sides healthy")
        assert any("--insecure-cluster: " in line and "takes rooms from anyone" in line for line in prefill.output)
        decodes[0].proc.kill()  # gone without a word; its stages follow
        decodes[0].proc.wait()

        def first_decode_out() -> bool:
            health = json.loads(router.request("GET", "/health")[2])
            return not health["decode"][0]["healthy"]

        router.wait_until(first_decode_out, what="the dead decode server out of the rotation")
        body = {"model": "m", "prompt": "around", "max_tokens": 4, "temperature": 0}
        assert all(router.request("POST", "/v1/completions", body)[0] == 200 for _ in range(3))
        assert (
            f'ppserve_router_requests_total{{backend="{decodes[1].url}",side="decode"}} 3'
            in router.request("GET", "/metrics")[2].decode()
        )
        prefill.wait_until(lambda: prefill.metrics()["ppserve_kv_blocks_used"] == 0, what="the prefill KV freed")
    finally:
        for server in (router, *decodes, prefill):
            server.stop()


def test_websocket_through_the_router(deployment: tuple[LiveServer, LiveServer, LiveServer], llama_dir: Path) -> None:
    _, _, router = deployment
    prompt = "Streams over a socket"
    ids = Tokenizer(llama_dir).encode(prompt)
    expected = pipeline(llama_dir).generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]

    async def talk() -> list[int]:
        import aiohttp

        tokens: list[int] = []
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {KEY}"}
            async with session.ws_connect(router.url + "/ws", headers=headers) as ws:
                params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
                await ws.send_json({"type": "generate", "id": "a", "text": prompt, "sampling_params": params})
                async for msg in ws:
                    event = json.loads(msg.data)
                    assert event["type"] in ("token", "done"), event
                    if event["type"] == "done":
                        return tokens
                    tokens.append(event["token_id"])
        return tokens

    assert asyncio.run(talk()) == expected.token_ids


def test_the_router_serves_the_playground_every_api_and_logs_traffic_only(
    deployment: tuple[LiveServer, LiveServer, LiveServer],
) -> None:
    """GET / is the playground page and /debug/pipeline the decode server's view of its pipeline;
    embeddings, the Responses and Messages APIs go through (the key as x-api-key too); and the
    servers' access logs have the traffic, not the router's health check every second."""
    prefill, decode, router = deployment
    status, headers, raw = router.request("GET", "/", headers={"Authorization": ""})
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"<script>" in raw
    status, _, raw = router.request("GET", "/debug/pipeline?since=0")
    assert status == 200 and json.loads(raw)["model"] == "m" and json.loads(raw)["status"] == "ok"
    assert router.request("GET", "/debug/pipeline?since=nan")[0] == 400  # the decode server's answer
    status, _, raw = router.request("POST", "/v1/embeddings", {"input": [[5, 6, 7]]})
    assert status == 200 and len(json.loads(raw)["data"][0]["embedding"]) == 64
    status, _, raw = router.request("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 3})
    assert status == 200 and json.loads(raw)["object"] == "response", raw
    anthropic = {"Authorization": "", "x-api-key": KEY}
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = router.request("POST", "/v1/messages", body, headers=anthropic)
    assert status == 200 and json.loads(raw)["type"] == "message", raw
    router.wait_until(lambda: any('"POST /v1/messages' in line for line in decode.output), what="the access line")
    for server in (prefill, decode, router):  # a failed check would be logged (the router's first ones are)
        assert not [line for line in server.output if '"GET /health HTTP/1.1" 200' in line]
