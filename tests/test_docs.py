"""The documents stay true to the code: every link between README.md and docs/ reaches an
existing file and heading, and every setting the service reads is documented somewhere in
docs/ (docs/settings.md, or the topic's own page such as docs/grpo.md or docs/slurm.md)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import AliasChoices

from core.infra.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
# Linked before they exist: this round's serving, evaluations, sandbox and retention work
# writes them on branches of its own. Once one exists, take it out of here (a test below
# says so).
PLANNED: set[str] = set()
# Dated records: they name the files of their day.
RECORDS = {"benchmarks.md", "benchmarks-history.md", "facts.md"}


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces to
    hyphens, repeats numbered), plus explicit <a id="..."> anchors."""
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        found.update(re.findall(r'<a id="([^"]+)"', line))
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            base = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchor, n = base, 1
            while anchor in found:
                anchor, n = f"{base}-{n}", n + 1
            found.add(anchor)
    return found


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text)
            if not t.startswith(("http://", "https://", "mailto:"))]


def test_every_link_reaches_an_existing_file_and_heading() -> None:
    broken = []
    for doc in documents():
        for link in relative_links(doc):
            file_part, _, anchor = link.partition("#")
            target = (doc.parent / file_part).resolve() if file_part else doc
            name = target.relative_to(REPO_ROOT).as_posix() if target.is_relative_to(
                REPO_ROOT) else str(target)
            if not target.exists():
                if name not in PLANNED:
                    broken.append(f"{doc.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
                broken.append(f"{doc.name}: {link} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_file_and_folder_the_documents_name_exists() -> None:
    # A file moved in the code leaves its old path in the documents that name it; this
    # lists them. The dated records are left as they were written.
    top = "|".join(re.escape(p.name) for p in REPO_ROOT.iterdir()
                   if p.is_dir() and not p.name.startswith("."))
    missing = []
    for doc in documents():
        if doc.name in RECORDS:
            continue
        for path in sorted(set(re.findall(rf"(?<![\w./-])((?:{top})/[\w./-]*)",
                                          doc.read_text()))):
            if not (REPO_ROOT / path.rstrip(".")).exists() and path not in PLANNED:
                missing.append(f"{doc.name}: {path}")
    assert not missing, "paths named in the documents that do not exist:\n" + "\n".join(missing)


def test_planned_documents_are_still_to_be_written() -> None:
    written = sorted(p for p in PLANNED if (REPO_ROOT / p).exists())
    assert not written, f"{written} exist now: remove them from PLANNED in tests/test_docs.py"


def test_every_setting_is_documented() -> None:
    text = "\n".join(p.read_text() for p in documents())
    named = set(re.findall(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))
    undocumented = []
    for field_name, field in Settings.model_fields.items():
        alias = field.validation_alias
        names = ([c for c in alias.choices if isinstance(c, str)]
                 if isinstance(alias, AliasChoices) else [f"FTUNE_{field_name.upper()}"])
        if not named.intersection(names):
            undocumented.append(names[0])
    assert not undocumented, (
        f"settings no document names (add them to docs/settings.md): {undocumented}"
    )
