"""Named chat templates for ``dataset.chat_template``, and the check of one at submit.

chatml: ``<|im_start|>role\\ncontent<|im_end|>`` turns (Qwen's layout), tools listed in the
system turn inside <tools>, assistant tool calls as <tool_call>{json}</tool_call> and tool
answers as a ``tool`` turn. No {% generation %} markers: ftune finds the assistant spans
itself (core/data/chat_spans.py), which is what a tokenizer's own template usually needs too.
"""

from __future__ import annotations

from typing import Any

CHATML = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}"
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

NAMED = {"chatml": CHATML}


def template_source(value: str) -> str:
    """A named template's Jinja source, or the value itself (a Jinja string)."""
    return NAMED.get(value, value)


def template_problem(value: str) -> str | None:
    """Why a dataset.chat_template value cannot be used (None: it can): an unknown name,
    or Jinja that does not compile or render a small conversation."""
    if value in NAMED:
        return None
    if "{" not in value:
        return f"{value!r} is neither a named template ({', '.join(NAMED)}) nor Jinja text"
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with transformers
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        text = env.from_string(value).render(
            messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
            add_generation_prompt=False, tools=None, bos_token="", eos_token="",
        )
    except TemplateError as e:
        return f"not a usable Jinja chat template: {e}"
    except Exception as e:  # noqa: BLE001 - a template may raise anything while rendering
        return f"the template fails on a two-message conversation: {e}"
    if "Yo" not in text:
        return "the template drops the assistant's text of a two-message conversation"
    return None


def _raise(message: str) -> Any:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
