"""Tokenizers and chat templates (pure: no servers).

- `bundled`: the bundled byte-level BPE tokenizer (the simulated model's), encode/decode and
  vectorized decoding of token-id lists;
- `templates`: the ChatML template, a Jinja environment that renders Hugging Face chat
  templates as transformers does, and the templates a tokenizer folder holds;
- `chat`: a model's chat tokenizer (`load_chat_tokenizer`): the bundled one, or a Hugging
  Face tokenizer folder loaded as inference servers load it.
"""

from claw_pipelines.tokenization.bundled import (
    BUNDLED,
    END_OF_TEXT,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    decode,
    decode_lists,
    encode,
    is_bundled,
    load_tokenizer,
    token_bytes,
)
from claw_pipelines.tokenization.chat import (
    ChatTokenizer,
    TransformersChatTokenizer,
    load_chat_tokenizer,
    server_messages,
    transformers_installed,
)
from claw_pipelines.tokenization.templates import (
    DEFAULT_CHAT_TEMPLATE,
    encode_chat,
    folder_templates,
    render_chat,
    render_tool_call,
)

__all__ = [
    "BUNDLED",
    "DEFAULT_CHAT_TEMPLATE",
    "END_OF_TEXT",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ChatTokenizer",
    "TransformersChatTokenizer",
    "decode",
    "decode_lists",
    "encode",
    "encode_chat",
    "folder_templates",
    "is_bundled",
    "load_chat_tokenizer",
    "load_tokenizer",
    "render_chat",
    "render_tool_call",
    "server_messages",
    "token_bytes",
    "transformers_installed",
]
