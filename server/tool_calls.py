"""Tool calls on /v1/chat/completions: OpenAI's `tools` and `tool_choice`, in and out.

In: the tools reach the model through its chat template where the template knows tools (it then
gets `tools=` as Hugging Face templates take it); otherwise through ppserve's default prompt, a
system message that lists the functions and asks for a JSON array of calls:

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Out: with `tool_choice` "required" or a named function, decoding is constrained to that array
(each item one of the functions, its arguments their JSON schema), so even a small model's calls
parse. With "auto" the model chooses: a reply that is such an array (bare, or inside Hermes/Qwen
`<tool_call>` tags) becomes `tool_calls`, anything else is content. "none" leaves the tools out.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

import msgspec

from ppserve.server.errors import ApiError
from ppserve.server.structured import strict_schema

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # calls one answer may make at once (the array of calls closes there)
FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule
ShortText = Annotated[str, msgspec.Meta(max_length=256)]


class FunctionDef(msgspec.Struct):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # OpenAI's strict mode on the arguments (structured.strict_schema)


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName_(msgspec.Struct):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName_


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(msgspec.Struct):
    name: ShortText
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: ShortText
    function: CalledFunction
    type: Literal["function"] = "function"

    def template_form(self) -> dict[str, Any]:
        try:
            args = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            raise ApiError(400, "a tool call's arguments must be JSON text", "messages") from None
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    if tools is None:
        if choice is not None and choice != "none":
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return
    if not tools or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must list 1 to {MAX_TOOLS} functions", "tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools has a function name more than once", "tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")


def calls_schema(tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema decoding is constrained to: a non-empty array of calls, for "required" and a
    named function (then exactly one call of it); None for "auto" and "none". Parallel calls are at
    most MAX_PARALLEL_CALLS, so that the array closes (a model may repeat a call until max_tokens);
    a tool with `strict` gets arguments under OpenAI's strict mode, any other tool its arguments'
    objects closed to the properties they list (structured.strict_schema)."""
    if choice in ("auto", "none"):
        return None
    chosen = [t for t in tools if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": _arguments(t.function),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    schema["maxItems"] = 1 if isinstance(choice, NamedToolChoice) or not parallel else MAX_PARALLEL_CALLS
    return schema


def _arguments(function: FunctionDef) -> dict[str, Any]:
    schema = function.parameters or {"type": "object", "properties": {}}
    return strict_schema(schema, require_all=bool(function.strict))


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (Hugging Face templates that do name it)."""
    return bool(chat_template) and "tools" in str(chat_template)


def default_prompt(tools: list[Tool]) -> str:
    functions = [msgspec.to_builtins(t.function) for t in tools]
    return (
        "You can call these functions:\n"
        + json.dumps(functions, ensure_ascii=False)
        + '\nTo call functions, reply with only a JSON array of calls, each {"name": <function name>, '
        '"arguments": <its arguments as a JSON object>}. Otherwise, answer normally.'
    )


def chat_prompt(
    messages: list[dict[str, Any]], tools: list[Tool] | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the `tools` argument for the chat template. A template without tools
    gets earlier calls as plain text, and the functions in the system message (default_prompt)."""
    if template_takes_tools(chat_template):
        return messages, [msgspec.to_builtins(t) for t in tools] if tools else None
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps(calls, ensure_ascii=False)}
        out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        prompt = default_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str, tools: list[Tool]) -> list[dict[str, Any]] | None:
    """The calls in a reply, as OpenAI's `tool_calls`; None if the reply is not calls."""
    stripped = text.strip()
    tagged = _TAGGED.findall(stripped)
    try:
        value: Any = [json.loads(t) for t in tagged] if tagged else json.loads(stripped)
    except json.JSONDecodeError:
        return None
    calls = value if isinstance(value, list) else [value]
    names = {t.function.name for t in tools}
    out = []
    for c in calls:
        if not isinstance(c, dict) or c.get("name") not in names:
            return None
        args = c.get("arguments", c.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        out.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    return out or None


def may_be_calls(text: str) -> bool:
    """Whether a reply that begins with `text` may still turn out to be calls (streaming "auto"
    holds such text back until it knows)."""
    head = text.lstrip()
    return not head or head[0] in "[{" or "<tool_call>".startswith(head[:11]) or head.startswith("<tool_call>")
