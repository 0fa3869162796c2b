#!/usr/bin/env python3
"""Checks the Markdown a reader follows, and fails with what is wrong and where.

- Links resolve. Every relative link in the repository's Markdown files — `[text](path)`,
  `[text](path#anchor)`, `[text](#anchor)`, `[id]: path` definitions and HTML `href`/`src`
  attributes — names a file or folder that exists, and an anchor into a Markdown file names
  one of its headings, as GitHub makes anchors of them (lowercase, punctuation dropped,
  spaces as hyphens, `-1`, `-2`… for repeats). Links with a scheme (`https:`) are not
  fetched. Code blocks and inline code are not links.
- The README's examples are the tested ones. Its ```rust block and its ```python block are,
  byte for byte, the lines between the `README:start` and `README:end` comments of the
  files the tests run (EXAMPLES below). Its `railyard` command lines are checked by
  `tests/readme_cli.rs`, which reads the README itself.
- The README stays short: fewer than 250 lines (reference text goes in docs/).

The Markdown files are those git tracks or would track (ignored ones, such as target/, are
left out). Run from anywhere: `python3 scripts/check_docs.py`.
"""

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250

# README block language -> (file the tests run, start marker line, end marker line).
EXAMPLES = {
    "rust": ("tests/readme_quickstart.rs", "// README:start", "// README:end"),
    "python": ("python/tests/readme_example.py", "# README:start", "# README:end"),
}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:[^`\n]|\n(?![ \t]*\n)|(?!\1)`)*?\1")  # within a paragraph
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]+<?(\S+?)>?(?:[ \t].*)?$", re.M)
HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*\"([^\"]+)\"")
HTML_ANCHOR = re.compile(r"\b(?:id|name)\s*=\s*\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")


class Markdown:
    """One Markdown file: its lines, its fenced code blocks, and its prose with code blanked
    out (same length and line breaks, so offsets still name lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_bytes().decode("utf-8")
        self.lines = self.text.split("\n")
        # (language, first line number of the content, content) of each fenced block.
        self.blocks: list[tuple[str, int, str]] = []
        prose = []
        fence = ""  # the open block's backticks or tildes; empty outside a block
        language, start, content = "", 0, []
        for number, line in enumerate(self.lines, 1):
            opening = FENCE.match(line)
            if fence:
                if re.fullmatch(rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", line):
                    self.blocks.append((language, start, "".join(content)))
                    fence = ""
                else:
                    content.append(line + "\n")
            elif opening:
                fence, start, content = opening.group(1), number + 1, []
                language = (opening.group(2).split() or [""])[0]
            else:
                prose.append(line)
                continue
            prose.append("")  # code is not prose
        self.prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(prose))

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1

    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    def anchors(self) -> set[str]:
        """The anchors of its headings (text from the file, code spans included) and of
        HTML `id`/`name` attributes."""
        found: set[str] = set()
        seen: dict[str, int] = {}
        for line, prose in zip(self.lines, self.prose.split("\n")):
            match = HEADING.match(line) if prose else None
            if match:
                slug = github_slug(match.group(1))
                repeat = seen.get(slug, 0)
                seen[slug] = repeat + 1
                found.add(f"{slug}-{repeat}" if repeat else slug)
        return found | set(HTML_ANCHOR.findall(self.prose))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped (letters,
    digits, `_`, `-` and spaces stay), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def markdown_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "*.md"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode().split("\0")
        paths = {ROOT / name for name in listed if name}
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "target", ".venv", "node_modules"}
        paths = {p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)}
    return sorted(p for p in paths if p.is_file())


def link_problems(doc: Markdown, cache: dict[Path, Markdown]) -> list[str]:
    targets = [(m.start(1), m.group(1)) for m in INLINE_LINK.finditer(doc.prose)]
    targets += [(m.start(1), m.group(1)) for m in DEFINITION.finditer(doc.prose)]
    targets += [(m.start(1), m.group(1)) for m in HTML_LINK.finditer(doc.prose)]
    problems = []
    for offset, target in sorted(targets):
        if SCHEME.match(target):
            continue
        where = f"{doc.name()}:{doc.line_of(offset)}"
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?")[0])
        if not path_part:
            resolved = doc.path
        elif path_part.startswith("/"):
            resolved = ROOT / path_part.lstrip("/")
        else:
            resolved = doc.path.parent / path_part
        if not resolved.exists():
            shown = os.path.relpath(resolved, ROOT)
            problems.append(f"{where}: link to {target}: {shown} does not exist")
            continue
        if anchor and resolved.suffix == ".md" and resolved.is_file():
            resolved = resolved.resolve()
            if resolved not in cache:
                cache[resolved] = Markdown(resolved)
            if unquote(anchor) not in cache[resolved].anchors():
                problems.append(
                    f"{where}: link to {target}: {cache[resolved].name()} has no heading "
                    f"whose anchor is #{anchor}"
                )
    return problems


def region(path: Path, start: str, end: str) -> tuple[int, str] | str:
    """The lines strictly between the `start` and `end` marker lines of `path`, with the line
    number of the first; or why there is no such region."""
    if not path.is_file():
        return f"{path.relative_to(ROOT)} does not exist"
    lines = path.read_bytes().decode("utf-8").split("\n")
    starts = [n for n, line in enumerate(lines) if line.strip() == start]
    ends = [n for n, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] <= starts[0]:
        return f"{path.relative_to(ROOT)} needs one `{start}` line and, after it, one `{end}` line"
    return starts[0] + 2, "".join(line + "\n" for line in lines[starts[0] + 1 : ends[0]])


def example_problems(readme: Markdown) -> list[str]:
    problems = []
    for language, (file, start, end) in EXAMPLES.items():
        blocks = [(line, text) for lang, line, text in readme.blocks if lang == language]
        if len(blocks) != 1:
            problems.append(
                f"README.md has {len(blocks)} ```{language} blocks; it holds one, the lines "
                f"between `{start}` and `{end}` in {file}, which the tests run"
            )
            continue
        (readme_line, shown), tested = blocks[0], region(ROOT / file, start, end)
        if isinstance(tested, str):
            problems.append(f"README.md:{readme_line}: the ```{language} block's source: {tested}")
            continue
        tested_line, code = tested
        if shown != code:
            diff = difflib.unified_diff(
                shown.splitlines(keepends=True),
                code.splitlines(keepends=True),
                f"README.md:{readme_line} (the ```{language} block)",
                f"{file}:{tested_line} (between {start} and {end}, what the tests run)",
            )
            problems.append(
                f"README.md:{readme_line}: the ```{language} block differs from the code the "
                f"tests run in {file}; make them the same:\n" + "".join(diff).rstrip("\n")
            )
    return problems


def main() -> int:
    cache: dict[Path, Markdown] = {}
    files = markdown_files()
    problems = []
    for path in files:
        doc = cache.setdefault(path.resolve(), Markdown(path))
        problems += link_problems(doc, cache)
    readme = cache.get(README.resolve()) or Markdown(README)
    problems += example_problems(readme)
    lines = len(readme.text.splitlines())
    if lines >= README_MAX_LINES:
        problems.append(
            f"README.md has {lines} lines; it stays under {README_MAX_LINES} (what a newcomer "
            "needs first): move reference text into docs/ and link it"
        )
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"check_docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check_docs: {len(files)} Markdown files, links resolve; README ({lines} lines) "
          f"shows the tested {' and '.join(EXAMPLES)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
