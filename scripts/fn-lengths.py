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


def blank(text):
    """The text with comments and string and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)

    def keep_lines(s):
        out.append("".join(ch if ch == "\n" else " " for ch in s))

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            keep_lines(text[i:j])
            i = j
        elif text.startswith("/*", i):
            start, depth, i = i, 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            keep_lines(text[start:i])
        elif c in "rb" and re.match(r'(br|r)#*"', text[i:]) and not re.match(r"\w", text[i - 1] if i else " "):
            m = re.match(r'(?:br|r)(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            keep_lines(text[i:j])
            i = j
        elif c == '"':
            start = i
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            keep_lines(text[start:i])
        elif c == "'" and re.match(r"'(\\[^']*|[^\\'])'", text[i:]):
            m = re.match(r"'(\\[^']*|[^\\'])'", text[i:])
            keep_lines(m.group(0))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(code, open_at):
    """The index of the brace closing the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return len(code) - 1


def without_test_modules(code):
    """`#[cfg(test)] mod x { ... }` blocks blanked (newlines kept); `mod x;` is left alone."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", code)
        if not m:
            return code
        end = matching_brace(code, m.end() - 1)
        code = code[: m.start()] + re.sub(r"[^\n]", " ", code[m.start() : end + 1]) + code[end + 1 :]


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
