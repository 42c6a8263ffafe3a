"""Reading Rust source as text, for the source checks in this folder (import-circles.py,
fn-lengths.py): comments and literals blanked out, braces matched, test modules left out."""

import re


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
