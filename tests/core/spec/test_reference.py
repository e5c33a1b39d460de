"""docs/spec.md is the JobSpec's schema laid out for reading (core/spec/reference.py)."""

from __future__ import annotations

from pathlib import Path

from core.spec import JobSpec
from core.spec.reference import reference_markdown

REPO = Path(__file__).resolve().parents[3]


def test_docs_spec_md_is_generated_from_the_current_schema() -> None:
    # Regenerate with: .venv/bin/python -m core.spec.reference > docs/spec.md
    assert (REPO / "docs" / "spec.md").read_text() == reference_markdown()


def test_every_field_of_every_section_has_a_row_with_its_description() -> None:
    schema = JobSpec.model_json_schema()
    text = reference_markdown()
    sections = [schema, *schema["$defs"].values()]
    for section in sections:
        for name, prop in section.get("properties", {}).items():
            assert prop.get("description"), f"{section['title']}.{name} has no description"
            assert f"| `{name}` |" in text, f"{section['title']}.{name} is not in docs/spec.md"
