"""Records: what one row of a dataset says, checked and put in one of three shapes.

Five formats, one per source: `text`, `prompt_completion` (strings, or TRL's conversational lists of
messages), `messages`, and two presets read as messages: `sharegpt` (`conversations` of `from`/`value`, roles
`human`/`gpt`/...) and `alpaca` (`instruction`, optional `input` and `system`, `output`). A source's
`columns` rename the fields a format reads. With `format: auto` the first record decides, and every later
record must be of that format too: a file that mixes them is almost always a mistake (two sets
concatenated), and silently training on both would hide it. Other fields are ignored, so records may carry
ids or metadata. A bad record fails with a `RecordError`, to which the reader adds `file:line`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from memstrata.api.dataset import SourceShape

__all__ = ["DatasetError", "RecordError", "Format", "TextRecord", "PromptCompletion", "Messages", "Turn", "Record",
           "ROLES", "Shape", "record_format", "parse_record"]

Format = Literal["text", "prompt_completion", "messages", "sharegpt", "alpaca"]
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's role names as the sets on the Hub write them (FastChat, LLaMA-Factory, Axolotl).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool", "function_response": "tool"}
# What an OpenAI-style turn may carry besides role and content, passed to the chat template as given.
TURN_EXTRAS = ("tool_calls", "tool_call_id", "name")
DEFAULT_COLUMNS = {"prompt": "prompt", "completion": "completion", "messages": "messages", "role": "role",
                   "content": "content", "instruction": "instruction", "input": "input", "output": "output",
                   "system": "system"}
SHAREGPT_COLUMNS = {**DEFAULT_COLUMNS, "messages": "conversations", "role": "from", "content": "value"}


class DatasetError(ValueError):
    """A dataset cannot be used; the message names the file (and line) and what is wrong."""


class RecordError(ValueError):
    """One record is bad; the reader adds the file and line."""


@dataclass(frozen=True)
class TextRecord:
    text: str


@dataclass(frozen=True)
class PromptCompletion:
    prompt: str
    completion: str


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    extra: tuple[tuple[str, Any], ...] = ()  # tool_calls, tool_call_id, name: for the chat template

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, **dict(self.extra)}


@dataclass(frozen=True)
class Messages:
    turns: tuple[Turn, ...]
    # Assistant turns before this index are context, not trained on (TRL's conversational prompt).
    first_trained: int = 0

    def as_dicts(self) -> list[dict[str, Any]]:
        """The shape `apply_chat_template` takes."""
        return [turn.as_dict() for turn in self.turns]

    def trained(self, index: int) -> bool:
        return index >= self.first_trained and self.turns[index].role == "assistant"


Record = Union[TextRecord, PromptCompletion, Messages]


@dataclass(frozen=True)
class Shape:
    """A source's column names, resolved: the format's own unless `columns` renames them."""

    text: str
    names: Mapping[str, str]  # messages-format names (messages, role, content, prompt, ..., system)
    sharegpt: Mapping[str, str]

    @classmethod
    def of(cls, spec: SourceShape) -> Shape:
        renamed = {k: v for k, v in (spec.columns.model_dump() if spec.columns else {}).items() if v is not None}
        return cls(spec.text_field, {**DEFAULT_COLUMNS, **renamed}, {**SHAREGPT_COLUMNS, **renamed})

    def columns(self, fmt: Format) -> Mapping[str, str]:
        return self.sharegpt if fmt == "sharegpt" else self.names

    def required(self, fmt: Format) -> str:
        """The column every record of `fmt` has."""
        c = self.columns(fmt)
        return {"text": self.text, "prompt_completion": c["prompt"], "messages": c["messages"],
                "sharegpt": c["messages"], "alpaca": c["instruction"]}[fmt]


def record_format(obj: Mapping[str, object], shape: Shape) -> Format | None:
    """The format a record's fields say it is (None: no known field)."""
    has = {k for k, v in obj.items() if v is not None}  # a table's rows carry every column, null where absent
    if shape.names["messages"] in has:
        return "messages"
    if shape.sharegpt["messages"] in has:
        return "sharegpt"
    if shape.names["instruction"] in has and shape.names["output"] in has:
        return "alpaca"
    if shape.names["prompt"] in has or shape.names["completion"] in has:
        return "prompt_completion"
    if shape.text in has:
        return "text"
    return None


def _string(obj: Mapping[str, object], key: str, where: str = "", optional: bool = False) -> str:
    value = obj.get(key)
    if value is None and optional:
        return ""
    if key not in obj:
        raise RecordError(f"no {key!r} field{where}")
    if not isinstance(value, str):
        raise RecordError(f"field {key!r}{where} must be a string, got {type(value).__name__}")
    return value


def _turn(item: object, at: str, columns: Mapping[str, str], roles: Mapping[str, str] | None) -> Turn:
    if not isinstance(item, dict):
        raise RecordError(f"{at} must be an object, got {type(item).__name__}")
    where = f" in {at}"
    role = _string(item, columns["role"], where)
    role = roles.get(role, role) if roles is not None else role
    if role not in ROLES:
        known = ", ".join(roles or ROLES)
        raise RecordError(f"{at}: unknown role {item[columns['role']]!r} (expected one of {known})")
    extra = tuple((k, item[k]) for k in TURN_EXTRAS if item.get(k) is not None)
    if extra and dict(extra).get("tool_calls") is not None and not isinstance(dict(extra)["tool_calls"], list):
        raise RecordError(f"field 'tool_calls'{where} must be a list, got {type(dict(extra)['tool_calls']).__name__}")
    # An assistant turn that only calls tools has no content (null in OpenAI's format).
    content = _string(item, columns["content"], where, optional=role == "assistant" and "tool_calls" in dict(extra))
    return Turn(role, content, extra)


def _turns(value: object, field: str, columns: Mapping[str, str],
           roles: Mapping[str, str] | None = None) -> list[Turn]:
    if not isinstance(value, list):
        raise RecordError(f"field {field!r} must be a list, got {type(value).__name__}")
    if not value:
        raise RecordError(f"field {field!r} is empty")
    return [_turn(item, f"{field}[{i}]", columns, roles) for i, item in enumerate(value)]


def _conversation(turns: list[Turn], field: str, first_trained: int = 0) -> Messages:
    if turns[0].role == "assistant":
        # The assistant tokens are told apart by rendering what precedes each turn, and a chat template
        # cannot render an empty conversation.
        raise RecordError(f"{field}[0] is an assistant turn: a conversation starts with a system or user turn")
    if not any(t.role == "assistant" for t in turns[first_trained:]):
        what = "the completion" if first_trained else f"field {field!r}"
        raise RecordError(f"no assistant turn in {what}: only assistant turns are trained on, so it needs one")
    return Messages(tuple(turns), first_trained)


def _prompt_completion(obj: Mapping[str, object], c: Mapping[str, str]) -> Record:
    prompt, completion = obj.get(c["prompt"]), obj.get(c["completion"])
    if isinstance(prompt, list) or isinstance(completion, list):  # TRL's conversational prompt/completion
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise RecordError(f"fields {c['prompt']!r} and {c['completion']!r} must both be strings or both lists "
                              "of messages")
        head = _turns(prompt, c["prompt"], c)
        return _conversation(head + _turns(completion, c["completion"], c), c["prompt"], first_trained=len(head))
    return PromptCompletion(_string(obj, c["prompt"]), _string(obj, c["completion"]))


def _alpaca(obj: Mapping[str, object], c: Mapping[str, str]) -> Messages:
    instruction, extra = _string(obj, c["instruction"]), _string(obj, c["input"], optional=True)
    system = _string(obj, c["system"], optional=True)
    turns = [Turn("system", system)] if system else []
    turns += [Turn("user", f"{instruction}\n\n{extra}" if extra else instruction), Turn("assistant",
                                                                                        _string(obj, c["output"]))]
    return Messages(tuple(turns))


def parse_record(obj: object, fmt: Format, shape: Shape, why: str) -> Record:
    """One row as a record of format `fmt`; `why` says where that format came from, for the error."""
    if not isinstance(obj, dict):
        raise RecordError(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get(shape.required(fmt)) is None:
        own = record_format(obj, shape)
        if own is not None and own != fmt:
            raise RecordError(f"a {own} record, but the dataset's format is {fmt} ({why})")
    c = shape.columns(fmt)
    if fmt == "text":
        return TextRecord(_string(obj, shape.text))
    if fmt == "prompt_completion":
        return _prompt_completion(obj, c)
    if fmt == "alpaca":
        return _alpaca(obj, c)
    if c["messages"] not in obj:
        raise RecordError(f"no {c['messages']!r} field")
    roles = SHAREGPT_ROLES if fmt == "sharegpt" else None
    return _conversation(_turns(obj[c["messages"]], c["messages"], c, roles), c["messages"])
