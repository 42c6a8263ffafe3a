//! LLM token accounting, pure: what an OpenAI-style request asks for (a prompt estimate and the
//! completion it may produce), and what a response really used (the `usage` object of a JSON
//! body, or of a streamed `text/event-stream`'s final chunk, read chunk by chunk as it passes).
//! No I/O: the proxy and the decision service feed bytes in and read numbers out; the engine
//! turns them into reservations (`token_bucket_llm` rules).

use serde_json::Value;
use std::borrow::Cow;

/// The largest token count a policy field takes, and a settlement charges: a billion. A usage
/// reported above it (by an upstream or a `POST /v1/usage` caller) settles as this much, so
/// no store's arithmetic (µtokens in 64 bits, refill times in µs) can overflow on it.
pub const MAX_TOKENS: u64 = 1_000_000_000;

/// Where a `token_bucket_llm` rule takes its prompt estimate from (`token_source.estimator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Estimator {
    /// Counted from the request body's prompt text ([`estimate_text`]).
    SimpleWord,
    /// The client's own count in `X-Token-Estimate` (a whole number); the body's estimate
    /// when the header is absent or not a number.
    HeaderHint,
    /// OpenAI's BPE over the same texts, exact, with the per-message overhead the OpenAI
    /// cookbook documents ([`LlmRequest::exact_prompt_tokens`]).
    Tiktoken(TokenEncoding),
}

/// A `tiktoken` encoding (`token_source.encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenEncoding {
    /// GPT-4o, GPT-4.1, o-series.
    O200kBase,
    /// GPT-4, GPT-3.5.
    Cl100kBase,
}

impl TokenEncoding {
    pub const ALL: [TokenEncoding; 2] = [TokenEncoding::O200kBase, TokenEncoding::Cl100kBase];

    /// Its position in [`LlmRequest::exact_prompt_tokens`].
    pub fn index(self) -> usize {
        match self {
            TokenEncoding::O200kBase => 0,
            TokenEncoding::Cl100kBase => 1,
        }
    }

    /// Its bit in the set of encodings a bundle asks for.
    pub fn bit(self) -> u8 {
        1 << self.index()
    }

    pub fn parse(name: &str) -> Option<TokenEncoding> {
        match name {
            "o200k_base" => Some(TokenEncoding::O200kBase),
            "cl100k_base" => Some(TokenEncoding::Cl100kBase),
            _ => None,
        }
    }

    /// Tokens of `text` (special tokens read as text, as a prompt's are), with the BPE's cost
    /// bounded: a run of more than [`BPE_RUN_BYTES`] without whitespace is counted in pieces of
    /// that size (BPE merging is quadratic in a piece's length, and its piece-splitting regex
    /// overflows on megabyte runs), and the text goes to the BPE at most [`BPE_CALL_BYTES`] at a
    /// time. Ordinary text (words and spaces) counts exactly as a whole.
    pub fn count(self, text: &str) -> u64 {
        let bpe = match self {
            TokenEncoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
            TokenEncoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
        };
        let mut tokens = 0u64;
        let mut start = 0;
        let mut run = 0usize;
        for (at, c) in text.char_indices() {
            if c.is_whitespace() {
                // Cut before the space: the BPE's pieces start with it (" word"), so ordinary
                // text splits where the BPE splits it anyway.
                if at - start >= BPE_CALL_BYTES {
                    tokens += bpe.encode_ordinary(&text[start..at]).len() as u64;
                    start = at;
                }
                run = 0;
                continue;
            }
            run += c.len_utf8();
            if run >= BPE_RUN_BYTES {
                let end = at + c.len_utf8();
                tokens += bpe.encode_ordinary(&text[start..end]).len() as u64;
                start = end;
                run = 0;
            }
        }
        if start < text.len() {
            tokens += bpe.encode_ordinary(&text[start..]).len() as u64;
        }
        tokens
    }
}

/// The longest run without whitespace the BPE is given at once (see [`TokenEncoding::count`]).
pub const BPE_RUN_BYTES: usize = 256;
/// The most text the BPE is given at once, cut at whitespace.
pub const BPE_CALL_BYTES: usize = 4096;

/// Tokens OpenAI adds per chat message (`<|start|>role ... <|end|>`), per message `name`, and
/// once to prime the reply (the OpenAI cookbook's `num_tokens_from_messages`).
pub const TOKENS_PER_MESSAGE: u64 = 3;
pub const TOKENS_PER_NAME: u64 = 1;
pub const TOKENS_REPLY_PRIMING: u64 = 3;

/// The header a `header_hint` estimator reads (lower case).
pub const TOKEN_ESTIMATE_HEADER: &str = "x-token-estimate";

/// The 413 body for a request body larger than the gateway reads (`--max-body-bytes`), in
/// OpenAI's error shape.
pub const BODY_TOO_LARGE: &str = r#"{"error":{"message":"The request body is larger than this gateway reads before forwarding (--max-body-bytes).","type":"invalid_request_error","param":null,"code":"request_too_large"}}"#;

/// The 411 body for a chunked request body too large to replay to the upstream.
pub const LENGTH_REQUIRED: &str = r#"{"error":{"message":"Send Content-Length with request bodies over 64 KiB on this route (token budgets read the body before forwarding it).","type":"invalid_request_error","param":null,"code":"length_required"}}"#;

/// The usage a `POST /v1/usage` reports: `{"total_tokens": n}`, an OpenAI `usage` object at
/// the top level, or one under `usage`. `None` when it holds no token count.
pub fn reported_usage(json: &Value) -> Option<Usage> {
    Usage::of(json).or_else(|| {
        let wrapped = serde_json::json!({ "usage": json });
        Usage::of(&wrapped)
    })
}

/// Word and character counts of a text, accumulated piece by piece (a word split across two
/// streamed pieces counts once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TextCount {
    pub words: u64,
    pub chars: u64,
    in_word: bool,
}

impl TextCount {
    /// Counts `text` (Unicode whitespace separates words). ASCII, most of any prompt, is
    /// classified byte by byte; other characters are decoded one at a time.
    pub fn add(&mut self, text: &str) {
        let bytes = text.as_bytes();
        let mut at = 0;
        while let Some(&b) = bytes.get(at) {
            let space = if b < 0x80 {
                at += 1;
                // `char::is_whitespace` on ASCII: tab, line feed, vertical tab, form feed,
                // carriage return and space.
                matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
            } else {
                let Some(c) = text.get(at..).and_then(|rest| rest.chars().next()) else {
                    break;
                };
                at += c.len_utf8();
                c.is_whitespace()
            };
            self.chars += 1;
            if space {
                self.in_word = false;
            } else if !self.in_word {
                self.in_word = true;
                self.words += 1;
            }
        }
    }

    /// Ends a piece of text: the next one starts a new word (message boundaries).
    pub fn separate(&mut self) {
        self.in_word = false;
    }

    /// The `simple_word` estimate: ⌈words × 4 / 3⌉ (English averages ¾ word per token), but
    /// never below ⌈chars / 4⌉ (code, URLs and unspaced scripts have more tokens than words).
    pub fn tokens(&self) -> u64 {
        (self.words * 4).div_ceil(3).max(self.chars.div_ceil(4))
    }
}

/// The `simple_word` estimate of one text.
pub fn estimate_text(text: &str) -> u64 {
    let mut count = TextCount::default();
    count.add(text);
    count.tokens()
}

/// What an LLM request asks for, read once from its body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlmRequest {
    /// The `simple_word` estimate of the prompt: every text the model reads (see
    /// [`field`]: every string of the body but known metadata, tool and response schemas as
    /// their JSON text) plus a fixed estimate per image or audio part (`media_tokens`). A body
    /// that is not JSON is estimated as text, whole.
    pub prompt_tokens: u64,
    /// `max_completion_tokens`, else `max_tokens`, else `max_output_tokens`, when a whole
    /// number.
    pub max_completion: Option<u64>,
    /// The exact prompt by [`TokenEncoding`] (in [`TokenEncoding::index`] order), for the
    /// encodings the bundle's `tiktoken` rules asked for ([`LlmRequest::parse_with`]).
    pub exact_prompt_tokens: [Option<u64>; 2],
}

impl LlmRequest {
    /// [`LlmRequest::parse`], and the exact prompt in each encoding of `encodings` (a set of
    /// [`TokenEncoding::bit`]s): the same texts through OpenAI's BPE, the media parts' fixed
    /// estimates, and the chat overhead (3 tokens per message of `messages` or `input`, 1 per
    /// `name`, 3 to prime the reply). A body that is not JSON is counted as text, whole.
    pub fn parse_with(body: &[u8], encodings: u8) -> LlmRequest {
        let mut request = LlmRequest::parse(body);
        for encoding in TokenEncoding::ALL {
            if encodings & encoding.bit() != 0 {
                request.exact_prompt_tokens[encoding.index()] = Some(exact_prompt(body, encoding));
            }
        }
        request
    }

    /// The prompt as `estimator` counts it.
    pub fn prompt_for(&self, estimator: Estimator) -> u64 {
        match estimator {
            Estimator::Tiktoken(encoding) => {
                self.exact_prompt_tokens[encoding.index()].unwrap_or(self.prompt_tokens)
            }
            Estimator::SimpleWord | Estimator::HeaderHint => self.prompt_tokens,
        }
    }

    /// Reads a request body (never fails: what cannot be read estimates conservatively). A
    /// JSON object is read in one pass, counting prompt text as the parser meets it (no JSON
    /// tree built: see the `llm/reserve_and_settle` bench); anything else goes through
    /// [`LlmRequest::parse_document`].
    pub fn parse(body: &[u8]) -> LlmRequest {
        use serde::de::DeserializeSeed;
        if !fast_path_ok(body) {
            return LlmRequest::parse_document(body);
        }
        let mut de = serde_json::Deserializer::from_slice(body);
        match RequestSeed
            .deserialize(&mut de)
            .and_then(|r| de.end().map(|()| r))
        {
            Ok(request) => request,
            Err(_) => LlmRequest::parse_document(body),
        }
    }

    /// The same reading through a JSON tree: the reference [`LlmRequest::parse`] agrees with
    /// (property-tested), and its path for bodies that are not a JSON object.
    pub fn parse_document(body: &[u8]) -> LlmRequest {
        let Ok(json) = serde_json::from_slice::<Value>(body) else {
            return LlmRequest {
                prompt_tokens: estimate_text(&String::from_utf8_lossy(body)),
                ..LlmRequest::default()
            };
        };
        let mut count = Prompt::default();
        if let Value::Object(map) = &json {
            for (key, v) in map {
                if !COMPLETION_FIELDS.contains(&key.as_str()) {
                    count.value(Reading::Field(top_level_field(key)), v, 1);
                }
            }
        } else {
            count.value(Reading::Field(Field::Text), &json, 0);
        }
        let max_completion = COMPLETION_FIELDS
            .iter()
            .find_map(|f| json.get(*f).and_then(Value::as_u64));
        LlmRequest {
            prompt_tokens: count.tokens(),
            max_completion,
            exact_prompt_tokens: [None; 2],
        }
    }
}

/// The exact prompt of a body in one encoding (see [`LlmRequest::parse_with`]).
fn exact_prompt(body: &[u8], encoding: TokenEncoding) -> u64 {
    let Ok(json) = serde_json::from_slice::<Value>(body) else {
        return encoding.count(&String::from_utf8_lossy(body));
    };
    let mut count = Prompt {
        exact: Some(encoding),
        ..Prompt::default()
    };
    let mut overhead = 0u64;
    if let Value::Object(map) = &json {
        for (key, v) in map {
            if COMPLETION_FIELDS.contains(&key.as_str()) {
                continue;
            }
            count.value(Reading::Field(top_level_field(key)), v, 1);
            if let ("messages" | "input", Value::Array(messages)) = (key.as_str(), v) {
                for message in messages.iter().filter_map(Value::as_object) {
                    overhead += TOKENS_PER_MESSAGE;
                    if message.contains_key("name") {
                        overhead += TOKENS_PER_NAME;
                    }
                    // The role is part of what the model reads of a message, too.
                    if let Some(role) = message.get("role").and_then(Value::as_str) {
                        overhead = overhead.saturating_add(encoding.count(role));
                    }
                }
            }
        }
    } else {
        count.value(Reading::Field(Field::Text), &json, 0);
    }
    if overhead > 0 {
        overhead += TOKENS_REPLY_PRIMING;
    }
    count
        .exact_tokens
        .saturating_add(count.media)
        .saturating_add(overhead)
}

/// The deepest value counted. serde_json refuses a body nested deeper than 128 levels (such a
/// body is then estimated as text, whole), so every value of a body that parses is above this
/// bound and counts; it only keeps the readers' recursion bounded should that limit change.
const MAX_PROMPT_DEPTH: u32 = 200;

/// How a field's value counts towards the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// Every string in it (the model reads it): messages, contents, tools' names and
    /// descriptions, tool-call arguments, system prompts, and every field not known to be
    /// metadata, so that an unknown API shape over-estimates rather than slipping through.
    Text,
    /// Metadata the model does not read as text (`model`, `user`, `metadata`, ids, roles,
    /// types, MIME types, sampling settings...): not counted.
    Skip,
    /// A schema (`parameters`, `input_schema`, `schema`, `json_schema`, `response_schema`) or
    /// a tool's input or result (`input` below the top level, Gemini's `args` and `response`):
    /// counted as its JSON text, keys, numbers and booleans included, and no name inside it is
    /// metadata (a tool's input may well have a `metadata` or `id` field holding text).
    Whole,
    /// An image or audio part: a fixed estimate (`media_tokens`), whatever its bytes.
    Media(MediaKind),
}

/// What a media part holds, as far as its field's name tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    Audio,
    /// Inline data or a file whose MIME type decides (`audio/...`, else an image).
    ByMime,
}

/// How an object's field counts, by its name.
pub fn field(key: &str) -> Field {
    match key {
        "model"
        | "user"
        | "metadata"
        | "id"
        | "type"
        | "role"
        | "object"
        | "tool_call_id"
        | "call_id"
        | "tool_use_id"
        | "service_tier"
        | "safety_identifier"
        | "prompt_cache_key"
        | "previous_response_id"
        | "store"
        | "stream"
        | "stop"
        | "stop_sequences"
        | "stopSequences"
        | "mime_type"
        | "mimeType"
        | "media_type"
        | "detail"
        | "encoding"
        | "status"
        | "modalities"
        | "responseModalities"
        | "voice"
        | "reasoning_effort"
        | "logit_bias"
        | "cache_control"
        | "finish_reason" => Field::Skip,
        "parameters"
        | "input_schema"
        | "schema"
        | "json_schema"
        | "response_schema"
        | "responseSchema"
        | "responseJsonSchema"
        | "parametersJsonSchema"
        | "input"
        | "args"
        | "response" => Field::Whole,
        "image_url" | "image" | "input_image" => Field::Media(MediaKind::Image),
        "input_audio" | "audio" => Field::Media(MediaKind::Audio),
        "inline_data" | "inlineData" | "file_data" | "fileData" | "source" => {
            Field::Media(MediaKind::ByMime)
        }
        _ => Field::Text,
    }
}

/// How a top-level field of a request body counts: as [`field`] says, except `input`, which at
/// the top is the Responses API's prompt (a string or a list of messages, with media parts
/// read as media), not a tool's input.
pub fn top_level_field(key: &str) -> Field {
    match key {
        "input" => Field::Text,
        _ => field(key),
    }
}

/// Tokens an image counts: OpenAI's published rule for one 1024 × 1024 image (the size a part
/// does not state): 85 at `detail: low`, else 85 + 170 per 512-pixel tile of the image scaled
/// to 768 on its short side, 4 tiles: 765.
pub const IMAGE_TOKENS_LOW: u64 = 85;
pub const IMAGE_TOKENS: u64 = 765;
/// Audio: about 10 tokens a second of 16 kHz 16-bit mono, from the base64 data's size (4
/// characters carry 3 bytes, 32 000 bytes a second), and never below this.
pub const AUDIO_TOKENS_MIN: u64 = 50;

/// What a media value said about itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct MediaFacts {
    low_detail: bool,
    /// The part's MIME type (or audio format) says: audio, an image, or compressed audio.
    audio_mime: bool,
    image_mime: bool,
    compressed_audio: bool,
    /// Characters of its `data` (base64, or a text document's text).
    data_chars: u64,
    /// Characters of text blocks inside it (an Anthropic document's `content`).
    text_chars: u64,
}

/// The estimate of one media part. Inline data of a type that is neither an image nor audio (a
/// text or PDF document, an unknown type) counts like text: a token per 4 characters of its
/// data, and of any text blocks in it.
fn media_tokens(kind: MediaKind, facts: MediaFacts) -> u64 {
    let text = facts.text_chars.div_ceil(4);
    let audio = match kind {
        MediaKind::Audio => true,
        MediaKind::Image => false,
        MediaKind::ByMime if facts.audio_mime => true,
        MediaKind::ByMime if facts.image_mime || facts.data_chars == 0 => false,
        MediaKind::ByMime => return facts.data_chars.div_ceil(4).saturating_add(text),
    };
    let part = if audio {
        // Compressed audio (mp3, opus...) carries a second in about 4 000 bytes, not 32 000.
        let bytes_per_second = if facts.compressed_audio {
            4_000
        } else {
            32_000
        };
        (facts.data_chars.saturating_mul(3) / 4)
            .saturating_mul(10)
            .div_ceil(bytes_per_second)
            .max(AUDIO_TOKENS_MIN)
    } else if facts.low_detail {
        IMAGE_TOKENS_LOW
    } else {
        IMAGE_TOKENS
    };
    part.saturating_add(text)
}

/// The fields of a media value that tell something about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MediaKey {
    Detail,
    Mime,
    Data,
    Text,
    /// The media value itself, when it is a string: a data URL (its MIME type and data), a
    /// URL elsewhere (nothing known of its size), or the data itself (OpenAI's `file_data`).
    Root,
    /// Any other field.
    Other,
}

impl MediaKey {
    fn of(key: &str) -> MediaKey {
        match key {
            "detail" => MediaKey::Detail,
            "mime_type" | "mimeType" | "media_type" | "format" => MediaKey::Mime,
            "data" => MediaKey::Data,
            "text" => MediaKey::Text,
            _ => MediaKey::Other,
        }
    }
}

/// A media value's string at `key`.
fn media_string(facts: &mut MediaFacts, key: MediaKey, text: &str) {
    match key {
        // The last value wins, as in a JSON tree (and in the upstream that reads the body).
        MediaKey::Detail => facts.low_detail = text == "low",
        MediaKey::Mime => {
            facts.audio_mime = text.starts_with("audio/")
                || matches!(
                    text,
                    "wav" | "pcm16" | "mp3" | "opus" | "aac" | "flac" | "ogg"
                );
            facts.image_mime = text.starts_with("image/");
            facts.compressed_audio = !matches!(
                text,
                "wav" | "pcm16" | "audio/wav" | "audio/x-wav" | "audio/pcm" | "audio/l16"
            );
        }
        MediaKey::Data => facts.data_chars = facts.data_chars.saturating_add(text.len() as u64),
        MediaKey::Text => {
            facts.text_chars = facts.text_chars.saturating_add(text.chars().count() as u64)
        }
        MediaKey::Root => {
            if let Some(url) = text.strip_prefix("data:") {
                let (meta, data) = url.split_once(',').unwrap_or((url, ""));
                media_string(facts, MediaKey::Mime, meta.split(';').next().unwrap_or(""));
                facts.data_chars = facts.data_chars.saturating_add(data.len() as u64);
            } else if !text.contains("://") {
                facts.data_chars = facts.data_chars.saturating_add(text.len() as u64);
            }
        }
        MediaKey::Other => {}
    }
}

/// How a value is being read: as a field of the prompt says, or as part of a media value
/// (where only what tells about the media counts, by the field it is under).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Field(Field),
    Media(MediaKey),
}

/// A prompt's count: its text, and the fixed estimates of its media parts.
#[derive(Debug, Clone, Copy, Default)]
struct Prompt {
    text: TextCount,
    media: u64,
    /// The media part being read.
    part: MediaFacts,
    /// Also counting every text through this BPE ([`exact_prompt`]).
    exact: Option<TokenEncoding>,
    exact_tokens: u64,
}

impl Prompt {
    fn tokens(&self) -> u64 {
        self.text.tokens().saturating_add(self.media)
    }

    fn string(&mut self, text: &str) {
        self.text.add(text);
        self.text.separate();
        if let Some(encoding) = self.exact {
            self.exact_tokens = self.exact_tokens.saturating_add(encoding.count(text));
        }
    }

    /// A string read as `how`.
    fn read_str(&mut self, how: Reading, text: &str) {
        match how {
            Reading::Media(key) => media_string(&mut self.part, key, text),
            Reading::Field(_) => self.string(text),
        }
    }

    /// Starts a media part (its facts gathered as it is read).
    fn start_part(&mut self) {
        self.part = MediaFacts::default();
    }

    /// Ends a media part: its estimate counts.
    fn end_part(&mut self, kind: MediaKind) {
        self.media = self.media.saturating_add(media_tokens(kind, self.part));
    }

    /// Counts a value read as `how`, through a JSON tree (the reference the one-pass reader
    /// agrees with).
    fn value(&mut self, how: Reading, v: &Value, depth: u32) {
        if depth > MAX_PROMPT_DEPTH {
            return;
        }
        match (how, v) {
            (Reading::Field(Field::Skip), _) => {}
            (Reading::Field(Field::Media(kind)), v) => {
                self.start_part();
                self.value(Reading::Media(MediaKey::Root), v, depth);
                self.end_part(kind);
            }
            (_, Value::String(s)) => self.read_str(how, s),
            // As JSON writes it (`1e308`, never 309 digits).
            (Reading::Field(Field::Whole), Value::Number(n)) => self.string(&n.to_string()),
            (Reading::Field(Field::Whole), Value::Bool(b)) => self.string(bool_text(*b)),
            (_, Value::Array(items)) => {
                for item in items {
                    self.value(how, item, depth + 1);
                }
            }
            (_, Value::Object(map)) => {
                for (key, inner) in map {
                    let inner_how = self.key(how, key);
                    self.value(inner_how, inner, depth + 1);
                }
            }
            _ => {}
        }
    }

    /// How the value under `key` of an object read as `how` is read; a schema's keys count as
    /// text themselves.
    fn key(&mut self, how: Reading, key: &str) -> Reading {
        match how {
            Reading::Field(Field::Whole) => {
                self.string(key);
                how
            }
            Reading::Media(_) => Reading::Media(MediaKey::of(key)),
            Reading::Field(_) => Reading::Field(field(key)),
        }
    }
}

/// Reads a request body that is a JSON object in one pass: every field counted as [`field`]
/// says, the completion fields kept when whole numbers. A field repeated in the body is counted
/// each time (a JSON tree keeps the last): a larger estimate, never a smaller one.
struct RequestSeed;

/// The completion fields, in the order they are preferred.
const COMPLETION_FIELDS: [&str; 3] = ["max_completion_tokens", "max_tokens", "max_output_tokens"];

impl<'de> serde::de::DeserializeSeed<'de> for RequestSeed {
    type Value = LlmRequest;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<LlmRequest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for RequestSeed {
    type Value = LlmRequest;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<LlmRequest, A::Error> {
        let mut count = Prompt::default();
        let mut completion = [None; 3];
        while let Some(key) = map.next_key::<RequestKey>()? {
            match key {
                RequestKey::Completion(i) => {
                    completion[i] = map.next_value::<Value>()?.as_u64();
                }
                RequestKey::Field(how) => map.next_value_seed(PromptSeed {
                    count: &mut count,
                    how: Reading::Field(how),
                    depth: 1,
                })?,
            }
        }
        Ok(LlmRequest {
            prompt_tokens: count.tokens(),
            max_completion: completion.into_iter().flatten().next(),
            exact_prompt_tokens: [None; 2],
        })
    }
}

/// A request body's top-level field, as [`RequestSeed`] reads it.
enum RequestKey {
    Completion(usize),
    Field(Field),
}

impl RequestKey {
    fn of(key: &str) -> RequestKey {
        match COMPLETION_FIELDS.iter().position(|f| *f == key) {
            Some(i) => RequestKey::Completion(i),
            None => RequestKey::Field(top_level_field(key)),
        }
    }
}

impl<'de> serde::Deserialize<'de> for RequestKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RequestKey, D::Error> {
        d.deserialize_str(KeyVisitor(RequestKey::of))
    }
}

/// Reads an object's key as `classify` sees it, without copying the name.
struct KeyVisitor<T>(fn(&str) -> T);

impl<T> serde::de::Visitor<'_> for KeyVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, key: &str) -> Result<T, E> {
        Ok((self.0)(key))
    }
}

/// Counts one value as the parser meets it, as [`Prompt::value`] does on a tree.
struct PromptSeed<'c> {
    count: &'c mut Prompt,
    how: Reading,
    depth: u32,
}

/// A boolean as its JSON text.
fn bool_text(b: bool) -> &'static str {
    if b {
        "true"
    } else {
        "false"
    }
}

impl PromptSeed<'_> {
    /// A number or boolean counts as its JSON text inside a schema or a tool's input, and
    /// nowhere else (sampling settings, counts and flags are not text the model reads).
    fn whole_scalar(self, text: impl FnOnce() -> String) {
        if self.how == Reading::Field(Field::Whole) && self.depth <= MAX_PROMPT_DEPTH {
            self.count.string(&text());
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match self.how {
            Reading::Field(Field::Skip) => {
                <serde::de::IgnoredAny as serde::Deserialize>::deserialize(d)?;
                Ok(())
            }
            Reading::Field(Field::Media(kind)) => {
                self.count.start_part();
                d.deserialize_any(PromptSeed {
                    count: &mut *self.count,
                    how: Reading::Media(MediaKey::Root),
                    depth: self.depth,
                })?;
                self.count.end_part(kind);
                Ok(())
            }
            _ => d.deserialize_any(self),
        }
    }
}

impl<'de> serde::de::Visitor<'de> for PromptSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, text: &str) -> Result<(), E> {
        if self.depth <= MAX_PROMPT_DEPTH {
            self.count.read_str(self.how, text);
        }
        Ok(())
    }

    fn visit_bool<E>(self, b: bool) -> Result<(), E> {
        self.whole_scalar(|| bool_text(b).to_string());
        Ok(())
    }

    fn visit_i64<E>(self, n: i64) -> Result<(), E> {
        self.whole_scalar(|| n.to_string());
        Ok(())
    }

    fn visit_u64<E>(self, n: u64) -> Result<(), E> {
        self.whole_scalar(|| n.to_string());
        Ok(())
    }

    fn visit_f64<E>(self, n: f64) -> Result<(), E> {
        // As JSON writes it (`1e308`, never 309 digits), as the tree reader does.
        self.whole_scalar(|| {
            serde_json::Number::from_f64(n).map_or_else(String::new, |n| n.to_string())
        });
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let PromptSeed { count, how, depth } = self;
        if depth >= MAX_PROMPT_DEPTH {
            // Nothing below is counted.
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
            return Ok(());
        }
        while seq
            .next_element_seed(PromptSeed {
                count: &mut *count,
                how,
                depth: depth + 1,
            })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let PromptSeed { count, how, depth } = self;
        while let Some(inner) = map.next_key_seed(KeySeed {
            count: &mut *count,
            how,
        })? {
            if depth >= MAX_PROMPT_DEPTH {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            map.next_value_seed(PromptSeed {
                count: &mut *count,
                how: inner,
                depth: depth + 1,
            })?;
        }
        Ok(())
    }
}

/// An object's key as the parser meets it: how its value is read ([`Prompt::key`]).
struct KeySeed<'c> {
    count: &'c mut Prompt,
    how: Reading,
}

impl<'de> serde::de::DeserializeSeed<'de> for KeySeed<'_> {
    type Value = Reading;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Reading, D::Error> {
        d.deserialize_str(self)
    }
}

impl serde::de::Visitor<'_> for KeySeed<'_> {
    type Value = Reading;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, key: &str) -> Result<Reading, E> {
        Ok(self.count.key(self.how, key))
    }
}

/// Tokens a response reports in its `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

impl Usage {
    /// OpenAI's `{prompt_tokens, completion_tokens, total_tokens}` or the Responses API's
    /// `{input_tokens, output_tokens, total_tokens}`; `None` when absent or `null`. A missing
    /// total is the sum of the two.
    pub fn of(json: &Value) -> Option<Usage> {
        let usage = json.get("usage").filter(|u| u.is_object())?;
        let field = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|n| usage.get(*n).and_then(Value::as_u64))
        };
        let prompt = field(["prompt_tokens", "input_tokens"]);
        let completion = field(["completion_tokens", "output_tokens"]);
        let total = usage.get("total_tokens").and_then(Value::as_u64);
        if prompt.is_none() && completion.is_none() && total.is_none() {
            return None;
        }
        let (prompt, completion) = (prompt.unwrap_or(0), completion.unwrap_or(0));
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: total.unwrap_or(prompt.saturating_add(completion)),
        })
    }
}

/// What a `token_bucket_llm` rule's `streaming` block does with a streamed completion that runs
/// past `max_completion_tokens` (Fairvisor's field names): the gateway stops the stream once the
/// estimate of the text streamed passes `max_completion_tokens + buffer_tokens`, ends it with a
/// closing event the SDKs understand and drops the upstream connection (the model stops
/// generating).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCap {
    /// The rule's `max_completion_tokens`.
    pub max_completion_tokens: u64,
    /// `buffer_tokens`: how far past `max_completion_tokens` the estimate may run before the
    /// stream is stopped (the estimate is a rule of thumb, not the model's tokenizer).
    pub buffer_tokens: u64,
    /// `on_limit_exceeded`.
    pub on_exceeded: StreamCutStyle,
    /// `include_partial_usage`: the closing event carries the `usage` the gateway counted.
    pub include_partial_usage: bool,
}

/// How a stopped stream ends (`streaming.on_limit_exceeded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCutStyle {
    /// `graceful_close`: a last chunk with `finish_reason: "length"`, as a model that reached
    /// its `max_tokens` sends, then `data: [DONE]`.
    GracefulClose,
    /// `error_chunk`: an `error` event (`code: completion_tokens_exceeded`), then `data: [DONE]`.
    ErrorChunk,
}

impl StreamCap {
    /// The completion estimate past which the stream is stopped.
    pub fn limit(&self) -> u64 {
        self.max_completion_tokens
            .saturating_add(self.buffer_tokens)
    }

    /// The tightest of several caps (one request may meet several `token_bucket_llm` rules).
    pub fn tightest(caps: impl IntoIterator<Item = StreamCap>) -> Option<StreamCap> {
        caps.into_iter().min_by_key(StreamCap::limit)
    }

    /// The bytes that end a stopped stream, after the event that crossed the limit: a blank line
    /// (that event's end), the closing event, and `data: [DONE]`. `id`, `created` and `model`
    /// repeat the stream's own, when it named them.
    pub fn closing_events(&self, meter: &ResponseMeter, prompt_tokens: u64) -> String {
        let completion = meter.completion_estimate();
        let usage = serde_json::json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens.saturating_add(completion),
        });
        let mut event = serde_json::Map::new();
        match self.on_exceeded {
            StreamCutStyle::GracefulClose => {
                if let Some(id) = &meter.stream_id {
                    event.insert("id".into(), Value::from(id.as_str()));
                }
                event.insert("object".into(), Value::from("chat.completion.chunk"));
                if let Some(created) = meter.stream_created {
                    event.insert("created".into(), Value::from(created));
                }
                if let Some(model) = &meter.stream_model {
                    event.insert("model".into(), Value::from(model.as_str()));
                }
                event.insert(
                    "choices".into(),
                    serde_json::json!([{"index": 0, "delta": {}, "finish_reason": "length"}]),
                );
            }
            StreamCutStyle::ErrorChunk => {
                event.insert(
                    "error".into(),
                    serde_json::json!({
                        "message": format!(
                            "The completion passed the {} tokens this gateway allows a request (max_completion_tokens); the stream was stopped.",
                            self.max_completion_tokens
                        ),
                        "type": "rate_limit_exceeded",
                        "param": null,
                        "code": "completion_tokens_exceeded",
                    }),
                );
            }
        }
        if self.include_partial_usage {
            event.insert("usage".into(), usage);
        }
        format!("\ndata: {}\n\ndata: [DONE]\n\n", Value::Object(event))
    }
}

/// The usual shape of a streamed chunk (Chat Completions, legacy Completions, Responses API
/// events), read without building a JSON map. A chunk of any other shape fails to parse here
/// and is read as a [`Value`] instead, so nothing is lost to the fast path.
#[derive(serde::Deserialize)]
struct StreamChunk<'a> {
    #[serde(borrow, default)]
    id: Option<Text<'a>>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(borrow, default)]
    model: Option<Text<'a>>,
    #[serde(borrow, default)]
    choices: Vec<Object<StreamChoice<'a>>>,
    #[serde(default)]
    usage: Option<Object<UsageFields>>,
    #[serde(default)]
    response: Option<Object<ResponseEvent>>,
    /// Responses API text deltas (`response.output_text.delta`).
    #[serde(borrow, default)]
    delta: Option<Text<'a>>,
}

#[derive(serde::Deserialize)]
struct StreamChoice<'a> {
    #[serde(borrow, default)]
    delta: Option<ChoiceDelta<'a>>,
    #[serde(borrow, default)]
    text: Option<Text<'a>>,
}

/// A choice's `delta`; `has_content` tells an absent `content` (the choice's `text` is read
/// instead) from a `null` one (nothing is), as the document path does.
struct ChoiceDelta<'a> {
    content: Option<Text<'a>>,
    has_content: bool,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for ChoiceDelta<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Raw<'a> {
            #[serde(borrow, default, deserialize_with = "present")]
            content: Option<Option<Text<'a>>>,
        }
        let Object(raw) = Object::<Raw>::deserialize(d)?;
        Ok(ChoiceDelta {
            has_content: raw.content.is_some(),
            content: raw.content.flatten(),
        })
    }
}

/// A field that is present (even as `null`) is `Some`.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A JSON string, borrowed from the input when it has no escapes (serde's own `Cow` always
/// copies).
struct Text<'a>(Cow<'a, str>);

impl std::ops::Deref for Text<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> serde::de::Visitor<'de> for TextVisitor {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Cow<'de, str>, E> {
                Ok(Cow::Borrowed(text))
            }
            fn visit_str<E>(self, text: &str) -> Result<Cow<'de, str>, E> {
                Ok(Cow::Owned(text.to_owned()))
            }
        }
        d.deserialize_str(TextVisitor).map(Text)
    }
}

/// `T` read from a JSON object only: serde's derived structs also accept an array of their
/// fields, which the document reader never reads as one.
struct Object<T>(T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for ObjectVisitor<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(ObjectVisitor(std::marker::PhantomData))
            .map(Object)
    }
}

/// Whether the one-pass readers may read `json`: they skip fields without checking them, so
/// what the document reader would refuse (bytes that are not UTF-8, a `\uD800`-`\uDFFF`
/// escape, lone or paired) goes to the document reader instead, and both agree.
fn fast_path_ok(json: &[u8]) -> bool {
    let surrogate_escape = memchr::memchr_iter(b'\\', json)
        .any(|at| matches!(json.get(at + 1..at + 3), Some([b'u', b'd' | b'D'])));
    !surrogate_escape && std::str::from_utf8(json).is_ok()
}

#[derive(serde::Deserialize)]
struct ResponseEvent {
    #[serde(default)]
    usage: Option<Object<UsageFields>>,
}

/// A `usage` object's token counts, under OpenAI's or the Responses API's names.
#[derive(serde::Deserialize)]
struct UsageFields {
    prompt_tokens: Option<u64>,
    input_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    output_tokens: Option<u64>,
    total_tokens: Option<u64>,
}

impl UsageFields {
    /// As [`Usage::of`]: `None` without any count; a missing total is the sum.
    fn usage(self) -> Option<Usage> {
        let prompt = self.prompt_tokens.or(self.input_tokens);
        let completion = self.completion_tokens.or(self.output_tokens);
        if prompt.is_none() && completion.is_none() && self.total_tokens.is_none() {
            return None;
        }
        let (prompt, completion) = (prompt.unwrap_or(0), completion.unwrap_or(0));
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: self
                .total_tokens
                .unwrap_or(prompt.saturating_add(completion)),
        })
    }
}

/// How a response body is read.
#[derive(Debug)]
enum Format {
    /// One JSON document: kept (up to the bound) and read at its end.
    Json { body: Vec<u8>, overflow: bool },
    /// Server-sent events: read line by line as they pass, only the current line kept.
    Stream { line: Vec<u8>, overflow: bool },
}

/// Reads the usage of an upstream response as its body streams to the client: nothing is held
/// back, and at most `limit` bytes are kept (the JSON body, or the current event line).
#[derive(Debug)]
pub struct ResponseMeter {
    format: Format,
    limit: usize,
    usage: Option<Usage>,
    /// The completion text seen (streamed deltas, or a JSON body's choices).
    completion: TextCount,
    /// Body bytes seen.
    pub bytes: u64,
    /// A streamed completion whose estimate passes this is stopped ([`StreamCap::limit`]).
    cap: Option<u64>,
    /// The cap was passed: nothing after it is read.
    pub stopped: bool,
    /// The stream's own `id`, `created` and `model` (from its first chunk naming them), for
    /// the closing event of a stopped stream.
    stream_id: Option<String>,
    stream_created: Option<u64>,
    stream_model: Option<String>,
}

impl ResponseMeter {
    /// Whether the response is an event stream (read line by line, of any length) rather than
    /// one JSON document (kept whole up to the limit).
    pub fn is_stream(&self) -> bool {
        matches!(self.format, Format::Stream { .. })
    }

    /// A meter for a response of this `Content-Type`, keeping at most `limit` bytes.
    pub fn new(content_type: &str, limit: usize) -> ResponseMeter {
        let streamed = content_type
            .split(';')
            .next()
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"));
        let format = if streamed {
            Format::Stream {
                line: Vec::new(),
                overflow: false,
            }
        } else {
            Format::Json {
                body: Vec::new(),
                overflow: false,
            }
        };
        ResponseMeter {
            format,
            limit,
            usage: None,
            completion: TextCount::default(),
            bytes: 0,
            cap: None,
            stopped: false,
            stream_id: None,
            stream_created: None,
            stream_model: None,
        }
    }

    /// Stops reading a streamed response once its completion estimate passes `limit`
    /// ([`ResponseMeter::feed`] then says where). A JSON response is never stopped: it is
    /// whole by the time it is read.
    pub fn with_cap(mut self, limit: Option<u64>) -> ResponseMeter {
        if matches!(self.format, Format::Stream { .. }) {
            self.cap = limit;
        }
        self
    }

    /// Whether a cap applies ([`ResponseMeter::with_cap`] on a stream).
    pub fn capped(&self) -> bool {
        self.cap.is_some()
    }

    /// Reads the next piece of the body. With a cap ([`ResponseMeter::with_cap`]), returns
    /// `Some(n)` when the event line ending at `chunk[n - 1]` took the completion estimate past
    /// it: the first `n` bytes may still go to the client, nothing after them (nor any later
    /// piece) is read.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<usize> {
        if self.stopped {
            return None;
        }
        self.bytes += chunk.len() as u64;
        match &mut self.format {
            Format::Json { body, overflow } => {
                if !*overflow {
                    if body.len() + chunk.len() > self.limit {
                        *overflow = true;
                        *body = Vec::new();
                    } else {
                        body.extend_from_slice(chunk);
                    }
                }
                None
            }
            Format::Stream { .. } => self.feed_stream(chunk),
        }
    }

    fn feed_stream(&mut self, chunk: &[u8]) -> Option<usize> {
        let mut rest = chunk;
        let mut at = 0;
        while let Some(end) = memchr::memchr(b'\n', rest) {
            let piece = &rest[..end];
            rest = &rest[end + 1..];
            at += end + 1;
            let Format::Stream { line, overflow } = &mut self.format else {
                return None;
            };
            // A line whole in this piece is read where it lies; one begun in an earlier piece
            // is completed in the kept buffer (its capacity reused line after line).
            let mut carried = std::mem::take(line);
            let read = !*overflow && carried.len() + piece.len() <= self.limit;
            *overflow = false;
            if read {
                if carried.is_empty() {
                    self.event_line(piece);
                } else {
                    carried.extend_from_slice(piece);
                    self.event_line(&carried);
                }
            }
            carried.clear();
            if let Format::Stream { line, .. } = &mut self.format {
                *line = carried;
            }
            if read && self.cap.is_some_and(|cap| self.completion.tokens() > cap) {
                self.stopped = true;
                self.bytes -= (chunk.len() - at) as u64;
                return Some(at);
            }
        }
        let Format::Stream { line, overflow } = &mut self.format else {
            return None;
        };
        if line.len() + rest.len() > self.limit {
            *overflow = true;
            line.clear();
        } else if !*overflow {
            line.extend_from_slice(rest);
        }
        None
    }

    /// One line of an event stream: a `data:` line holding JSON is a chunk. The usual chunk
    /// shapes are read typed, borrowing their strings (no map built per event: see the
    /// `llm/meter_stream` bench); any other JSON is read as a document.
    fn event_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if fast_path_ok(data) {
            if let Ok(Object(chunk)) = serde_json::from_slice::<Object<StreamChunk>>(data) {
                self.read_chunk(chunk);
                return;
            }
        }
        let Ok(json) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        self.read_document(&json, true);
    }

    /// Keeps the stream's `id`, `created` and `model` from its first chunk naming an `id`
    /// (bounded: 128 characters each), for the closing event of a stopped stream.
    fn remember_stream(&mut self, id: &str, created: Option<u64>, model: Option<&str>) {
        if self.stream_id.is_none() {
            self.stream_id = Some(id.chars().take(128).collect());
            self.stream_created = created;
            self.stream_model = model.map(|m| m.chars().take(128).collect());
        }
    }

    /// A typed stream chunk: what [`ResponseMeter::read_document`] reads of the same JSON.
    fn read_chunk(&mut self, chunk: StreamChunk<'_>) {
        if let Some(id) = &chunk.id {
            self.remember_stream(id, chunk.created, chunk.model.as_deref());
        }
        if let Some(Object(usage)) = chunk.usage {
            if let Some(usage) = usage.usage() {
                self.usage = Some(usage);
            }
        }
        if let Some(Object(ResponseEvent {
            usage: Some(Object(usage)),
        })) = chunk.response
        {
            if let Some(usage) = usage.usage() {
                self.usage = Some(usage);
            }
        }
        for Object(choice) in &chunk.choices {
            let text = match &choice.delta {
                Some(delta) if delta.has_content => delta.content.as_deref(),
                _ => choice.text.as_deref(),
            };
            if let Some(text) = text {
                self.completion.add(text);
            }
        }
        if let Some(delta) = &chunk.delta {
            self.completion.add(delta);
        }
    }

    /// The usage and completion text of one JSON document (a whole response, or one chunk).
    fn read_document(&mut self, json: &Value, streamed: bool) {
        if let Some(id) = json.get("id").and_then(Value::as_str).filter(|_| streamed) {
            let created = json.get("created").and_then(Value::as_u64);
            self.remember_stream(id, created, json.get("model").and_then(Value::as_str));
        }
        if let Some(usage) = Usage::of(json) {
            self.usage = Some(usage);
        }
        // Responses API events carry their usage in `response.usage`.
        if let Some(usage) = json.get("response").and_then(Usage::of) {
            self.usage = Some(usage);
        }
        let texts = json
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|choice| {
                let part = if streamed {
                    choice.get("delta")
                } else {
                    choice.get("message")
                };
                part.and_then(|p| p.get("content"))
                    .or_else(|| choice.get("text"))
                    .and_then(Value::as_str)
            });
        for text in texts {
            self.completion.add(text);
            if !streamed {
                self.completion.separate();
            }
        }
        // Responses API stream: `{"type": "response.output_text.delta", "delta": "..."}`.
        if let Some(delta) = json
            .get("delta")
            .and_then(Value::as_str)
            .filter(|_| streamed)
        {
            self.completion.add(delta);
        }
    }

    /// The body is complete: a JSON body is read now.
    pub fn finish(&mut self) {
        if let Format::Json { body, overflow } = &mut self.format {
            if !*overflow && !body.is_empty() {
                let body = std::mem::take(body);
                if let Ok(json) = serde_json::from_slice::<Value>(&body) {
                    self.read_document(&json, false);
                }
            }
        }
    }

    /// The usage the response reported, if it did.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// The `simple_word` estimate of the completion text seen so far.
    pub fn completion_estimate(&self) -> u64 {
        self.completion.tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn prompts_are_estimated_from_every_openai_shape() {
        // 3 words → ⌈4⌉ = 4; 12 chars → 3.
        assert_eq!(estimate_text("hello big world"), 4);
        // One long word: chars win (40 chars → 10).
        assert_eq!(estimate_text(&"x".repeat(40)), 10);
        let chat = br#"{"model":"m","max_tokens":800,"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"one two three"},{"type":"image_url","image_url":{"url":"http://x"}}]}]}"#;
        // 2 + 3 words = 5 → ⌈20/3⌉ = 7; chars 8 + 13 = 21 → 6; and the image part, 765.
        assert_eq!(
            LlmRequest::parse(chat),
            LlmRequest {
                prompt_tokens: 7 + IMAGE_TOKENS,
                max_completion: Some(800),
                exact_prompt_tokens: [None; 2],
            }
        );
        let completion = br#"{"prompt":["a b","c"],"max_completion_tokens":5,"max_tokens":9}"#;
        assert_eq!(
            LlmRequest::parse(completion),
            LlmRequest {
                prompt_tokens: 4,
                max_completion: Some(5),
                exact_prompt_tokens: [None; 2],
            }
        );
        let responses = br#"{"input":[{"role":"user","content":[{"type":"input_text","text":"w w w w w w"}]}],"instructions":"x"}"#;
        assert_eq!(LlmRequest::parse(responses).prompt_tokens, 10);
        // Not JSON: the whole body is the prompt.
        assert_eq!(LlmRequest::parse(b"a b c d e f").prompt_tokens, 8);
        // A word split across two message texts counts twice, within one text once.
        assert_eq!(
            LlmRequest::parse(br#"{"messages":[{"content":"ab"},{"content":"cd"}]}"#).prompt_tokens,
            3
        );
    }

    /// Issue 27: every text the model reads counts, wherever the API shape puts it; metadata
    /// does not; schemas count as their JSON text; media parts count their fixed estimate.
    #[test]
    fn every_text_the_model_reads_is_counted() {
        let text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"; // 12 words
                                                                                         // The estimate of these texts, counted apart.
        let t = |texts: &[&str]| {
            let mut count = TextCount::default();
            for piece in texts {
                count.add(piece);
                count.separate();
            }
            count.tokens()
        };
        let cases: Vec<(String, u64)> = vec![
            (format!(r#"{{"model":"gpt-4o","tools":[{{"type":"function","function":{{"name":"x","description":"{text}"}}}}]}}"#), t(&["x", text])),
            (format!(r#"{{"functions":[{{"name":"x","description":"{text}"}}]}}"#), t(&["x", text])),
            (format!(r#"{{"messages":[{{"role":"assistant","tool_calls":[{{"id":"call_1","type":"function","function":{{"name":"f","arguments":"{text}"}}}}]}}]}}"#), t(&["f", text])),
            (format!(r#"{{"messages":[{{"role":"user","name":"{text}","content":"hi"}}]}}"#), t(&[text, "hi"])),
            (format!(r#"{{"contents":[{{"role":"user","parts":[{{"text":"{text}"}}]}}]}}"#), t(&[text])),
            (format!(r#"{{"systemInstruction":{{"parts":[{{"text":"{text}"}}]}}}}"#), t(&[text])),
            (format!(r#"{{"system":[{{"type":"text","text":"{text}"}}],"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t1","content":[{{"type":"text","text":"{text}"}}]}}]}}]}}"#), t(&[text, text])),
            // A tool's input counts whole: its keys, numbers and booleans, and its `metadata`.
            (format!(r#"{{"messages":[{{"role":"assistant","content":[{{"type":"tool_use","id":"t1","name":"f","input":{{"q":"{text}"}}}}]}}]}}"#), t(&["f", "q", text])),
            (format!(r#"{{"messages":[{{"role":"assistant","content":[{{"type":"tool_use","id":"t1","name":"f","input":{{"metadata":"{text}","n":[1,-2,2.5],"ok":true}}}}]}}]}}"#), t(&["f", "metadata", text, "n", "1", "-2", "2.5", "ok", "true"])),
            (format!(r#"{{"contents":[{{"role":"model","parts":[{{"functionCall":{{"name":"f","args":{{"id":"{text}"}}}}}}]}},{{"role":"user","parts":[{{"functionResponse":{{"name":"f","response":{{"status":"{text}"}}}}}}]}}]}}"#), t(&["f", "id", text, "f", "status", text])),
            // Numbers count as JSON writes them: `1e308` is one short word, not 309 digits.
            (r#"{"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{"n":[1e308]}}]}]}"#.to_string(), t(&["f", "n", "1e308"])),
            // An OpenAI file part counts by its data's size, a data URL's MIME type deciding.
            (format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"file","file":{{"filename":"a","file_data":"data:application/pdf;base64,{}"}}}}]}}]}}"#, "Q".repeat(40_000)), t(&["a"]) + 10_000),
            (format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"file","file":{{"file_data":"{}"}}}}]}}]}}"#, "Q".repeat(4_000)), 1_000),
            (r#"{"messages":[{"role":"user","content":[{"type":"file","file":{"file_data":"data:image/png;base64,AAAA"}}]}]}"#.to_string(), IMAGE_TOKENS),
            // As deep as serde_json parses (128 levels), a string still counts.
            (format!(r#"{{"messages":{}"{text}"{}}}"#, "[".repeat(126), "]".repeat(126)), t(&[text])),
            (format!(r#"{{"some_future_field":{{"deep":["{text}"]}},"user":"u-123","metadata":{{"k":"{text}"}}}}"#), t(&[text])),
            // A schema counts as its JSON text, keys included: type, object, properties, city,
            // type, string, description + the text → 7 + 12 words.
            (format!(r#"{{"response_format":{{"type":"json_schema","json_schema":{{"type":"object","properties":{{"city":{{"type":"string","description":"{text}"}}}}}}}}}}"#), t(&["type", "object", "properties", "city", "type", "string", "description", text])),
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png","detail":"low"}}]}]}"#.to_string(), IMAGE_TOKENS_LOW),
            (r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y.png"}]}]}"#.to_string(), IMAGE_TOKENS),
            (r#"{"contents":[{"parts":[{"inline_data":{"mime_type":"image/png","data":"AAAA"}}]}]}"#.to_string(), IMAGE_TOKENS),
            // 10 s of 16 kHz 16-bit audio: 320 000 bytes, 426 664 base64 characters → 100.
            (format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data":"{}","format":"wav"}}}}]}}]}}"#, "A".repeat(426_664)), 100),
            (format!(r#"{{"contents":[{{"parts":[{{"inlineData":{{"mimeType":"audio/wav","data":"{}"}}}}]}}]}}"#, "A".repeat(4)), AUDIO_TOKENS_MIN),
            // The Responses API's structured output schema sits under `text.format`.
            (format!(r#"{{"text":{{"format":{{"type":"json_schema","name":"n","schema":{{"description":"{text}"}}}}}}}}"#), t(&["n", "description", text])),
            // A text document given as inline data counts by its size, not as one image.
            (format!(r#"{{"contents":[{{"parts":[{{"inline_data":{{"mime_type":"text/plain","data":"{}"}}}}]}}]}}"#, "x".repeat(40_000)), 10_000),
            (format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"document","source":{{"type":"text","media_type":"text/plain","data":"{}"}}}}]}}]}}"#, "y".repeat(8_000)), 2_000),
            // A duplicated detail: the last one counts, as in the tree.
            (r#"{"messages":[{"content":[{"image_url":{"url":"u","detail":"low","detail":"high"}}]}]}"#.to_string(), IMAGE_TOKENS),
        ];
        for (body, expected) in cases {
            let fast = LlmRequest::parse(body.as_bytes());
            assert_eq!(fast, LlmRequest::parse_document(body.as_bytes()), "{body}");
            assert_eq!(
                fast.prompt_tokens,
                expected,
                "{}",
                &body[..body.len().min(300)]
            );
        }
    }

    /// The `tiktoken` estimator against the tiktoken-rs crate's own reference: the six
    /// messages of its `num_tokens_from_messages` test count 129 tokens for GPT-4 (cl100k_base)
    /// and 124 for GPT-4o (o200k_base), role, name and per-message overhead included.
    #[test]
    fn tiktoken_counts_what_the_reference_counts() {
        let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 50, "messages": [
            {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
            {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
            {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
            {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
            {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
            {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."}
        ]})
        .to_string();
        let all = TokenEncoding::O200kBase.bit() | TokenEncoding::Cl100kBase.bit();
        let r = LlmRequest::parse_with(body.as_bytes(), all);
        assert_eq!(
            r.prompt_for(Estimator::Tiktoken(TokenEncoding::Cl100kBase)),
            129
        );
        assert_eq!(
            r.prompt_for(Estimator::Tiktoken(TokenEncoding::O200kBase)),
            124
        );
        // Not asked for: the simple estimate stands in.
        let plain = LlmRequest::parse_with(body.as_bytes(), 0);
        assert_eq!(plain.exact_prompt_tokens, [None, None]);
        assert_eq!(
            plain.prompt_for(Estimator::Tiktoken(TokenEncoding::O200kBase)),
            plain.prompt_tokens
        );
        // The crate's own split of a spaced sentence: 10 tokens (cl100k_base).
        assert_eq!(
            TokenEncoding::Cl100kBase.count("This is a test         with a lot of spaces"),
            10
        );
        assert_eq!(TokenEncoding::Cl100kBase.count("hello"), 1);
        // A megabyte run without whitespace (which would overflow the BPE's piece regex and
        // merge quadratically) is counted in bounded pieces: an answer, not a panic.
        let run = "^".repeat(1 << 20);
        let tokens = TokenEncoding::O200kBase.count(&run);
        assert!(tokens > 0 && tokens <= run.len() as u64, "{tokens}");
        // Ordinary text is counted whole: the same as the BPE's own count.
        let prose = "the quick brown fox jumps over the lazy dog ".repeat(400);
        let bpe = tiktoken_rs::cl100k_base_singleton();
        assert_eq!(
            TokenEncoding::Cl100kBase.count(&prose),
            bpe.encode_ordinary(&prose).len() as u64
        );
    }

    #[test]
    fn json_usage_is_read_at_the_end_of_the_body() {
        let body = br#"{"id":"x","choices":[{"message":{"role":"assistant","content":"hi there"}}],"usage":{"prompt_tokens":12,"completion_tokens":288,"total_tokens":300}}"#;
        let mut meter = ResponseMeter::new("application/json; charset=utf-8", 1 << 20);
        for piece in body.chunks(7) {
            meter.feed(piece);
        }
        assert_eq!(meter.usage(), None);
        meter.finish();
        assert_eq!(
            meter.usage(),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 288,
                total_tokens: 300
            })
        );
        assert_eq!(meter.completion_estimate(), 3);
        // Over the bound: nothing kept, nothing read.
        let mut small = ResponseMeter::new("application/json", 10);
        small.feed(body);
        small.finish();
        assert_eq!(small.usage(), None);
        assert_eq!(small.bytes, body.len() as u64);
    }

    #[test]
    fn streamed_usage_comes_from_the_final_chunk_and_text_from_deltas() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo world\"}}]}\r\n\r\n",
            ": keep-alive\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":290,\"total_tokens\":300}}\n\n",
            "data: [DONE]\n\n"
        );
        let mut meter = ResponseMeter::new("text/event-stream", 1 << 16);
        // Byte by byte: lines and words split anywhere.
        for b in stream.as_bytes() {
            meter.feed(std::slice::from_ref(b));
        }
        assert_eq!(meter.usage().map(|u| u.total_tokens), Some(300));
        // "Hello world": 2 words → 3; 11 chars → 3.
        assert_eq!(meter.completion_estimate(), 3);
        // Without the usage chunk: only the text is known.
        let mut cut = ResponseMeter::new("text/event-stream", 1 << 16);
        cut.feed(&stream.as_bytes()[..110]);
        assert_eq!(cut.usage(), None);
        assert_eq!(cut.completion_estimate(), 3);
        // A line longer than the bound is skipped whole, the next one read.
        let mut bounded = ResponseMeter::new("text/event-stream", 64);
        bounded.feed(format!("data: {}\n", "x".repeat(100)).as_bytes());
        bounded.feed(b"data: {\"usage\":{\"total_tokens\":7}}\n");
        assert_eq!(bounded.usage().map(|u| u.total_tokens), Some(7));
    }

    #[test]
    fn responses_api_usage_and_null_usage() {
        let v: Value = serde_json::from_str(
            r#"{"type":"response.completed","response":{"usage":{"input_tokens":5,"output_tokens":6}}}"#,
        )
        .unwrap();
        let mut meter = ResponseMeter::new("text/event-stream", 1024);
        meter.read_document(&v, true);
        assert_eq!(meter.usage().map(|u| u.total_tokens), Some(11));
        let null: Value = serde_json::from_str(r#"{"usage":null}"#).unwrap();
        assert_eq!(Usage::of(&null), None);
    }

    fn cap(max: u64, buffer: u64, on_exceeded: StreamCutStyle) -> StreamCap {
        StreamCap {
            max_completion_tokens: max,
            buffer_tokens: buffer,
            on_exceeded,
            include_partial_usage: true,
        }
    }

    #[test]
    fn a_capped_stream_stops_after_the_event_that_passes_the_cap() {
        // Each delta "w w w " is 3 words: the estimate runs 4, 8, 12, 16 (⌈words × 4/3⌉).
        let delta = "data: {\"id\":\"c-9\",\"created\":17,\"model\":\"m1\",\"choices\":[{\"delta\":{\"content\":\"w w w \"}}]}\n\n";
        let cap = cap(6, 4, StreamCutStyle::GracefulClose);
        assert_eq!(cap.limit(), 10);
        let mut meter =
            ResponseMeter::new("text/event-stream", 1 << 16).with_cap(Some(cap.limit()));
        let stream = delta.repeat(4);
        // The first two events (8 tokens) pass; the third (12 > 10) is the last one sent.
        assert_eq!(meter.feed(&stream.as_bytes()[..delta.len() * 2]), None);
        let at = meter.feed(&stream.as_bytes()[delta.len() * 2..]);
        assert_eq!(at, Some(delta.len() - 1));
        assert!(meter.stopped);
        assert_eq!(meter.completion_estimate(), 12);
        assert_eq!(meter.bytes, (delta.len() * 3 - 1) as u64);
        // Nothing after the stop is read.
        assert_eq!(meter.feed(delta.as_bytes()), None);
        assert_eq!(meter.completion_estimate(), 12);
        assert_eq!(
            cap.closing_events(&meter, 5),
            "\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\",\"index\":0}],\"created\":17,\"id\":\"c-9\",\"model\":\"m1\",\"object\":\"chat.completion.chunk\",\"usage\":{\"completion_tokens\":12,\"prompt_tokens\":5,\"total_tokens\":17}}\n\ndata: [DONE]\n\n"
        );
        let error = StreamCap {
            include_partial_usage: false,
            ..cap_error()
        };
        assert_eq!(
            error.closing_events(&meter, 5),
            "\ndata: {\"error\":{\"code\":\"completion_tokens_exceeded\",\"message\":\"The completion passed the 6 tokens this gateway allows a request (max_completion_tokens); the stream was stopped.\",\"param\":null,\"type\":\"rate_limit_exceeded\"}}\n\ndata: [DONE]\n\n"
        );
    }

    fn cap_error() -> StreamCap {
        cap(6, 4, StreamCutStyle::ErrorChunk)
    }

    #[test]
    fn json_responses_and_uncapped_streams_are_never_stopped() {
        let mut json = ResponseMeter::new("application/json", 1 << 16).with_cap(Some(0));
        let body = br#"{"choices":[{"message":{"content":"a b c d e f"}}]}"#;
        assert_eq!(json.feed(body), None);
        json.finish();
        assert_eq!(json.completion_estimate(), 8);
        assert!(!json.stopped);
        let mut open = ResponseMeter::new("text/event-stream", 1 << 16).with_cap(None);
        let event = "data: {\"choices\":[{\"delta\":{\"content\":\"w w w \"}}]}\n\n".repeat(50);
        assert_eq!(open.feed(event.as_bytes()), None);
        assert_eq!(open.completion_estimate(), 200);
        assert_eq!(
            StreamCap::tightest([
                cap(100, 50, StreamCutStyle::ErrorChunk),
                cap(60, 100, StreamCutStyle::GracefulClose),
                cap(90, 20, StreamCutStyle::GracefulClose)
            ])
            .map(|c| c.limit()),
            Some(110)
        );
        assert_eq!(StreamCap::tightest([]), None);
    }

    /// A JSON value where chunk fields go: absent (`None`), or one of the shapes a field may
    /// take, right or wrong.
    fn odd_value() -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            2 => Just(None),
            2 => Just(Some(Value::Null)),
            2 => (0u64..5000).prop_map(|n| Some(Value::from(n))),
            1 => Just(Some(serde_json::json!(12.5))),
            1 => Just(Some(serde_json::json!(-3))),
            3 => "[a-z \\\\\"é]{1,12}".prop_map(|t| Some(Value::from(t))),
            1 => Just(Some(serde_json::json!({}))),
            1 => Just(Some(serde_json::json!([]))),
            // Arrays where objects go: serde's derived structs would read them as fields.
            1 => Just(Some(serde_json::json!([1, 2, 3, 4, 5]))),
            1 => Just(Some(serde_json::json!(["a b", "c"]))),
            1 => Just(Some(serde_json::json!([null, "a b c"]))),
        ]
    }

    fn object(fields: Vec<(&str, Option<Value>)>) -> Value {
        Value::Object(
            fields
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
                .collect(),
        )
    }

    /// Mostly a well-typed field (`good`), sometimes any odd value.
    fn field(
        good: impl Strategy<Value = Option<Value>> + 'static,
    ) -> impl Strategy<Value = Option<Value>> {
        prop_oneof![12 => good, 1 => odd_value()]
    }

    fn text() -> impl Strategy<Value = Option<Value>> {
        proptest::option::of("[a-z \\\\\"é]{1,12}".prop_map(Value::from))
    }

    fn count() -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            2 => Just(None),
            1 => Just(Some(Value::Null)),
            4 => (0u64..5000).prop_map(|n| Some(Value::from(n))),
        ]
    }

    /// Prompt-shaped values: strings, parts, messages, odd values, nested up to 12 deep (past
    /// the depth counted).
    fn prompt_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            4 => "[a-z \\\\\"é]{0,12}".prop_map(Value::from),
            1 => odd_value().prop_map(|v| v.unwrap_or(Value::Null)),
        ];
        // A text under a chain of arrays and prompt objects, around the depth counted.
        let chain =
            ("[a-z ]{1,8}", proptest::collection::vec(0u8..4, 6..12)).prop_map(|(text, layers)| {
                layers
                    .iter()
                    .fold(Value::from(text), |inner, layer| match layer {
                        0 => Value::Array(vec![inner]),
                        1 => serde_json::json!({"content": inner}),
                        2 => serde_json::json!({"text": inner, "type": "text"}),
                        _ => serde_json::json!({"input_text": inner}),
                    })
            });
        let leaf = prop_oneof![3 => leaf, 1 => chain];
        leaf.prop_recursive(12, 64, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                (
                    proptest::sample::select(vec![
                        "content",
                        "text",
                        "input_text",
                        "role",
                        "image_url",
                        "parameters",
                        "inline_data",
                        "detail",
                        "data",
                        "mime_type",
                        "future_field"
                    ]),
                    inner.clone(),
                    proptest::sample::select(vec![
                        "content",
                        "text",
                        "type",
                        "name",
                        "schema",
                        "input_audio",
                        "data",
                        "detail",
                        "metadata"
                    ]),
                    inner,
                )
                    .prop_map(|(k1, v1, k2, v2)| {
                        let mut m = serde_json::Map::new();
                        m.insert(k1.to_string(), v1);
                        m.insert(k2.to_string(), v2);
                        Value::Object(m)
                    }),
            ]
        })
    }

    fn request_json() -> impl Strategy<Value = Value> {
        let field = |v: BoxedStrategy<Value>| proptest::option::of(v);
        let count = prop_oneof![
            4 => (0u64..100_000).prop_map(Value::from),
            1 => odd_value().prop_map(|v| v.unwrap_or(Value::Null)),
        ]
        .boxed();
        (
            field(prompt_json().boxed()),
            field(prompt_json().boxed()),
            field(prompt_json().boxed()),
            field(prompt_json().boxed()),
            field(prompt_json().boxed()),
            field(count.clone()),
            field(count.clone()),
            field(count),
            field(prompt_json().boxed()),
        )
            .prop_map(
                |(messages, prompt, input, instructions, system, mct, mt, mot, other)| {
                    object(vec![
                        ("model", Some(Value::from("m"))),
                        ("messages", messages),
                        ("prompt", prompt),
                        ("input", input),
                        ("instructions", instructions),
                        ("system", system),
                        ("max_completion_tokens", mct),
                        ("max_tokens", mt),
                        ("max_output_tokens", mot),
                        ("metadata", other),
                    ])
                },
            )
    }

    fn usage_json() -> impl Strategy<Value = Option<Value>> {
        let usage = proptest::collection::vec(field(count()), 5).prop_map(|v| {
            let names = [
                "prompt_tokens",
                "input_tokens",
                "completion_tokens",
                "output_tokens",
                "total_tokens",
            ];
            object(names.iter().copied().zip(v).collect())
        });
        field(prop_oneof![
            2 => Just(None),
            1 => Just(Some(Value::Null)),
            3 => usage.prop_map(Some),
        ])
    }

    fn chunk_json() -> impl Strategy<Value = Value> {
        let content = prop_oneof![2 => text(), 1 => Just(Some(Value::Null))];
        let delta = field(prop_oneof![
            6 => field(content).prop_map(|content| Some(object(vec![
                ("content", content),
                ("role", Some(Value::from("assistant"))),
            ]))),
            1 => Just(None),
            1 => Just(Some(Value::Null)),
        ]);
        let choice = (delta, field(text())).prop_map(|(delta, text)| {
            object(vec![
                ("index", Some(Value::from(0))),
                ("delta", delta),
                ("text", text),
            ])
        });
        let choices =
            field(proptest::collection::vec(choice, 0..4).prop_map(|c| Some(Value::Array(c))));
        let response = field(
            usage_json()
                .prop_map(|u| Some(object(vec![("usage", u), ("id", Some(Value::from("r")))]))),
        );
        (
            field(text()),
            field(count()),
            field(text()),
            choices,
            usage_json(),
            response,
            field(prop_oneof![3 => Just(None), 1 => text()]),
        )
            .prop_map(|(id, created, model, choices, usage, response, delta)| {
                object(vec![
                    ("id", id),
                    ("created", created),
                    ("model", model),
                    ("choices", choices),
                    ("usage", usage),
                    ("response", response),
                    ("delta", delta),
                ])
            })
    }

    #[test]
    fn request_edge_cases_read_like_documents() {
        let bodies: [&[u8]; 6] = [
            // Bytes that are not UTF-8, or a lone surrogate, in a field the one-pass reader
            // skips: not JSON to the document reader, so the whole body is estimated as text.
            b"{\"messages\":[{\"content\":\"a b\"}],\"user\":\"\xff\xfe\"}",
            br#"{"messages":[{"content":"a b"}],"user":"\udc00"}"#,
            // A paired surrogate is fine for both.
            br#"{"messages":[{"content":"a b \ud83d\ude00"}],"max_tokens":7}"#,
            // Not an object at the top: nothing is a prompt field.
            br#"[{"messages":[{"content":"a b"}]}]"#,
            // Numbers that are not whole are not a completion.
            br#"{"prompt":"a","max_tokens":1e3,"max_completion_tokens":5.0,"max_output_tokens":-1}"#,
            // Trailing bytes after the object.
            br#"{"prompt":"a b c"} x"#,
        ];
        for body in bodies {
            assert_eq!(
                LlmRequest::parse(body),
                LlmRequest::parse_document(body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            LlmRequest::parse(bodies[0]).prompt_tokens,
            estimate_text(&String::from_utf8_lossy(bodies[0]))
        );
        assert_eq!(
            LlmRequest::parse(bodies[2]),
            LlmRequest {
                prompt_tokens: 4,
                max_completion: Some(7),
                exact_prompt_tokens: [None; 2],
            }
        );
        assert_eq!(LlmRequest::parse(bodies[4]).max_completion, None);
    }

    #[test]
    fn typed_chunk_edge_cases_read_like_documents() {
        // (chunk, completion estimate, total tokens)
        let cases = [
            // A null delta content hides the choice's text; an absent one does not.
            (
                r#"{"choices":[{"delta":{"content":null},"text":"a b c"}]}"#,
                0,
                None,
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant"},"text":"a b c"}]}"#,
                4,
                None,
            ),
            (r#"{"choices":[{"delta":null,"text":"a b c"}]}"#, 4, None),
            // A float count is not a count; the others still are.
            (
                r#"{"usage":{"prompt_tokens":1.5,"completion_tokens":7}}"#,
                0,
                Some(7),
            ),
            (
                r#"{"usage":{"input_tokens":3,"output_tokens":4}}"#,
                0,
                Some(7),
            ),
            (
                r#"{"type":"response.output_text.delta","delta":"x y z"}"#,
                4,
                None,
            ),
            (
                r#"{"choices":[{"delta":{"content":["x"]}}],"usage":{"total_tokens":9}}"#,
                0,
                Some(9),
            ),
            // Arrays are not objects, however many fields they could fill.
            (r#"{"usage":[1,2,3,4,5]}"#, 0, None),
            (r#"{"choices":[{"delta":["a b"]}]}"#, 0, None),
            (r#"{"choices":[[null,"a b c"]]}"#, 0, None),
            (r#"{"response":[[1,2,3,4,5]]}"#, 0, None),
            // Counts past u64 when summed saturate.
            (
                r#"{"usage":{"prompt_tokens":18446744073709551615,"completion_tokens":2}}"#,
                0,
                Some(u64::MAX),
            ),
            // A lone surrogate escape: not JSON to the document reader, so nothing is read.
            (r#"{"x":"\ud800","usage":{"total_tokens":9}}"#, 0, None),
        ];
        for (chunk, estimate, total) in cases {
            let value: Option<Value> = serde_json::from_str(chunk).ok();
            if let Some(value) = &value {
                let mut slow = ResponseMeter::new("text/event-stream", 1 << 16);
                slow.read_document(value, true);
                assert_eq!(slow.completion_estimate(), estimate, "{chunk}");
                assert_eq!(slow.usage().map(|u| u.total_tokens), total, "{chunk}");
            }
            let mut meter = ResponseMeter::new("text/event-stream", 1 << 16);
            meter.feed(format!("data: {chunk}\n").as_bytes());
            assert_eq!(meter.completion_estimate(), estimate, "{chunk}");
            assert_eq!(meter.usage().map(|u| u.total_tokens), total, "{chunk}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn requests_read_in_one_pass_like_documents(request in request_json()) {
            let body = request.to_string();
            prop_assert_eq!(
                LlmRequest::parse(body.as_bytes()),
                LlmRequest::parse_document(body.as_bytes())
            );
        }

        #[test]
        fn typed_chunks_read_like_documents(chunk in chunk_json()) {
            // The fast typed path (with its fallback) and the document path agree on every
            // chunk shape, odd ones included (nulls, floats, strings where objects go).
            let mut fast = ResponseMeter::new("text/event-stream", 1 << 16);
            fast.feed(format!("data: {chunk}\n").as_bytes());
            let mut slow = ResponseMeter::new("text/event-stream", 1 << 16);
            slow.read_document(&chunk, true);
            prop_assert_eq!(fast.usage(), slow.usage());
            prop_assert_eq!(fast.completion_estimate(), slow.completion_estimate());
            prop_assert_eq!(&fast.stream_id, &slow.stream_id);
            prop_assert_eq!(fast.stream_created, slow.stream_created);
            prop_assert_eq!(&fast.stream_model, &slow.stream_model);
        }
    }

    proptest! {
        #[test]
        fn hostile_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512), cut in 0usize..512) {
            let _ = LlmRequest::parse(&body);
            let mut meter = ResponseMeter::new("text/event-stream", 128);
            let cut = cut.min(body.len());
            meter.feed(&body[..cut]);
            meter.feed(&body[cut..]);
            meter.finish();
            prop_assert_eq!(meter.bytes, body.len() as u64);
        }

        #[test]
        fn a_stream_stops_at_the_same_byte_however_it_is_split(words in proptest::collection::vec(1usize..6, 1..40), cut in 0usize..4096, limit in 0u64..60) {
            let stream: String = words
                .iter()
                .map(|n| format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n", "w ".repeat(*n)))
                .collect();
            let whole = ResponseMeter::new("text/event-stream", 1 << 16).with_cap(Some(limit)).feed(stream.as_bytes());
            let cut = cut.min(stream.len());
            let mut split = ResponseMeter::new("text/event-stream", 1 << 16).with_cap(Some(limit));
            let stopped_at = split
                .feed(&stream.as_bytes()[..cut])
                .or_else(|| split.feed(&stream.as_bytes()[cut..]).map(|n| n + cut));
            prop_assert_eq!(whole, stopped_at);
            if let Some(at) = stopped_at {
                // What was let through estimates past the limit, one event less would not.
                let sent = &stream[..at];
                let mut count = TextCount::default();
                for w in sent.matches("w ") { count.add(w); }
                prop_assert!(count.tokens() > limit);
                prop_assert_eq!(split.bytes, at as u64);
            }
        }

        #[test]
        fn text_counts_like_a_char_by_char_count(text in "(\\PC|[ \t\n\u{b}\u{c}\r\u{85}\u{a0}\u{2028}\u{3000}]){0,40}") {
            let mut count = TextCount::default();
            count.add(&text);
            let words = text.split(char::is_whitespace).filter(|w| !w.is_empty()).count() as u64;
            prop_assert_eq!((count.words, count.chars), (words, text.chars().count() as u64));
        }

        #[test]
        fn split_text_counts_like_whole_text(text in "[a-z ]{0,64}", cut in 0usize..64) {
            let cut = cut.min(text.len());
            let mut pieces = TextCount::default();
            pieces.add(&text[..cut]);
            pieces.add(&text[cut..]);
            prop_assert_eq!(pieces.tokens(), estimate_text(&text));
        }
    }
}
