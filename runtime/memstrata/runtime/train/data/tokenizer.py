"""Tokenizers: the model's own (a `transformers` tokenizer from its directory) or a byte tokenizer for presets.

The data pipeline sees only the small `Tokenizer` protocol below, so synthetic sets and preset models (random
weights, no tokenizer files) use `ByteTokenizer`, and a model directory uses `HFTokenizer`, which wraps
whatever `AutoTokenizer` loads from it - offline, nothing is ever downloaded.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from memstrata.runtime.train.data.records import DatasetError, RecordError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "TokenizerError", "load_tokenizer", "use_chat_template", "add_tokens",
           "TOKENIZER_FILES"]

# Any one of these makes a directory loadable by AutoTokenizer (fast, SentencePiece, BPE or WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class TokenizerError(DatasetError):
    """A model directory's tokenizer cannot be used. A DatasetError, so every caller that reports bad
    data before training reports this too."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str  # for error messages: which tokenizer
    eos_id: int
    pad_id: int  # only ever fills padding, whose labels are -100

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Token ids of `text`; `first`: it starts an example, so add the tokenizer's own leading specials (BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def has_chat_template(self) -> bool: ...

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The chat template applied to `messages`, as text."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of an already rendered text (no specials added) and each token's character span."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; then PAD, BOS, EOS. No chat template."""

    PAD, BOS, EOS = 256, 257, 258
    VOCAB = 259
    name = "the byte tokenizer"
    eos_id = EOS
    pad_id = PAD

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if first else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        return False

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        raise TokenizerError(f"{self.name} has no chat template")

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        at = 0
        for char in text:
            raw = char.encode("utf-8")
            ids += raw
            offsets += [(at, at + 1)] * len(raw)  # every byte of a character belongs to that character
            at += 1
        return ids, offsets

    def __len__(self) -> int:
        return self.VOCAB


class HFTokenizer:
    """A `transformers` tokenizer behind the `Tokenizer` protocol; `hf` is the tokenizer itself (for
    generation), and `save_pretrained` writes it next to a fine-tuned model."""

    def __init__(self, hf: "PreTrainedTokenizerBase", name: str) -> None:
        self.hf, self.name = hf, name
        if hf.eos_token_id is None:
            raise TokenizerError(f"{name}: the tokenizer defines no end-of-sequence token (eos_token), which "
                                 "ends every training example")
        self.eos_id: int = hf.eos_token_id
        # Many tokenizers (Llama's) have no pad token; padding is never trained on, so EOS serves.
        self.pad_id: int = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        return list(self.hf(text, add_special_tokens=first)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        text = self.hf.decode(list(ids))
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template's own raise_exception(), or jinja's errors
            raise RecordError(f"the chat template of {self.name} refused the conversation: {exc}") from None
        if not isinstance(text, str):
            raise RecordError(f"the chat template of {self.name} rendered {type(text).__name__}, not text")
        return text

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # The template writes its own specials (BOS, turn markers): adding more would double them, which is
        # also what apply_chat_template(tokenize=True) does.
        out = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), [(int(a), int(b)) for a, b in out["offset_mapping"]]

    def save_pretrained(self, path: str | Path) -> Any:
        return self.hf.save_pretrained(str(path))

    def __len__(self) -> int:
        return len(self.hf)


def use_chat_template(tokenizer: Tokenizer, template: str) -> None:
    """Render conversations (and save the tokenizer) with `template` instead of the tokenizer's own; fails
    naming dataset.chatTemplate when it cannot be used or does not render a plain exchange."""
    if not isinstance(tokenizer, HFTokenizer):
        raise TokenizerError(f"dataset.chatTemplate: {tokenizer.name} renders no templates; a chat template needs a "
                             "model directory's tokenizer (model.path)")
    tokenizer.hf.chat_template = template
    probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    try:
        text = tokenizer.render_chat(probe, add_generation_prompt=False)
    except RecordError as exc:
        raise TokenizerError(f"dataset.chatTemplate: does not render a user/assistant exchange: {exc}") from None
    if "ping" not in text or "pong" not in text:
        raise TokenizerError("dataset.chatTemplate: a user/assistant exchange renders without its messages' "
                             f"content ({text[:80]!r}): the template must write each message's content")


def add_tokens(tokenizer: Tokenizer, tokens: list[str], rows: int) -> None:
    """Add `tokens` to the tokenizer as special tokens (never split, kept when decoding), ids `rows`, `rows` + 1,
    ...: the embedding rows the model grows by (`rows`: its vocabulary before). Fails naming model.addedTokens
    for a tokenizer that takes none, a token it has already, or a tokenizer whose size is not the vocabulary
    (a padded one: the new ids would land on existing padding rows, not on the new ones)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise TokenizerError(f"model.addedTokens: {tokenizer.name} takes no tokens; use a model directory's")
    known = tokenizer.hf.get_vocab()
    present = [t for t in tokens if t in known]
    if present:
        raise TokenizerError(f"model.addedTokens: {', '.join(present)} already in {tokenizer.name} (id "
                             f"{known[present[0]]}); remove them from the list")
    if len(tokenizer.hf) != rows:
        raise TokenizerError(f"model.addedTokens: {tokenizer.name} has {len(tokenizer.hf)} tokens and the model's "
                             f"vocabulary {rows} rows: new tokens would take ids from {len(tokenizer.hf)} on, rows "
                             "that exist, not the ones added; memstrata adds tokens only where the two are equal")
    tokenizer.hf.add_tokens(tokens, special_tokens=True)


def load_tokenizer(model_dir: Path, vocab: int) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory, loaded offline; fails (naming the directory) when it
    has no tokenizer files, they do not load, or the tokenizer has more tokens than the model's `vocab`."""
    found = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not found:
        raise TokenizerError(f"{model_dir}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
                             "a model directory must carry the tokenizer it was trained with")
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a broken directory
        raise TokenizerError(f"{model_dir}: the tokenizer does not load: {type(exc).__name__}: {exc}") from None
    if not getattr(hf, "is_fast", False):
        # Loss masks need each token's character offsets, which only a tokenizers-backed tokenizer gives.
        raise TokenizerError(f"{model_dir}: the tokenizer is not backed by the `tokenizers` library (no "
                             "tokenizer.json, or a slow-only class); memstrata needs tokenizer.json")
    if len(hf) > vocab:
        raise TokenizerError(f"{model_dir}: the tokenizer has {len(hf)} tokens but the model's vocabulary has "
                             f"{vocab}: a tokenizer that does not match the vocab")
    return HFTokenizer(hf, name=f"the tokenizer of {model_dir}")
