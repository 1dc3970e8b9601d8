"""The API's forms of a constraint on the output: vLLM's `structured_outputs` and OpenAI's
`response_format` (chat and completions alike), each read into (kind, spec) for
engine/model/grammar.py's `build_grammar`. Tools are the third form (server/tool_calls.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ppserve.server.errors import ApiError

ShortText = Annotated[str, msgspec.Meta(max_length=256)]


def _error(message: str, field: str) -> Exception:
    return ApiError(400, message, field)


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one constraint on the output (engine/model/grammar.py)."""

    json: dict[str, Any] | str | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (llama.cpp's GBNF) or Lark
    json_object: bool | None = None  # any JSON object

    def constraint(self) -> tuple[str, Any] | None:
        given = [(k, v) for k, v in msgspec.structs.asdict(self).items() if v is not None and v is not False]
        if len(given) > 1:
            raise _error(
                "structured_outputs takes one of json, regex, choice, grammar, json_object", "structured_outputs"
            )
        if not given:
            return None
        kind, spec = given[0]
        return kind, spec


class JsonSchemaFormat(msgspec.Struct):
    name: ShortText = "response"
    schema: dict[str, Any] | None = None
    # The schema is enforced either way; strict adds OpenAI's strict-mode rules (strict_schema).
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> tuple[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return "json_object", True
        if self.json_schema is None or self.json_schema.schema is None:
            raise _error("response_format of type json_schema needs json_schema.schema", "response_format")
        schema = self.json_schema.schema
        return "json", strict_schema(schema) if self.json_schema.strict else schema


def strict_schema(schema: Any, require_all: bool = True) -> Any:
    """`schema` under OpenAI's strict mode (which refuses a schema that breaks its rules; this
    applies them instead): every object has only the properties it lists (`additionalProperties:
    false` where the schema says nothing) and all of them (`required`: every property). A copy;
    depth is bounded by the schema's size limit and msgspec's decoding depth.

    `require_all` False: only close the objects that list their properties, which narrows what
    the schema accepts (anything it gives still validates against `schema`) without requiring
    more. A tool's arguments are decoded so: a small model, free to add keys, copies the schema's
    own keywords into its arguments until max_tokens."""
    if isinstance(schema, list):
        return [strict_schema(s, require_all) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: strict_schema(v, require_all) for name, v in value.items()}
        elif key in _DATA:  # values, not schemas
            out[key] = value
        else:
            out[key] = strict_schema(value, require_all)
    if (require_all and out.get("type") == "object") or "properties" in out:
        out.setdefault("additionalProperties", False)
        if require_all and isinstance(out.get("properties"), dict):
            out["required"] = list(out["properties"])
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required")
