"""Generate litft's shipped demo assets: a synthetic corpus, an instruction data set and a tiny pretrained model.

Everything here is made from scratch by this script (hand-written word lists, fact tables and templates; no
third-party text), with fixed seeds, so that the demo recipe runs offline on a CPU in minutes and its validation
loss visibly falls. Writes into litft/assets/demo/:

    pretrain.txt          synthetic English-like text (the pretraining corpus)
    instructions.jsonl    Alpaca-format records {"instruction", "input", "output"} from 15 task families
    model/                a LitGPT checkpoint: tokenizer.json, tokenizer_config.json, model_config.yaml, lit_model.pth
    README.md             what each file is, how it was made, sizes and the pretraining loss

Run from the repository root (about 6 minutes on 2 idle CPU cores, nearly all of it pretraining):

    python scripts/make_demo_assets.py

The design: pretraining teaches the model the vocabulary and the facts (arithmetic, antonyms, colours, sounds, ...),
stated as prose and drilled as questions and answers in a layout of its own; the instruction data asks for the same
facts and transformations in the Alpaca format. A short fine-tune then only has to learn the Alpaca format, and the
loss on the responses drops quickly (about 150 steps of batch 16 at lr 1e-3 suffice). The drills come from the same
generators as the instruction data, with other seeds and without any question that instructions.jsonl holds: no
record appears verbatim in the corpus, but the facts it asks about do, so the demo shows a fine-tune learning a
format rather than new facts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from litgpt.config import Config
from litgpt.model import GPT
from litgpt.prompts import Alpaca
from litgpt.utils import save_config

SEED = 1234
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "litft" / "assets" / "demo"

PRETRAIN_TARGET_BYTES = 1_600_000
VOCAB_SIZE = 2000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, the same order as Llama's (plus a pad token)
BOS, EOS = "<s>", "</s>"

# Pretraining: packed windows of SEQ_LEN tokens drawn at random from the token stream.
SEQ_LEN = 256
BATCH_SIZE = 8
PRETRAIN_STEPS = 1800
PEAK_LR = 3e-3
MIN_LR = 3e-4
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
VAL_FRACTION = 0.02  # of the documents, held out to report a pretraining validation loss

# The corpus states facts as prose, and also drills them as questions and answers (in a layout other than Alpaca's):
# with the question -> answer habit learnt in pretraining, a short fine-tune only has to learn the Alpaca format.
# Without the drills the model knows "7 plus 5 is 12" but 150 fine-tuning steps do not teach it to answer
# "What is 7 plus 5?": the response loss stayed near 2 (measured while building these assets), against 1 with them.
QA_SHARE = 0.5
QUESTION_POOL_DRAWS = 8

# ----------------------------------------------------------------------------------------------------------------------
# Hand-written tables (written for this project)
# ----------------------------------------------------------------------------------------------------------------------

NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Ella", "Jack", "Nora", "Finn", "Ruby"]

# Singular -> plural; the irregular ones make the plural task more than "add an s".
NOUNS = {
    "cat": "cats", "dog": "dogs", "bird": "birds", "tree": "trees", "house": "houses", "ball": "balls",
    "book": "books", "apple": "apples", "car": "cars", "boat": "boats", "cup": "cups", "hat": "hats",
    "star": "stars", "flower": "flowers", "river": "rivers", "stone": "stones", "door": "doors", "chair": "chairs",
    "table": "tables", "lamp": "lamps", "cake": "cakes", "kite": "kites", "shoe": "shoes", "key": "keys",
    "box": "boxes", "fox": "foxes", "bus": "buses", "dish": "dishes", "bench": "benches", "glass": "glasses",
    "baby": "babies", "city": "cities", "berry": "berries", "story": "stories", "party": "parties",
    "leaf": "leaves", "wolf": "wolves", "knife": "knives", "shelf": "shelves",
    "mouse": "mice", "child": "children", "foot": "feet", "tooth": "teeth", "man": "men", "woman": "women",
    "goose": "geese", "sheep": "sheep", "fish": "fish",
}

COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown", "grey", "silver"]

# Each pair appears once; the opposite task is asked in both directions.
ANTONYMS = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("open", "closed"), ("old", "young"), ("tall", "short"), ("full", "empty"), ("early", "late"), ("wet", "dry"),
    ("loud", "quiet"), ("hard", "soft"), ("high", "low"), ("left", "right"), ("day", "night"), ("in", "out"),
    ("on", "off"), ("first", "last"), ("good", "bad"), ("rich", "poor"), ("strong", "weak"), ("clean", "dirty"),
    ("thick", "thin"), ("near", "far"), ("yes", "no"), ("win", "lose"), ("push", "pull"), ("start", "stop"),
    ("buy", "sell"), ("give", "take"), ("above", "below"), ("front", "back"), ("sweet", "sour"), ("true", "false"),
]

ANIMAL_SOUNDS = {
    "dog": "woof", "cat": "meow", "cow": "moo", "duck": "quack", "sheep": "baa", "pig": "oink", "horse": "neigh",
    "lion": "roar", "owl": "hoot", "frog": "croak", "bee": "buzz", "snake": "hiss", "mouse": "squeak",
    "wolf": "howl", "crow": "caw", "hen": "cluck",
}

THING_COLOURS = {
    "sky": "blue", "grass": "green", "snow": "white", "coal": "black", "banana": "yellow", "tomato": "red",
    "carrot": "orange", "plum": "purple", "lemon": "yellow", "cherry": "red", "leaf": "green", "milk": "white",
    "crow": "black", "pumpkin": "orange", "sea": "blue", "cloud": "white", "frog": "green", "strawberry": "red",
    "chocolate": "brown", "flamingo": "pink", "elephant": "grey", "coin": "silver", "sun": "yellow", "night": "black",
}

# Invented creatures with invented colours and sounds: facts that exist only in this corpus, so the model can only
# answer questions about them if pretraining taught it.
CREATURES = {
    "zibble": ("blue", "zip"), "florp": ("green", "blop"), "grix": ("red", "krik"), "wumble": ("purple", "wum"),
    "tazzle": ("yellow", "tazz"), "nerg": ("orange", "nurr"), "skiv": ("silver", "skee"), "blorn": ("pink", "bloo"),
    "quopp": ("brown", "quop"), "dwibble": ("grey", "dwee"), "frunk": ("white", "frum"), "yazzo": ("black", "yaz"),
    "krell": ("green", "kree"), "mipple": ("red", "mip"), "zorb": ("purple", "zorr"), "snib": ("yellow", "snee"),
}

ADJECTIVES = ["small", "big", "happy", "old", "young", "fast", "slow", "quiet", "loud", "tall", "little", "kind"]
VERBS_INTRANSITIVE = ["runs", "jumps", "sleeps", "sings", "walks", "swims", "plays", "waits", "laughs", "rests"]
VERBS_TRANSITIVE = ["sees", "likes", "finds", "paints", "carries", "follows", "holds", "draws", "counts", "wants"]
PLACES = ["in the park", "near the river", "under the tree", "at home", "by the lake", "in the garden",
          "on the hill", "at school", "in the forest", "behind the house"]
TIMES = ["in the morning", "at night", "after lunch", "every day", "on Sunday", "in the evening", "today"]
COUNTABLE_THINGS = ["apples", "books", "balls", "stones", "cakes", "kites", "cups", "hats", "flowers", "coins"]

# Words the uppercase, first-letter, repeat and reverse tasks draw from.
SIMPLE_WORDS = sorted(set(NOUNS) | set(COLOURS) | set(ADJECTIVES) | set(ANIMAL_SOUNDS) | set(THING_COLOURS))

# ----------------------------------------------------------------------------------------------------------------------
# Small helpers shared by the corpus and the instruction families
# ----------------------------------------------------------------------------------------------------------------------


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def number_list(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)


def random_numbers(rng: random.Random, count: int, high: int) -> list[int]:
    """`count` distinct numbers from 1..high, in random order."""
    return rng.sample(range(1, high + 1), count)


def random_words(rng: random.Random, count: int) -> list[str]:
    return rng.sample(SIMPLE_WORDS, count)


def random_sentence(rng: random.Random) -> str:
    """A short narrative sentence from a tiny grammar, e.g. 'The small dog sees a red ball in the park.'"""
    noun = rng.choice(["dog", "cat", "bird", "fox", "child", "man", "woman", "baby", "wolf", "mouse"])
    subject = rng.choice([f"The {noun}", f"The {rng.choice(ADJECTIVES)} {noun}", rng.choice(NAMES)])
    shape = rng.randrange(4)
    if shape == 0:
        return f"{subject} {rng.choice(VERBS_INTRANSITIVE)}."
    if shape == 1:
        return f"{subject} {rng.choice(VERBS_INTRANSITIVE)} {rng.choice(PLACES)}."
    obj = rng.choice(list(NOUNS)[:30])  # everyday objects and animals, not "tooth" or "woman"
    colour = rng.choice(COLOURS)
    if shape == 2:
        return f"{subject} {rng.choice(VERBS_TRANSITIVE)} {article(colour)} {colour} {obj}."
    return f"{subject} {rng.choice(VERBS_TRANSITIVE)} the {obj} {rng.choice(PLACES)} {rng.choice(TIMES)}."


def count_words(sentence: str) -> int:
    return len(sentence.split())


# ----------------------------------------------------------------------------------------------------------------------
# The instruction data: one function per task family, each returning Alpaca records
# ----------------------------------------------------------------------------------------------------------------------


def record(instruction: str, output: str, input: str = "") -> dict[str, str]:
    return {"instruction": instruction, "input": input, "output": output}


def family_addition(rng: random.Random) -> list[dict[str, str]]:
    templates = ["What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"]
    pairs = [(a, b) for a in range(0, 21) for b in range(0, 21)]
    return [record(rng.choice(templates).format(a=a, b=b), str(a + b)) for a, b in rng.sample(pairs, 300)]


def family_subtraction(rng: random.Random) -> list[dict[str, str]]:
    templates = ["What is {a} minus {b}?", "Subtract {b} from {a}.", "What is {a} take away {b}?"]
    pairs = [(a, b) for a in range(0, 21) for b in range(0, a + 1)]
    return [record(rng.choice(templates).format(a=a, b=b), str(a - b)) for a, b in rng.sample(pairs, 230)]


def family_compare(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for _ in range(260):
        a, b = random_numbers(rng, 2, 60)
        if rng.random() < 0.5:
            records.append(record(f"Which number is larger, {a} or {b}?", str(max(a, b))))
        else:
            records.append(record(f"Which number is smaller, {a} or {b}?", str(min(a, b))))
    return records


def family_next_previous(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for n in rng.sample(range(1, 99), 90):
        records.append(record(f"What number comes after {n}?", str(n + 1)))
    for n in rng.sample(range(2, 100), 90):
        records.append(record(f"What number comes before {n}?", str(n - 1)))
    return records


def family_sort(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for _ in range(200):
        numbers = random_numbers(rng, rng.choice([3, 4]), 30)
        if rng.random() < 0.75:
            instruction, answer = "Sort these numbers from smallest to largest.", sorted(numbers)
        else:
            instruction, answer = "Sort these numbers from largest to smallest.", sorted(numbers, reverse=True)
        records.append(record(instruction, number_list(answer), input=number_list(numbers)))
    return records


def family_reverse_words(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for _ in range(200):
        words = random_words(rng, rng.choice([3, 4]))
        records.append(record("Reverse the order of these words.", " ".join(reversed(words)), input=" ".join(words)))
    return records


def family_uppercase(rng: random.Random) -> list[dict[str, str]]:
    templates = ["Write this word in capital letters.", "Convert the word to uppercase."]
    return [record(rng.choice(templates), word.upper(), input=word) for word in SIMPLE_WORDS]


def family_count_words(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for _ in range(200):
        sentence = random_sentence(rng)
        records.append(record("How many words are in this sentence?", str(count_words(sentence)), input=sentence))
    return records


def family_opposite(rng: random.Random) -> list[dict[str, str]]:
    templates = ["What is the opposite of {w}?", "Give the opposite of the word {w}."]
    records = []
    for left, right in ANTONYMS:
        for word, opposite in ((left, right), (right, left)):
            records.append(record(rng.choice(templates).format(w=word), opposite))
    return records


def family_colour(rng: random.Random) -> list[dict[str, str]]:
    table = {**THING_COLOURS, **{creature: colour for creature, (colour, _) in CREATURES.items()}}
    records = []
    for thing, colour in table.items():
        if rng.random() < 0.5:
            records.append(record(f"What colour is {article(thing)} {thing}?", colour))
        else:
            records.append(record(f"Name the colour of {article(thing)} {thing}.",
                                  f"{article(thing).capitalize()} {thing} is {colour}."))
    return records


def family_sound(rng: random.Random) -> list[dict[str, str]]:
    table = {**ANIMAL_SOUNDS, **{creature: sound for creature, (_, sound) in CREATURES.items()}}
    records = []
    for animal, sound in table.items():
        if rng.random() < 0.5:
            records.append(record(f"What sound does {article(animal)} {animal} make?", sound))
        else:
            records.append(record(f"Describe the sound of {article(animal)} {animal}.", f"The {animal} says {sound}."))
        records.append(record(f"Which animal says {sound}?", f"The {animal}."))  # the table read the other way
    return records


def family_repeat(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for _ in range(200):
        word, times = rng.choice(SIMPLE_WORDS), rng.randint(2, 5)
        records.append(record(f"Repeat the word {word} {times} times.", " ".join([word] * times)))
    return records


def family_first_letter(rng: random.Random) -> list[dict[str, str]]:
    return [record(f"What is the first letter of the word {word}?", word[0]) for word in SIMPLE_WORDS]


def family_plural(rng: random.Random) -> list[dict[str, str]]:
    templates = ["What is the plural of {w}?", "Write the plural form of the word {w}."]
    return [record(rng.choice(templates).format(w=singular), plural) for singular, plural in NOUNS.items()]


def family_word_problem(rng: random.Random) -> list[dict[str, str]]:
    records = []
    for _ in range(250):
        name, things = rng.choice(NAMES), rng.choice(COUNTABLE_THINGS)
        if rng.random() < 0.5:
            a, b = rng.randint(1, 10), rng.randint(1, 10)
            question = f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?"
            total = a + b
        else:
            a = rng.randint(2, 20)
            b = rng.randint(1, a - 1)
            question = f"{name} has {a} {things} and gives away {b}. How many {things} does {name} have now?"
            total = a - b
        records.append(record(question, f"{name} has {total} {things}."))
    return records


INSTRUCTION_FAMILIES = [
    family_addition, family_subtraction, family_compare, family_next_previous, family_sort, family_reverse_words,
    family_uppercase, family_count_words, family_opposite, family_colour, family_sound, family_repeat,
    family_first_letter, family_plural, family_word_problem,
]


def make_instructions(rng: random.Random) -> list[dict[str, str]]:
    """All families' records, duplicates (same instruction and input) dropped, shuffled."""
    records, seen = [], set()
    for family in INSTRUCTION_FAMILIES:
        for rec in family(rng):
            key = (rec["instruction"], rec["input"])
            if key not in seen:
                seen.add(key)
                records.append(rec)
    rng.shuffle(records)
    return records


# ----------------------------------------------------------------------------------------------------------------------
# The pretraining corpus: the same facts and transformations, stated as plain sentences
# ----------------------------------------------------------------------------------------------------------------------


def fact_addition(rng: random.Random) -> str:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return rng.choice([f"{a} plus {b} is {a + b}.", f"The sum of {a} and {b} is {a + b}.",
                       f"If you add {a} and {b}, you get {a + b}."])


def fact_subtraction(rng: random.Random) -> str:
    a = rng.randint(0, 20)
    b = rng.randint(0, a)
    return rng.choice([f"{a} minus {b} is {a - b}.", f"{a} take away {b} leaves {a - b}.",
                       f"If you subtract {b} from {a}, you get {a - b}."])


def fact_compare(rng: random.Random) -> str:
    a, b = sorted(random_numbers(rng, 2, 60))
    return rng.choice([f"{b} is larger than {a}.", f"{a} is smaller than {b}.",
                       f"Of {a} and {b}, the larger number is {b}.", f"Of {b} and {a}, the smaller number is {a}."])


def fact_counting(rng: random.Random) -> str:
    n = rng.randint(1, 98)
    return rng.choice([f"After {n} comes {n + 1}.", f"Before {n + 1} comes {n}.",
                       f"Counting up: {n}, {n + 1}, {n + 2}."])


def fact_sort(rng: random.Random) -> str:
    numbers = random_numbers(rng, rng.choice([3, 4]), 30)
    if rng.random() < 0.75:
        return f"Sorted from smallest to largest, {number_list(numbers)} becomes {number_list(sorted(numbers))}."
    return (f"Sorted from largest to smallest, {number_list(numbers)} becomes "
            f"{number_list(sorted(numbers, reverse=True))}.")


def fact_reverse(rng: random.Random) -> str:
    words = random_words(rng, rng.choice([3, 4]))
    return f"In reverse order, {' '.join(words)} becomes {' '.join(reversed(words))}."


def fact_uppercase(rng: random.Random) -> str:
    word = rng.choice(SIMPLE_WORDS)
    return rng.choice([f"In capital letters, {word} is {word.upper()}.", f"The word {word} in uppercase is "
                                                                         f"{word.upper()}."])


def fact_count_words(rng: random.Random) -> str:
    sentence = random_sentence(rng)
    return f'The sentence "{sentence}" has {count_words(sentence)} words.'


def fact_opposite(rng: random.Random) -> str:
    word, opposite = rng.choice(ANTONYMS)
    if rng.random() < 0.5:
        word, opposite = opposite, word
    return rng.choice([f"The opposite of {word} is {opposite}.", f"{word.capitalize()} and {opposite} are "
                                                                 f"opposites."])


def fact_colour(rng: random.Random) -> str:
    if rng.random() < 0.5:
        thing, colour = rng.choice(list(THING_COLOURS.items()))
    else:
        thing, (colour, _) = rng.choice(list(CREATURES.items()))
    return rng.choice([f"{article(thing).capitalize()} {thing} is {colour}.", f"The colour of {article(thing)} "
                                                                              f"{thing} is {colour}."])


def fact_sound(rng: random.Random) -> str:
    if rng.random() < 0.5:
        animal, sound = rng.choice(list(ANIMAL_SOUNDS.items()))
    else:
        animal, (_, sound) = rng.choice(list(CREATURES.items()))
    return rng.choice([f"The {animal} says {sound}.", f"{article(animal).capitalize()} {animal} makes the sound "
                                                      f"{sound}."])


def fact_repeat(rng: random.Random) -> str:
    word, times = rng.choice(SIMPLE_WORDS), rng.randint(2, 5)
    return f"The word {word} said {times} times is {' '.join([word] * times)}."


def fact_first_letter(rng: random.Random) -> str:
    word = rng.choice(SIMPLE_WORDS)
    return f"The word {word} starts with the letter {word[0]}."


def fact_plural(rng: random.Random) -> str:
    singular, plural = rng.choice(list(NOUNS.items()))
    return rng.choice([f"One {singular}, two {plural}.", f"The plural of {singular} is {plural}."])


def story(rng: random.Random) -> str:
    """A two-sentence counting story, like the word problems."""
    name, things = rng.choice(NAMES), rng.choice(COUNTABLE_THINGS)
    a = rng.randint(2, 10)
    if rng.random() < 0.5:
        b = rng.randint(1, 10)
        return f"{name} has {a} {things}. {name} gets {b} more, so {name} has {a + b} {things} now."
    b = rng.randint(1, a - 1)
    return f"{name} has {a} {things}. {name} gives away {b}, so {name} has {a - b} {things} now."


# Weights: the narrative sentences give the text its general shape, the facts carry the knowledge.
SENTENCE_MAKERS = [
    (random_sentence, 6), (fact_addition, 3), (fact_subtraction, 3), (fact_compare, 2), (fact_counting, 2),
    (fact_sort, 2), (fact_reverse, 2), (fact_uppercase, 2), (fact_count_words, 2), (fact_opposite, 2),
    (fact_colour, 2), (fact_sound, 2), (fact_repeat, 2), (fact_first_letter, 1), (fact_plural, 2), (story, 3),
]


def make_paragraph(rng: random.Random) -> str:
    makers, weights = zip(*SENTENCE_MAKERS)
    return " ".join(maker(rng) for maker in rng.choices(makers, weights=weights, k=rng.randint(3, 7)))


def make_question_pool(seed: int, records: list[dict[str, str]]) -> list[dict[str, str]]:
    """Questions for the corpus's question/answer drills: the instruction families drawn with other seeds, less every
    question (instruction and input) that `records` holds, so that no instruction record appears verbatim in the
    corpus; the facts it asks about do, in other wordings and in the prose."""
    taken = {(rec["instruction"], rec["input"]) for rec in records}
    return [
        rec
        for offset in range(QUESTION_POOL_DRAWS)
        for rec in make_instructions(random.Random(seed + offset))
        if (rec["instruction"], rec["input"]) not in taken
    ]


def qa_text(rec: dict[str, str]) -> str:
    """A record in the corpus's own question/answer layout, not the Alpaca template (which the fine-tune teaches).

    Each part starts on its own line, as in the Alpaca template: byte-level BPE gives a word after a space another
    token than the same word after a newline ("Ġcats" vs "cats"), and an answer the fine-tune asks for after
    "### Response:\n" must be made of tokens the model has seen in that position."""
    lines = ["Question:", rec["instruction"]]
    if rec["input"]:
        lines += ["Input:", rec["input"]]
    lines += ["Answer:", rec["output"]]
    return "\n".join(lines)


def make_qa_document(rng: random.Random, pool: list[dict[str, str]]) -> str:
    return "\n".join(qa_text(rec) for rec in rng.sample(pool, rng.randint(2, 5)))


def make_pretrain_documents(rng: random.Random, pool: list[dict[str, str]], target_bytes: int) -> list[str]:
    """Prose paragraphs mixed with question/answer drills, until the text reaches target_bytes."""
    documents, size = [], 0
    while size < target_bytes:
        document = make_qa_document(rng, pool) if rng.random() < QA_SHARE else make_paragraph(rng)
        documents.append(document)
        size += len(document.encode("utf-8")) + 2  # the blank line that separates documents in the file
    return documents


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------------


def alpaca_text(rec: dict[str, str]) -> str:
    """A record as the fine-tune sees it: the Alpaca prompt followed by the response."""
    return Alpaca().apply(prompt=rec["instruction"], **rec) + rec["output"]


def train_tokenizer(texts: list[str]) -> HFTokenizer:
    """Byte-level BPE (as GPT-2's): any text encodes, and decode(encode(text)) gives back spaces and newlines."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so no text is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def write_tokenizer_files(tokenizer: HFTokenizer, model_dir: Path) -> None:
    tokenizer.save(str(model_dir / "tokenizer.json"))
    # litgpt's Tokenizer reads bos/eos from here, reads `tokenizer_class` unconditionally, and prepends BOS only when
    # `add_bos_token` is true. Not "LlamaTokenizer": that class name switches on a SentencePiece-only decoding fix.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 512,
    }
    with open(model_dir / "tokenizer_config.json", "w", encoding="utf-8") as fp:
        json.dump(tokenizer_config, fp, indent=2)
        fp.write("\n")


# ----------------------------------------------------------------------------------------------------------------------
# Model and pretraining
# ----------------------------------------------------------------------------------------------------------------------


def make_model_config(vocab_size: int) -> Config:
    """A TinyLlama-shaped model (RMSNorm, SwiGLU MLP, full rotary, no biases, grouped-query attention), ~1.3M params."""
    return Config(
        name="litft-demo-tiny",
        block_size=512,
        vocab_size=vocab_size,
        padding_multiple=64,
        padded_vocab_size=math.ceil(vocab_size / 64) * 64,
        n_layer=4,
        n_head=4,
        n_embd=128,
        n_query_groups=2,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        intermediate_size=352,
    )


def encode_documents(tokenizer: HFTokenizer, documents: list[str]) -> torch.Tensor:
    """One token stream, <s> document </s> <s> document </s> ..., so the model learns both markers."""
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.append(bos_id)
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def learning_rate(step: int) -> float:
    """Linear warmup, then cosine decay from PEAK_LR to MIN_LR."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, PRETRAIN_STEPS - WARMUP_STEPS)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1 + math.cos(math.pi * progress))


def random_batch(stream: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH_SIZE packed windows of SEQ_LEN tokens at random offsets; targets are the inputs shifted by one."""
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH_SIZE,), generator=generator)
    windows = torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def next_token_loss(model: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: GPT, stream: torch.Tensor) -> float:
    """Mean loss over consecutive, non-overlapping windows of the held-out stream (the same windows every time)."""
    model.eval()
    n_windows = (len(stream) - 1) // SEQ_LEN
    losses = []
    for i in range(0, n_windows, BATCH_SIZE):
        starts = range(i * SEQ_LEN, min(i + BATCH_SIZE, n_windows) * SEQ_LEN, SEQ_LEN)
        windows = torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts])
        losses.append(next_token_loss(model, windows[:, :-1], windows[:, 1:]).item())
    model.train()
    return statistics.fmean(losses)


def pretrain(model: GPT, train_stream: torch.Tensor, val_stream: torch.Tensor) -> dict[str, object]:
    """Plain next-token training in fp32 on the CPU; returns the per-step losses and the validation losses."""
    generator = torch.Generator().manual_seed(SEED)
    # Weight decay on matrices only, not on norms' scales (as litgpt's pretraining does for 1-d parameters).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR, betas=(0.9, 0.95),
    )
    val_before = evaluate(model, val_stream)
    losses = []
    started = time.perf_counter()
    model.train()
    for step in range(PRETRAIN_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        inputs, targets = random_batch(train_stream, generator)
        loss = next_token_loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == PRETRAIN_STEPS - 1:
            print(f"  step {step:5d}  loss {loss.item():.3f}  lr {learning_rate(step):.2e}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    return {"losses": losses, "val_before": val_before, "val_after": evaluate(model, val_stream),
            "seconds": time.perf_counter() - started}


# ----------------------------------------------------------------------------------------------------------------------
# Writing files and reporting
# ----------------------------------------------------------------------------------------------------------------------


def write_jsonl(records: list[dict[str, str]], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fp:
        for rec in records:
            fp.write(json.dumps(rec, ensure_ascii=False) + "\n")


def check_checkpoint_loads(model_dir: Path, config: Config) -> None:
    """Fail loudly if litgpt cannot read back what was written (the way litft will read it)."""
    from litgpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    assert tokenizer.use_bos and tokenizer.bos_id == 1 and tokenizer.eos_id == 2, "BOS/EOS not set up as intended"
    sample = "Below is an instruction.\n\n### Response:\n  7 plus 5 is 12."
    ids = tokenizer.encode(sample, bos=True, eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == sample, "tokenizer does not round-trip text"
    assert Config.from_file(model_dir / "model_config.yaml") == config, "model_config.yaml does not round-trip"
    GPT(config).load_state_dict(torch.load(model_dir / "lit_model.pth", weights_only=True), strict=True)


def token_length_stats(tokenizer: HFTokenizer, records: list[dict[str, str]]) -> dict[str, float]:
    """Tokens per record under the Alpaca template, counted as litgpt's SFTDataset counts them: BOS + prompt +
    response + EOS."""
    lengths = [len(encoding.ids) + 2 for encoding in tokenizer.encode_batch([alpaca_text(r) for r in records])]
    response_lengths = [len(encoding.ids) + 1 for encoding in tokenizer.encode_batch([r["output"] for r in records])]
    return {
        "min": min(lengths), "mean": statistics.fmean(lengths), "max": max(lengths),
        "response_min": min(response_lengths), "response_mean": statistics.fmean(response_lengths),
        "response_max": max(response_lengths),
    }


def loss_summary(losses: list[float]) -> dict[str, float]:
    """The first step's loss and means over the first, middle and last 50 steps (single steps are noisy)."""
    mid = len(losses) // 2
    return {"first": losses[0], "first50": statistics.fmean(losses[:50]),
            "middle50": statistics.fmean(losses[mid - 25 : mid + 25]), "last50": statistics.fmean(losses[-50:])}


def file_sizes(out_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(out_dir)): p.stat().st_size for p in sorted(out_dir.rglob("*")) if p.is_file()}


def human_size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.2f} MB" if n_bytes >= 1e5 else f"{n_bytes / 1e3:.1f} kB"


def write_readme(out_dir: Path, facts: dict[str, object]) -> None:
    """README.md of the assets, with the numbers of this run."""
    sizes = "\n".join(f"| `{name}` | {size:,} bytes ({human_size(size)}) |" for name, size in facts["sizes"].items()
                      if name != "README.md")
    stats, loss = facts["length_stats"], facts["loss"]
    text = f"""# litft demo assets

A tiny, self-made setup so that the `demo` recipe runs offline on a CPU in minutes and its validation loss visibly
falls. Every file here is generated by `scripts/make_demo_assets.py` from word lists, fact tables and sentence
templates written for this project; no third-party text or weights are included. The script uses fixed seeds (two runs
on one machine write identical files) and took {facts['total_seconds'] / 60:.1f} minutes on 2 CPU cores. Regenerate with:

    python scripts/make_demo_assets.py

The pretraining corpus states the facts as prose and drills them as questions and answers in a layout of its own;
the instruction records ask for the same facts in the Alpaca format, so a short fine-tune only has to learn that
format. The drills come from the same generators as the instruction records (other seeds) but leave out every
question that `instructions.jsonl` holds: no record appears verbatim in the corpus, but the facts it asks about do
(in other wordings, and in the prose), so the demo shows a fine-tune learning a format rather than new facts.

| file | what it is |
| --- | --- |
| `pretrain.txt` | synthetic English-like text, the pretraining corpus: {facts['n_documents']:,} documents separated by blank lines, {QA_SHARE:.0%} of them question/answer drills (`Question:` / `Input:` / `Answer:` sections), the others prose paragraphs of short sentences about numbers, words, colours, animal sounds, opposites, plurals and invented creatures |
| `instructions.jsonl` | {facts['n_records']:,} Alpaca-format records (`instruction`, `input`, `output`) from {facts['n_families']} task families: add, subtract, compare, next/previous number, sort numbers, reverse words, uppercase, count words, opposites, colours, animal sounds, repeat a word, first letter, plurals, small word problems |
| `model/tokenizer.json` | byte-level BPE ({facts['vocab_size']} tokens, `<unk>`=0, `<s>`=1 (BOS), `</s>`=2 (EOS), `<pad>`=3) trained on `pretrain.txt` and the instruction records in the Alpaca prompt template |
| `model/tokenizer_config.json` | BOS/EOS names, `add_bos_token: true` (litgpt then prepends BOS), `tokenizer_class` |
| `model/model_config.yaml` | the litgpt `Config` (`litft-demo-tiny`): Llama-style, 4 layers, 128 wide, 4 heads in 2 query groups, SwiGLU 352, RMSNorm, rotary, block size 512, padded vocab {facts['padded_vocab_size']} |
| `model/lit_model.pth` | fp32 state dict of `litgpt.model.GPT` ({facts['n_params']:,} parameters) after pretraining on `pretrain.txt` |

## Sizes

(README.md itself not counted.)

| file | size |
| --- | --- |
{sizes}

## How the model was pretrained

Plain PyTorch next-token training on the CPU in fp32: AdamW (betas 0.9/0.95, weight decay {WEIGHT_DECAY}), learning
rate {PEAK_LR:g} with {WARMUP_STEPS} warmup steps and cosine decay to {MIN_LR:g}, gradient clipping {GRAD_CLIP},
{PRETRAIN_STEPS} steps of {BATCH_SIZE} packed windows of {SEQ_LEN} tokens (each document wrapped in `<s>` ... `</s>`),
{facts['train_tokens']:,} training tokens ({facts['epochs']:.1f} passes).
{VAL_FRACTION:.0%} of the documents are held out.

- training loss: {loss['first']:.2f} at the first step, {loss['first50']:.2f} over the first 50 steps,
  {loss['middle50']:.2f} over 50 steps mid-way, {loss['last50']:.2f} over the last 50 steps
- held-out loss: {facts['val_before']:.2f} before, {facts['val_after']:.2f} after

## Instruction records under the Alpaca template

Tokens per record (BOS + prompt + response + EOS): min {stats['min']}, mean {stats['mean']:.1f}, max {stats['max']};
response (+ EOS): min {stats['response_min']}, mean {stats['response_mean']:.1f}, max {stats['response_max']}.
"""
    (out_dir / "README.md").write_text(text, encoding="utf-8")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where to write (default: %(default)s)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    # Every random draw below comes from a seeded random.Random or from torch's seeded generators, so two runs on the
    # same machine write the same files; another thread count or torch version can change the weights' last bits.
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)

    out_dir: Path = args.out_dir
    model_dir = out_dir / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    print("Generating the instruction records and the pretraining text ...", flush=True)
    records = make_instructions(random.Random(SEED))
    question_pool = make_question_pool(SEED + 100, records)
    documents = make_pretrain_documents(random.Random(SEED + 1), question_pool, PRETRAIN_TARGET_BYTES)
    write_jsonl(records, out_dir / "instructions.jsonl")
    (out_dir / "pretrain.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")

    print("Training the tokenizer ...", flush=True)
    tokenizer = train_tokenizer(documents + [alpaca_text(r) for r in records])
    write_tokenizer_files(tokenizer, model_dir)

    config = make_model_config(tokenizer.get_vocab_size())
    save_config(config, model_dir)  # litgpt's own writer, so Config.from_file reads it back identically

    n_val = max(1, int(len(documents) * VAL_FRACTION))
    train_stream = encode_documents(tokenizer, documents[:-n_val])
    val_stream = encode_documents(tokenizer, documents[-n_val:])
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Pretraining {n_params:,} parameters on {len(train_stream):,} tokens ...", flush=True)
    result = pretrain(model, train_stream, val_stream)
    torch.save(model.state_dict(), model_dir / "lit_model.pth")
    check_checkpoint_loads(model_dir, config)

    length_stats = token_length_stats(tokenizer, records)
    loss = loss_summary(result["losses"])
    facts = {
        "sizes": file_sizes(out_dir),
        "n_documents": len(documents),
        "n_records": len(records),
        "n_families": len(INSTRUCTION_FAMILIES),
        "vocab_size": tokenizer.get_vocab_size(),
        "padded_vocab_size": config.padded_vocab_size,
        "n_params": n_params,
        "train_tokens": len(train_stream),
        "epochs": PRETRAIN_STEPS * BATCH_SIZE * SEQ_LEN / len(train_stream),
        "length_stats": length_stats,
        "loss": loss,
        "val_before": result["val_before"],
        "val_after": result["val_after"],
        "total_seconds": time.perf_counter() - started,
    }
    write_readme(out_dir, facts)

    print("\nSummary")
    for name, size in file_sizes(out_dir).items():
        print(f"  {name:32s} {size:>10,d} bytes")
    print(f"  pretrain.txt: {len(documents):,} documents, {len(train_stream) + len(val_stream):,} tokens")
    print(f"  instructions.jsonl: {len(records):,} records from {len(INSTRUCTION_FAMILIES)} families")
    print(f"  tokenizer: {tokenizer.get_vocab_size()} tokens; model: {n_params:,} parameters, "
          f"padded vocab {config.padded_vocab_size}")
    print(f"  record tokens under the Alpaca template: min {length_stats['min']}, mean {length_stats['mean']:.1f}, "
          f"max {length_stats['max']}; responses min {length_stats['response_min']}, "
          f"mean {length_stats['response_mean']:.1f}, max {length_stats['response_max']}")
    print(f"  pretraining loss: first {loss['first']:.3f}, first-50 mean {loss['first50']:.3f}, "
          f"last-50 mean {loss['last50']:.3f}; held-out {result['val_before']:.3f} -> {result['val_after']:.3f} "
          f"({result['seconds']:.0f}s)")
    print(f"  total time: {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
