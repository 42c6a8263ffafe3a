//! What a gRPC request is, read from its HTTP shape: whether a content type is gRPC's (also
//! `+proto`, `+json` and gRPC-Web's), the service and method its path names
//! (`/package.Service/Method`), and where its length-prefixed messages end in a request body
//! read piece by piece ([`MessageFrames`]), so that a stream can be limited per message. Pure:
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

/// Finds where the length-prefixed messages of a gRPC request body end, however the body is
/// cut into pieces: [`MessageFrames::feed`] takes each piece in order and reports the offsets,
/// within that piece, just past each message that completes in it.
#[derive(Debug, Default, Clone)]
pub struct MessageFrames {
    /// Prefix bytes of the current message seen so far (0 to 5).
    prefix: [u8; FRAME_PREFIX],
    prefix_len: usize,
    /// Payload bytes of the current message still to come (once its prefix is whole).
    remaining: u64,
    /// Whole messages seen.
    pub messages: u64,
}

impl MessageFrames {
    /// Feeds the next piece of the body; `ends` receives, in order, the offset just past each
    /// message that completes in `piece`.
    pub fn feed(&mut self, piece: &[u8], ends: &mut Vec<usize>) {
        let mut at = 0;
        while at < piece.len() {
            if self.prefix_len < FRAME_PREFIX {
                let take = (FRAME_PREFIX - self.prefix_len).min(piece.len() - at);
                self.prefix[self.prefix_len..self.prefix_len + take]
                    .copy_from_slice(&piece[at..at + take]);
                self.prefix_len += take;
                at += take;
                if self.prefix_len < FRAME_PREFIX {
                    break;
                }
                let len = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]);
                self.remaining = u64::from(len);
            }
            let left = (piece.len() - at) as u64;
            let take = self.remaining.min(left);
            at += take as usize;
            self.remaining -= take;
            if self.remaining == 0 {
                self.prefix_len = 0;
                self.messages += 1;
                ends.push(at);
            }
        }
    }

    /// Whether the body so far ends exactly between two messages.
    pub fn at_boundary(&self) -> bool {
        self.prefix_len == 0
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

    /// However a body of three messages is cut, the ends found are the messages' ends.
    #[test]
    fn message_ends_are_found_across_any_cut() {
        let body: Vec<u8> = [frame(b"abc"), frame(b""), frame(&[7; 300])].concat();
        let expected = vec![8, 13, 318];
        for size in 1..=body.len() {
            let mut frames = MessageFrames::default();
            let mut found = Vec::new();
            let mut offset = 0;
            for piece in body.chunks(size) {
                let mut ends = Vec::new();
                frames.feed(piece, &mut ends);
                found.extend(ends.iter().map(|e| e + offset));
                offset += piece.len();
            }
            assert_eq!(found, expected, "pieces of {size}");
            assert_eq!(frames.messages, 3);
            assert!(frames.at_boundary());
        }
        let mut frames = MessageFrames::default();
        let mut ends = Vec::new();
        frames.feed(&body[..10], &mut ends);
        assert_eq!(ends, vec![8]);
        assert!(!frames.at_boundary());
    }
}
