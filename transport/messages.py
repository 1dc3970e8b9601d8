"""Wire messages (msgspec). Everything that crosses a process boundary is defined here.

Each message is a tagged Struct, so one decoder reads any of them; `PROTOCOL_VERSION` is checked
in the handshake so that mismatched processes fail at start-up, not mid-run.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

PROTOCOL_VERSION = 13  # 13: SeqChunk.drafts, StepPlan.truncated, Sampled.forced (speculative decoding)
S = TypeVar("S", bound=msgspec.Struct)


class Msg(msgspec.Struct, tag=True, frozen=True):
    """Base of every control-plane message (the class name is the type tag)."""


class SeqChunk(msgspec.Struct, frozen=True, array_like=True):
    """One request's part of a micro-batch: `token_ids` are new tokens at positions
    [start, start + len(token_ids)).

    The request's KV block table covers every position up to start + len(token_ids). In a
    StepPlan, stages keep each request's table between plans (engine/runtime/block_tables.py), so
    `blocks` holds only the blocks added since the request's previous chunk, usually none in a
    decode step; `new_table` marks a chunk whose `blocks` start the table afresh (the request's
    first chunk, or its first since it was preempted or the pipeline was reset): whatever a
    stage held under that id is replaced. A plan's size thus follows its new tokens, not the
    requests' context. Given to `StageRunner.execute` directly (synthetic chunks, reference
    passes), `blocks` is always the whole table.
    """

    request_id: str
    token_ids: list[int]
    start: int
    blocks: list[int]
    sample: bool  # sample a token after this chunk (last prefill chunk, or a decode step)
    new_table: bool = False
    # A decode step planned before its input token was known: `token_ids` is [-1], and the stage
    # that embeds, which at PP=1 is the one that sampled that token in the previous plan, puts it
    # there (Sampler.follow).
    follows: bool = False
    # A model with sliding-window layers: their own blocks (scheduler/window_kv.py), entry for entry
    # as `blocks` (so as many), -1 for blocks that slid out of the window (never read). Given to
    # `execute` directly, empty: `blocks` serves both groups.
    window_blocks: list[int] = []
    # Speculative decoding: the last `drafts` of `token_ids` are guesses of the tokens that follow
    # (scheduler/drafter.py). Every stage computes each row of such a chunk as a decode step of its
    # own, and the last stage samples at every row, keeping a draft while it is what was sampled
    # (engine/model/sampler.py, `verify`).
    drafts: int = 0

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """Prompt work rather than decode steps (a 1-token final prefill chunk counts as decode)."""
        return (self.num_new > 1 and not self.drafts) or not self.sample


class WireSamplingParams(msgspec.Struct, frozen=True, array_like=True):
    """SamplingParams as the last stage needs them (sent once per request)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    logprobs: int | None
    prompt_logprobs: int | None = None  # top N scored at each prompt position (see PromptTargets)
    repetition_penalty: float = 1.0  # 1 = off; otherwise NewRequest carries the prompt's token ids
    logit_bias: list[tuple[int, float]] = []  # (token id, bias in [-100, 100]), sorted by id
    grammar: str | None = None  # llguidance's grammar: the last stage masks the tokens it forbids


class NewRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    params: WireSamplingParams
    # Tokens generated before this announcement: non-empty when a request is announced again to a
    # pipeline that lost its state (a stage was replaced). Penalties count them, and a seeded
    # request's noise continues at step len(output_token_ids), so sampling carries on exactly.
    output_token_ids: list[int] = []
    # The prompt's token ids, only for a request with a repetition penalty (which applies to the
    # prompt's tokens too, and the last stage sees only the chunks it computes: not a cached
    # prefix, nor KV imported from a prefill server). Empty otherwise: plans stay small.
    prompt_token_ids: list[int] = []
    # Bytes the request's compiled grammar costs, as the host's grammar worker measured them: the
    # last stage's cache of compiled grammars is bounded by their sum (0: no grammar, or unknown).
    grammar_cost: int = 0


class PromptTargets(msgspec.Struct, frozen=True, array_like=True):
    """Prompt logprobs the last stage computes for one chunk of a plan: the logits row of the
    chunk's token at `first + j` predicts `token_ids[j]` (the prompt token after it, which for
    the chunk's last row is the first token of the next chunk: the host knows it, so the last
    stage keeps no state between chunks)."""

    chunk: int  # index in StepPlan.chunks
    first: int  # the chunk's first row to score (rows before it are scored already, or position 0)
    token_ids: list[int]


class StepPlan(Msg, frozen=True):
    """One micro-batch, sent to every stage; stages execute plans strictly in order."""

    mb_id: int
    chunks: list[SeqChunk]
    new_requests: list[NewRequest] = []  # sampling state to create on the last stage
    # Requests that are over: every stage drops its block table, the last its sampling state.
    released: list[str] = []
    prompt_targets: list[PromptTargets] = []  # only for requests that asked for prompt logprobs
    # Requests preempted since the previous plan: stages drop their block tables now, so that
    # they hold only live ones (a preempted request comes back with a `new_table` chunk); the
    # last stage keeps their sampling state.
    preempted: list[str] = []
    # Chunks (indices in `chunks`) that end an embedding request's prompt: the last stage returns
    # their last row's final hidden state (`Pooled`) instead of sampling from it.
    pooled: list[int] = []
    # (request id, blocks): tables that drop back to their first `blocks` entries before this plan's
    # chunks, where the scheduler freed blocks it had taken only for rejected drafts.
    truncated: list[tuple[str, int]] = []


class Timing(msgspec.Struct, frozen=True, array_like=True):
    stage: int
    start: float  # time.time() on that stage's host, seconds
    end: float
    tokens: int = 0  # rows (tokens) this stage's layers computed for the micro-batch


class Sampled(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []
    # Non-empty: no token could be sampled, because the request's grammar stopped (a limit of the
    # grammar engine, or a dead end); the request ends with this error, `token_id` means nothing.
    error: str = ""
    # The tokens the request's grammar forces next (a JSON key, a closing brace), on a request's
    # last sample of a step: the host drafts them in its next step (jump-forward).
    forced: list[int] = []


class Pooled(msgspec.Struct, frozen=True, array_like=True):
    """An embedding request's vector: its prompt's last token's hidden state after the model's
    final norm, L2-normalized, in float32 (as floats: exact on the wire)."""

    request_id: str
    vector: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs of one request's prompt tokens at positions [start, start + len(logprobs)), from
    one chunk (start >= 1: nothing predicts the first token). At most MAX_TOP_LOGPROBS pairs per
    token, so a result grows with the chunk, never with the whole prompt."""

    request_id: str
    start: int
    logprobs: list[float]  # of the prompt's own token at each position
    top_logprobs: list[list[tuple[int, float]]]  # per position: (token id, logprob), best first


class StepResult(Msg, frozen=True):
    """From the last stage: what each sampling chunk produced (a chunk with drafts: one sample per
    token it made, in order), prompt logprobs where asked for, and every stage's compute time."""

    mb_id: int
    samples: list[Sampled]
    timings: list[Timing]
    prompt_logprobs: list[PromptLogprobs] = []
    pooled: list[Pooled] = []  # for the plan's `pooled` chunks


class StageKernels(msgspec.Struct, frozen=True):
    """The CPU kernels a stage runs: what its StageReady says, and /debug/pipeline shows."""

    isa: str = ""  # the kernel library's build ("native", "avx2", "scalar"; "" without one)
    amx: bool = False  # the AMX tiles are there and this stage may use them (engine/model/amx.py)
    # Each float linear shape's kernel per row count of `rows` (engine/model/kernel_choice.py).
    rows: list[int] = []
    linears: dict[str, list[str]] = {}


class StageReady(Msg, frozen=True):
    stage: int
    protocol: int
    num_kv_blocks: int
    pid: int
    profile: list[tuple[int, int, float]] = []  # start-up prefill timings: (prefix, tokens, seconds)
    kv_address: str = ""  # decode side of disaggregation: where prefill stages send this stage KV
    kernels: StageKernels = StageKernels()


class StageFailed(Msg, frozen=True):
    """A stage could not start or hit an error while running; it exits after sending this."""

    stage: int
    error: str
    pid: int  # which incarnation of the stage (a replaced one may still have messages in flight)


class Heartbeat(Msg, frozen=True):
    stage: int
    # About once a second: per MoE layer of the stage, tokens per expert since its process started
    # (engine/runtime/expert_load.py).
    expert_tokens: dict[int, list[int]] = {}
    pid: int = 0  # the stage's process: a replaced stage's counts start from zero


class Reset(Msg, frozen=True):
    """Host -> surviving stages when another stage is replaced: every plan received so far is
    void. The stage drops queued plans, block tables and per-request sampling state, then
    answers ResetDone."""

    epoch: int
    first_mb: int  # the first micro-batch of the new epoch: activations of older ones are leftovers


class ResetDone(Msg, frozen=True):
    stage: int
    epoch: int


class Shutdown(Msg, frozen=True):
    pass


class NodeHeartbeat(Msg, frozen=True):
    """A node's agent -> the host, every 0.2 s: the node (not just its stages) is reachable."""

    node: int


class NodeStageExited(Msg, frozen=True):
    """A node's agent -> the host: one of its stage processes ended without being asked to."""

    node: int
    stage: int
    pid: int
    exitcode: int | None


class HostHeartbeat(Msg, frozen=True):
    """The host -> each node's agent, every 0.2 s: a node whose host is silent stops its stages."""


class EdgeHeader(msgspec.Struct, frozen=True, array_like=True):
    """Sent stage i -> i+1 with each micro-batch's activations (the tensor itself travels by the
    tensor channel): the micro-batch id for an order check, upstream timings, and for the shm
    channel the ring slot that holds the tensor."""

    mb_id: int
    timings: list[Timing]
    slot: int = -1


class KvTarget(msgspec.Struct, frozen=True, array_like=True):
    """Disaggregation: where one prefill stage sends the KV of some of its layers (a decode
    stage's receiver), and which of the room's blocks there take it (in block-table order)."""

    dst_stage: int
    address: str
    layer_start: int
    layer_stop: int


class KvStatus(Msg, frozen=True):
    """A stage -> its host: where its part of a room's KV transfer stands. Prefill side: a
    scheduler.bootstrap.KvState value; decode side: "Received" (every block it expects is in)
    or "Failed"."""

    room: str
    stage: int
    state: str
    error: str = ""


class KvBootstrap(Msg, frozen=True):
    """Host -> prefill stage: the decode side's handshake for a room (where its layers go)."""

    room: str
    targets: list[KvTarget]


class KvExport(Msg, frozen=True):
    """Host -> prefill stage: the room's prompt is prefilled; send the KV of these blocks."""

    room: str
    blocks: list[int]


class KvExpect(Msg, frozen=True):
    """Host -> decode stage: a room's KV will arrive into these blocks."""

    room: str
    blocks: list[int]


class KvForget(Msg, frozen=True):
    """Host -> any stage: the room is over (failed or aborted): stop sending or expecting it."""

    room: str


class RoomOpen(Msg, frozen=True):
    """Decode host -> prefill host: prefill this prompt and send its KV to these decode stages."""

    room: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    decode_stages: list[KvTarget]  # one per decode stage: its receiver and its layers
    block_size: int
    num_layers: int
    reply_to: str  # the decode host's room inbox
    # The request's effective cache salt (its tenant's, as the decode host derived it): the
    # prefill host looks up and registers the prompt's blocks under it. Last, with a default, so
    # that a RoomOpen without it still decodes (then: no salt).
    cache_salt: str | None = None


class RoomFirstToken(Msg, frozen=True):
    """Prefill host -> decode host: the room's prompt is done; its first token."""

    room: str
    sample: Sampled


class RoomState(msgspec.Struct, frozen=True, array_like=True):
    """One room on the prefill side: its stage furthest behind, and that stage's state."""

    room: str
    stage: int
    state: str  # a scheduler.bootstrap.KvState value


class RoomProgress(Msg, frozen=True):
    """Prefill host -> decode host, every second and when a room's transfer is done: the prefill
    side is alive and where its rooms stand (the decode side fails a room whose prefill side
    goes silent, naming the stage and state it went silent in)."""

    rooms: list[RoomState]


class RoomFailed(Msg, frozen=True):
    """Either host -> the other: the room is over, and why (names the side, stage and state)."""

    room: str
    error: str


class NodeJoin(msgspec.Struct, frozen=True):
    """A node -> the host through the rendezvous store: who it is, what it loaded, where it listens."""

    node: int
    addr: str
    hostname: str
    proof: str  # HMAC with the cluster key of the session and all the rest of this join ("" without a key)
    fingerprint: dict[str, str]  # of its local checkpoint (engine/cluster/fingerprint.py)
    settings: dict[str, str]  # what every node must agree on (EngineConfig.cluster_settings)
    control: str  # the node agent's control socket (host -> node)
    edges: dict[int, str]  # stage -> the address its inbound edge binds


class Layout(msgspec.Struct, frozen=True):
    """The host -> every node: all ZeroMQ addresses of the pipeline."""

    host_inbox: str
    plans: list[str]
    edges: list[str]  # edge i: stage i -> stage i + 1
    controls: list[str]  # per node ("" for node 0)


class Verdict(msgspec.Struct, frozen=True):
    """The host's answer to a NodeJoin: an error, or the layout (with an HMAC, as the store is open)."""

    error: str = ""
    layout: Layout | None = None
    proof: str = ""


ControlMsg = (
    StepPlan
    | StepResult
    | StageReady
    | StageFailed
    | Heartbeat
    | Reset
    | ResetDone
    | Shutdown
    | NodeHeartbeat
    | NodeStageExited
    | HostHeartbeat
    | KvStatus
    | KvBootstrap
    | KvExport
    | KvExpect
    | KvForget
    | RoomOpen
    | RoomFirstToken
    | RoomProgress
    | RoomFailed
)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMsg)
_header_decoder = msgspec.msgpack.Decoder(EdgeHeader)


def encode(msg: Msg | EdgeHeader) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> ControlMsg:
    return _decoder.decode(data)


def encode_struct(obj: msgspec.Struct) -> str:
    """JSON text, for the rendezvous store's values."""
    return msgspec.json.encode(obj).decode()


def decode_struct(data: bytes | str, kind: type[S]) -> S:
    """Raises msgspec.DecodeError on anything that is not a `kind`."""
    return msgspec.json.decode(data, type=kind)


def decode_header(data: bytes | memoryview) -> EdgeHeader:
    return _header_decoder.decode(data)
