"""Cache salts and tenants without a server process: the scheduler shares cached blocks only
between requests of one salt, the server derives each tenant's salt, the request bodies bound
`cache_salt`, and the command line takes several API keys."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from test_cli import run_cli

from ppserve.scheduler.block_allocator import block_hash, salt_root
from ppserve.scheduler.request import MAX_CACHE_SALT_CHARS, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.server.cli import build_parser
from ppserve.server.cli_clients import _read_key_file
from ppserve.server.errors import ApiError
from ppserve.server.json_body import decode, decode_ws
from ppserve.server.protocol import ChatRequest, CompletionRequest, GenerateRequest, WsChat, WsGenerate
from ppserve.server.state import ServerOptions, ServerState
from ppserve.server.tenants import ANONYMOUS, Tenants
from ppserve.transport import messages
from ppserve.transport.messages import KvTarget, RoomOpen, Sampled, StepResult, WireSamplingParams

BLOCK = 4
PROMPT = list(range(100, 117))  # four full blocks and one token: four blocks can be found cached


# ---- the scheduler ------------------------------------------------------------------------


def _run(s: Scheduler, rid: str, salt: str | None, prompt: list[int] = PROMPT) -> Request:
    """Serve one request to its end (plans answered in order); it is returned with its counts."""
    r = Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), cache_salt=salt)
    s.add(r)
    while s.has_work:
        plan = s.schedule()
        assert plan is not None
        s.update(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], []))
    return r


@pytest.fixture
def sched() -> Scheduler:
    cfg = SchedulerConfig(
        num_blocks=64, block_size=BLOCK, pp_size=1, chunked_prefill_size=8, enable_prefix_caching=True
    )
    return Scheduler(cfg)


def test_different_salts_share_no_cached_blocks(sched: Scheduler) -> None:
    a = _run(sched, "a", "tenant-a")
    b = _run(sched, "b", "tenant-b")
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    # Every block's hash differs, not only the first: the salt roots the whole chain.
    assert not set(a.block_hashes) & set(b.block_hashes)


def test_the_same_salt_shares_them(sched: Scheduler) -> None:
    _run(sched, "a", "tenant-a")
    again = _run(sched, "a2", "tenant-a")
    assert again.num_cached_tokens == 4 * BLOCK
    # A longer prompt of the same salt finds the prefix too; the hit counters count it.
    longer = _run(sched, "a3", "tenant-a", [*PROMPT[:8], 1, 2, 3, 4, 5])
    assert longer.num_cached_tokens == 2 * BLOCK
    assert sched.prefix_hits == 6 * BLOCK


def test_no_salt_and_a_salt_do_not_share(sched: Scheduler) -> None:
    plain = _run(sched, "plain", None)
    salted = _run(sched, "salted", "s")
    assert salted.num_cached_tokens == 0 and not set(plain.block_hashes) & set(salted.block_hashes)
    assert _run(sched, "plain2", None).num_cached_tokens == 4 * BLOCK  # unsalted requests share as before


def test_a_salt_cannot_continue_another_chain() -> None:
    # The salt's root is a different function from the chain's: a salt spelling some chain hash
    # does not make a salted first block equal that chain's next block.
    first = block_hash(None, PROMPT[:BLOCK])
    assert salt_root(first.hex()) != first
    assert salt_root("\ud800") != salt_root("\ud801")  # lone surrogates are salts, not crashes


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, b"bytes"])
def test_a_request_refuses_a_bad_salt(salt: object) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        Request("r", [1, 2], SamplingParams(), cache_salt=salt)  # type: ignore[arg-type]
    Request("r", [1, 2], SamplingParams(), cache_salt="x" * MAX_CACHE_SALT_CHARS)


def test_room_open_carries_the_salt_and_reads_without_it() -> None:
    wire = WireSamplingParams(0.0, 0, 1.0, 0.0, 0.0, 0.0, None, None)
    room = RoomOpen("r", [1, 2], wire, [KvTarget(0, "tcp://127.0.0.1:1", 0, 2)], 16, 2, "tcp://127.0.0.1:2")
    assert room.cache_salt is None
    salted = messages.decode(messages.encode(msgspec.structs.replace(room, cache_salt="t:1")))
    assert isinstance(salted, RoomOpen) and salted.cache_salt == "t:1"
    # A RoomOpen from a decode host that does not send the field: no salt.
    fields = msgspec.to_builtins(room)
    del fields["cache_salt"]
    old = messages.decode(msgspec.msgpack.encode(fields))
    assert isinstance(old, RoomOpen) and old.cache_salt is None


# ---- tenants ------------------------------------------------------------------------------


def test_each_key_is_a_tenant_and_a_wrong_one_none() -> None:
    tenants = Tenants(["key-a", "key-b", "key-a"])
    a, b = tenants.match(b"key-a"), tenants.match(b"key-b")
    assert a is not None and b is not None and a != b and len(tenants) == 2
    for wrong in (b"", b"key-", b"key-a ", b"KEY-A", "\ud800".encode("utf-8", "surrogatepass")):
        assert tenants.match(wrong) is None
    assert Tenants([]).match(b"anything") is ANONYMOUS and not Tenants([]).keyed


def test_salts_are_per_tenant_under_api_key_scope() -> None:
    tenants = Tenants(["key-a", "key-b"])
    a, b = tenants.match(b"key-a"), tenants.match(b"key-b")
    assert a is not None and b is not None
    salts = {tenants.cache_salt(t, s) for t in (a, b) for s in (None, "x", "y")}
    assert len(salts) == 6  # two tenants x three salts, all apart
    assert tenants.cache_salt(a, "x") == tenants.cache_salt(a, "x")
    assert all(s is not None and "key-" not in s and len(s) <= MAX_CACHE_SALT_CHARS for s in salts)
    # Without keys there is one tenant: the client's salt alone separates.
    assert Tenants([]).cache_salt(ANONYMOUS, None) is None
    assert Tenants([]).cache_salt(ANONYMOUS, "x") == "x"


def test_decode_servers_with_one_cluster_key_salt_a_tenant_alike() -> None:
    """Two decode servers of one deployment send a tenant's requests to the same prefill server
    with the same salt (its prefixes shared there); servers of no shared key do not."""
    key = b"the-deployment-secret"
    first, second = Tenants(["key-a"], cluster_key=key), Tenants(["key-a"], cluster_key=key)
    a1, a2 = first.match(b"key-a"), second.match(b"key-a")
    assert a1 is not None and a2 is not None
    assert first.cache_salt(a1, None) == second.cache_salt(a2, None)
    assert first.cache_salt(a1, "x") == second.cache_salt(a2, "x") != first.cache_salt(a1, None)
    apart = Tenants(["key-a"])
    a3 = apart.match(b"key-a")
    assert a3 is not None and apart.cache_salt(a3, None) != first.cache_salt(a1, None)


def test_salts_are_the_clients_own_under_shared_scope() -> None:
    tenants = Tenants(["key-a", "key-b"], "shared")
    a, b = tenants.match(b"key-a"), tenants.match(b"key-b")
    assert a is not None and b is not None
    assert tenants.cache_salt(a, None) is tenants.cache_salt(b, None) is None
    assert tenants.cache_salt(a, "x") == tenants.cache_salt(b, "x") == "x"
    with pytest.raises(ValueError, match="scope"):
        Tenants([], "per-user")  # type: ignore[arg-type]


def test_a_request_without_a_tenant_fails_closed(llama_dir: Path) -> None:
    from ppserve.engine.config import EngineConfig

    keyed = ServerState(EngineConfig.create(llama_dir), ServerOptions(api_key="a", api_keys=("b",)))
    assert (
        keyed.options.keys == ("a", "b") and keyed.tenants.match(b"b") is not None and keyed.tenants.match(b"c") is None
    )
    with pytest.raises(ApiError) as e:
        keyed.cache_salt(None, "x")  # only a handler reached without the auth middleware
    assert e.value.status == 401
    open_ = ServerState(EngineConfig.create(llama_dir), ServerOptions())
    assert open_.cache_salt(None, "x") == "x"


# ---- request bodies -------------------------------------------------------------------------

BODIES: list[tuple[type, dict[str, object]]] = [
    (CompletionRequest, {"prompt": "hi"}),
    (ChatRequest, {"messages": [{"role": "user", "content": "hi"}]}),
    (GenerateRequest, {"text": "hi"}),
]


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["x"], {"a": 1}])
@pytest.mark.parametrize(("kind", "body"), BODIES)
def test_a_bad_cache_salt_is_a_400_naming_it(kind: type, body: dict[str, object], salt: object) -> None:
    import json

    with pytest.raises(ApiError) as e:
        decode(json.dumps({**body, "cache_salt": salt}), kind)
    assert e.value.status == 400 and e.value.param == "cache_salt" and "cache_salt" in e.value.message


@pytest.mark.parametrize(("kind", "body"), BODIES)
def test_a_good_cache_salt_is_taken(kind: type, body: dict[str, object]) -> None:
    import json

    salt = "é" * MAX_CACHE_SALT_CHARS  # characters, not bytes
    assert decode(json.dumps({**body, "cache_salt": salt}), kind).cache_salt == salt
    assert decode(json.dumps({**body, "cache_salt": None}), kind).cache_salt is None


def test_websocket_messages_take_a_cache_salt() -> None:
    gen = decode_ws('{"type": "generate", "id": "g", "text": "hi", "cache_salt": "s"}')
    chat = decode_ws('{"type": "chat", "id": "c", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "s"}')
    assert isinstance(gen, WsGenerate) and isinstance(chat, WsChat) and gen.cache_salt == chat.cache_salt == "s"
    with pytest.raises(ApiError) as e:
        decode_ws('{"type": "generate", "id": "g", "text": "hi", "cache_salt": ""}')
    assert e.value.param == "cache_salt"


# ---- the command line -----------------------------------------------------------------------


def test_several_api_keys_on_the_command_line(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"])
    assert args.api_key == ["a", "b"] and args.prefix_cache_scope == "api-key"
    assert build_parser().parse_args(["serve", "--prefix-cache-scope", "shared"]).prefix_cache_scope == "shared"
    keys = tmp_path / "keys"
    keys.write_text("  first  \n\n\tsecond\nthird\n\n")
    assert _read_key_file(str(keys)) == ["first", "second", "third"]


def test_bad_key_and_scope_flags_are_one_line_errors(tmp_path: Path) -> None:
    for flags, message in [
        (["--api-key", "a", "--api-key", " "], "--api-key must not be empty"),
        (["--prefix-cache-scope", "user"], "invalid choice"),
    ]:
        res = run_cli("serve", *flags)
        assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1
