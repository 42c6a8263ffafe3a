//! LLM accounting tests: prompt estimates (simple_word and tiktoken against the reference
//! counts), requested completions, response usage in JSON and streamed bodies, stream caps.

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
            model: Some("m".to_string()),
            prompt_tokens: 7 + IMAGE_TOKENS,
            max_completion: Some(800),
            exact_prompt_tokens: [None; 2],
        }
    );
    let completion = br#"{"prompt":["a b","c"],"max_completion_tokens":5,"max_tokens":9}"#;
    assert_eq!(
        LlmRequest::parse(completion),
        LlmRequest {
            model: None,
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
            total_tokens: 300,
            billed: BilledTokens {
                input: 12,
                output: 288,
                ..BilledTokens::default()
            }
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

/// Issue 54: cached and cache-write tokens, each API's way. OpenAI counts cached tokens inside
/// `prompt_tokens`; Anthropic beside `input_tokens`, and streams the input in `message_start`
/// and the output in `message_delta`.
#[test]
fn cached_tokens_are_told_apart_in_both_api_shapes() {
    let openai = br#"{"usage":{"prompt_tokens":1000,"completion_tokens":50,"total_tokens":1050,"prompt_tokens_details":{"cached_tokens":800}}}"#;
    let mut meter = ResponseMeter::new("application/json", 1 << 16);
    meter.feed(openai);
    meter.finish();
    let billed = |input, cached, cache_write, output| BilledTokens {
        input,
        cached,
        cache_write,
        output,
    };
    assert_eq!(meter.usage().unwrap().billed, billed(200, 800, 0, 50));
    let anthropic = br#"{"type":"message","usage":{"input_tokens":30,"cache_read_input_tokens":900,"cache_creation_input_tokens":70,"output_tokens":40}}"#;
    let mut meter = ResponseMeter::new("application/json", 1 << 16);
    meter.feed(anthropic);
    meter.finish();
    let usage = meter.usage().unwrap();
    assert_eq!(usage.billed, billed(30, 900, 70, 40));
    assert_eq!(usage.total_tokens, 70);
    let stream = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"model\":\"claude-x\",\"usage\":{\"input_tokens\":30,\"cache_read_input_tokens\":900,\"cache_creation_input_tokens\":70,\"output_tokens\":1}}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":40}}\n\n",
    );
    let mut meter = ResponseMeter::new("text/event-stream", 1 << 16);
    for piece in stream.as_bytes().chunks(5) {
        meter.feed(piece);
    }
    assert_eq!(meter.usage().unwrap().billed, billed(30, 900, 70, 40));
    // The Responses API's cached input, inside `input_tokens`.
    let v: Value = serde_json::from_str(
        r#"{"type":"response.completed","response":{"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":20},"output_tokens":6}}}"#,
    )
    .unwrap();
    let mut meter = ResponseMeter::new("text/event-stream", 1024);
    meter.read_document(&v, true);
    assert_eq!(meter.usage().unwrap().billed, billed(30, 20, 0, 6));
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
    let mut meter = ResponseMeter::new("text/event-stream", 1 << 16).with_cap(Some(cap.limit()));
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
        usage_json().prop_map(|u| Some(object(vec![("usage", u), ("id", Some(Value::from("r")))]))),
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
            model: None,
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
