//! LLM token accounting, pure: what an OpenAI-style request asks for (a prompt estimate and the
//! completion it may produce), and what a response really used (the `usage` object of a JSON
//! body, or of a streamed `text/event-stream`'s final chunk, read chunk by chunk as it passes).
//! No I/O: the proxy and the decision service feed bytes in and read numbers out; the engine
//! turns them into reservations (`token_bucket_llm` rules).

mod response;
mod text_count;
pub use response::*;
pub use text_count::TextCount;

use serde_json::Value;

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

/// The `simple_word` estimate of one text.
pub fn estimate_text(text: &str) -> u64 {
    let mut count = TextCount::default();
    count.add(text);
    count.tokens()
}

/// The longest model name read from a request (a longer one is no model the price table can
/// name, and is not kept).
pub const MAX_MODEL_LEN: usize = 256;

/// Gemini's model in a request path (`/v1beta/models/gemini-1.5-pro:generateContent` →
/// `gemini-1.5-pro`); OpenAI and Anthropic name theirs in the body's `model`.
pub fn gemini_model(path: &str) -> Option<&str> {
    let (_, rest) = path.split_once("/models/")?;
    let name = rest.split([':', '/']).next()?;
    (!name.is_empty() && name.len() <= MAX_MODEL_LEN).then_some(name)
}

/// A body's `model` value, when a string of at most [`MAX_MODEL_LEN`] bytes.
fn model_of(v: &Value) -> Option<String> {
    v.as_str()
        .filter(|m| !m.is_empty() && m.len() <= MAX_MODEL_LEN)
        .map(str::to_string)
}

/// What an LLM request asks for, read once from its body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LlmRequest {
    /// The top-level `model`, when a non-empty string of at most [`MAX_MODEL_LEN`] bytes.
    pub model: Option<String>,
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
            model: json.get("model").and_then(model_of),
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
        let mut model = None;
        while let Some(key) = map.next_key::<RequestKey>()? {
            match key {
                RequestKey::Model => model = model_of(&map.next_value::<Value>()?),
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
            model,
            prompt_tokens: count.tokens(),
            max_completion: completion.into_iter().flatten().next(),
            exact_prompt_tokens: [None; 2],
        })
    }
}

/// A request body's top-level field, as [`RequestSeed`] reads it.
enum RequestKey {
    Model,
    Completion(usize),
    Field(Field),
}

impl RequestKey {
    fn of(key: &str) -> RequestKey {
        if key == "model" {
            return RequestKey::Model;
        }
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

#[cfg(test)]
mod tests;
