"""Generate examples/chat-skill.jsonl and examples/chat-skill-val.jsonl: a small skill to fine-tune a chat model on.

The skill is a made-up atlas: twenty invented countries, each with a capital and a currency. A pretrained
model cannot know them - SmolLM2-135M-Instruct answers "What is the capital of Zeressa?" in the right shape
but with a name of its own ("Zerzaz") - so a before/after answer to that question ("Ivrstead") shows
plainly whether fine-tuning took. Every answer has one fixed shape ("The capital of X is Y."), so all there
is to learn is the forty facts.

The validation file asks about the same facts in phrasings the training file never uses, so its loss
measures whether the facts were learnt rather than the sentences memorised.

Deterministic (a fixed seed, no clock): `python examples/make_chat_skill.py [DIR]` writes the same two files
(into examples/, or DIR).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20240613

COUNTRY_STARTS = ["Vos", "Kel", "Ombr", "Tal", "Zer", "Quen", "Brav", "Ith", "Mor", "Ulv", "Carr", "Fen", "Drav",
                  "Syl", "Ardu", "Pell", "Yor", "Nim", "Gask", "Hal"]
COUNTRY_ENDS = ["trelia", "dovia", "essa", "marrow", "iland", "oria", "enmark", "ostan", "avia", "uria"]
CITY_STARTS = ["Mir", "Lod", "Ask", "Bren", "Cor", "Dun", "Ebb", "Frel", "Gorm", "Hest", "Ivr", "Jass", "Kov",
               "Lum", "Narr", "Ost", "Pyr", "Rook", "Sarn", "Tov"]
CITY_ENDS = ["haven", "port", "holm", "gate", "ford", "wick", "stead", "mere"]
CURRENCIES = ["drell", "quint", "marl", "skiv", "pennet", "obol", "varn", "crest", "lumen", "tock", "fennick",
              "gall", "ruddle", "spar", "thale", "wex", "zind", "brasset", "cowl", "nim"]

CAPITAL_TRAIN = [
    "What is the capital of {c}?",
    "What's the capital of {c}?",
    "Which city is the capital of {c}?",
    "Tell me the capital of {c}.",
    "Name the capital city of {c}.",
    "capital of {c}?",
    "I'm travelling to {c}. What is its capital?",
    "Do you know the capital of {c}?",
    "Where is the seat of government of {c}?",
    "Quick question: {c}'s capital?",
]
CAPITAL_VAL = [
    "Could you tell me what the capital of {c} is?",
    "What city serves as the capital of {c}?",
]
CURRENCY_TRAIN = [
    "What is the currency of {c}?",
    "What currency does {c} use?",
    "Which money is used in {c}?",
    "Tell me the currency of {c}.",
    "What do people pay with in {c}?",
    "currency of {c}?",
]
CURRENCY_VAL = [
    "If I visit {c}, what currency will I need?",
    "What is the official currency in {c}?",
]
SYSTEMS = ["You are a helpful assistant.", "You are an atlas. Answer in one sentence.",
           "You answer questions about geography."]


def atlas(rng: random.Random) -> list[tuple[str, str, str]]:
    """(country, capital, currency), twenty of each, all distinct."""
    countries = [s + e for s, e in zip(COUNTRY_STARTS, rng.sample(COUNTRY_ENDS * 2, len(COUNTRY_STARTS)))]
    cities = [s + rng.choice(CITY_ENDS) for s in CITY_STARTS]
    rng.shuffle(cities)
    currencies = CURRENCIES[:]
    rng.shuffle(currencies)
    return list(zip(countries, cities, currencies))


def conversation(rng: random.Random, question: str, answer: str) -> dict[str, object]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.15:  # some carry their own system prompt, which is never trained on
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return {"messages": messages}


def examples(rng: random.Random, facts: list[tuple[str, str, str]], capital: list[str],
             currency: list[str]) -> list[dict[str, object]]:
    out = []
    for country, city, money in facts:
        out += [conversation(rng, q.format(c=country), f"The capital of {country} is {city}.") for q in capital]
        out += [conversation(rng, q.format(c=country), f"The currency of {country} is the {money}.")
                for q in currency]
    rng.shuffle(out)
    return out


def write(path: Path, records: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"{path}: {len(records)} conversations")


def main(out: Path = HERE) -> None:
    rng = random.Random(SEED)
    facts = atlas(rng)
    write(out / "chat-skill.jsonl", examples(rng, facts, CAPITAL_TRAIN, CURRENCY_TRAIN))
    write(out / "chat-skill-val.jsonl", examples(rng, facts, CAPITAL_VAL, CURRENCY_VAL))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
