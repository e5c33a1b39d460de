"""The checks that relate an eval's parts: template fields against the item schema, rows
against it."""

from __future__ import annotations

from core.evals.checks import missing_field, row_problems

SCHEMA = {"type": "object", "properties": {
    "question": {"type": "string"},
    "meta": {"type": "object", "properties": {"lang": {"type": "string"}}},
    "free": {"type": "object"}}}


def test_a_declared_field_and_a_nested_one_are_found() -> None:
    assert missing_field(SCHEMA, ("question",)) is None
    assert missing_field(SCHEMA, ("meta", "lang")) is None


def test_a_field_the_schema_lacks_is_named_with_what_it_has() -> None:
    assert missing_field(SCHEMA, ("answer",)) == (
        "the item schema has no field 'answer' (its properties: free, meta, question)")
    assert missing_field(SCHEMA, ("meta", "langs")) == (
        "item.meta has no field 'langs' (its properties: lang)")


def test_an_object_without_declared_properties_is_taken_at_its_word() -> None:
    assert missing_field(SCHEMA, ("free", "anything")) is None


def test_rows_are_checked_with_their_numbers_and_a_bounded_report() -> None:
    rows = [(n, {"item": {"question": n}}) for n in range(100)]
    found = row_problems(rows, SCHEMA, needs_sample=False, item_reference=None)
    assert len(found) == 20 and found[0] == (0, "item.question: 0 is not of type 'string'")


def test_an_item_reference_needs_messages_in_every_row() -> None:
    rows = [(0, {"item": {"chat": [{"role": "user", "content": "hi"}]}}),
            (1, {"item": {"chat": "hi"}})]
    found = row_problems(rows, {"type": "object"}, needs_sample=False,
                         item_reference="item.chat")
    assert found == [(1, "item.chat: must be a non-empty list of chat messages")]
