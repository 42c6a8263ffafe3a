//! The `simple_word` estimate against the exact `tiktoken` count, on the committed sample
//! prompts (`benches/prompts/`: English, code, CJK, JSON), each sent as one chat message. Run by
//! hand (the README's table comes from it):
//!
//! ```sh
//! cargo run --release --example estimator_accuracy
//! ```

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tollgate::request::llm::{Estimator, LlmRequest, TokenEncoding};

const SAMPLES: [(&str, &str); 4] = [
    ("English", include_str!("../benches/prompts/english.txt")),
    ("code", include_str!("../benches/prompts/code.txt")),
    ("CJK", include_str!("../benches/prompts/cjk.txt")),
    ("JSON", include_str!("../benches/prompts/json.txt")),
];

fn main() {
    println!("| sample | bytes | simple_word | o200k_base | ratio | cl100k_base | ratio |");
    println!("|---|---|---|---|---|---|---|");
    let all = TokenEncoding::O200kBase.bit() | TokenEncoding::Cl100kBase.bit();
    for (name, text) in SAMPLES {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]})
                .to_string();
        let r = LlmRequest::parse_with(body.as_bytes(), all);
        let simple = r.prompt_for(Estimator::SimpleWord);
        let o200k = r.prompt_for(Estimator::Tiktoken(TokenEncoding::O200kBase));
        let cl100k = r.prompt_for(Estimator::Tiktoken(TokenEncoding::Cl100kBase));
        println!(
            "| {name} | {} | {simple} | {o200k} | {:.2} | {cl100k} | {:.2} |",
            text.len(),
            simple as f64 / o200k as f64,
            simple as f64 / cl100k as f64
        );
    }
}
