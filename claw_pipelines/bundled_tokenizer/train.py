"""Train the small byte-level BPE tokenizer that ships with the package (`tokenizer.json`).

Regenerate (deterministic: a fixed seed and a generated corpus, no downloads):

    .venv/bin/python claw_pipelines/bundled_tokenizer/train_tokenizer.py

The corpus is synthetic English, Python, arithmetic Q&A and JSON tool calls, so the vocabulary
fits what the simulated model and the demo agents say. Byte-level pre-tokenization and decoding
mean any text round-trips, whatever the training data covered.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 20240607
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
OUTPUT = Path(__file__).with_name("tokenizer.json")

SUBJECTS = (
    "the agent",
    "the model",
    "the user",
    "a trainer",
    "the gateway",
    "the policy",
    "this tool",
    "the reward",
    "each step",
    "the dataset",
    "our team",
    "the server",
    "a student",
    "the answer",
    "the function",
    "the result",
    "every trajectory",
    "the assistant",
    "the system",
    "the table",
)
VERBS = (
    "computes",
    "returns",
    "reads",
    "writes",
    "checks",
    "finds",
    "uses",
    "calls",
    "learns",
    "stores",
    "sends",
    "explains",
    "improves",
    "measures",
    "answers",
    "builds",
    "runs",
    "needs",
    "takes",
    "gives",
    "shows",
    "keeps",
    "makes",
    "starts",
    "stops",
    "loads",
    "updates",
    "tests",
)
OBJECTS = (
    "the number",
    "a short answer",
    "the weather",
    "the next token",
    "a list of files",
    "the final result",
    "a new version",
    "the search results",
    "the data",
    "a simple plan",
    "the current time",
    "every record",
    "the correct value",
    "a small model",
    "the question",
    "the tool output",
    "the prompt",
    "a good reward",
    "the batch",
    "the summary",
)
ADVERBS = (
    "quickly",
    "carefully",
    "again",
    "today",
    "in order",
    "step by step",
    "for now",
    "once",
    "without errors",
    "as expected",
    "at the end",
    "in this case",
    "first",
    "then",
    "finally",
)
OPENERS = (
    "Sure.",
    "Of course.",
    "Let me think.",
    "Here is what I found.",
    "I can help with that.",
    "Thanks for asking.",
    "Good question.",
    "Okay.",
    "Let me check.",
    "Great, here we go.",
)
NAMES = ("Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Paris", "London", "Tokyo", "Berlin")
UNICODE_SAMPLES = (
    "café",
    "naïve",
    "über",
    "señor",
    "日本語",
    "中文",
    "한국어",
    "Привет",
    "γειά",
    "🙂",
    "✓",
    "→",
)
TOOLS = ("calculator", "search", "get_weather", "read_file", "run_python", "lookup")
ARG_NAMES = ("expression", "query", "city", "path", "code", "key", "unit", "limit")
CODE_TEMPLATES = (
    "def {f}({a}, {b}):\n    return {a} {op} {b}\n",
    "for {a} in range({n}):\n    print({a})\n",
    "if {a} > {n}:\n    {b} = {a} {op} {n}\nelse:\n    {b} = 0\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    'import json\n\ndata = json.loads({a})\nprint(data["{b}"])\n',
    "{a} = [{n}, {m}, {k}]\ntotal = sum({a})\n",
    'with open("{b}.txt") as handle:\n    {a} = handle.read()\n',
)
COMMON_TEXT = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by not word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross "
    "farm hard start might story saw far sea draw left late run don't while press close night "
    "real life few north open seem together next white children begin got walk example ease "
    "paper group always music those both mark often letter until mile river car feet care "
    "second book carry took science eat room friend began idea fish mountain stop once base "
    "hear horse cut sure watch color face wood main enough plain girl usual young ready above "
    "ever red list though feel talk bird soon body dog family direct pose leave song measure "
    "door product black short numeral class wind question happen complete ship area half rock "
    "order fire south problem piece told knew pass since top whole king space heard best hour "
    "better true during hundred five remember step early hold west ground interest reach fast "
    "verb sing listen six table travel less morning ten simple several toward war lay against "
    "pattern slow center love person money serve appear road map rain rule govern pull cold "
    "notice voice unit power town fine certain fly fall lead cry dark machine note wait plan "
    "figure star box noun field rest correct able pound done beauty drive stood contain front "
    "teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force "
    "blue object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane instead dry wonder laugh thousand ago ran check game shape equate miss "
    "brought heat snow tire bring yes distant fill east paint language among anything else "
    "task depends looks used returned based output"
)
COMMON_WORDS = COMMON_TEXT.split()
IDENTIFIERS = ("x", "y", "value", "items", "count", "result", "total", "name", "path", "step")


def _sentence(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    text = f"{subject} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ADVERBS)}"
    text = text[0].upper() + text[1:]
    if rng.random() < 0.2:
        text += f", said {rng.choice(NAMES)}"
    if rng.random() < 0.05:
        text += f" ({rng.choice(UNICODE_SAMPLES)})"
    return text + rng.choice(".....!?")


def _common(rng: random.Random) -> str:
    words = rng.choices(COMMON_WORDS, k=rng.randint(4, 16))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".,.?!")


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = rng.choice(("What is {e}?", "Compute {e}.", "Please calculate {e}", "{e} = ?"))
    answer = rng.choice(("The answer is {v}.", "{e} = {v}", "{e} = {v}. The answer is {v}."))
    expression = f"{a} {op} {b}"
    return question.format(e=expression) + "\n" + answer.format(e=expression, v=value)


def _code(rng: random.Random) -> str:
    a, b = rng.sample(IDENTIFIERS, 2)
    return rng.choice(CODE_TEMPLATES).format(
        f=rng.choice(("add", "compute", "load", "main", "score")),
        F=rng.choice(("Agent", "Step", "Tokenizer", "Record")),
        a=a,
        b=b,
        op=rng.choice("+-*/"),
        n=rng.randint(0, 100),
        m=rng.randint(0, 100),
        k=rng.randint(0, 100),
    )


def _tool_call(rng: random.Random) -> str:
    arguments = {rng.choice(ARG_NAMES): rng.choice((rng.randint(0, 500), rng.choice(NAMES)))}
    call = {"name": rng.choice(TOOLS), "arguments": arguments}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _chat(rng: random.Random) -> str:
    turns = [("system", "You are a helpful assistant.")] if rng.random() < 0.5 else []
    turns += [("user", _sentence(rng)), ("assistant", _sentence(rng))]
    if rng.random() < 0.3:
        turns += [("assistant", _tool_call(rng)), ("tool", str(rng.randint(0, 999)))]
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


def corpus(seed: int = SEED, documents: int = 60_000) -> Iterator[str]:
    """Yield the synthetic training documents for a seed."""
    rng = random.Random(seed)
    makers = (_sentence, _sentence, _common, _common, _arithmetic, _code, _tool_call, _chat)
    for _ in range(documents):
        maker = rng.choice(makers)
        parts = [maker(rng) for _ in range(rng.randint(1, 4))]
        if maker in (_sentence, _common) and rng.random() < 0.3:
            parts.insert(0, rng.choice(OPENERS))
        yield " ".join(parts) if maker in (_sentence, _common) else "\n".join(parts)


def train(output: Path = OUTPUT) -> Tokenizer:
    """Train the tokenizer on the synthetic corpus and save it to `output`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.save(str(output), pretty=False)
    return tokenizer


if __name__ == "__main__":
    trained = train()
    size = OUTPUT.stat().st_size
    print(f"wrote {OUTPUT} ({trained.get_vocab_size()} tokens, {size / 1024:.0f} KiB)")
