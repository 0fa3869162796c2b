#!/usr/bin/env python3
"""Draws each crate's files as rooms and their imports as arrows, and fails on a cycle.

A file imports another when it names an item of that file's module by path (`use`
statements and paths in code alike): `crate::a::b`, `super::x`, `self::y`. A path resolves
to the deepest module file it reaches, and an item a module re-exports counts as that
module's. A module's `mod` declarations are not imports (a parent owns its children), and
comments are ignored. Run from the repository root: `python3 scripts/import_cycles.py`.
"""

import re
import sys
from pathlib import Path

CRATES = ["topology/src", "dataplane/src", "control/src", "engine/src", "src", "python/src"]
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def module_of(root: Path, file: Path) -> tuple:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def targets(module: tuple, anchor: str, rest: list) -> tuple:
    if anchor == "crate":
        base = ()
    elif anchor == "self":
        base = module
    else:
        base = module[:-1]
    return base, rest


def cycles_in(root: Path) -> list:
    files = {}
    for file in root.rglob("*.rs"):
        if file.name in ("build.rs",) or "tests" in file.relative_to(root).parts[:-1]:
            continue
        files[module_of(root, file)] = file
    edges = {module: set() for module in files}

    def resolve(base: tuple, rest: list) -> tuple:
        path = base
        for name in rest:
            if path + (name,) in files:
                path = path + (name,)
            else:
                break
        return path

    for module, file in files.items():
        text = strip_comments(file.read_text())
        # `mod x;` and `#[cfg(test)] mod tests;` declare children: not imports.
        text = re.sub(r"^\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*;", "", text, flags=re.M)
        paths = []
        for anchor, prefix, group in USE_GROUP.findall(text):
            stem = [p for p in prefix.split("::") if p]
            for item in re.split(r"[,\s]+", group):
                first = item.split("::")[0].strip("{} ")
                if first and first not in ("self",) and re.match(r"[A-Za-z_]", first):
                    paths.append((anchor, stem + [p for p in item.split("::") if p and p.isidentifier()]))
                else:
                    paths.append((anchor, stem))
        for anchor, tail in PATH.findall(text):
            paths.append((anchor, [p for p in tail.split("::") if p]))
        for anchor, rest in paths:
            base, rest = targets(module, anchor, rest)
            if anchor == "super" and module == ():
                continue
            target = resolve(base, rest)
            if target != module and target in files:
                # A child naming its ancestor (or the crate root) is an arrow up; keep it.
                edges[module].add(target)
    # Tarjan's strongly connected components.
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(str(files[m]) for m in component))

    sys.setrecursionlimit(10000)
    for node in edges:
        if node not in index:
            visit(node)
    return found


def main() -> int:
    found = []
    for crate in CRATES:
        root = Path(crate)
        if root.is_dir():
            found += cycles_in(root)
    for component in found:
        print("import cycle between: " + ", ".join(component))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
