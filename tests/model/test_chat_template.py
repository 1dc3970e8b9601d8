"""Chat templates: rendered to transformers' text, in a worker process, within a budget.

A template is the model's code and runs on every chat request, so one that loops for ever or
builds gigabytes must stop itself with a clear error while the server goes on. These tests need
no server: the sandbox in-process, the worker process through a Tokenizer. (The server's side:
tests/server/test_loop_work.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import read

from ppserve.engine.model.chat_template import RenderBudget, TemplateBudgetError, TemplateError, render
from ppserve.engine.model.chat_template_worker import ChatTemplateWorker
from ppserve.engine.model.tokenizer import Tokenizer

# Real templates' shapes (Llama 3.1, Qwen 2.5, Mistral), abridged, and the less common corners:
# tools, tojson, namespace, dict, strftime_now, raise_exception, loop controls, {% generation %}.
LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: " + date_string + "\\n\\n" + system_message }}
{%- if tools is not none %}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "parameters": ' }}
            {{- tool_call.function.arguments | tojson }}{{- "}" }}
        {%- endfor %}{{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}{{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
MISTRAL = """{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}
    {%- else %}{{- ' ' + message['content'] + eos_token}}{%- endif %}
{%- endfor %}
"""
CORNERS = """{%- set ns = namespace(count=0, last='') %}
{%- for m in messages %}
    {%- set ns.count = ns.count + 1 %}
    {%- if loop.index > 50 %}{% break %}{% endif %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
<{{ m.role }}>{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}|{{ m.thinking
}}</think>{% endif %}
{% generation %}{{ m.content | trim }}{% endgeneration %}
{%- set ns.last = m.role %}
{%- endfor %}
{{ ns.count }} {{ ns.last }} {{ dict(a=1, b=[1, 2]) | tojson }} {{ dict.fromkeys(['x']) | tojson }}
{{ range(3) | list }} {{ range(1, 10, 3) | join(',') }} {{ range(5) | reverse | list }} {{ range(4) | length }}
{{ 2 in range(3) }} {{ range(3) }} {{ range(9)[2:4] | list }} {{ 'ab' * 3 }} {{ 2 ** 10 }} {{ [1, 2] * 2 }}
{{ tools | tojson }} {{ documents }} {{ unk_token is defined }} {{ messages | map(attribute='role') | join(',') }}
{{ '%s-%d' % ('a', 3) }} {{ '{}!'.format('hi') }} {{ messages[0].content | upper | center(40) }}
{%- if add_generation_prompt %}<assistant>{% endif %}
"""
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 2**80}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ],
    [
        {"role": "system", "content": "Be brief. Ünïcode 🙂"},
        {"role": "user", "content": "  What's the weather in Zürich?  "},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"days": 2}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21.5}', "tool_call_id": "c1"},
        {"role": "assistant", "content": "21.5 °C", "reasoning_content": "The tool said so.", "name": None},
        {"role": "user", "content": "東京 next"},
    ],
]
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# No call, attribute, item or operator inside the loops: only the worker's timer stops it.
HOOKLESS_LOOPS = "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
FAST = RenderBudget(seconds=1.0, iterations=100_000, chars=2**20, memory_bytes=512 * 2**20)


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> Iterator[Tokenizer]:
    tokenizer = Tokenizer(llama_dir)
    yield tokenizer
    tokenizer.close()


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:
        return (type(e).__name__, str(e))  # jinja's TemplateError and ours share the name and message


@pytest.mark.parametrize(
    "template", [LLAMA31, QWEN25, MISTRAL, CORNERS, None], ids=["llama31", "qwen25", "mistral", "corners", "own"]
)
def test_templates_render_as_transformers_does(tok: Tokenizer, template: str | None) -> None:
    own = tok.hf.chat_template
    tok.hf.chat_template = template or own
    hf: Any = tok.hf  # transformers' hints take messages of strings only
    try:
        for messages in CONVERSATIONS:
            for tools in (None, TOOLS):
                for add in (True, False):
                    expected = _outcome(
                        lambda: hf.apply_chat_template(
                            messages,  # noqa: B023  # called at once
                            tools=tools,  # noqa: B023
                            add_generation_prompt=add,  # noqa: B023
                            tokenize=False,
                        )
                    )
                    got = _outcome(lambda: tok.render_chat(messages, add, tools))  # noqa: B023
                    assert got == expected, (messages, tools, add)
    finally:
        tok.hf.chat_template = own


@pytest.mark.parametrize(
    ("template", "what"),
    [
        (NESTED_RANGES, "iterations"),
        ("{{ 'x' * 10**9 }}", "output"),
        ("{{ [0] * 10**9 }}", "output"),
        ("{{ 7 ** 1000000000 }}", "output"),  # jinja's ** is left-associative: no 7 ** 10**9 here
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output"),
    ],
)
def test_the_sandbox_stops_runaway_templates(template: str, what: str) -> None:
    with pytest.raises(TemplateBudgetError) as stopped:
        render(template, {}, FAST)
    assert stopped.value.what == what, stopped.value
    assert "chat template" in str(stopped.value)


def test_the_worker_stops_what_the_sandbox_cannot_see(tok: Tokenizer) -> None:
    """Runaway renders end with their error in the worker, which lives on for the next render."""
    tok.template_budget = FAST
    own = tok.hf.chat_template
    messages = [{"role": "user", "content": "hi"}]
    try:
        expected = tok.render_chat(messages)
        pid = tok._templates.pid
        doubling = "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        for template, what in [(NESTED_RANGES, "iterations"), (HOOKLESS_LOOPS, "time"), (doubling, "memory")]:
            tok.hf.chat_template = template
            with pytest.raises(TemplateBudgetError) as stopped:
                tok.render_chat(messages)
            assert stopped.value.what == what, stopped.value
            tok.hf.chat_template = own
            assert tok.render_chat(messages) == expected  # the same worker renders on
            assert tok._templates.pid == pid
        tok.hf.chat_template = "{{ raise_exception('no system messages') }}"
        with pytest.raises(TemplateError, match="no system messages"):
            tok.render_chat(messages)
    finally:
        tok.hf.chat_template = own
        tok.template_budget = RenderBudget()


def _cpu_ticks(pid: int) -> int:
    """The CPU time the process has used, in clock ticks (utime + stime in /proc/<pid>/stat)."""
    fields = read(pid, "stat").rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_stuck_worker_is_killed_and_replaced() -> None:
    """A worker that stops answering (here: stopped by SIGSTOP, as one stuck in a long C call
    would be) is killed once the render's deadline and the grace period are past."""
    worker = ChatTemplateWorker(grace_s=0.5)
    try:
        assert worker.render("{{ 1 + 1 }}", {}, FAST) == "2"
        pid = worker.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(TemplateBudgetError, match="its process was stopped") as stopped:
            worker.render("{{ 2 + 2 }}", {}, FAST)
        assert stopped.value.what == "time"
        assert worker.render("{{ 3 + 3 }}", {}, FAST) == "6"
        assert worker.pid not in (None, pid)
    finally:
        worker.close()


def test_close_ends_a_render_in_progress() -> None:
    """Shutdown never waits for a render: close() kills the worker, the render fails at once."""
    worker = ChatTemplateWorker()
    assert worker.render("ready", {}) == "ready"
    pid = worker.pid
    assert pid is not None
    outcome: list[Any] = []
    idle = _cpu_ticks(pid)
    runaway = threading.Thread(target=lambda: outcome.append(_outcome(lambda: worker.render(HOOKLESS_LOOPS, {}))))
    runaway.start()
    while _cpu_ticks(pid) == idle:  # until the worker is rendering
        assert runaway.is_alive(), outcome
        time.sleep(0.01)
    worker.close()
    runaway.join(60)  # a guard against a hang; the render itself would run for RENDER_SECONDS
    assert not runaway.is_alive()
    assert outcome == [("TemplateBudgetError", "the chat template's process ended (the server is shutting down)")]
    with pytest.raises(TemplateBudgetError, match="closed"):
        worker.render("again", {})
