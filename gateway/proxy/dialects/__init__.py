"""Other agent protocols through the proxy, translated to the upstream's chat completions.

- `base.py`: what a translated call is to the proxy (`DialectCall`, `DialectStream`): its chat
  body, its answer made from the chat answer, its stream's events made from the chat chunks,
  its errors in its own shape.
- `responses.py`: OpenAI's Responses API (`POST /v1/responses`): input items, function calls
  and their outputs as items, `previous_response_id` chains, streamed semantic events.
- `response_store.py`: the conversations behind response ids, read back from the WAL and
  bronze after a restart (so a `previous_response_id` chain survives it).
- `messages.py`: Anthropic's Messages API (`POST /v1/messages`): system, content blocks,
  `tool_use` / `tool_result`, `stop_reason`, streamed events, Anthropic's error shape.
"""

from gateway.proxy.dialects.base import DialectCall, DialectStream
from gateway.proxy.dialects.messages import MessagesCall, open_messages
from gateway.proxy.dialects.responses import Responses, ResponsesCall

__all__ = [
    "DialectCall",
    "DialectStream",
    "MessagesCall",
    "Responses",
    "ResponsesCall",
    "open_messages",
]
