"""A record as token ids plus a loss mask: which tokens the model is trained to produce.

- text: every token, then EOS.
- prompt/completion: the prompt (with the tokenizer's leading specials, as a text starts), then the
  completion, then EOS; only the completion and the EOS are trained on. The two strings are joined as
  given - a separating space or newline belongs in the data, where the user can see it.
- messages (and ShareGPT, Alpaca and TRL's conversational prompt/completion, read as messages): the chat
  template (see chat.py); only the assistant turns, each through its end-of-turn token.
  No EOS is added: the template's own turn markers delimit a conversation, and an EOS after the last
  end-of-turn is a token the model never sees when it is asked a question.

With `dataset.completionOnlyLoss: false` every token is trained on (the prompt, every turn, the markers).
"""
from __future__ import annotations

from memstrata.runtime.train.data.chat import chat_example
from memstrata.runtime.train.data.records import Messages, PromptCompletion, Record, RecordError, TextRecord
from memstrata.runtime.train.data.tokenizer import Tokenizer

__all__ = ["Example", "encode_record"]

Example = tuple[list[int], list[bool]]  # token ids, and per token whether it carries a label


def encode_record(record: Record, tokenizer: Tokenizer, completion_only: bool = True) -> Example:
    """Token ids and, per token, whether it is trained on; `completion_only` false: every token is."""
    ids, mask = _encode(record, tokenizer)
    return (ids, mask) if completion_only else (ids, [True] * len(ids))


def _encode(record: Record, tokenizer: Tokenizer) -> Example:
    if isinstance(record, TextRecord):
        ids = [*tokenizer.encode(record.text, first=True), tokenizer.eos_id]
        return ids, [True] * len(ids)
    if isinstance(record, PromptCompletion):
        prompt = tokenizer.encode(record.prompt, first=True)
        completion = [*tokenizer.encode(record.completion), tokenizer.eos_id]
        return prompt + completion, [False] * len(prompt) + [True] * len(completion)
    assert isinstance(record, Messages)
    if not tokenizer.has_chat_template:  # TRL's conversational prompt/completion, found record by record
        raise RecordError(f"a conversation needs a chat template, and {tokenizer.name} has none (set "
                          "dataset.chatTemplate, or use a model directory whose tokenizer has one)")
    return chat_example(record, tokenizer)
