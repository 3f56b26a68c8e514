"""What a FineTuneJob trains on: its data files as users have them (formats, presets, column names), several
sets mixed by weight, or a built-in synthetic set; and how examples become sequences."""
from __future__ import annotations

import glob
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from memstrata.api.base import ApiModel, cel
from memstrata.api.bounds import MAX_SEED

# The record shapes: three of memstrata's own (text, prompt/completion, messages) and two named presets that are
# read as messages (ShareGPT's `conversations` of `from`/`value`; Alpaca's `instruction`/`input`/`output`).
DatasetFormat = Literal["auto", "text", "prompt_completion", "messages", "sharegpt", "alpaca"]
MAX_MIX = 32


def glob_files(pattern: str) -> list[Path] | None:
    """The files a dataset path with glob characters names (recursive `**`, files only, sorted), as the runtime
    reads them and `memstrata run` checks them; None when `pattern` is a plain path, not a glob."""
    if not glob.has_magic(pattern):
        return None
    return sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())


class Columns(ApiModel):
    """The names a file uses for the fields a format reads, where they differ from the format's own (unset: the
    format's name: `prompt`, `completion`, `messages`, `role`, `content`; `conversations`, `from`, `value` for
    sharegpt; `instruction`, `input`, `output`, `system` for alpaca)."""

    prompt: str | None = Field(None, min_length=1, description="The prompt column (prompt_completion).")
    completion: str | None = Field(None, min_length=1, description="The completion column (prompt_completion).")
    messages: str | None = Field(None, min_length=1, description="The conversation column (messages, sharegpt).")
    role: str | None = Field(None, min_length=1, description="A turn's role key (messages, sharegpt).")
    content: str | None = Field(None, min_length=1, description="A turn's content key (messages, sharegpt).")
    instruction: str | None = Field(None, min_length=1, description="The instruction column (alpaca).")
    input: str | None = Field(None, min_length=1, description="The optional input column (alpaca).")
    output: str | None = Field(None, min_length=1, description="The response column (alpaca).")
    system: str | None = Field(None, min_length=1, description="The optional system-prompt column (alpaca).")


class SourceShape(ApiModel):
    """How the records of a data file are read."""

    format: DatasetFormat = Field("auto", description="The record format: text, prompt_completion (strings, or "
                                                      "TRL's conversational lists of messages), messages, sharegpt "
                                                      "or alpaca; auto: that of the first record.")
    text_field: str = Field("text", min_length=1, description="The column that holds the text (format text).")
    columns: Columns | None = Field(None, description="Column names where the file's differ from the format's.")


class MixSource(SourceShape):
    """One of several datasets trained on together."""

    path: str = Field(min_length=1, description="A data file, a glob of files, a directory of files, or a "
                                                "`save_to_disk` directory (as dataset.path).")
    weight: float = Field(gt=0, le=1e6, description="The share of the examples drawn from this set, relative to the "
                                                    "others' weights.")


class Dataset(SourceShape):
    """Exactly one of `path` (one dataset), `mix` (several, drawn by weight) or `synthetic`.

    A path is a file (JSON Lines, a JSON array, Parquet, CSV or Arrow; `.gz`, `.bz2`, `.xz` or `.zst` compressed),
    a glob of such files, a directory of them, or a directory written by `datasets`' `save_to_disk` (its train
    split). Records are `{"text": ...}` (trained on every token), `{"prompt": ..., "completion": ...}` (loss on the
    completion only), `{"messages": [{"role": ..., "content": ...}, ...]}` (the chat template applied, loss on the
    assistant turns), ShareGPT or Alpaca records (read as messages); `format: auto` takes the first record's.
    """

    synthetic: Literal["copy", "arithmetic"] | None = Field(
        None, description="A built-in synthetic set with learnable structure."
    )
    path: str | None = Field(None, min_length=1, description="A data file, a glob of files, a directory of files, "
                                                             "or a `save_to_disk` directory.")
    mix: list[MixSource] | None = Field(None, min_length=2, max_length=MAX_MIX,
                                        description="Several datasets, each example drawn from one with probability "
                                                    "proportional to its weight.")
    chat_template: str | None = Field(None, min_length=1, max_length=65536,
                                      description="A Jinja chat template used instead of the tokenizer's; the output "
                                                  "model's tokenizer carries it.")
    completion_only_loss: bool = Field(True, description="The loss on what the model answers only: completions "
                                                          "and assistant turns (TRL's default); false: on every "
                                                          "token, prompts, user and system turns and the chat "
                                                          "template's markers too (Axolotl's train_on_inputs).")
    packing: bool = Field(True, description="Pack examples end to end into full sequences, each attending only "
                                            "to itself (position ids restart per example); false: one example "
                                            "per sequence, padded.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="The seed of the data's order, mix draws and "
                                                                   "held-out split (TRL's data_seed); default: "
                                                                   "training.seed.")
    validation_split: float = Field(0.0, ge=0, lt=0.5, description="Fraction of the records held out for "
                                                                   "validation (chosen by record, reproducibly).")
    validation_path: str | None = Field(None, min_length=1, description="A separate dataset for validation "
                                                                        "(instead of a split), read as `path` is.")

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("[has(self.synthetic), has(self.path), has(self.mix)].filter(x, x).size() == 1",
                    "set exactly one of dataset.synthetic, dataset.path or dataset.mix"),
                cel("!has(self.validationPath) || !has(self.validationSplit) || self.validationSplit == 0.0",
                    "set at most one of dataset.validationSplit or dataset.validationPath"),
                cel("!has(self.mix) || !has(self.validationPath)",
                    "dataset.mix takes its validation records from each set by validationSplit, not validationPath"),
                cel("!has(self.mix) || ((!has(self.format) || self.format == 'auto') && (!has(self.textField) || "
                    "self.textField == 'text') && !has(self.columns))",
                    "dataset.format, textField and columns: with dataset.mix, give each set's own in dataset.mix[i]"),
            ]
        }
    )

    @model_validator(mode="after")
    def _one_source(self) -> "Dataset":
        if sum(x is not None for x in (self.synthetic, self.path, self.mix)) != 1:
            raise ValueError("set exactly one of dataset.synthetic, dataset.path or dataset.mix")
        if self.validation_path is not None and self.validation_split:
            raise ValueError("set at most one of dataset.validationSplit or dataset.validationPath")
        if self.mix is not None and self.validation_path is not None:
            raise ValueError("dataset.mix takes its validation records from each set by validationSplit, "
                             "not validationPath")
        shaped = [f"dataset.{name}" for name, set_ in (("format", self.format != "auto"),
                                                        ("textField", self.text_field != "text"),
                                                        ("columns", self.columns is not None)) if set_]
        if self.mix is not None and shaped:
            raise ValueError(f"{', '.join(shaped)}: with dataset.mix, give each set's own in dataset.mix[i]")
        return self

    def sources(self) -> list[MixSource]:
        """The file datasets trained on, each with its weight (one, of weight 1, for `path`)."""
        if self.mix is not None:
            return list(self.mix)
        if self.path is None:
            return []
        return [MixSource(path=self.path, weight=1.0, format=self.format, text_field=self.text_field,
                          columns=self.columns)]
