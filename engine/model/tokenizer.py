"""Tokenizer glue: `tokenizer.json` (+ `tokenizer_config.json`, chat template) via transformers,
and incremental detokenization for streaming. Chat templates render in a worker process, within
a budget (chat_template.py, chat_template_worker.py), to the text transformers renders."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from ppserve.engine.model.chat_template import DEFAULT_BUDGET, RenderBudget, chat_variables
from ppserve.engine.model.chat_template_worker import ChatTemplateWorker
from ppserve.engine.model.model_config import ConfigError

# Tokens of context kept before the unread ones: enough for a tokenizer to decode a word's
# leading space (SentencePiece) or finish a multi-token character (byte-level BPE) correctly.
_CONTEXT_TOKENS = 6
INLINE_CHARS = 4096  # texts up to this long tokenize in well under a millisecond: no thread hop


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"no tokenizer.json in {model_dir}")
        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.template_budget: RenderBudget = DEFAULT_BUDGET
        self._templates = ChatTemplateWorker()  # its process starts with the first render

    @property
    def eos_token_id(self) -> int | None:
        eos: int | None = self.hf.eos_token_id
        return eos

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def check_fits(self, chars: int, max_tokens: int, what: str = "prompt") -> None:
        """ValueError if a text of `chars` characters needs more than `max_tokens` tokens, known
        from its length alone (see `max_token_chars`), so a huge text is never tokenized."""
        limit = max_tokens * self.max_token_chars
        if chars > limit:
            raise ValueError(
                f"{what} is {chars} characters long, more than a context of {max_tokens} tokens can hold "
                f"(at most {limit} characters: no token covers more than {self.max_token_chars})"
            )

    async def encode_async(
        self, text: str, max_tokens: int, add_special_tokens: bool = True, what: str = "prompt"
    ) -> list[int]:
        """`encode` without stalling the event loop: a text that cannot fit `max_tokens` is refused
        (ValueError) before tokenizing, and a long one is tokenized in a worker thread."""
        self.check_fits(len(text), max_tokens, what)
        if len(text) <= INLINE_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Render `messages` with the model's chat template and tokenize the result."""
        # The template writes its own special tokens (BOS included), so don't add them twice.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[Any, Any]] | None = None,
    ) -> str:
        """The chat template's text for `messages` (what `apply_chat_template` tokenizes), so a
        caller can look at its length before paying for tokenization. `tools`: OpenAI's, for a
        template that renders them. The text is transformers' `apply_chat_template(...,
        tokenize=False)`, rendered in the worker process: chat_template.TemplateError if the
        template fails, TemplateBudgetError if it runs past `template_budget`. Blocks until the
        worker answers; `render_chat_async` waits without blocking."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use completions with a plain prompt")
        template = self.hf.get_chat_template(None, tools)  # the "tool_use" one of several, with tools
        variables = chat_variables(messages, tools, add_generation_prompt, self.hf.special_tokens_map)
        return self._templates.render(template, variables, self.template_budget)

    async def render_chat_async(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[Any, Any]] | None = None,
    ) -> str:
        """`render_chat` from the event loop: it waits in the renders' own thread."""
        render = functools.partial(self.render_chat, messages, add_generation_prompt, tools)
        return await asyncio.get_running_loop().run_in_executor(self._templates.executor, render)

    def close(self) -> None:
        """Stop the chat template worker (a render in progress fails at once); later renders fail."""
        self._templates.close()

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: the longest token string of the
        vocabulary, added tokens included. A byte-level token's string has one character per byte
        and a SentencePiece token's one per character, so neither covers more text than its own
        length: a text of c characters needs at least c / max_token_chars tokens, which bounds
        its token count without tokenizing it. (Normalizers that shrink text, such as NFKC
        composition, would break this; the supported model families have none.)"""
        vocab: dict[str, int] = self.hf.get_vocab()
        added = [str(t) for t in self.hf.added_tokens_decoder.values()]
        return max(1, *(len(t) for t in vocab), *(len(t) for t in added))

    def detokenizer(self, prompt_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never emitting half a UTF-8 character.

    Each push decodes a short window (a few tokens of context + the unread ones) and emits the
    text past the context, unless it ends in U+FFFD: then the last token is part of a character
    that later tokens finish, and it waits.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] is the already emitted context
        self.read = len(self.ids)
        self.text = ""  # everything emitted so far

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        context = self.tokenizer.decode(self.ids[self.prefix : self.read])
        full = self.tokenizer.decode(self.ids[self.prefix :])
        if len(full) <= len(context) or full.endswith("\ufffd"):
            return ""
        delta = full[len(context) :]
        # Slide the window: keep the last few tokens as context for the next push.
        self.prefix = max(self.read, len(self.ids) - _CONTEXT_TOKENS)
        self.read = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: emit whatever is left, even an unfinished character (as U+FFFD)."""
        context = self.tokenizer.decode(self.ids[self.prefix : self.read])
        full = self.tokenizer.decode(self.ids[self.prefix :])
        delta = full[len(context) :]
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
