//! What a gRPC request is, read from its HTTP shape: whether a content type is gRPC's (also
//! `+proto`, `+json` and gRPC-Web's), the service and method its path names
//! (`/package.Service/Method`), and where its length-prefixed messages begin in a request body
//! read piece by piece ([`MessageStarts`]), so that a stream can be limited per message. Pure:
//! no I/O.

/// Whether `content_type` is gRPC's: `application/grpc` with or without a `+codec` suffix or
/// parameters, and gRPC-Web's `application/grpc-web`, `application/grpc-web-text` (any case).
pub fn is_grpc_content_type(content_type: &[u8]) -> bool {
    const PREFIX: &[u8] = b"application/grpc";
    if content_type.len() < PREFIX.len()
        || !content_type[..PREFIX.len()].eq_ignore_ascii_case(PREFIX)
    {
        return false;
    }
    // What may follow: nothing, a codec (`+proto`), gRPC-Web (`-web`, `-web-text`, each with
    // an optional codec) or parameters.
    let rest = &content_type[PREFIX.len()..];
    let rest = strip_ci(rest, b"-web-text")
        .or_else(|| strip_ci(rest, b"-web"))
        .unwrap_or(rest);
    matches!(rest.first(), None | Some(b'+' | b';' | b' '))
}

/// Whether `content_type` is gRPC-Web's (its answers may travel over HTTP/1.1).
pub fn is_grpc_web_content_type(content_type: &[u8]) -> bool {
    is_grpc_content_type(content_type)
        && content_type.len() > 16
        && content_type[16..].starts_with(b"-web")
}

fn strip_ci<'a>(text: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    (text.len() >= prefix.len() && text[..prefix.len()].eq_ignore_ascii_case(prefix))
        .then(|| &text[prefix.len()..])
}

/// The service (`package.Service`) and the method (`Method`) of a gRPC path
/// `/package.Service/Method`, as OpenTelemetry's `rpc.service` and `rpc.method` name them;
/// `None` for any other shape (no leading `/`, an empty part, more segments).
pub fn service_and_method(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix('/')?;
    let (service, method) = rest.split_once('/')?;
    (!service.is_empty() && !method.is_empty() && !method.contains('/'))
        .then_some((service, method))
}

/// Bytes of a gRPC message's prefix: a compressed flag and a 4-byte big-endian length.
pub const FRAME_PREFIX: usize = 5;

/// Finds where the length-prefixed messages of a gRPC request body begin, however the body is
/// cut into pieces, so that each message can be decided before any byte of it is passed on.
/// A message's start is known once its whole 5-byte prefix has arrived: the bytes of a prefix
/// cut by a piece's end are held back ([`MessageStarts::join`] puts them before the next
/// piece), so that everything before a start can be passed on and nothing from it on.
#[derive(Debug, Default, Clone)]
pub struct MessageStarts {
    /// Payload bytes of the current message still to come.
    remaining: u64,
    /// The first bytes of a prefix cut by the last piece's end (at most 4).
    held: Vec<u8>,
    /// Messages begun so far.
    pub messages: u64,
}

/// What [`MessageStarts::step`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A message begins at this offset (its prefix is whole in the data).
    Message { start: usize },
    /// No further start in the data: the bytes before this offset may be passed on, those
    /// after it (part of a prefix) are held back.
    End { pass_to: usize },
}

impl MessageStarts {
    /// The data to scan: the bytes held back from the last piece, then `piece`.
    pub fn join(&mut self, piece: &[u8]) -> Vec<u8> {
        let mut data = std::mem::take(&mut self.held);
        data.extend_from_slice(piece);
        data
    }

    /// Whether bytes of a cut prefix are held back (a body ending now ends mid-prefix).
    pub fn holds(&self) -> bool {
        !self.held.is_empty()
    }

    /// The next message start in `data` from `*at` on (moving `*at` past its prefix), or the
    /// end of what may be passed on.
    pub fn step(&mut self, data: &[u8], at: &mut usize) -> Step {
        let left = (data.len() - *at) as u64;
        let take = self.remaining.min(left);
        *at += take as usize;
        self.remaining -= take;
        if self.remaining > 0 {
            return Step::End {
                pass_to: data.len(),
            };
        }
        if data.len() - *at < FRAME_PREFIX {
            self.held = data[*at..].to_vec();
            return Step::End { pass_to: *at };
        }
        let start = *at;
        let len = u32::from_be_bytes([
            data[start + 1],
            data[start + 2],
            data[start + 3],
            data[start + 4],
        ]);
        self.remaining = u64::from(len);
        *at += FRAME_PREFIX;
        self.messages += 1;
        Step::Message { start }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types_are_told_apart() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+json",
            "Application/GRPC; charset=utf-8",
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ] {
            assert!(is_grpc_content_type(yes.as_bytes()), "{yes}");
        }
        for no in [
            "application/json",
            "application/grpcx",
            "application/grpc-webby",
            "application/gr",
            "",
            "text/plain",
        ] {
            assert!(!is_grpc_content_type(no.as_bytes()), "{no}");
        }
        assert!(is_grpc_web_content_type(b"application/grpc-web+proto"));
        assert!(!is_grpc_web_content_type(b"application/grpc+proto"));
    }

    #[test]
    fn paths_name_a_service_and_a_method() {
        assert_eq!(
            service_and_method("/helloworld.Greeter/SayHello"),
            Some(("helloworld.Greeter", "SayHello"))
        );
        assert_eq!(service_and_method("/Svc/M"), Some(("Svc", "M")));
        for bad in ["/", "//M", "/Svc/", "/a/b/c", "Svc/M", "/Svc"] {
            assert_eq!(service_and_method(bad), None, "{bad}");
        }
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// However a body of three messages is cut, the starts found are the messages' starts,
    /// and the bytes passed on are the body, each once and in order.
    #[test]
    fn message_starts_are_found_across_any_cut() {
        let body: Vec<u8> = [frame(b"abc"), frame(b""), frame(&[7; 300])].concat();
        let expected = vec![0, 8, 13];
        for size in 1..=body.len() {
            let mut starts = MessageStarts::default();
            let mut found = Vec::new();
            let mut passed: Vec<u8> = Vec::new();
            for piece in body.chunks(size) {
                let data = starts.join(piece);
                // Offsets in `data` are offsets in the body from what was passed on.
                let base = passed.len();
                let mut at = 0;
                loop {
                    match starts.step(&data, &mut at) {
                        Step::Message { start } => found.push(base + start),
                        Step::End { pass_to } => {
                            passed.extend_from_slice(&data[..pass_to]);
                            break;
                        }
                    }
                }
            }
            assert_eq!(found, expected, "pieces of {size}");
            assert_eq!(passed, body, "pieces of {size}");
            assert_eq!(starts.messages, 3);
            assert!(!starts.holds());
        }
        // A prefix cut after 3 bytes is held back.
        let mut starts = MessageStarts::default();
        let data = starts.join(&body[..11]);
        let mut at = 0;
        assert_eq!(starts.step(&data, &mut at), Step::Message { start: 0 });
        assert_eq!(starts.step(&data, &mut at), Step::End { pass_to: 8 });
        assert!(starts.holds());
        assert_eq!(starts.join(&body[11..13]), body[8..13].to_vec());
    }
}
