"""Hugging Face tokenizer and model folders built locally (no hub): the bundled vocabulary with
the special tokens and the chat-template layout of several model families, saved the way
transformers saves them, and a tiny random Qwen2 beside one for a real inference server
(`transformers serve`). Needs transformers (and torch for a model): the `train` extra.

The templates are written here in each family's layout (ChatML with Qwen's tool section;
Llama 3's header blocks with tools in the system turn; Mistral's `[INST]` turns with
`[AVAILABLE_TOOLS]`); they use what real templates use (namespaces, `tojson(indent=…)`,
`raise_exception`, `{% generation %}`, loop controls), not any model's exact text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from claw_pipelines.tokenization import load_tokenizer

Layout = Literal["v5", "v4", "named", "processor"]

CHATML = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn a json object per call within <tool_call></tool_call> tags.'
    '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "01 Jan 2026" %}{%- endif %}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools %}
{{- 'Respond with JSON {"name": function name, "parameters": arguments} to call one of:\\n\\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role in ('user', 'assistant') and not message.tool_calls %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{%- if message.role == 'assistant' %}
{% generation %}{{- message.content | trim }}{% endgeneration %}
{%- else %}{{- message.content | trim }}{%- endif %}
{{- '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping %}{{- message.content | tojson }}
{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """\
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
{%- if message.role in ('user', 'assistant') and not message.tool_calls %}
{%- if (message.role == 'user') != (ns.index % 2 == 0) %}
{{- raise_exception('conversation roles must alternate user/assistant') }}
{%- endif %}
{%- set ns.index = ns.index + 1 %}
{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools and message == user_messages[-1] %}
{{- '[AVAILABLE_TOOLS] [' }}
{%- for tool in tools %}
{{- '{"type": "function", "function": {' }}
{%- for key, value in tool.function | items %}
{{- '"' + key + '": ' + value | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- '}}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- '][/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if loop.last and system_message is defined %}
{{- '[INST] ' + system_message + '\\n\\n' + message.content + '[/INST]' }}
{%- else %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- endif %}
{%- elif message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{%- if call.id is not defined or call.id | length != 9 %}
{{- raise_exception('tool call ids must have 9 characters') }}
{%- endif %}
{{- (call.function | tojson)[:-1] + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content | trim + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "' }}
{{- message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('unsupported role ' + message.role) }}
{%- endif %}
{%- endfor %}
"""


@dataclass(frozen=True)
class Family:
    """A model family's chat layout: its special tokens and template(s)."""

    name: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    templates: dict[str, str] = field(default_factory=dict)  # `default`, maybe `tool_use`


FAMILIES = {
    family.name: family
    for family in (
        Family(
            "chatml",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            None,
            "<|im_end|>",
            {"default": CHATML},
        ),
        Family(
            "llama3",
            ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            "<|begin_of_text|>",
            "<|eot_id|>",
            {"default": LLAMA3},
        ),
        Family(
            "mistral",
            (
                *("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
                *("[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
            ),
            "<s>",
            "</s>",
            {"default": MISTRAL},
        ),
        # named templates: plain chat by default, the tool layout under `tool_use`
        Family(
            "chatml-named",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            None,
            "<|im_end|>",
            {
                "default": "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + "
                "m.content + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
                "tool_use": CHATML,
            },
        ),
    )
}


def _tokenizer_object(family: Family) -> Any:
    """The bundled vocabulary plus the family's special tokens (new ids past the vocabulary)."""
    from tokenizers import AddedToken

    tokenizer = load_tokenizer()
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in family.specials]
    )
    return copy


def tokenizer_folder(
    root: Path, family: str = "chatml", layout: Layout = "v5", model_type: str | None = None
) -> Path:
    """A tokenizer folder of `family` at `root`: saved by transformers 5 (`v5`: the template
    in chat_template.jinja, named ones in additional_chat_templates/), in transformers 4's
    layout (`v4`: templates inside tokenizer_config.json, a named list when several), or
    with the template only in a processor's chat_template.json (`processor`). With
    `model_type`, a config.json naming it (transformers then picks that model's tokenizer
    class)."""
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    root.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer_object(spec),
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.specials[0],
    )
    templates = spec.templates
    fast.chat_template = templates["default"] if len(templates) == 1 else dict(templates)
    fast.save_pretrained(str(root))
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if layout in ("v4", "processor"):
        for path in [root / "chat_template.jinja", *root.glob("additional_chat_templates/*")]:
            path.unlink()
        if (root / "additional_chat_templates").is_dir():
            (root / "additional_chat_templates").rmdir()
    if layout == "v4":
        config["chat_template"] = (
            templates["default"]
            if len(templates) == 1
            else [{"name": n, "template": t} for n, t in templates.items()]
        )
    if layout == "processor":
        (root / "chat_template.json").write_text(
            json.dumps({"chat_template": templates["default"]})
        )
    config_path.write_text(json.dumps(config, indent=2))
    if model_type is not None:
        (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def tiny_model_folder(root: Path, family: str = "chatml", seed: int = 0) -> Path:
    """A tiny random Qwen2 and its tokenizer in one folder, for `transformers serve`. It
    samples whole words with a leading space (which re-encoding its text gives back) and,
    now and then, a multi-digit number (which Qwen2's tokenizer, splitting digits, does not:
    so about half its replies re-encode exactly and half do not), and ends most replies with
    the family's end-of-turn token within a few dozen tokens."""
    tokenizer_folder(root, family, "v5")
    tokenizer = _tokenizer_object(FAMILIES[family])
    return _qwen2_folder(
        root,
        family,
        seed,
        sampled=_reply_ids(root, tokenizer),
        ends=True,
        max_new_tokens=24,
        # the end-of-turn token grows likelier with every token: replies end on their own
        exponential_decay_length_penalty=(4, 1.6),
    )


def word_policy_folder(
    root: Path, words: int = 128, seed: int = 0, max_new_tokens: int = 6
) -> Path:
    """A tiny random Qwen2 that says only `words` whole words (chosen by `seed` among the
    words its tokenizer encodes back to one token each) and never ends a reply by itself:
    every reply is `max_new_tokens` words, re-encoding exactly. The starting policy of the
    learning loop (`claw demo --learn`); its generation config's `suppress_tokens` is the
    sampling distribution's support (`sampled_ids`)."""
    import random

    tokenizer_folder(root, "chatml", "v5")
    tokenizer = _tokenizer_object(FAMILIES["chatml"])
    candidates = _word_ids(root, tokenizer)
    if len(candidates) < words:
        raise ValueError(f"words: the tokenizer has {len(candidates)} one-token words, not {words}")
    chosen = sorted(random.Random(seed).sample(candidates, words))
    return _qwen2_folder(
        root, "chatml", seed, sampled=chosen, ends=False, max_new_tokens=max_new_tokens
    )


def sampled_ids(folder: Path) -> list[int]:
    """The token ids a model folder's generation config lets it sample (those not in
    `suppress_tokens`), in id order."""
    config = json.loads((folder / "generation_config.json").read_text())
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return sorted(set(range(vocab)) - set(config.get("suppress_tokens") or ()))


def _qwen2_folder(
    root: Path,
    family: str,
    seed: int,
    sampled: list[int],
    ends: bool,
    max_new_tokens: int,
    **generation: Any,
) -> Path:
    """A random 2-layer Qwen2 (hidden 64) saved beside the tokenizer folder at `root`, whose
    generation config samples at temperature 1 from `sampled` only (and the family's
    end-of-turn token when `ends`)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = FAMILIES[family]
    tokenizer = _tokenizer_object(spec)
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id(spec.eos)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=eos,
        pad_token_id=tokenizer.token_to_id(spec.specials[0]),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(str(root))
    allowed = set(sampled) | ({eos} if ends else set())
    GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=config.pad_token_id,
        suppress_tokens=sorted(set(range(vocab)) - allowed),
        **generation,
    ).save_pretrained(str(root))
    return root


NUMBERS_SAMPLED = 60  # multi-digit tokens a reply may hold: about half the replies get one


def _reply_ids(folder: Path, tokenizer: Any) -> list[int]:
    """The ids the tiny model may sample: words with a leading space that the folder's own
    tokenizer (as transformers loads it) encodes back to themselves, and a few multi-digit
    numbers, which it does not."""
    import re

    from claw_pipelines.tokenization import token_bytes

    numbers = []
    for token_id, piece in enumerate(token_bytes(tokenizer)):
        if re.fullmatch(rb"[0-9]{2,}", piece):
            numbers.append(token_id)
    return _word_ids(folder, tokenizer) + numbers[:NUMBERS_SAMPLED]


def _word_ids(folder: Path, tokenizer: Any) -> list[int]:
    """Ids of words with a leading space (two letters or more) that the folder's own
    tokenizer, as transformers loads it, encodes back to themselves, in id order."""
    import re

    from transformers import AutoTokenizer

    from claw_pipelines.tokenization import token_bytes

    hf = AutoTokenizer.from_pretrained(str(folder))
    words = []
    for token_id, piece in enumerate(token_bytes(tokenizer)):
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if re.fullmatch(r" [A-Za-z]{2,}", text) and hf.encode(text, add_special_tokens=False) == [
            token_id
        ]:
            words.append(token_id)
    return words
