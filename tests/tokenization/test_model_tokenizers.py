"""A model's own tokenizer folder (`CLAW_TOKENIZER`), as transformers loads it: prompt ids
equal `AutoTokenizer.from_pretrained(folder).apply_chat_template(...)` for every message
shape the proxy accepts, across template families (ChatML with tools, Llama 3, Mistral,
named templates) and folder layouts (transformers 5 files, transformers 4's config, a
processor's chat_template.json). A folder whose model-specific tokenizer class would change
pre-tokenization is honoured through transformers, and refused in one line without it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from claw_pipelines.simulation.model_folders import FAMILIES, tokenizer_folder
from claw_pipelines.tokenization import (
    TransformersChatTokenizer,
    load_chat_tokenizer,
    load_tokenizer,
    server_messages,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find a fact.",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
            },
        },
    }
]
CALL = {
    "id": "call00001",  # 9 characters: Mistral's templates insist
    "type": "function",
    "function": {"name": "lookup", "arguments": '{"q":"Peru capital"}'},
}
SHAPES = {
    "user": [{"role": "user", "content": "Count 12345 then say 678."}],
    "system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo  wörld\n\nagain ✓ 3.14159"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
        },
    ],
    "tool-result": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is the capital of Peru?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "Lima"},
    ],
}
LAYOUTS = ["v5", "v4", "processor"]


def _truth(folder, layout: str, messages: list[dict], tools) -> list[int]:
    """What a server computes: AutoTokenizer's apply_chat_template on the messages as servers
    pass them (text parts joined, tool-call arguments parsed)."""
    hf = AutoTokenizer.from_pretrained(str(folder))
    template = None
    if layout == "processor":  # the tokenizer does not read a processor's file: pass it
        template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
    ids = hf.apply_chat_template(
        server_messages(messages),
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        chat_template=template,
    )
    return list(ids)


def _valid(family: str, shape: str, tools) -> bool:
    """Conversations a family's template renders (as the real ones: Mistral wants user and
    assistant turns to alternate; a plain named default knows no tool messages)."""
    if family == "mistral" and shape == "tool-result":
        return True  # user, tool call, tool result: alternation skips tool turns
    return not (family == "chatml-named" and shape == "tool-result" and not tools)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    built = {}
    for family, layout in CASES:
        built[family, layout] = tokenizer_folder(root / f"{family}-{layout}", family, layout)
    return built


# a processor's chat_template.json holds one template: no named ones there
CASES = [
    (f, layout)
    for f in FAMILIES
    for layout in LAYOUTS
    if (f, layout) != ("chatml-named", "processor")
]


@pytest.mark.parametrize(("family", "layout"), CASES)
@pytest.mark.parametrize("engine", ["transformers", "jinja"])
def test_prompt_ids_equal_autotokenizers_for_every_message_shape(folders, family, layout, engine):
    folder = folders[family, layout]
    chat = load_chat_tokenizer(str(folder), use_transformers=engine == "transformers")
    assert isinstance(chat, TransformersChatTokenizer) == (engine == "transformers")
    compared = 0
    for shape, messages in SHAPES.items():
        for tools in (None, TOOLS):
            if not _valid(family, shape, tools):
                continue
            assert chat.prompt_ids(messages, tools) == _truth(folder, layout, messages, tools), (
                shape,
                tools is not None,
            )
            compared += 1
    assert compared >= 6


def test_the_tool_template_is_picked_when_tools_are_given(folders):
    chat = load_chat_tokenizer(str(folders["chatml-named", "v5"]))
    messages = SHAPES["user"]
    assert "# Tools" in chat.render(messages, TOOLS)
    assert "# Tools" not in chat.render(messages)
    assert set(chat.templates) == {"default", "tool_use"}


def test_a_model_specific_tokenizer_class_is_honoured_or_refused(tmp_path):
    folder = tokenizer_folder(tmp_path / "qwen2", "chatml", "v5", model_type="qwen2")
    messages = SHAPES["user"]
    chat = load_chat_tokenizer(str(folder))
    truth = _truth(folder, "v5", messages, None)
    assert chat.prompt_ids(messages) == truth
    # the folder's tokenizer.json as written splits digits otherwise: the difference is real
    raw = load_tokenizer(str(folder)).encode(chat.render(messages), add_special_tokens=False).ids
    assert raw != truth
    with pytest.raises(ValueError) as refused:
        load_chat_tokenizer(str(folder), use_transformers=False)
    message = str(refused.value)
    assert "\n" not in message
    assert "model_type 'qwen2'" in message and "install transformers" in message


def test_fingerprints_tell_tokenizers_apart(folders):
    a = load_chat_tokenizer(str(folders["chatml", "v5"]))
    b = load_chat_tokenizer(str(folders["llama3", "v5"]))
    again = load_chat_tokenizer(str(folders["chatml", "v4"]), use_transformers=False)
    assert len(a.fingerprint) == 16 and a.fingerprint != b.fingerprint
    assert a.name == str(folders["chatml", "v5"])
    assert again.fingerprint != b.fingerprint
