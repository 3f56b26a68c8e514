"""Chat records: the model's chat template applied, with the loss on the assistant turns only.

Which tokens are the assistant's is read off the template itself, so any template works without knowing
its markers: for each assistant turn `i`, `render(messages[:i], add_generation_prompt=True)` ends exactly
where the turn's content starts (that is what the model sees when it is asked to answer), and
`render(messages[:i + 1])` ends after the turn's end-of-turn token. Both must be prefixes of the whole
conversation's rendering - a template that rewrites earlier turns (one that drops past reasoning, say) is
refused rather than trained on a guess. The whole rendering is then tokenized once, as at inference, and a
token is trained on when it starts inside an assistant span.

Whitespace a template writes after the end-of-turn token (ChatML's newline) is left out of the span: the
model stops generating at the end-of-turn token and never produces it.
"""
from __future__ import annotations

from typing import Any

from memstrata.runtime.train.data.records import DatasetError, Messages, RecordError
from memstrata.runtime.train.data.tokenizer import Tokenizer

__all__ = ["chat_spans", "chat_example", "check_chat_template"]


class ChatTemplateError(RecordError):
    """The tokenizer's chat template cannot be used to find the assistant tokens of a record."""


def chat_spans(messages: Messages, tokenizer: Tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of its assistant turns."""
    turns = messages.as_dicts()
    full = tokenizer.render_chat(turns, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, turn in enumerate(messages.turns):
        if turn.extra and "tool_calls" in dict(turn.extra):
            _check_calls_rendered(turns, i, tokenizer)
        if not messages.trained(i):
            continue
        content = turn.content
        before = tokenizer.render_chat(turns[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(turns[: i + 1], add_generation_prompt=False)
        for what, part in ((f"messages[:{i}] with the generation prompt", before), (f"messages[:{i + 1}]", through)):
            if not full.startswith(part):
                raise ChatTemplateError(
                    f"the chat template of {tokenizer.name} is not prefix-stable: {what}, rendered, is not the start "
                    "of the whole conversation's rendering, so the assistant tokens cannot be told apart")
        start = len(before)
        if spans and start < spans[-1][1] or start > len(through):
            raise ChatTemplateError(f"the chat template of {tokenizer.name} renders messages[{i}] (assistant) out of "
                                    "order: the assistant tokens cannot be told apart")
        end = len(through.rstrip())
        # Trailing whitespace of the content itself is the model's to produce; only the template's goes.
        at = full.find(content, start, len(through)) if content else -1
        if at >= 0:
            end = max(end, at + len(content))
        spans.append((start, max(start, end)))
    return full, spans


def _check_calls_rendered(turns: list[dict[str, Any]], i: int, tokenizer: Tokenizer) -> None:
    """Refuse a turn whose tool calls the template leaves out: the model would learn to answer without them."""
    bare = [*turns[:i], {k: v for k, v in turns[i].items() if k != "tool_calls"}]
    if tokenizer.render_chat(bare, add_generation_prompt=False) == tokenizer.render_chat(
            turns[: i + 1], add_generation_prompt=False):
        raise ChatTemplateError(f"messages[{i}] has tool_calls, but the chat template of {tokenizer.name} does not "
                                "render them: they would be dropped from what is trained on (set dataset.chatTemplate "
                                "to a template that renders tool calls)")


def chat_example(messages: Messages, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trained on (assistant turns)."""
    text, spans = chat_spans(messages, tokenizer)
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask, k = [], 0
    for begin, finish in offsets:
        while k < len(spans) and begin >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and spans[k][0] <= begin < spans[k][1] and finish > begin)
    return ids, mask


def check_chat_template(tokenizer: Tokenizer, dataset: str, fmt: str = "messages") -> None:
    """Refuse a messages dataset for a tokenizer that has no chat template (before reading any record)."""
    if not tokenizer.has_chat_template:
        raise DatasetError(f"{dataset}: a {fmt} dataset needs a chat template, and {tokenizer.name} has none "
                           "(set dataset.chatTemplate, use a model directory whose tokenizer_config.json or "
                           "chat_template.jinja has one, or use prompt/completion records)")
