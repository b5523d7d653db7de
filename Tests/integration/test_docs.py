"""Every citation of a document resolves (issue 44, item 5): the code, the tests and the docs
point readers at sections of docs/*.md, the README and bench/README.md, and a section renamed
or moved leaves them pointing at nothing. This scans Sources/, Tests/, scripts/, bench/,
packaging/, man/, .ci/, docs/ and README.md for every form of citation used there:

- a quoted section after a file: `docs/security.md, "Time bounds"`, `docs/security.md
  ("The cache directory")`, `bench/README.md "--tls"`, `(README, "Errors")`, the README's
  "Errors" table, several joined by "and"; and the other way round, `"Shutdown" in
  architecture.md`. The section must be a heading of that file: equal to it once backticks,
  a trailing parenthetical and a leading number are taken off, or its part before a colon;
- a named part of a section: `"Adaptive transfers": Sharing)` must be a bullet of that
  section that starts with the name;
- a quotation after a colon, `bench/README.md: "Latency rows use..."`: the text must be in
  the file;
- numbered items and sections: `docs/fuse-notes.md, item 11` (a list item "11." of the file),
  `docs/protocol.md §1.3, §8` and `docs/integrity.md, level 2` (headings numbered so);
- markdown links in .md files, `[text](docs/operations.md#metrics)` and `(#offline-use)`: the
  file must exist and the anchor must be one of its headings' (GitHub's slugs);
- inside a .md file, `"Results" below` / `("Cache writes", above)`: a heading of that file;
  `(see "--chart")`: a heading of that file or a bold label (`**Bandwidth.**`) in it;
- any path to a .md file (`docs/design.md`): the file must exist in this repository (the
  team's shared docs are not the project's: cite docs/ here, never ../shared).

A comment's lines are joined before scanning, so a citation wrapped over two comment lines
counts. Needs no mount and no server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["Sources", "Tests", "scripts", "bench", "packaging", "man", ".ci", "docs", "README.md"]
SKIPPED_SUFFIXES = {".png", ".jpg", ".gz", ".deb", ".o", ".pyc", ".json", ".pem", ".key", ".crt"}
THIS = Path(__file__).resolve()

# A cited file: a path ending in .md, or the README by name.
FILE = r"(?P<file>(?<![\w/.-])(?:(?:\.\./|[\w.-]+/)*[\w-]+\.md|README)(?![\w-]))"
QUOTED = r"[\"\u201c](?P<sec>[^\"\u201d\n]{1,100})[\"\u201d]"
SECTION_AFTER_FILE = re.compile(
    FILE + r"(?:'s)?\]?\)?(?P<sep>\s*[,:]\s*\(?\s*|\s*\(\s*|\s+)" + QUOTED
    + r"(?P<more>(?:\s*(?:,\s*)?and\s+[\"\u201c][^\"\u201d\n]{1,100}[\"\u201d])*)"
    # A named part: capitalised ("Sharing", "Kept in memory") or a possessive ("curl's ...").
    + r"(?P<label>[:,]\s*(?:[A-Z]|[a-z]+'s\s)[A-Za-z' -]{0,40}?\s*\.?\))?")
SECTION_BEFORE_FILE = re.compile(QUOTED + r"\s+in\s+" + FILE)
ITEMS = re.compile(FILE + r",?\s+items?\s+(?P<nums>\d+(?:\s*(?:,|and)\s*\d+)*)")
NUMBERED = re.compile(FILE + r",?\s+(?:level\s+(?P<level>\d+)|(?P<secs>\u00a7[\d.]*\d(?:\s*,\s*\u00a7[\d.]*\d)*))")
MD_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
SAME_FILE = re.compile(r"\(?" + QUOTED + r",?\s+(?:below|above)(?=[).,;:]|$)")
SEE = re.compile(r"\bsee\s+" + QUOTED + r"(?!\s+in\s)")
# A path to a document of this repository (object names in tests, `docs/notes/todo.md`, are not).
MD_PATH = re.compile(r"(?<![\w/.$-])(?P<path>(?:\.\./[\w./-]*|(?:docs|bench|bench/link|man|packaging|scripts)/)"
                     r"[\w-]+\.md)(?![\w/-])")

COMMENT_LEAD = re.compile(r"^\s*(?:///?|/\*\*?|\*/?|#+(?=\s|$)|--|\.\\\")\s?")


@dataclass(frozen=True)
class Problem:
    where: str
    cited: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.cited}: {self.why}"


@dataclass
class Doc:
    """A cited file: its headings (level, text), numbered list items, text and slugs."""

    path: Path
    text: str
    headings: list[tuple[int, str, int]]  # (level, heading text, line index)
    lines: list[str]

    @classmethod
    def load(cls, path: Path) -> "Doc":
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        headings, fenced = [], False
        for i, line in enumerate(lines):
            if line.startswith("```"):
                fenced = not fenced
            m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if m and not fenced:
                headings.append((len(m.group(1)), m.group(2), i))
        return cls(path, text, headings, lines)

    @staticmethod
    def plain(heading: str) -> str:
        h = heading.replace("`", "").strip()
        h = re.sub(r"\s*\([^()]*\)\s*$", "", h)          # a trailing "(`File.swift`)"
        h = re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", h)        # "3. Every complete object"
        return h.strip()

    def section(self, name: str) -> tuple[int, str, int] | None:
        wanted = {name.replace("`", "").strip(), self.plain(name)}
        for h in self.headings:
            plain = self.plain(h[1])
            if wanted & {h[1].replace("`", "").strip(), plain, plain.split(":")[0].strip()}:
                return h
        return None

    def body(self, heading: tuple[int, str, int]) -> list[str]:
        level, _, start = heading
        end = len(self.lines)
        for lv, _, i in self.headings:
            if i > start and lv <= level:
                end = i
                break
        return self.lines[start + 1:end]

    def numbered_heading(self, number: str) -> bool:
        return any(re.match(re.escape(number) + r"(?:\.|\s)", h[1]) for h in self.headings)

    def list_item(self, number: str) -> bool:
        return any(re.match(rf"^{number}\.\s", line) for line in self.lines)

    def slugs(self) -> set[str]:
        seen: dict[str, int] = {}
        out = set()
        for _, text, _ in self.headings:
            s = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower()).replace(" ", "-")
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
        return out


def scanned_files() -> list[Path]:
    out = []
    for name in SCANNED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
            continue
        for f in sorted(p.rglob("*")):
            if not f.is_file() or f.suffix in SKIPPED_SUFFIXES or f.resolve() == THIS:
                continue
            if any(part in {".build", "__pycache__", ".pytest_cache"} for part in f.parts):
                continue
            out.append(f)
    return out


def joined(path: Path, text: str) -> tuple[str, list[int]]:
    """The file's text with comment markers taken off each line and lines joined by a space
    (so a citation wrapped over comment lines reads as one), and each line's start offset."""
    md = path.suffix == ".md"
    parts, starts, at = [], [], 0
    for line in text.split("\n"):
        s = line.strip() if md else COMMENT_LEAD.sub("", line).strip()
        starts.append(at)
        parts.append(s)
        at += len(s) + 1
    return " ".join(parts), starts


def resolve(cited: str, citing: Path) -> Path | None:
    """The file a citation names: the README by name is the repository's; a bare name is the
    citing file's neighbour, else the repository's or docs/'s; a path is from the root (or
    from the citing file, for ../)."""
    if cited == "README":
        return ROOT / "README.md"
    if cited.startswith("../"):
        p = (citing.parent / cited).resolve()
        return p if p.is_file() else None
    candidates = [citing.parent / cited] if "/" not in cited else []
    candidates += [ROOT / cited] + ([ROOT / "docs" / cited] if "/" not in cited else [])
    for p in candidates:
        if p.is_file():
            return p.resolve()
    return None


class Checker:
    def __init__(self) -> None:
        self.docs: dict[Path, Doc] = {}
        self.problems: list[Problem] = []
        self.counts: dict[str, int] = {}

    def doc(self, path: Path) -> Doc:
        if path not in self.docs:
            self.docs[path] = Doc.load(path)
        return self.docs[path]

    def report(self, problem: Problem) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    def count(self, form: str) -> None:
        self.counts[form] = self.counts.get(form, 0) + 1

    def target(self, cited: str, citing: Path, where: str) -> Doc | None:
        p = resolve(cited, citing)
        if p is None:
            self.report(Problem(where, cited, "no such file in this repository"))
            return None
        if p.suffix != ".md":
            return None
        return self.doc(p)

    def check_text(self, path: Path, text: str, rel: str) -> None:
        flat, starts = joined(path, text)

        def where(offset: int) -> str:
            line = max(i for i, s in enumerate(starts) if s <= offset) + 1
            return f"{rel}:{line}"

        for m in SECTION_AFTER_FILE.finditer(flat):
            w = where(m.start())
            doc = self.target(m.group("file"), path, w)
            if ":" in m.group("sep") and "(" not in m.group("sep"):
                # `FILE: "text"` quotes the file rather than naming a section of it.
                self.count("quotation")
                if doc is not None and m.group("sec") not in " ".join(doc.text.split()):
                    self.report(Problem(w, f'{m.group("file")}: "{m.group("sec")}"',
                                        "quoted text not found in the file"))
                continue
            names = [m.group("sec")] + re.findall(r"[\"\u201c]([^\"\u201d\n]{1,100})[\"\u201d]",
                                                  m.group("more") or "")
            for name in names:
                self.count("section")
                if doc is None:
                    continue
                heading = doc.section(name)
                if heading is None:
                    self.report(Problem(w, f'{m.group("file")}, "{name}"',
                                        f"no such section in {doc.path.relative_to(ROOT)}"))
                    continue
                if name == names[-1] and m.group("label"):
                    label = m.group("label").lstrip(":,").strip().rstrip(")").rstrip(".").strip()
                    self.count("label")
                    bullet = re.compile(r"^\s*[-*]\s+(?:\*\*)?" + re.escape(label), re.IGNORECASE)
                    if not any(bullet.match(line) for line in doc.body(heading)):
                        self.report(Problem(w, f'{m.group("file")}, "{name}": {label}',
                                            "no bullet of that section starts so"))

        for m in SECTION_BEFORE_FILE.finditer(flat):
            w = where(m.start())
            doc = self.target(m.group("file"), path, w)
            self.count("section")
            if doc is not None and doc.section(m.group("sec")) is None:
                self.report(Problem(w, f'"{m.group("sec")}" in {m.group("file")}',
                                    f"no such section in {doc.path.relative_to(ROOT)}"))

        for m in ITEMS.finditer(flat):
            w = where(m.start())
            doc = self.target(m.group("file"), path, w)
            for n in re.findall(r"\d+", m.group("nums")):
                self.count("item")
                if doc is not None and not doc.list_item(n):
                    self.report(Problem(w, f'{m.group("file")}, item {n}',
                                        f"no item {n}. in {doc.path.relative_to(ROOT)}"))

        for m in NUMBERED.finditer(flat):
            w = where(m.start())
            doc = self.target(m.group("file"), path, w)
            numbers = [m.group("level")] if m.group("level") else re.findall(r"\u00a7([\d.]*\d)", m.group("secs"))
            for n in numbers:
                self.count("numbered")
                if doc is not None and not doc.numbered_heading(n):
                    self.report(Problem(w, f'{m.group("file")} {n}',
                                        f"no heading numbered {n} in {doc.path.relative_to(ROOT)}"))

        for m in MD_PATH.finditer(flat):
            self.count("path")
            if resolve(m.group("path"), path) is None:
                self.report(Problem(where(m.start()), m.group("path"), "no such file in this repository"))

        if path.suffix != ".md":
            return
        own = self.doc(path.resolve())
        for m in MD_LINK.finditer(text):
            target = m.group("target")
            if re.match(r"^[a-z]+:", target):
                continue
            line = text.count("\n", 0, m.start()) + 1
            file_part, _, anchor = target.partition("#")
            self.count("link")
            dest = (path.parent / file_part).resolve() if file_part else path.resolve()
            if not dest.exists():
                self.report(Problem(f"{rel}:{line}", target, "link to a missing file"))
                continue
            if anchor and dest.suffix == ".md" and anchor not in self.doc(dest).slugs():
                self.report(Problem(f"{rel}:{line}", target, "no heading with that anchor"))
        for m in SAME_FILE.finditer(flat):
            self.count("same-file")
            if own.section(m.group("sec")) is None:
                self.report(Problem(where(m.start()), f'"{m.group("sec")}" (below/above)',
                                    "no such section in this file"))
        for m in SEE.finditer(flat):
            self.count("same-file")
            label = re.escape(m.group("sec"))
            if own.section(m.group("sec")) is None and not re.search(rf"\*\*{label}[.:]?\*\*", own.text):
                self.report(Problem(where(m.start()), f'see "{m.group("sec")}"',
                                    "no such section or bold label in this file"))

    def check_tree(self) -> None:
        for f in scanned_files():
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            self.check_text(f, text, str(f.relative_to(ROOT)))


def test_every_cited_doc_section_exists():
    checker = Checker()
    checker.check_tree()
    assert not checker.problems, "citations of docs that do not resolve:\n" + "\n".join(map(str, checker.problems))
    # The scan must have seen the forms the tree uses, or a broken regex would pass it.
    for form, at_least in {"section": 100, "label": 5, "item": 4, "numbered": 10, "link": 20,
                           "path": 50, "quotation": 1, "same-file": 5}.items():
        assert checker.counts.get(form, 0) >= at_least, (form, checker.counts)


def _problems(tmp_path: Path, name: str, text: str) -> list[str]:
    f = tmp_path / name
    f.write_text(text)
    checker = Checker()
    checker.check_text(f, text, name)
    return sorted(p.cited for p in checker.problems)


def test_a_broken_citation_of_each_form_is_found(tmp_path):
    """The checker itself: each form, broken, is reported; the same form, whole, is not."""
    swift = (
        '/// (docs/security.md, "No such section"): one\n'
        '/// (docs/architecture.md, "Adaptive\n'
        '/// transfers": Nosuchbullet).\n'
        "// docs/fuse-notes.md, item 99\n"
        "// docs/protocol.md §1.3, §42\n"
        "// docs/integrity.md, level 9\n"
        '/// (README, "Nowhere")\n'
        "/// docs/design.md\n"
        '/// "Nothing" in architecture.md\n'
        '/// (docs/operations.md, "Metrics" and "Nor this")\n'
    )
    assert _problems(tmp_path, "x.swift", swift) == sorted([
        'docs/security.md, "No such section"', 'docs/architecture.md, "Adaptive transfers": Nosuchbullet',
        'README, "Nowhere"', 'docs/operations.md, "Nor this"', '"Nothing" in architecture.md',
        "docs/fuse-notes.md, item 99", "docs/protocol.md 42", "docs/integrity.md 9", "docs/design.md",
    ])
    whole = (
        '/// (docs/security.md, "Time bounds"); docs/architecture.md, "Threads"\n'
        "# docs/protocol.md §1.3; docs/integrity.md, level 2\n"
        '/// (README, "Namespace semantics"; docs/operations.md, "Warm-up" and "Cache tools")\n'
    )
    assert _problems(tmp_path, "y.swift", whole) == []
    md = ("# T\n\n## Here\n\nsee [a](README.md#nowhere), [b](#here), [c](#gone) and \"There\" below.\n"
          "- **Label.** (see \"Label\"), (see \"Here\") and (see \"Elsewhere\").\n")
    (tmp_path / "README.md").write_text("# R\n\n## Somewhere\n")
    assert _problems(tmp_path, "z.md", md) == sorted(["README.md#nowhere", "#gone", '"There" (below/above)',
                                                      'see "Elsewhere"'])
