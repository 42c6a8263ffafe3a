#!/usr/bin/env python3
"""Measures the length of every function in tollgate's `src/` outside tests.

A function's length is the count of lines from its `fn` line to its closing brace. Test code is
left out: `tests.rs` files, files under a `tests/` folder, and `#[cfg(test)] mod ... { }` blocks.
Comments and string literals are blanked first (newlines kept), so braces inside them do not
count. Prints the longest functions, longest first; `--max N` exits 1 when one runs over N
lines. Usage:

    python3 scripts/fn-lengths.py [--max N] [--top K] [SRC_DIR]
"""

import os
import re
import sys

from rust_source import blank, matching_brace, without_test_modules


def functions(path):
    """(name, first line, lines) for every function with a body in one file."""
    with open(path, encoding="utf-8") as f:
        code = without_test_modules(blank(f.read()))
    found = []
    for m in re.finditer(r"\bfn\s+(\w+)", code):
        # The body opens at the first `{` after the signature, unless a `;` ends it first
        # (a trait method without a default body).
        j = m.end()
        depth = 0
        while j < len(code):
            ch = code[j]
            if ch in "(<[":
                depth += 1
            elif ch in ")>]" and not (ch == ">" and code[j - 1] == "-"):
                depth -= 1
            elif ch == ";" and depth <= 0:
                j = -1
                break
            elif ch == "{" and depth <= 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        end = matching_brace(code, j)
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, end) + 1
        found.append((m.group(1), first, last - first + 1))
    return found


def main(argv):
    limit, top, src = None, 15, None
    args = iter(argv)
    for a in args:
        if a == "--max":
            limit = int(next(args))
        elif a == "--top":
            top = int(next(args))
        else:
            src = a
    src = src or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    rows = []
    for dirpath, _, files in os.walk(src):
        rel_dir = os.path.relpath(dirpath, src)
        if "tests" in rel_dir.split(os.sep):
            continue
        for name in files:
            if not name.endswith(".rs") or name == "tests.rs":
                continue
            path = os.path.join(dirpath, name)
            for fn, line, length in functions(path):
                rows.append((length, os.path.relpath(path, src), line, fn))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    over = [r for r in rows if limit is not None and r[0] > limit]
    print(f"{len(rows)} functions; longest {rows[0][0] if rows else 0} lines")
    for length, path, line, fn in rows[:top]:
        print(f"{length:5}  {fn}  src/{path}:{line}")
    if over:
        print(f"{len(over)} function(s) over {limit} lines")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
