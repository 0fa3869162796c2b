#!/usr/bin/env python3
"""Draws each crate's files as rooms and their imports as arrows, and fails on a cycle.

A file imports another when it names an item of that file's module by path (`use`
statements and paths in code alike): `crate::a::b`, `super::x`, `self::y`. A path resolves
to the deepest module file it reaches; a name a module re-exports (`pub use`) resolves to
the file that defines it, so `crate::EndpointId` is an arrow to the file where
`EndpointId` lives, not to the crate root. A parent's `mod` declarations are not
arrows, but its paths into its children are (`pub use child::X;` included), so a child that
names its parent while the parent names it back is a cycle. Comments are ignored, and a binary's
`main.rs` is not a module of the library. Run from the repository root:
`python3 scripts/import_cycles.py`.
"""

import re
import sys
from pathlib import Path

CRATES = ["topology/src", "dataplane/src", "control/src", "engine/src", "store/src", "chaos/src", "src", "python/src"]
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
PUB_USE = re.compile(
    r"\bpub(?:\([^)]*\))?\s+use\s+((?:[A-Za-z_][A-Za-z0-9_]*::)*)(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*(?:\s+as\s+[A-Za-z_][A-Za-z0-9_]*)?))\s*;"
)
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
        if file.relative_to(root) == Path("main.rs") and (root / "lib.rs").exists():
            continue
        files[module_of(root, file)] = file
    edges = {module: set() for module in files}
    texts = {module: strip_comments(file.read_text()) for module, file in files.items()}

    # What each module re-exports: (module, name) -> (anchor, path) of the item's origin.
    reexports = {}
    for module, text in texts.items():
        for head, group, single in PUB_USE.findall(text):
            segments = [p for p in head.split("::") if p]
            items = re.split(r",", group) if group else [single]
            for item in items:
                item = item.strip().strip("{} ")
                if not item:
                    continue
                parts = [p.strip() for p in item.split(" as ")]
                path = segments + [p for p in parts[0].split("::") if p]
                name = parts[-1].split("::")[-1]
                if path and name.isidentifier() and name != "self":
                    reexports[(module, name)] = path

    def resolve(base: tuple, rest: list, depth: int = 0) -> tuple:
        path = base
        for index, name in enumerate(rest):
            if path + (name,) in files:
                path = path + (name,)
                continue
            origin = reexports.get((path, name))
            if origin and depth < 8:
                anchor, tail = origin[0], origin[1:]
                if anchor in ("crate", "super", "self"):
                    start, tail = targets(path, anchor, tail)
                elif path + (anchor,) in files:
                    start = path + (anchor,)
                else:
                    break  # another crate's item
                return resolve(start, tail + rest[index + 1 :], depth + 1)
            break
        return path

    for module, text in texts.items():
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
        # Bare paths into a child module (`use child::X;`, `child::f()`).
        for m in re.finditer(r"(?<![:\w])([a-z_][a-z0-9_]*)::", text):
            if module + (m.group(1),) in files:
                rest = re.match(r"(?:[A-Za-z_][A-Za-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*", text[m.start():]).group(0)
                paths.append(("self", rest.split("::")))
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
