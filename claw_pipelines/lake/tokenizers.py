"""The tokenizers of a lake's steps, kept in the lake: `_tokenizers/<fingerprint>/` holds the
small files of each model tokenizer folder a gateway or `claw import` used (tokenizer.json,
its configs and chat templates), so whoever reads the steps later (exports, judges, the
dashboard) decodes them with the tokenizer that produced them, on any machine. A step names
its tokenizer in `metadata.tokenizer` (`name`, `fingerprint`; silver's `tokenizer` column).
The bundled tokenizer ships with the package and is never copied."""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

from claw_pipelines.lake.delta import Lake
from claw_pipelines.tokenization import ChatTokenizer, load_chat_tokenizer
from claw_pipelines.tokenization.templates import TEMPLATE_DIR

TOKENIZER_FOLDER = "_tokenizers"
NAME_FILE = "claw-name.txt"  # the folder it was kept from (what steps call it)
# what a tokenizer folder needs to load as transformers loads it (no weights)
KEPT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",  # its model_type picks the tokenizer class
)


@lru_cache(maxsize=1)
def bundled_fingerprint() -> str:
    """The bundled tokenizer's fingerprint."""
    return load_chat_tokenizer().fingerprint


def save_tokenizer(lake: Lake, tokenizer: ChatTokenizer) -> str:
    """Keep a tokenizer folder's files in the lake under its fingerprint (once); return the
    fingerprint. The bundled tokenizer and bare tokenizer.json files are not copied."""
    fingerprint = tokenizer.fingerprint
    folder = Path(tokenizer.name)
    if fingerprint == bundled_fingerprint() or not folder.is_dir():
        return fingerprint
    home = f"{TOKENIZER_FOLDER}/{fingerprint}"
    if lake.read_text(f"{home}/tokenizer.json") is not None:
        return fingerprint
    names = [n for n in KEPT_FILES if (folder / n).is_file()]
    names += [f"{TEMPLATE_DIR}/{p.name}" for p in sorted((folder / TEMPLATE_DIR).glob("*.jinja"))]
    lake.write_text(f"{home}/{NAME_FILE}", tokenizer.name)
    for name in sorted(names, key=lambda n: n == "tokenizer.json"):  # the marker goes last
        lake.write_text(f"{home}/{name}", (folder / name).read_text(encoding="utf-8"))
    return fingerprint


def stored_fingerprints(lake: Lake) -> list[str]:
    """The fingerprints of the tokenizers kept in the lake."""
    names = lake.list_folders(TOKENIZER_FOLDER)
    return sorted(n for n in names if lake.read_text(f"{TOKENIZER_FOLDER}/{n}/tokenizer.json"))


def tokenizer_of(lake: Lake, fingerprint: str | None) -> ChatTokenizer | None:
    """The tokenizer with this fingerprint: the bundled one, or one kept in the lake (copied
    to a local folder and loaded as the gateway loaded it); None when the lake has none."""
    if fingerprint is None:
        return None
    if fingerprint == bundled_fingerprint():
        return load_chat_tokenizer()
    return _kept(lake.uri, tuple(sorted(lake.storage_options.items())), fingerprint)


@lru_cache(maxsize=16)
def _kept(uri: str, options: tuple[tuple[str, str], ...], fingerprint: str) -> ChatTokenizer | None:
    lake = Lake(uri, dict(options))
    home = f"{TOKENIZER_FOLDER}/{fingerprint}"
    if lake.read_text(f"{home}/tokenizer.json") is None:
        return None
    local = Path(tempfile.mkdtemp(prefix=f"claw-tokenizer-{fingerprint}-"))
    for name in [*lake.list_files(home), *lake.list_files(f"{home}/{TEMPLATE_DIR}")]:
        if name.endswith(NAME_FILE):
            continue
        target = local / name.removeprefix(home + "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(lake.read_text(name) or "", encoding="utf-8")
    chat = load_chat_tokenizer(str(local))
    chat.name = lake.read_text(f"{home}/{NAME_FILE}") or chat.name  # as its steps call it
    if chat.fingerprint != fingerprint:  # loaded otherwise than where it was kept from
        raise ValueError(
            f"the lake's tokenizer {fingerprint} loads here as {chat.fingerprint} (another "
            "transformers version?): decode with --tokenizer FOLDER instead"
        )
    return chat
