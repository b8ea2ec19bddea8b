"""The bundled byte-level BPE tokenizer (the simulated model's) and byte-level decoding.

Any text round-trips: `decode(encode(text)) == text`. Its special tokens are ChatML's plus
the Hermes tool-call markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)
# what CLAW_TOKENIZER may say to choose the bundled tokenizer explicitly
BUNDLED = "bundled"

# GPT-2's printable stand-ins for the 256 byte values (the ByteLevel pre-tokenizer alphabet).
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_OF_CHAR = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTABLE)
}


def is_bundled(path: str | None) -> bool:
    """Whether a tokenizer setting names the bundled tokenizer (unset, or `bundled`)."""
    return path is None or path == BUNDLED


@lru_cache(maxsize=8)
def _load(path: str | None) -> Tokenizer:
    if path is None:
        shipped = resources.files("claw_pipelines").joinpath("bundled_tokenizer", "tokenizer.json")
        return Tokenizer.from_str(shipped.read_text(encoding="utf-8"))
    return Tokenizer.from_file(path)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer at `path` (a Hugging Face tokenizer.json, or a directory holding one),
    default the bundled one; cached."""
    if is_bundled(path):
        return _load(None)
    assert path is not None
    if Path(path).is_dir():
        path = str(Path(path) / "tokenizer.json")
    return _load(path)


def encode(text: str, tokenizer: Tokenizer | None = None) -> list[int]:
    """Token ids of `text`; special-token strings in it become their special ids."""
    return (tokenizer or load_tokenizer()).encode(text, add_special_tokens=False).ids


def decode(
    ids: Sequence[int], tokenizer: Tokenizer | None = None, skip_special_tokens: bool = False
) -> str:
    """Text of token ids; by default the exact inverse of `encode` (special tokens kept)."""
    return (tokenizer or load_tokenizer()).decode(
        list(ids), skip_special_tokens=skip_special_tokens
    )


@lru_cache(maxsize=8)
def _token_bytes(tokenizer: Tokenizer) -> tuple[bytes, ...]:
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    table = []
    for token_id in range(tokenizer.get_vocab_size()):
        if token_id in added:
            table.append(added[token_id].encode("utf-8"))
            continue
        piece = tokenizer.id_to_token(token_id) or ""
        table.append(bytes(_BYTE_OF_CHAR.get(char, 0x3F) for char in piece))
    return tuple(table)


def token_bytes(tokenizer: Tokenizer | None = None) -> tuple[bytes, ...]:
    """The raw bytes of every token id of a byte-level tokenizer (index = id); cached."""
    return _token_bytes(tokenizer or load_tokenizer())


@lru_cache(maxsize=8)
def _byte_table(tokenizer: Tokenizer) -> pa.Array:
    return pa.array(token_bytes(tokenizer), pa.binary())


def decode_lists(ids: pa.ListArray | pa.ChunkedArray, tokenizer: str | None = None) -> pl.Series:
    """Texts of token-id lists with a byte-level tokenizer (default the bundled one),
    vectorized: a byte lookup per token and one join per list."""
    return decode_lists_with(ids, load_tokenizer(None if is_bundled(tokenizer) else tokenizer))


def decode_lists_with(ids: pa.ListArray | pa.ChunkedArray, tokenizer: Tokenizer) -> pl.Series:
    """`decode_lists` with a loaded byte-level tokenizer (ArrowInvalid when a text is not
    whole UTF-8)."""
    table = _byte_table(tokenizer)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    pieces = pa.ListArray.from_arrays(ids.offsets, pc.take(table, ids.values))
    texts = pc.binary_join(pieces, b"").cast(pa.large_string())
    series = pl.from_arrow(texts)
    assert isinstance(series, pl.Series)
    return series
