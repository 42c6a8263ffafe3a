//! The one escaping point for values in text log lines: every value a text line carries that
//! a client, an upstream or a policy file could have chosen (paths, hosts, bucket names and
//! their keys, header values, rule names, Pingora's messages) is written through
//! [`write_escaped`], so a value can neither end its line, forge another one, end a quoted
//! field, nor reach a terminal as a control sequence.
//!
//! The rule, nginx's: printable ASCII stays as it is, except `"` and `\`; every other byte
//! (C0 controls such as CR, LF, TAB and ESC, DEL, and each byte of a non-ASCII character, so C1
//! controls, bidirectional overrides and line separators too) is written `\xHH` (two upper-case
//! hex digits). The backslash itself is `\x5C`, so every `\` in an escaped value starts an
//! escape and the original bytes can always be read back: two different values never look the
//! same.
//!
//! Values that need nothing (nearly all of them) are written as they are, without allocating.
//! Pure string work, no I/O.
//!
//! Behind it, a net for whole text lines ([`escape_line_controls`]): the log writer passes every
//! formatted `tracing` line through it, so a value some line forgot to escape (an error's text
//! quoting a file, say) still cannot end its line. It escapes control bytes only, the same way
//! (`\xHH`), and so leaves lines already escaped as they are.

use std::borrow::Cow;
use std::fmt;

/// Whether a byte is written as it is (without branches: see [`all_plain`]).
#[inline]
fn is_plain(b: u8) -> bool {
    // 0x20..=0x7e in one comparison.
    (b.wrapping_sub(0x20) < 0x5f) & (b != b'"') & (b != b'\\')
}

/// Whether nothing in `text` needs escaping: the common case, checked over all the bytes
/// without a branch per byte, so that the compiler checks many bytes at once (this runs for
/// every value of every `RATE_LIMIT` and access-log line).
#[inline]
fn all_plain(text: &str) -> bool {
    text.bytes().fold(true, |plain, b| plain & is_plain(b))
}

/// Writes `text` into `out`, escaped (see the module's comment): runs of plain bytes in one
/// `write_str` each, `\xHH` for the rest.
pub fn write_escaped<W: fmt::Write + ?Sized>(out: &mut W, text: &str) -> fmt::Result {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    if all_plain(text) {
        return out.write_str(text);
    }
    let bytes = text.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if is_plain(b) {
            continue;
        }
        // `start..i` is either empty or plain ASCII from a character boundary to one (every
        // byte of a multi-byte character is escaped), so the slice is always valid.
        if start < i {
            out.write_str(&text[start..i])?;
        }
        let escaped = [
            b'\\',
            b'x',
            HEX[usize::from(b >> 4)],
            HEX[usize::from(b & 0xf)],
        ];
        // Four ASCII bytes: always UTF-8.
        out.write_str(std::str::from_utf8(&escaped).map_err(|_| fmt::Error)?)?;
        start = i + 1;
    }
    if start < bytes.len() {
        out.write_str(&text[start..])?;
    }
    Ok(())
}

/// Writes `text` as the value of an unquoted `key=value` field: escaped, and inside double
/// quotes when it holds a space (logfmt's way), so a value such as `x policy=other` stays one
/// field instead of forging another. (`"` itself is always escaped, so the quotes are
/// unambiguous.)
pub fn write_field<W: fmt::Write + ?Sized>(out: &mut W, text: &str) -> fmt::Result {
    if text.as_bytes().contains(&b' ') {
        out.write_char('"')?;
        write_escaped(out, text)?;
        out.write_char('"')
    } else {
        write_escaped(out, text)
    }
}

/// Appends `text` as a field's value (see [`write_field`]) to a line being built.
#[inline]
pub fn push_field(out: &mut String, text: &str) {
    // The common case in one pass over the bytes: nothing to escape and no space to quote.
    if text
        .bytes()
        .fold(true, |plain, b| plain & is_plain(b) & (b != b' '))
    {
        out.push_str(text);
        return;
    }
    // Writing into a `String` never fails.
    let _ = write_field(out, text);
}

/// `text` escaped: borrowed as it is when nothing needs escaping.
pub fn escape(text: &str) -> Cow<'_, str> {
    if all_plain(text) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    push_escaped(&mut out, text);
    Cow::Owned(out)
}

/// Appends `text`, escaped, to a line being built.
#[inline]
pub fn push_escaped(out: &mut String, text: &str) {
    // Writing into a `String` never fails.
    let _ = write_escaped(out, text);
}

/// `text`, escaped when displayed (in a `format!`/`write!` or a `tracing` field), without
/// allocating.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0)
    }
}

/// One formatted text line (its final `\n` kept) with every other control byte (C0 and DEL)
/// written `\xHH`: the net under every `tracing` line. Borrowed when there is none.
pub fn escape_line_controls(line: &[u8]) -> Cow<'_, [u8]> {
    let (body, end) = match line.split_last() {
        Some((b'\n', body)) => (body, &b"\n"[..]),
        _ => (line, &b""[..]),
    };
    let control = |b: u8| b < 0x20 || b == 0x7f;
    if !body.iter().any(|&b| control(b)) {
        return Cow::Borrowed(line);
    }
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(line.len() + 16);
    for &b in body {
        if control(b) {
            out.extend_from_slice(&[
                b'\\',
                b'x',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]);
        } else {
            out.push(b);
        }
    }
    out.extend_from_slice(end);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_value_with_a_space_is_quoted_so_it_cannot_forge_a_field() {
        let mut line = String::from("bucket=");
        push_field(&mut line, "tb:r:x policy=other who=1.2.3.4");
        assert_eq!(line, "bucket=\"tb:r:x policy=other who=1.2.3.4\"");
        let mut line = String::from("bucket=");
        push_field(&mut line, "a \"b\" c");
        assert_eq!(line, "bucket=\"a \\x22b\\x22 c\"");
        let mut line = String::from("bucket=");
        push_field(&mut line, "plain");
        assert_eq!(line, "bucket=plain");
    }

    #[test]
    fn the_line_net_escapes_controls_only_and_keeps_the_final_newline() {
        assert!(matches!(
            escape_line_controls(b"plain line\n"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            &*escape_line_controls(b"ERROR a\r\nforged \x1b[31m\t\x7f done\n"),
            &b"ERROR a\\x0D\\x0Aforged \\x1B[31m\\x09\\x7F done\n"[..]
        );
        // A line already escaped is left as it is; non-ASCII text too.
        let escaped = format!("bucket={} caf\u{e9}\n", escape("a\r\nb\\c"));
        assert_eq!(
            &*escape_line_controls(escaped.as_bytes()),
            escaped.as_bytes()
        );
        assert_eq!(
            &*escape_line_controls(b"no newline\x00"),
            &b"no newline\\x00"[..]
        );
    }

    /// Reads an escaped value back (the inverse of [`escape`]); `None` when `text` is not
    /// something [`escape`] could have written.
    fn unescape(text: &str) -> Option<String> {
        let mut bytes = Vec::with_capacity(text.len());
        let mut rest = text.as_bytes();
        while let Some((&b, tail)) = rest.split_first() {
            if b == b'\\' {
                let &[b'x', hi, lo, ..] = tail else {
                    return None;
                };
                let hex = |d: u8| (d as char).to_digit(16).map(|v| v as u8);
                bytes.push(hex(hi)? << 4 | hex(lo)?);
                rest = &tail[3..];
            } else {
                bytes.push(b);
                rest = tail;
            }
        }
        String::from_utf8(bytes).ok()
    }

    #[test]
    fn control_characters_quotes_and_backslashes_are_escaped() {
        assert_eq!(
            escape("evil\r\n\x1b[31mFORGED"),
            "evil\\x0D\\x0A\\x1B[31mFORGED"
        );
        assert_eq!(escape("a\tb\x7fc\0"), "a\\x09b\\x7Fc\\x00");
        assert_eq!(escape("say \"hi\" \\ bye"), "say \\x22hi\\x22 \\x5C bye");
        // C1 (U+009B, a one-character CSI), a bidi override, a line separator, a plain é.
        assert_eq!(
            escape("\u{9b}\u{202e}\u{2028}é"),
            "\\xC2\\x9B\\xE2\\x80\\xAE\\xE2\\x80\\xA8\\xC3\\xA9"
        );
    }

    #[test]
    fn plain_values_are_borrowed() {
        for plain in ["", "tb:per-ip:203.0.113.7", "/v1/orders?limit=10", "a b ~"] {
            assert!(matches!(escape(plain), Cow::Borrowed(p) if p == plain));
        }
    }

    #[test]
    fn every_form_writes_the_same_text() {
        let value = "k\u{1b}]0;x\u{7}é";
        let mut pushed = String::from(">");
        push_escaped(&mut pushed, value);
        assert_eq!(pushed, format!(">{}", escape(value)));
        assert_eq!(format!(">{}", Escaped(value)), pushed);
    }

    proptest::proptest! {
        /// Whatever the value, the escaped text is printable ASCII without `"`, and reads back
        /// to the value: no two values are written alike.
        #[test]
        fn escaped_values_are_printable_and_read_back(value in "\\PC*|.*|[\\x00-\\x7f\u{80}-\u{9f}\u{2028}\u{202e}]*") {
            let escaped = escape(&value);
            proptest::prop_assert!(
                escaped.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b'"'),
                "{:?}", escaped
            );
            proptest::prop_assert_eq!(unescape(&escaped), Some(value.clone()));
        }

        /// Two different values never escape to the same text.
        #[test]
        fn escaping_is_injective(a in ".*", b in ".*") {
            proptest::prop_assume!(a != b);
            proptest::prop_assert_ne!(escape(&a), escape(&b));
        }
    }
}
