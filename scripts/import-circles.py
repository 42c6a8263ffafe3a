#!/usr/bin/env python3
"""Counts the import edges between tollgate's source files and prints every circle.

An edge A -> B means a file A names an item of the module whose file is B: a `use` tree
(`use crate::a::{b, c::D}`) or a path in code (`crate::a::b(...)`, `super::x`, a child
module's `child::y`). Test code is left out (`#[cfg(test)] mod ...` to the end of a file, and
`tests.rs` files): a test may look anywhere. A file naming its own module is no edge.

A circle is a strongly connected component of two or more files; each is printed with the
edges that tie it. `--check` exits 1 when there is one. Usage:

    python3 scripts/import-circles.py [--check] [--edges] [SRC_DIR]
"""

import os
import re
import sys


def module_path(src, path):
    """src/a/b.rs -> ['a', 'b']; src/a/mod.rs -> ['a']; src/lib.rs -> []."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] == "mod" or rel == ["lib"] or rel == ["main"]:
        rel = rel[:-1]
    return rel


def strip_code(text):
    """The file without comments, string literals and test modules."""
    test = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s", text)
    if test:
        text = text[: test.start()]
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"\w", text[i - 1] if i else " "):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            i = n if j < 0 else j + len(end)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:]):
            i += len(re.match(r"'(\\.[^']*|[^\\'])'", text[i:]).group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def use_trees(code):
    """Every path a `use` declaration names, expanded: `a::{b, c::D}` -> a::b, a::c::D."""
    paths = []
    for m in re.finditer(r"\buse\s+([^;]*);", code):
        tree = re.sub(r"\s+as\s+\w+", "", m.group(1))
        paths.extend(expand(re.sub(r"\s+", "", tree)))
    return paths


def expand(tree):
    """Expands one use tree (no spaces) into its paths."""
    brace = tree.find("{")
    if brace < 0:
        return [tree]
    prefix, inner = tree[:brace], tree[brace + 1 : tree.rindex("}")]
    parts, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    out = []
    for part in parts:
        if part:
            out.extend(prefix + p for p in expand(part))
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    check = "--check" in sys.argv
    show_edges = "--edges" in sys.argv
    src = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "src")
    src = os.path.normpath(src)

    files = {}
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs") and name != "tests.rs":
                path = os.path.join(root, name)
                files[path] = module_path(src, path)
    modules = {}
    for path, mod in files.items():
        if os.path.basename(path) != "main.rs":
            modules[tuple(mod)] = path

    def resolve(segments):
        """The file of the longest module prefix of an absolute path."""
        for k in range(len(segments), -1, -1):
            if tuple(segments[:k]) in modules:
                return modules[tuple(segments[:k])]
        return None

    edges = {}
    for path, mod in files.items():
        with open(path, encoding="utf-8") as f:
            code = strip_code(f.read())
        here = list(mod)
        is_main = os.path.basename(path) == "main.rs"
        if is_main:
            here = []
        children = {m[len(here)] for m in modules if len(m) == len(here) + 1 and list(m[: len(here)]) == here}
        names = use_trees(code)
        names += re.findall(r"\b((?:crate|super|self|tollgate)(?:::\w+)+)", code)
        for child in children:
            names += re.findall(r"(?<![\w:])(" + child + r"(?:::\w+)+)", code)
        targets = set()
        for name in names:
            segments = [s for s in name.split("::") if s]
            if not segments:
                continue
            if segments[0] in ("crate", "tollgate"):
                absolute = segments[1:]
            elif segments[0] in ("super", "self"):
                base = list(here)
                while segments and segments[0] in ("super", "self"):
                    if segments[0] == "super":
                        base = base[:-1]
                    segments = segments[1:]
                absolute = base + segments
            elif segments[0] in children:
                absolute = here + segments
            else:
                continue
            target = resolve(absolute)
            if target and target != path:
                targets.add(target)
        edges[path] = targets

    # Tarjan's strongly connected components.
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            connect(v)

    rel = lambda p: os.path.relpath(p, os.path.dirname(src))
    circles = [sorted(c) for c in comps if len(c) > 1]
    total = sum(len(t) for t in edges.values())
    print(f"{len(files)} files, {total} import edges, {len(circles)} circle(s)")
    if show_edges:
        for v in sorted(edges):
            for w in sorted(edges[v]):
                print(f"  {rel(v)} -> {rel(w)}")
    for circle in sorted(circles, key=len, reverse=True):
        members = set(circle)
        print(f"circle of {len(circle)} files: " + ", ".join(rel(p) for p in circle))
        for v in circle:
            for w in sorted(edges[v] & members):
                print(f"    {rel(v)} -> {rel(w)}")
    if check and circles:
        sys.exit(1)


if __name__ == "__main__":
    main()
