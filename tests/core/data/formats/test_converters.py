"""Each layout's converter on rows as other tools' docs show them: what it makes of them,
and the problem it names for each bad input."""

from __future__ import annotations

import copy
from typing import Any

from core.data.formats import LAYOUTS as ALL
from core.data.formats import Chat, Problems, columns_for
from core.spec import DatasetSpec, ShareGptTags
from tests.utils import samples

LAYOUTS = {lay.name: lay for lay in ALL}


def convert(layout: str, row: dict[str, Any], **ds: Any) -> tuple[Any, list[str]]:
    lay = LAYOUTS[layout]
    spec = DatasetSpec(file_id="f", **ds)
    cols, _ = columns_for(lay, spec)
    out = Problems()
    got = lay.convert(row, cols, spec, out)
    return got, [str(p) for p in out.items]


def test_openai_weight_0_turn_is_context_only() -> None:
    chat, problems = convert("openai_chat", samples.OPENAI_WEIGHTED)
    assert problems == [] and isinstance(chat, Chat)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.weights == [0, 0, 0, 0, 1]
    assert all("weight" not in m for m in chat.messages)  # templates never see it


def test_openai_tools_and_tool_calls_are_kept_for_the_template() -> None:
    chat, problems = convert("openai_chat", samples.OPENAI_TOOLS)
    assert problems == []
    assert chat.tools == [samples.WEATHER_TOOL]
    call = chat.messages[1]["tool_calls"][0]
    # Arguments as an object (OpenAI stores JSON text): templates write them with tojson.
    assert call["function"]["arguments"] == {"location": "San Francisco, USA", "format": "celsius"}
    assert chat.messages[1]["content"] == "" and chat.weights == [0, 1, 0, 1]
    assert chat.messages[2] == {"role": "tool", "content": '{"temperature": 18}',
                                "tool_call_id": "call_id"}


def test_openai_legacy_functions_become_tools() -> None:
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "function_call": {"name": "get_current_weather",
                                                    "arguments": '{"location": "Paris"}'}},
            {"role": "function", "name": "get_current_weather", "content": "20C"},
            {"role": "assistant", "content": "20 degrees."},
        ],
        "functions": [samples.WEATHER_TOOL["function"]],
    }
    chat, problems = convert("openai_chat", row)
    assert problems == []
    assert chat.tools == [samples.WEATHER_TOOL]
    assert chat.messages[1]["tool_calls"][0]["function"]["name"] == "get_current_weather"
    assert chat.messages[2] == {"role": "tool", "content": "20C", "name": "get_current_weather"}


def test_openai_text_parts_are_joined() -> None:
    chat, problems = convert("openai_chat", samples.OPENAI_PARTS)
    assert problems == []
    assert [m["content"] for m in chat.messages] == ["What is two plus two?", "Four."]


def test_openai_images_are_refused_saying_so() -> None:
    _, problems = convert("openai_chat", samples.OPENAI_IMAGE)
    assert problems == [
        ("field 'messages[0].content[1]': a image_url part: images, audio and files are not "
        "supported (ftune trains text models); remove the part or the row")
    ]


def test_openai_bad_weights_are_named() -> None:
    row = copy.deepcopy(samples.OPENAI_WEIGHTED)
    row["messages"][4]["weight"] = 0.5
    assert convert("openai_chat", row)[1] == ["field 'messages[4].weight': must be 0 or 1, got 0.5"]
    row["messages"][4]["weight"] = 0
    assert convert("openai_chat", row)[1] == [
        "field 'messages': every assistant turn has weight 0: nothing to learn"
    ]
    row["messages"][1]["weight"] = 1
    assert convert("openai_chat", row)[1] == [
        "field 'messages[1].weight': only assistant messages carry a weight"
    ]


def test_alpaca_joins_instruction_and_input_as_llama_factory_does() -> None:
    (plain, _), (with_input, _) = (convert("alpaca", r) for r in samples.ALPACA)
    assert plain.messages[0] == {"role": "user", "content": "Describe a process of making crepes."}
    assert with_input.messages == [
        {"role": "user", "content": "Identify the odd one out.\nTwitter, Instagram, Telegram"},
        {"role": "assistant", "content": "Telegram"},
    ]
    assert with_input.weights == [0, 1]


def test_alpaca_system_and_history_come_first() -> None:
    row = {**samples.ALPACA[1], "system": "Be brief.",
           "history": [["Name a bird.", "A robin."]]}
    chat, problems = convert("alpaca", row)
    assert problems == []
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.weights == [0, 0, 1, 0, 1]  # history answers are learned, as LLaMA-Factory does


def test_alpaca_columns_can_be_renamed() -> None:
    row = {"question": "Name a bird.", "answer": "A robin."}
    chat, problems = convert("alpaca", row, columns={"prompt": "question", "response": "answer"})
    assert problems == [] and chat.messages[1]["content"] == "A robin."


def test_sharegpt_roles_tools_and_function_calls() -> None:
    chat, problems = convert("sharegpt", samples.SHAREGPT_TOOLS)
    assert problems == []
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool", "assistant"]
    assert chat.messages[1]["tool_calls"][0]["function"] == {
        "name": "convert_currency",
        "arguments": {"amount": 500, "from_currency": "USD", "to_currency": "EUR"},
    }
    assert chat.tools is not None and chat.tools[0]["function"]["name"] == "convert_currency"
    chat, _ = convert("sharegpt", samples.SHAREGPT)
    assert chat.messages[0] == {"role": "system", "content": "You are a helpful assistant."}


def test_sharegpt_tags_map_other_names() -> None:
    row = {"conversations": [{"role": "user", "text": "hi"}, {"role": "bot", "text": "hello"}]}
    tags = ShareGptTags(role_tag="role", content_tag="text", user_tag="user", assistant_tag="bot")
    chat, problems = convert("sharegpt", row, tags=tags)
    assert problems == [] and chat.messages[1] == {"role": "assistant", "content": "hello"}


def test_sharegpt_unknown_role_is_named() -> None:
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}
    assert convert("sharegpt", row)[1] == [
        ("field 'conversations[1].from': 'bot' is not one of 'human', 'gpt', 'observation', "
        "'function_call', 'system'")
    ]


def test_openai_dpo_becomes_trl_messages() -> None:
    got, problems = convert("openai_dpo", samples.OPENAI_DPO)
    assert problems == []
    assert got["prompt"] == samples.OPENAI_DPO["input"]["messages"]
    assert got["chosen"] == samples.OPENAI_DPO["preferred_output"]
    assert got["rejected"] == samples.OPENAI_DPO["non_preferred_output"]
    assert "tools" not in got  # an empty tools list is no tools


def test_sharegpt_preference_becomes_trl_messages() -> None:
    got, problems = convert("sharegpt_preference", samples.SHAREGPT_DPO)
    assert problems == []
    assert got == {
        "prompt": [{"role": "user", "content": "What is the color of the sky?"}],
        "chosen": [{"role": "assistant", "content": "The sky is blue on a clear day."}],
        "rejected": [{"role": "assistant", "content": "The sky is green."}],
    }


def test_trl_implicit_prompt_is_the_shared_start() -> None:
    got, problems = convert("trl_implicit_preference", samples.TRL_IMPLICIT)
    assert problems == []
    assert got == {k: samples.TRL_PAIR[k] for k in ("prompt", "chosen", "rejected")}


def test_kto_messages_last_assistant_turn_is_the_completion() -> None:
    got, problems = convert("kto_messages", samples.KTO_MESSAGES)
    assert problems == []
    assert got["prompt"] == [{"role": "user", "content": "Tell me a fact about the moon."}]
    assert got["completion"] == [{"role": "assistant", "content": "The moon orbits the earth."}]
    assert got["label"] is True
    _, problems = convert("kto_messages", {**samples.KTO_MESSAGES, "label": "yes"})
    assert problems == ["field 'label': must be true or false, got 'yes'"]
