#!/usr/bin/env python3
"""Counts the import edges between tollgate's source files and prints every circle.

An edge A -> B means a file A names an item of the module whose file is B: a `use` tree
(`use crate::a::{b, c::D}`) or a path in code (`crate::a::b(...)`, `super::x`, a child
module's `child::y`). Test code is left out (`#[cfg(test)] mod ...` to the end of a file, and
`tests.rs` files): a test may look anywhere. A file naming its own module is no edge.

A circle is a strongly connected component of two or more files; each is printed with the
edges that tie it.

It also checks the layers. `src/lib.rs`'s map names each folder's layer (`engine/  L2`) or range
of layers (`limits/  L0-L2`). A file in a one-layer folder is at that layer; a file in a ranged
folder is at the highest layer of what it imports (at least the range's bottom, at most its top).
An import from one folder into another that names a file of a higher layer climbs, and so does a
ranged file whose imports put it over its folder's top. The few climbs made on purpose are listed,
each with its reason, in EXCEPTIONS below.

`--check` exits 1 when there is a circle or a climb that is not an exception. Usage:

    python3 scripts/import-circles.py [--check] [--edges] [SRC_DIR]
"""

import os
import re
import sys

from rust_source import blank

# Imports that climb a layer on purpose: (importing folder or file, imported folder or file,
# why). Paths are relative to src/; a folder ends with "/".
EXCEPTIONS = [
    (
        "policy/compile/",
        "limits/",
        "a limit kind keeps its compile half (L0, reads JSON) in one file with its plan half (L2), "
        "so that a kind is read and added in one place; the compiler calls only the compile half",
    ),
]


def module_path(src, path):
    """src/a/b.rs -> ['a', 'b']; src/a/mod.rs -> ['a']; src/lib.rs -> []."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] == "mod" or rel == ["lib"] or rel == ["main"]:
        rel = rel[:-1]
    return rel


def strip_code(text):
    """The file without comments, string literals and test modules (from the first
    `#[cfg(test)] mod` to the end of the file)."""
    test = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s", text)
    if test:
        text = text[: test.start()]
    return blank(text)


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
    climbs = layer_climbs(src, edges)
    used = [(what, why) for what, why in climbs if why]
    wrong = [what for what, why in climbs if why is None]
    print(f"{len(wrong)} upward import(s), {len(used)} listed exception(s)")
    for what in wrong:
        print(f"climbs a layer: {what}")
    if show_edges:
        for what, why in used:
            print(f"  exception: {what} ({why})")
    if check and (circles or wrong):
        sys.exit(1)


def folder_layers(src):
    """{folder: (lowest, highest)} from the layer map in src/lib.rs's doc comment."""
    try:
        with open(os.path.join(src, "lib.rs"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    found = re.finditer(r"^//! (\w+)/\s+L(\d)(?:-L(\d))?\b", text, re.M)
    return {m.group(1): (int(m.group(2)), int(m.group(3) or m.group(2))) for m in found}


def layer_climbs(src, edges):
    """[(description, None | exception's reason)] for every import that climbs a layer."""
    layers = folder_layers(src)
    rel = lambda p: os.path.relpath(p, src).replace(os.sep, "/")

    def folder(path):
        parts = rel(path).split("/")
        return parts[0] if len(parts) > 1 and parts[0] in layers else None

    inferred = {}

    def layer(path):
        top = folder(path)
        if top is None:
            return None
        low, high = layers[top]
        if low == high:
            return low
        if path not in inferred:
            inferred[path] = low  # no circles (checked above), so this is never read early
            inferred[path] = max([low] + [l for l in map(layer, edges[path]) if l is not None])
        return inferred[path]

    def exception(a, b):
        for here, there, why in EXCEPTIONS:
            if rel(a).startswith(here) and rel(b).startswith(there):
                return why
        return None

    climbs = []
    for a in sorted(edges):
        if folder(a) is None:
            continue
        here = layer(a)
        high = layers[folder(a)][1]
        for b in sorted(edges[a]):
            if folder(b) in (None, folder(a)) or layer(b) <= here:
                continue
            climbs.append((f"{rel(a)} (L{here}) -> {rel(b)} (L{layer(b)})", exception(a, b)))
        if here > high:
            over = [rel(b) for b in sorted(edges[a]) if (layer(b) or 0) > high]
            climbs.append((f"{rel(a)} is L{here}, over its folder's L{high}: imports {', '.join(over)}", None))
    return climbs


if __name__ == "__main__":
    main()
