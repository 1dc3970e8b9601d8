"""`ppserve generate` end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import alive, pipeline, spawned_children
from live_server import ROOT, LiveServer

from ppserve.engine.model.grammar import build_grammar
from ppserve.engine.model.tokenizer import Tokenizer
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.server.cli import build_parser, main
from ppserve.server.cli_sampling import sampling_params
from ppserve.server.structured import strict_schema

RAY = ["--executor", "ray"]
CLUSTER_AT = ["--dist-init-addr", "127.0.0.1:29999"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if args[:1] == ("generate",):
        args = (*args, "--kv-cache-gb", "0.02")  # the tiny model needs little; allocate little
    return subprocess.run(
        [sys.executable, "-m", "ppserve.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        input=stdin,
    )


def test_generate_json_matches_engine(llama_dir: Path) -> None:
    prompt = "The pipeline stage"
    res = run_cli(
        "generate", "--model", str(llama_dir), "--pp-size", "2", "--prompt", prompt,
        "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--json", "--logprobs", "2",
        "--prompt-logprobs", "1",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    tok = Tokenizer(llama_dir)
    expected = pipeline(llama_dir).generate(
        [tok.encode(prompt)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == tok.decode(expected.token_ids)
    assert out["finish_reason"] == "length"
    assert len(out["logprobs"]) == 12 and len(out["logprobs"][0]["top_logprobs"]) == 2
    first, *scored = out["prompt_logprobs"]
    assert first is None and [lp["token_id"] for lp in scored] == tok.encode(prompt)[1:]
    assert all(len(lp["top_logprobs"]) == 1 and lp["logprob"] <= lp["top_logprobs"][0][1] for lp in scored)


def test_seeded_generate_is_reproducible_and_prints_the_text(llama_dir: Path) -> None:
    """The same seeded sampling twice gives the same tokens; without --json the output is the text."""
    args = ["generate", "--model", str(llama_dir), "--input-ids", "5,6,7,8", "--max-tokens", "10"]
    args += ["--seed", "3", "--top-p", "0.9", "--ignore-eos", "--layer-partition", "1,3", "--pp-size", "2"]
    as_json, plain = run_cli(*args, "--json"), run_cli(*args)
    assert as_json.returncode == 0, as_json.stderr
    assert plain.returncode == 0, plain.stderr
    out = json.loads(as_json.stdout)
    assert out["prompt_token_ids"] == [5, 6, 7, 8] and len(out["token_ids"]) == 10
    assert plain.stdout == out["text"] + "\n"  # the same sampled tokens, printed as text


def test_batch_from_stdin_through_the_pipeline(llama_dir: Path) -> None:
    """Several prompts (one per line on stdin) as one batch through 2 stage processes, over the
    channel that is not the default (shm is what every other run here uses)."""
    prompts = ["The pipeline stage", "café 東京", "a b c d e f g h i j k l m n o p"]
    tok = Tokenizer(llama_dir)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [g.token_ids for g in pipeline(llama_dir).generate([tok.encode(p) for p in prompts], greedy)]
    res = run_cli(
        "generate", "--model", str(llama_dir), "--pp-size", "2", "--tensor-transport", "zmq",
        "--prompts-file", "-", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json",
        "--chunked-prefill-size", "4", stdin="\n".join(prompts) + "\n",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [line["token_ids"] for line in lines] == expected


def test_stop_string(llama_dir: Path) -> None:
    base = ["generate", "--model", str(llama_dir), "--input-ids", "5,6,7", "--max-tokens", "24"]
    base += ["--temperature", "0", "--ignore-eos", "--json"]
    free = json.loads(run_cli(*base).stdout)
    stop = free["text"][5:8]
    assert stop.strip()
    cut = json.loads(run_cli(*base, "--stop", stop).stdout)
    assert cut["text"] == free["text"][: free["text"].index(stop)]
    assert cut["finish_reason"] == "stop"


def test_constraint_flags_give_their_grammars(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "g.lark").write_text('start: "a" | "b"')
    cases = [
        (["--json-schema", json.dumps(schema)], build_grammar("json", schema)),
        (["--json-schema", f"@{tmp_path / 'schema.json'}"], build_grammar("json", schema)),
        (["--json-object"], build_grammar("json_object", None)),
        (["--regex", "[0-9]+"], build_grammar("regex", "[0-9]+")),
        (["--choice", "yes", "--choice", "no"], build_grammar("choice", ["yes", "no"])),
        (["--grammar", f"@{tmp_path / 'g.lark'}"], build_grammar("grammar", 'start: "a" | "b"')),
        (["--json-schema", json.dumps(schema), "--strict"], build_grammar("json", strict_schema(schema))),
        ([], None),
    ]
    for flags, grammar in cases:
        args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flags])
        assert sampling_params(args, 8).grammar == grammar, flags
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--logit-bias", "7=-1.5"])
    assert sampling_params(args, 8).logit_bias == ((7, -1.5),)
    assert build_grammar("json", strict_schema(schema)) != build_grammar("json", schema)  # it closes the object
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--regex", "a", "--strict"])
    with pytest.raises(ValueError, match="--strict applies to --json-schema"):
        sampling_params(args, 8)


def test_generate_constrained(llama_dir: Path) -> None:
    """A constraint holds through the stage processes, even on random weights."""
    base = ["generate", "--model", str(llama_dir), "--pp-size", "2", "--prompt", "Say", "--max-tokens", "12"]
    res = run_cli(*base, "--json", "--seed", "3", "--regex", "[0-9]{3}-[a-c]+")
    assert res.returncode == 0, res.stderr
    assert re.fullmatch("[0-9]{3}-[a-c]+", json.loads(res.stdout)["text"]), res.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "x", "--pp-size", "5"], "pp_size 5 is larger than the model's 4 layers"),
        (["--prompt", "x", "--pp-size", "2", "--layer-partition", "1,2"], "sums to 3"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be an integer in [1, "),
        (["--prompt", "x", "--stage-timeout", "0.5"], "stage_timeout_s (--stage-timeout) must be >= 1, got 0.5"),
        (["--prompt", "x", "--stage-timeout", "nan"], "stage_timeout_s (--stage-timeout) must be a finite number"),
        (["--prompt", "x", "--max-stage-restarts", "-1"], "max_stage_restarts (--max-stage-restarts) must be >= 0"),
        (["--prompt", "x", "--dtype", "int4"], "dtype must be auto"),
        (["--input-ids", "1,x"], "expected comma-separated token ids"),
        (["--prompt", "x", "--input-ids", "1"], "not allowed with argument"),
        (["--prompt", ""], "the prompt is empty"),
        (
            ["--prompt", "x", "--chunked-prefill-size", "0"],
            "chunked_prefill_size (--chunked-prefill-size) must be >= 1",
        ),
        (["--prompt", "x", "--tensor-transport", "nccl"], "tensor transport 'nccl' needs --device cuda"),
        (["--prompt", "x", "--tensor-transport", "carrier-pigeon"], "invalid choice"),
        (["--prompt", "x", "--top-k", "many"], "invalid int value"),
        (["--prompt", "x", "--json-schema", "{nope"], "--json-schema: not JSON"),
        (["--prompt", "x", "--regex", "a", "--choice", "b"], "not allowed with argument"),
        (["--prompt", "x", "--logit-bias", "7"], "--logit-bias wants TOKEN=BIAS"),
        (["--prompt", "x", "--logit-bias", "7=101"], "logit_bias"),
        (["--prompt", "x", "--pp-size", "2", "--nnodes", "2"], "needs --dist-init-addr HOST:PORT"),
        (["--prompt", "x", "--pp-size", "2", "--nnodes", "2", "--dist-init-addr", "nope"], "expected HOST:PORT"),
        (["--prompt", "x", "--pp-size", "2", "--nnodes", "2", *CLUSTER_AT], "needs a shared secret"),
        (["--prompt", "x", "--pp-size", "2", "--nnodes", "3", *CLUSTER_AT, "--insecure-cluster"], "every node needs"),
        (["--prompt", "x", "--pp-size", "2", "--nnodes", "2", "--node-rank", "2", *CLUSTER_AT], "--node-rank must be"),
        (
            [
                "--prompt",
                "x",
                "--pp-size",
                "2",
                "--nnodes",
                "2",
                *CLUSTER_AT,
                "--insecure-cluster",
                "--stages-per-node",
                "2",
            ],
            "--stages-per-node '2' must name one count",
        ),
        (["--prompt", "x", "--nnodes", "2", *CLUSTER_AT, "--cluster-key-file", "/no/such/key"], "cannot read"),
        (["--prompt", "x", "--disaggregation-mode", "prefill"], "unrecognized arguments"),  # serve only
        (["--prompt", "x", "--ray-address", "198.18.0.1:6379"], "--ray-address needs --executor ray"),
        (["--prompt", "x", "--placement-strategy", "SPREAD"], "--placement-strategy needs --executor ray"),
        (["--prompt", "x", "--placement-strategy", "ANYWHERE"], "invalid choice"),
        (["--prompt", "x", *RAY, "--ray-address", "nope"], "--ray-address: expected HOST:PORT"),
        (["--prompt", "x", *RAY, "--ray-address", "ray://198.18.0.1:10001"], "expected the cluster's HOST:PORT"),
        (["--prompt", "x", *RAY, "--ray-address", "198.18.0.1:6379"], "stages on a Ray cluster need a shared secret"),
        (["--prompt", "x", *RAY, "--pp-size", "2", "--tensor-transport", "shm"], "'shm' works within one node"),
        (
            ["--prompt", "x", *RAY, "--pp-size", "2", "--nnodes", "2", *CLUSTER_AT, "--insecure-cluster"],
            "--executor ray places the stages itself",
        ),
    ],
)
def test_bad_arguments_one_line_exit_2(
    llama_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each is refused before any stage starts: run in this process (main() as the console
    script calls it), which spares a Python start per case."""
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(llama_dir), *args, "--kv-cache-gb", "0.02"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-ids", "1,99999"], "token id 99999 is outside the vocabulary"),
        (["--prompt", "x", "--regex", "(unclosed"], "--regex: "),
    ],
)
def test_arguments_the_engine_refuses_one_line_exit_2(llama_dir: Path, args: list[str], message: str) -> None:
    res = run_cli("generate", "--model", str(llama_dir), *args)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_cluster_key_and_rendezvous_address_errors(llama_dir: Path, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("a-cluster-secret-for-the-cli")
    cluster = ["--pp-size", "2", "--nnodes", "2", "--cluster-key-file", str(key)]
    res = run_cli("generate", "--model", str(llama_dir), "--prompt", "x", *cluster, *CLUSTER_AT, "--insecure-cluster")
    assert res.returncode == 2 and "exclude each other" in res.stderr, res.stderr
    with socket.socket() as taken:  # node 0 cannot run the rendezvous store on a port in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        at = f"127.0.0.1:{taken.getsockname()[1]}"
        res = run_cli("generate", "--model", str(llama_dir), "--prompt", "x", *cluster, "--dist-init-addr", at)
    assert res.returncode == 1 and f"cannot listen on --dist-init-addr {at}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_missing_model_dir(tmp_path: Path) -> None:
    """A path that is not there says so, and what --model takes; a directory without a config says that."""
    for missing in (tmp_path / "nope", tmp_path / "nope.gguf"):
        res = run_cli("generate", "--model", str(missing), "--prompt", "x")
        assert res.returncode == 2 and f"model '{missing}' does not exist" in res.stderr, res.stderr
        assert "a .gguf file" in res.stderr
    res = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert res.returncode == 2 and "no config.json in" in res.stderr


def test_version_and_a_bare_ppserve(capsys: pytest.CaptureFixture[str]) -> None:
    """`ppserve --version` names the version; `ppserve` alone lists the commands."""
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("ppserve ")
    main([])
    out = capsys.readouterr().out
    assert all(command in out for command in ("generate", "serve", "router"))


@pytest.mark.slow
def test_serve_flags(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--served-model-name, --max-model-len, --log-level, --no-playground and the PPSERVE_API_KEY variable."""
    monkeypatch.setenv("PPSERVE_API_KEY", "from-env")
    flags = ["--served-model-name", "tiny", "--max-model-len", "64", "--log-level", "warning", "--no-playground"]
    server = LiveServer(llama_dir, *flags, api_key=None)
    try:
        code, _, raw = server.request("GET", "/", headers={"Authorization": "Bearer from-env"})
        assert code == 404 and json.loads(raw)["error"]["code"] == 404  # no page: the route is not there
        assert server.request("GET", "/v1/models")[0] == 401
        code, _, raw = server.request("GET", "/v1/models", headers={"Authorization": "Bearer from-env"})
        card = json.loads(raw)["data"][0]
        assert code == 200 and card["id"] == "tiny" and card["max_model_len"] == 64
        assert not any("aiohttp.access" in line for line in server.output)  # warning level: no access log
    finally:
        assert server.stop() == 0


PREFILL = ["--disaggregation-mode", "prefill"]
DECODE = ["--disaggregation-mode", "decode"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*DECODE, "--disaggregation-transfer-timeout", "0"], "(--disaggregation-transfer-timeout) must be > 0"),
        (
            [*PREFILL, "--disaggregation-bootstrap-timeout", "nan"],
            "(--disaggregation-bootstrap-timeout) must be a finite number",
        ),
        (
            [*PREFILL, "--disaggregation-bootstrap-port", "70000"],
            "(--disaggregation-bootstrap-port) must be in [0, 65535]",
        ),
        (["--disaggregation-mode", "middle"], "invalid choice"),
        # The pair's sockets need the cluster key, unless the user opts out loudly.
        (DECODE, "needs a shared secret on both sides"),
        (["--log-level", "loud"], "--log-level"),
        (["--port", "80000"], "a port is 1 to 65535 (0: any free one), got 80000"),
        (["--port", "-1"], "a port is 1 to 65535"),
        (["--stage-start-timeout", "0"], "stage_start_timeout_s (--stage-start-timeout) must be > 0"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    ],
)
def test_serve_bad_flags_one_line_exit_2(
    llama_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything is started or bound: in this process, as the console script runs main()."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(llama_dir), "--port", "0", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and message in lines[-1], err


def test_router_needs_the_shared_secret(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"])
    assert exited.value.code == 2 and "the router needs the servers' shared secret" in capsys.readouterr().err


def test_serve_refusals_through_the_console_script(llama_dir: Path) -> None:
    """What only a started server finds, as a user sees it: one line, no traceback."""
    res = run_cli("serve", "--model", str(llama_dir), "--pp-size", "9")
    assert res.returncode == 2 and "pp_size" in res.stderr.replace("-", "_") and "Traceback" not in res.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        res = run_cli("serve", "--model", str(llama_dir), "--kv-cache-gb", "0.02", "--port", port)
        assert res.returncode == 1 and "address already in use" in res.stderr.lower(), res.stderr
        assert f"cannot listen on 127.0.0.1 port {port}" in res.stderr
        # The port is checked before the model is even read: a missing model is not what fails.
        res = run_cli("serve", "--model", str(llama_dir / "missing"), "--port", port)
        assert res.returncode == 1 and "address already in use" in res.stderr.lower(), res.stderr


@pytest.mark.slow
def test_ctrl_c_while_stages_start_prints_one_line(llama_dir: Path) -> None:
    """Ctrl-C reaches the whole process group, stage processes included, while they still
    import torch; the user sees one line from the server and no traceback."""
    cmd = [sys.executable, "-m", "ppserve.server.cli", "serve", "--model", str(llama_dir), "--pp-size", "2"]
    proc = subprocess.Popen(
        [*cmd, "--kv-cache-gb", "0.02", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    try:
        # Polled without a pause: the point is to interrupt the stages while they still import torch.
        stages: list[int] = []
        deadline = time.monotonic() + 60
        while len(stages) < 2 and proc.poll() is None and time.monotonic() < deadline:
            stages = spawned_children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert len(stages) == 2, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode in (0, 130), err
    last = (out + err).strip().splitlines()[-1]
    ended = ("ppserve: start-up interrupted", "ppserve: shutting down", "ppserve serve: interrupted")
    assert last.startswith(ended), out + err
    assert not any(alive(pid) for pid in stages)


@pytest.mark.slow
def test_embed_example_runs_and_is_in_readme(llama_dir: Path) -> None:
    script = ROOT / "scripts" / "embed_example.py"
    res = subprocess.run([sys.executable, str(script), str(llama_dir)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert [line.split(":")[0] for line in lines] == ["first", "second"]
    assert all("16 tokens (length)" in line for line in lines), lines
    # The documentation (docs/python-api.md) shows this file's code; keep the two from drifting apart.
    code = script.read_text().split('"""', 2)[2].strip()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert any(code in page.read_text() for page in docs)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--dynamic-chunking-smooth-factor", "1.5"], {}, "chunk_smooth (--chunk-smooth) must be in [0, 1]"),
        (["--dynamic-chunking-smooth-factor", "-0.1"], {}, "chunk_smooth (--chunk-smooth) must be in [0, 1]"),
        ([], {"PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR": "lots"}, "PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR"),
        ([], {"PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR": "2"}, "chunk_smooth (--chunk-smooth) must be in [0, 1]"),
        (["--synthetic-latency", "1,2"], {}, "A,B,C"),
        (["--synthetic-latency", "1,-2,3"], {}, "synthetic latency"),
    ],
)
def test_chunking_flag_errors(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], env: dict[str, str], message: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    res = run_cli("generate", "--model", str(llama_dir), "--prompt", "x", "--enable-dynamic-chunking", *flags)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_smooth_factor_from_flag_or_environment(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppserve.engine.config import EngineConfig

    assert EngineConfig.create(llama_dir, num_kv_blocks=8).chunk_smooth == 0.75
    monkeypatch.setenv("PPSERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "0.4")
    assert EngineConfig.create(llama_dir, num_kv_blocks=8).chunk_smooth == 0.4
    assert EngineConfig.create(llama_dir, num_kv_blocks=8, chunk_smooth=1.0).chunk_smooth == 1.0  # the flag wins
    args = build_parser().parse_args(["serve", "--enable-dynamic-chunking", "--synthetic-latency", "1e-9,2e-5,0.001"])
    assert args.dynamic_chunking and args.synthetic_latency == (1e-9, 2e-5, 0.001)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(llama_dir: Path) -> None:
    """The first Ctrl-C drains (requests in flight may finish, here for up to a minute); a second
    one ends that at once: the request in flight gets its end, the stages are gone, the server
    exits. What would otherwise wait out --shutdown-timeout takes a moment."""
    server = LiveServer(llama_dir, "--pp-size", "2", "--kv-cache-gb", "0.02", "--shutdown-timeout", "60")
    stages = server.stage_pids()
    body = {"prompt": "once upon", "max_tokens": 1500, "ignore_eos": True}
    answers: list[int] = []
    worker = threading.Thread(target=lambda: answers.append(_status(server, body)), daemon=True)
    worker.start()
    try:
        server.wait_until(lambda: server.metrics().get("ppserve_requests_running", 0) >= 1, what="the request")
        server.proc.send_signal(signal.SIGINT)
        server.wait_until(lambda: any("Ctrl-C again" in line for line in server.output), what="the drain")
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0  # a guard against a hang: the drain had 60 s left
    finally:
        server.stop()
    worker.join(timeout=30)
    assert any("stopping at once" in line for line in server.output), "".join(server.output)
    assert len(stages) == 2 and not any(alive(pid) for pid in stages)


def _status(server: LiveServer, body: dict[str, object]) -> int:
    """The request's HTTP status, or 0 where the connection ended without one."""
    try:
        return server.request("POST", "/v1/completions", body)[0]
    except OSError:
        return 0
