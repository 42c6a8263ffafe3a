//! Reading an LLM response's `usage` whatever its `Content-Encoding`, pure: a gzip, deflate,
//! br or zstd body is decoded on a copy as it passes (the client still gets the bytes the
//! upstream sent) and fed to the [`ResponseMeter`], bounded in memory (the decoders write in
//! pieces of their own buffer size straight into the meter) and in expansion: a JSON answer
//! decoding to more than the response limit, or an event stream to more than
//! [`DECODED_LIMIT_FACTOR`] × that limit (a stream is read line by line, and a long completion
//! is legitimately larger than one document), stops decoding and counts as too large, so a
//! decompression bomb cannot cost more than reading that many bytes. An encoding that cannot be
//! decoded (unknown, several codings, corrupt data, too large) leaves the reservation to settle
//! on its estimate.

use crate::request::llm::ResponseMeter;
use std::io::Write;

/// Decoded bytes of an event stream read at most, as a multiple of the meter's response limit
/// (a JSON answer: the limit itself).
pub const DECODED_LIMIT_FACTOR: u64 = 16;

/// Why a response's body could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undecodable {
    /// An encoding this build does not decode (or several stacked).
    Unknown,
    /// The data is not what its encoding says.
    Corrupt,
    /// It decodes to more than the bound.
    TooLarge,
}

impl Undecodable {
    /// The label of `tollgate_llm_undecodable_responses_total{reason}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Undecodable::Unknown => "unknown_encoding",
            Undecodable::Corrupt => "corrupt",
            Undecodable::TooLarge => "too_large",
        }
    }
}

/// Where decoded bytes go: the meter, up to the bound.
struct Sink {
    meter: ResponseMeter,
    decoded: u64,
    limit: u64,
    /// A write past the bound was refused.
    over: bool,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.decoded.saturating_add(buf.len() as u64) > self.limit {
            self.over = true;
            return Err(std::io::Error::other("decoded past the bound"));
        }
        self.decoded += buf.len() as u64;
        self.meter.feed(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

enum Decoder {
    Gzip(Box<flate2::write::GzDecoder<Sink>>),
    Deflate(Box<flate2::write::ZlibDecoder<Sink>>),
    Brotli(Box<brotli_decompressor::DecompressorWriter<Sink>>),
    Zstd(Box<zstd::stream::write::Decoder<'static, Sink>>),
}

impl Decoder {
    fn sink(&self) -> &Sink {
        match self {
            Decoder::Gzip(d) => d.get_ref(),
            Decoder::Deflate(d) => d.get_ref(),
            Decoder::Brotli(d) => d.get_ref(),
            Decoder::Zstd(d) => d.get_ref(),
        }
    }

    fn write_all(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        match self {
            Decoder::Gzip(d) => d.write_all(chunk),
            Decoder::Deflate(d) => d.write_all(chunk),
            Decoder::Brotli(d) => d.write_all(chunk),
            Decoder::Zstd(d) => d.write_all(chunk),
        }
    }

    fn end(&mut self) -> std::io::Result<()> {
        match self {
            Decoder::Gzip(d) => d.try_finish(),
            Decoder::Deflate(d) => d.try_finish(),
            Decoder::Brotli(d) => d
                .close()
                .map_err(|e| std::io::Error::other(format!("{e:?}"))),
            Decoder::Zstd(d) => d.flush(),
        }
    }
}

/// A `Content-Encoding` value as a coding to undo: `None` for none (absent, empty or
/// `identity`), else the coding in lower case.
pub fn coding(content_encoding: Option<&str>) -> Option<String> {
    content_encoding
        .map(|v| v.trim().to_ascii_lowercase())
        .filter(|v| !v.is_empty() && v != "identity")
}

/// A response body's meter, reading through its content decoding when it has one.
pub struct BodyMeter(Reading);

enum Reading {
    /// Identity: the bytes are the text.
    Plain(ResponseMeter),
    Decoding {
        decoder: Decoder,
        /// Set once decoding failed: nothing more is read.
        failed: Option<Undecodable>,
        encoding: &'static str,
    },
    /// An encoding that cannot be read: the meter sees nothing.
    Unreadable {
        meter: ResponseMeter,
        encoding: String,
    },
}

impl BodyMeter {
    /// The meter for a response with this `Content-Encoding` (absent or `identity`: plain).
    pub fn new(meter: ResponseMeter, content_encoding: Option<&str>, limit: usize) -> BodyMeter {
        let Some(coding) = coding(content_encoding) else {
            return BodyMeter(Reading::Plain(meter));
        };
        let limit = if meter.is_stream() {
            (limit as u64).saturating_mul(DECODED_LIMIT_FACTOR)
        } else {
            limit as u64
        };
        let sink = Sink {
            meter,
            decoded: 0,
            limit,
            over: false,
        };
        let (decoder, encoding) = match coding.as_str() {
            "gzip" | "x-gzip" => (
                Decoder::Gzip(Box::new(flate2::write::GzDecoder::new(sink))),
                "gzip",
            ),
            "deflate" => (
                Decoder::Deflate(Box::new(flate2::write::ZlibDecoder::new(sink))),
                "deflate",
            ),
            "br" => (
                Decoder::Brotli(Box::new(brotli_decompressor::DecompressorWriter::new(
                    sink, 4096,
                ))),
                "br",
            ),
            "zstd" => match zstd::stream::write::Decoder::new(sink) {
                Ok(d) => (Decoder::Zstd(Box::new(d)), "zstd"),
                // The decoder could not be made: read nothing (the estimate settles).
                Err(_) => {
                    return BodyMeter(Reading::Unreadable {
                        meter: ResponseMeter::new("", 0),
                        encoding: coding,
                    })
                }
            },
            _ => {
                return BodyMeter(Reading::Unreadable {
                    meter: sink.meter,
                    encoding: coding,
                })
            }
        };
        BodyMeter(Reading::Decoding {
            decoder,
            failed: None,
            encoding,
        })
    }

    /// Reads one piece of the body as it passes. `Some(at)` only for a plain body: where a
    /// stream's cap was passed, `at` bytes into `chunk` (an encoded stream is never cut: its
    /// bytes do not split where its text does).
    pub fn feed(&mut self, chunk: &[u8]) -> Option<usize> {
        match &mut self.0 {
            Reading::Plain(meter) => meter.feed(chunk),
            Reading::Decoding {
                decoder, failed, ..
            } => {
                if failed.is_none() {
                    if let Err(e) = decoder.write_all(chunk) {
                        *failed = Some(failure(decoder, &e));
                    }
                }
                None
            }
            Reading::Unreadable { .. } => None,
        }
    }

    /// The body is complete.
    pub fn finish(&mut self) {
        if let Reading::Decoding {
            decoder, failed, ..
        } = &mut self.0
        {
            if failed.is_none() {
                if let Err(e) = decoder.end() {
                    *failed = Some(failure(decoder, &e));
                }
            }
        }
        match &mut self.0 {
            Reading::Plain(meter) | Reading::Unreadable { meter, .. } => meter.finish(),
            Reading::Decoding { decoder, .. } => match decoder {
                Decoder::Gzip(d) => d.get_mut().meter.finish(),
                Decoder::Deflate(d) => d.get_mut().meter.finish(),
                Decoder::Brotli(d) => d.get_mut().meter.finish(),
                Decoder::Zstd(d) => d.get_mut().meter.finish(),
            },
        }
    }

    /// The meter, with what it read (nothing of a body that could not be decoded).
    pub fn meter(&self) -> &ResponseMeter {
        match &self.0 {
            Reading::Plain(meter) | Reading::Unreadable { meter, .. } => meter,
            Reading::Decoding { decoder, .. } => &decoder.sink().meter,
        }
    }

    /// Why the body could not be read, with its encoding, if it could not.
    pub fn undecodable(&self) -> Option<(Undecodable, &str)> {
        match &self.0 {
            Reading::Plain(_) => None,
            Reading::Decoding {
                failed, encoding, ..
            } => failed.map(|f| (f, *encoding)),
            Reading::Unreadable { encoding, .. } => Some((Undecodable::Unknown, encoding)),
        }
    }

    /// Whether the usage it read can be trusted (a body that failed to decode may have been
    /// read only in part: its estimate settles instead).
    pub fn readable(&self) -> bool {
        self.undecodable().is_none()
    }
}

fn failure(decoder: &Decoder, _e: &std::io::Error) -> Undecodable {
    if decoder.sink().over {
        Undecodable::TooLarge
    } else {
        Undecodable::Corrupt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = br#"{"id":"x","choices":[{"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":10,"completion_tokens":5000,"total_tokens":5010}}"#;

    fn encode(encoding: &str, body: &[u8]) -> Vec<u8> {
        match encoding {
            "gzip" => {
                let mut e =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(body).unwrap();
                e.finish().unwrap()
            }
            "deflate" => {
                let mut e =
                    flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(body).unwrap();
                e.finish().unwrap()
            }
            "zstd" => zstd::stream::encode_all(body, 3).unwrap(),
            _ => unreachable!(),
        }
    }

    fn read(encoding: &str, bytes: &[u8], pieces: usize) -> BodyMeter {
        read_as("application/json", encoding, bytes, pieces)
    }

    /// A response of `content_type` in `encoding`, fed in `pieces` pieces, limit 1 MiB.
    fn read_as(content_type: &str, encoding: &str, bytes: &[u8], pieces: usize) -> BodyMeter {
        let mut m = BodyMeter::new(
            ResponseMeter::new(content_type, 1 << 20),
            Some(encoding),
            1 << 20,
        );
        for piece in bytes.chunks(bytes.len().div_ceil(pieces).max(1)) {
            assert_eq!(m.feed(piece), None);
        }
        m.finish();
        m
    }

    #[test]
    fn every_encoding_settles_on_its_usage() {
        for encoding in ["gzip", "deflate", "zstd"] {
            let m = read(encoding, &encode(encoding, BODY), 7);
            assert!(m.readable(), "{encoding}");
            assert_eq!(
                m.meter().usage().map(|u| u.total_tokens),
                Some(5010),
                "{encoding}"
            );
        }
        // Identity, and an encoding given in capitals.
        let m = read("identity", BODY, 3);
        assert_eq!(m.meter().usage().map(|u| u.total_tokens), Some(5010));
        let m = read("GZIP", &encode("gzip", BODY), 1);
        assert_eq!(m.meter().usage().map(|u| u.total_tokens), Some(5010));
    }

    #[test]
    fn what_cannot_be_decoded_is_said_and_read_as_nothing() {
        let m = read("compress", BODY, 1);
        assert_eq!(m.undecodable(), Some((Undecodable::Unknown, "compress")));
        assert_eq!(m.meter().usage(), None);
        let m = read("gzip, br", BODY, 1);
        assert_eq!(m.undecodable().map(|u| u.0), Some(Undecodable::Unknown));
        let m = read("gzip", b"not gzip at all", 1);
        assert_eq!(m.undecodable(), Some((Undecodable::Corrupt, "gzip")));
        let mut garbled = encode("zstd", BODY);
        garbled[6] ^= 0xff;
        let m = read("zstd", &garbled, 2);
        assert!(!m.readable());
    }

    /// A JSON answer decoding to more than the response limit is too large (its usage could
    /// not be read whole), where the same bytes as an event stream are read to 16 × the limit.
    #[test]
    fn a_json_answer_past_the_limit_is_too_large() {
        let padded = format!(
            r#"{{"pad":"{}","usage":{{"prompt_tokens":10,"completion_tokens":5000,"total_tokens":5010}}}}"#,
            " ".repeat(3 << 20)
        );
        let gzipped = encode("gzip", padded.as_bytes());
        let m = read_as("application/json", "gzip", &gzipped, 8);
        assert_eq!(m.undecodable(), Some((Undecodable::TooLarge, "gzip")));
        let m = read_as("text/event-stream", "gzip", &gzipped, 8);
        assert!(m.readable());
    }

    #[test]
    fn a_decompression_bomb_stops_at_the_bound() {
        // 64 MiB of zeros gzip to about 64 KiB; a JSON answer's bound is the 1 MiB limit.
        let zeros = vec![0u8; 64 << 20];
        let bomb = encode("gzip", &zeros);
        assert!(bomb.len() < 1 << 20);
        let m = read("gzip", &bomb, 16);
        assert_eq!(m.undecodable(), Some((Undecodable::TooLarge, "gzip")));
        if let Reading::Decoding { decoder, .. } = &m.0 {
            assert!(decoder.sink().decoded <= 1 << 20);
        }
    }
}
