//! Reading a request's headers by lower-case name ([`HeaderLookup`]), whatever holds them:
//! Pingora's header map in the proxy, a list of pairs for `simulate`, Envoy and tests.

use std::borrow::Cow;

/// Read access to request headers by lower-case name.
pub trait HeaderLookup {
    /// The raw bytes of the first line of header `lower_name` (already lower-case), if present.
    fn header_bytes(&self, lower_name: &str) -> Option<&[u8]>;

    /// The raw bytes of the last line of header `lower_name`: what the nearest hop added, for
    /// headers a proxy in front sets (the network facts, [`crate::request::network`]).
    fn last_header_bytes(&self, lower_name: &str) -> Option<&[u8]>;

    /// Whether header `lower_name` arrived on more than one line. Frameworks disagree on which
    /// line counts (many take the last), so a limit keyed on a repeated header could count one
    /// identity while the upstream serves another.
    fn is_repeated(&self, lower_name: &str) -> bool;

    /// Whether any header at all arrived on more than one line; when not, no name needs
    /// [`HeaderLookup::is_repeated`] (a request rarely repeats one, and asking costs a lookup per
    /// name read). The default answers "perhaps".
    fn repeats_any(&self) -> bool {
        true
    }

    /// The first value, if present and valid UTF-8 (credentials: anything else is no token).
    fn header(&self, lower_name: &str) -> Option<&str> {
        self.header_bytes(lower_name)
            .and_then(|b| std::str::from_utf8(b).ok())
    }

    /// The first value as text for keys and matching: bytes that are not UTF-8 become U+FFFD,
    /// so a stray byte never makes a header (and the limit keyed on it) disappear.
    fn header_text(&self, lower_name: &str) -> Option<Cow<'_, str>> {
        self.header_bytes(lower_name).map(String::from_utf8_lossy)
    }
}

/// Whether a listed name is the header `wanted` ([`super::header_name`] form): any case, and `_` as
/// `-` (Envoy descriptor keys such as `x_user` and simulated requests are named freely).
fn is_header(name: &str, wanted: &str) -> bool {
    name.len() == wanted.len()
        && name.bytes().zip(wanted.bytes()).all(|(a, b)| {
            let a = if a == b'_' {
                b'-'
            } else {
                a.to_ascii_lowercase()
            };
            a == b
        })
}

/// Headers as a list of `(name, value)` pairs (any case), for `simulate`, Envoy descriptors and
/// tests.
impl HeaderLookup for [(String, String)] {
    fn header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(name, _)| is_header(name, lower_name))
            .map(|(_, value)| value.as_bytes())
    }

    fn last_header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.iter()
            .rfind(|(name, _)| is_header(name, lower_name))
            .map(|(_, value)| value.as_bytes())
    }

    fn is_repeated(&self, lower_name: &str) -> bool {
        self.iter()
            .filter(|(name, _)| is_header(name, lower_name))
            .nth(1)
            .is_some()
    }

    fn repeats_any(&self) -> bool {
        self.iter().enumerate().any(|(i, (a, _))| {
            self[i + 1..].iter().any(|(b, _)| {
                a.len() == b.len()
                    && a.bytes().zip(b.bytes()).all(|(x, y)| {
                        let fold = |c: u8| {
                            if c == b'_' {
                                b'-'
                            } else {
                                c.to_ascii_lowercase()
                            }
                        };
                        fold(x) == fold(y)
                    })
            })
        })
    }
}

impl HeaderLookup for Vec<(String, String)> {
    fn header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.as_slice().header_bytes(lower_name)
    }

    fn last_header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.as_slice().last_header_bytes(lower_name)
    }

    fn is_repeated(&self, lower_name: &str) -> bool {
        self.as_slice().is_repeated(lower_name)
    }

    fn repeats_any(&self) -> bool {
        self.as_slice().repeats_any()
    }
}
