//! The response side: the `usage` an upstream reports (a JSON body's, or a streamed
//! `text/event-stream`'s final event), read as the body passes without holding it back
//! ([`ResponseMeter`]), and the `streaming` cap that stops a completion running past its rule
//! ([`StreamCap`]).

use super::text_count::TextCount;
use serde_json::Value;
use std::borrow::Cow;

/// Tokens a response reports in its `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// The same tokens as each is priced (`llm_spend` rules).
    pub billed: BilledTokens,
}

/// A response's tokens by price: prompt tokens read fresh, read from the provider's cache,
/// written to its cache, and completion tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BilledTokens {
    pub input: u64,
    pub cached: u64,
    pub cache_write: u64,
    pub output: u64,
}

impl Usage {
    /// OpenAI's `{prompt_tokens, completion_tokens, total_tokens}`, the Responses API's
    /// `{input_tokens, output_tokens, total_tokens}` or Anthropic's `{input_tokens,
    /// output_tokens, cache_read_input_tokens, cache_creation_input_tokens}`; `None` when
    /// absent or `null`. A missing total is the sum of the two.
    pub fn of(json: &Value) -> Option<Usage> {
        let usage = json.get("usage").filter(|u| u.is_object())?;
        UsageFields::of(usage).usage()
    }

    /// The tokens to price: [`Usage::billed`], with tokens named only in the total (a report
    /// of `total_tokens` alone) charged as completion tokens.
    pub fn priced(&self) -> BilledTokens {
        let b = self.billed;
        let named = b
            .input
            .saturating_add(b.cached)
            .saturating_add(b.cache_write)
            .saturating_add(b.output);
        BilledTokens {
            output: b
                .output
                .saturating_add(self.total_tokens.saturating_sub(named)),
            ..b
        }
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
    /// Anthropic's `message_start`: the message with its input usage.
    #[serde(default)]
    message: Option<Object<ResponseEvent>>,
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
#[derive(Debug, Clone, Copy)]
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
pub(super) fn fast_path_ok(json: &[u8]) -> bool {
    let surrogate_escape = memchr::memchr_iter(b'\\', json)
        .any(|at| matches!(json.get(at + 1..at + 3), Some([b'u', b'd' | b'D'])));
    !surrogate_escape && std::str::from_utf8(json).is_ok()
}

#[derive(serde::Deserialize)]
struct ResponseEvent {
    #[serde(default)]
    usage: Option<Object<UsageFields>>,
}

/// A `usage` object's token counts, under OpenAI's, the Responses API's or Anthropic's names.
/// A stream may report them over several events (Anthropic's `message_start` has the input,
/// `message_delta` the output): each event's counts replace those it names ([`UsageFields::merge`]).
#[derive(serde::Deserialize, Debug, Clone, Copy, Default)]
struct UsageFields {
    prompt_tokens: Option<u64>,
    input_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    output_tokens: Option<u64>,
    total_tokens: Option<u64>,
    /// Anthropic: read from the cache, beside `input_tokens`.
    cache_read_input_tokens: Option<u64>,
    /// Anthropic: written to the cache, beside `input_tokens`.
    cache_creation_input_tokens: Option<u64>,
    /// OpenAI: `prompt_tokens_details.cached_tokens` (part of `prompt_tokens`).
    #[serde(default)]
    prompt_tokens_details: Option<Object<CachedDetails>>,
    /// Responses API: `input_tokens_details.cached_tokens` (part of `input_tokens`).
    #[serde(default)]
    input_tokens_details: Option<Object<CachedDetails>>,
}

#[derive(serde::Deserialize, Debug, Clone, Copy, Default)]
struct CachedDetails {
    cached_tokens: Option<u64>,
}

impl UsageFields {
    /// The counts of a `usage` object read as a document (a field that is not a whole number
    /// is absent).
    fn of(usage: &Value) -> UsageFields {
        let n = |name: &str| usage.get(name).and_then(Value::as_u64);
        let cached = |name: &str| {
            let cached_tokens = usage
                .get(name)
                .and_then(|d| d.get("cached_tokens"))
                .and_then(Value::as_u64);
            cached_tokens.map(|c| {
                Object(CachedDetails {
                    cached_tokens: Some(c),
                })
            })
        };
        UsageFields {
            prompt_tokens: n("prompt_tokens"),
            input_tokens: n("input_tokens"),
            completion_tokens: n("completion_tokens"),
            output_tokens: n("output_tokens"),
            total_tokens: n("total_tokens"),
            cache_read_input_tokens: n("cache_read_input_tokens"),
            cache_creation_input_tokens: n("cache_creation_input_tokens"),
            prompt_tokens_details: cached("prompt_tokens_details"),
            input_tokens_details: cached("input_tokens_details"),
        }
    }

    /// These counts, with those a later event names replacing them.
    fn merge(&mut self, later: UsageFields) {
        macro_rules! take {
            ($($field:ident),*) => { $(if later.$field.is_some() { self.$field = later.$field; })* };
        }
        take!(
            prompt_tokens,
            input_tokens,
            completion_tokens,
            output_tokens,
            total_tokens,
            cache_read_input_tokens,
            cache_creation_input_tokens
        );
        if later.prompt_tokens_details.is_some() {
            self.prompt_tokens_details = later.prompt_tokens_details;
        }
        if later.input_tokens_details.is_some() {
            self.input_tokens_details = later.input_tokens_details;
        }
    }

    /// As [`Usage::of`]: `None` without any count; a missing total is the sum.
    fn usage(self) -> Option<Usage> {
        let prompt = self.prompt_tokens.or(self.input_tokens);
        let completion = self.completion_tokens.or(self.output_tokens);
        if prompt.is_none() && completion.is_none() && self.total_tokens.is_none() {
            return None;
        }
        let (prompt, completion) = (prompt.unwrap_or(0), completion.unwrap_or(0));
        let details = |d: Option<Object<CachedDetails>>| d.and_then(|Object(d)| d.cached_tokens);
        // OpenAI counts cached tokens inside the prompt; Anthropic beside it.
        let cached_inside = details(self.prompt_tokens_details)
            .or(details(self.input_tokens_details))
            .unwrap_or(0)
            .min(prompt);
        let billed = BilledTokens {
            input: prompt - cached_inside,
            cached: cached_inside.saturating_add(self.cache_read_input_tokens.unwrap_or(0)),
            cache_write: self.cache_creation_input_tokens.unwrap_or(0),
            output: completion,
        };
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: self
                .total_tokens
                .unwrap_or(prompt.saturating_add(completion)),
            billed,
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
    /// The usage counts read so far (merged event by event), if any.
    usage: Option<UsageFields>,
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
    pub(super) stream_id: Option<String>,
    pub(super) stream_created: Option<u64>,
    pub(super) stream_model: Option<String>,
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
            self.add_usage(usage);
        }
        // Responses API events carry it in `response.usage`, Anthropic's `message_start` in
        // `message.usage`.
        for event in [chunk.response, chunk.message].into_iter().flatten() {
            if let Object(ResponseEvent {
                usage: Some(Object(usage)),
            }) = event
            {
                self.add_usage(usage);
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
    pub(super) fn read_document(&mut self, json: &Value, streamed: bool) {
        if let Some(id) = json.get("id").and_then(Value::as_str).filter(|_| streamed) {
            let created = json.get("created").and_then(Value::as_u64);
            self.remember_stream(id, created, json.get("model").and_then(Value::as_str));
        }
        // The response's own `usage`; Responses API events carry theirs in `response.usage`,
        // Anthropic's `message_start` in `message.usage`.
        for holder in [Some(json), json.get("response"), json.get("message")]
            .into_iter()
            .flatten()
        {
            if let Some(usage) = holder.get("usage").filter(|u| u.is_object()) {
                self.add_usage(UsageFields::of(usage));
            }
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

    /// Counts a usage object read from the response: merged into those read before.
    fn add_usage(&mut self, usage: UsageFields) {
        match &mut self.usage {
            Some(seen) => seen.merge(usage),
            None => self.usage = Some(usage),
        }
    }

    /// The usage the response reported, if it did.
    pub fn usage(&self) -> Option<Usage> {
        self.usage.and_then(UsageFields::usage)
    }

    /// The `simple_word` estimate of the completion text seen so far.
    pub fn completion_estimate(&self) -> u64 {
        self.completion.tokens()
    }
}
