"""Rows as other tools' documentation shows them: OpenAI's chat, tools and DPO files,
LLaMA-Factory's alpaca, ShareGPT (glaive tool calls), DPO and KTO demo data, TRL's
preference layouts. Used by the converter, API and trainer tests alike."""

from __future__ import annotations

import json
from typing import Any

# OpenAI fine-tuning guide: a multi-turn chat whose first answer is kept as context only.
OPENAI_WEIGHTED = {
    "messages": [
        {"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."},
        {"role": "user", "content": "What's the capital of France?"},
        {"role": "assistant", "content": "Paris", "weight": 0},
        {"role": "user", "content": "Can you be more sarcastic?"},
        {"role": "assistant", "content": "Paris, as if everyone doesn't know that already.",
         "weight": 1},
    ]
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and country, eg. San Francisco, USA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "format"],
        },
    },
}

# OpenAI function-calling fine-tuning: an assistant turn that only calls a tool.
OPENAI_TOOLS = {
    "messages": [
        {"role": "user", "content": "What is the weather in San Francisco?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_id", "type": "function", "function": {
                    "name": "get_current_weather",
                    "arguments": '{"location": "San Francisco, USA", "format": "celsius"}',
                }}
            ],
        },
        {"role": "tool", "tool_call_id": "call_id", "content": '{"temperature": 18}'},
        {"role": "assistant", "content": "It is 18 degrees celsius in San Francisco."},
    ],
    "tools": [WEATHER_TOOL],
    "parallel_tool_calls": False,
}

OPENAI_PARTS = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is "},
                                     {"type": "text", "text": "two plus two?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Four."}]},
    ]
}

OPENAI_IMAGE = {
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        ]},
        {"role": "assistant", "content": "A cat."},
    ]
}

# OpenAI preference fine-tuning (DPO) guide.
OPENAI_DPO = {
    "input": {
        "messages": [{"role": "user", "content": "Hello, can you tell me how cold San Francisco is today?"}],
        "tools": [],
        "parallel_tool_calls": True,
    },
    "preferred_output": [{"role": "assistant", "content": "Today in San Francisco, it is not quite "
                          "cold as expected. Morning clouds will give away to sunshine."}],
    "non_preferred_output": [{"role": "assistant", "content": "It is not particularly cold in San "
                              "Francisco today."}],
}

# LLaMA-Factory data/alpaca_en_demo.json: most rows have an empty input.
ALPACA = [
    {"instruction": "Describe a process of making crepes.", "input": "",
     "output": "Making crepes is an easy and delicious process."},
    {"instruction": "Identify the odd one out.", "input": "Twitter, Instagram, Telegram",
     "output": "Telegram"},
]

# LLaMA-Factory data/glaive_toolcall_en_demo.json (ShareGPT with tools as JSON text).
SHAREGPT_TOOLS = {
    "conversations": [
        {"from": "human", "value": "Hi, I need to convert 500 US dollars to Euros."},
        {"from": "function_call", "value": json.dumps({"name": "convert_currency", "arguments": {
            "amount": 500, "from_currency": "USD", "to_currency": "EUR"}})},
        {"from": "observation", "value": json.dumps({"converted_amount": 425.5})},
        {"from": "gpt", "value": "Sure, 500 US dollars is approximately 425.50 Euros."},
    ],
    "tools": json.dumps([{"name": "convert_currency", "description": "Convert amount from one "
                          "currency to another", "parameters": {"type": "object", "properties": {
                              "amount": {"type": "number"}, "from_currency": {"type": "string"},
                              "to_currency": {"type": "string"}}}}]),
}

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "You are a helpful assistant."},
        {"from": "human", "value": "Name a red fruit."},
        {"from": "gpt", "value": "An apple."},
    ]
}

# LLaMA-Factory data/dpo_en_demo.json.
SHAREGPT_DPO = {
    "conversations": [{"from": "human", "value": "What is the color of the sky?"}],
    "chosen": {"from": "gpt", "value": "The sky is blue on a clear day."},
    "rejected": {"from": "gpt", "value": "The sky is green."},
}

# LLaMA-Factory data/kto_en_demo.json.
KTO_MESSAGES = {
    "messages": [
        {"content": "Tell me a fact about the moon.", "role": "user"},
        {"content": "The moon orbits the earth.", "role": "assistant"},
    ],
    "label": True,
}

# TRL's dataset formats page: conversational explicit and implicit prompt.
TRL_PAIR = {
    "prompt": [{"role": "user", "content": "What color is the sky?"}],
    "chosen": [{"role": "assistant", "content": "It is blue."}],
    "rejected": [{"role": "assistant", "content": "It is green."}],
}
TRL_IMPLICIT = {
    "chosen": [{"role": "user", "content": "What color is the sky?"},
               {"role": "assistant", "content": "It is blue."}],
    "rejected": [{"role": "user", "content": "What color is the sky?"},
                 {"role": "assistant", "content": "It is green."}],
}


def unweighted(row: dict[str, Any]) -> dict[str, Any]:
    """The same chat with every ``weight`` key removed."""
    return {**row, "messages": [{k: v for k, v in m.items() if k != "weight"}
                                for m in row["messages"]]}
