//! An upstream stream of any bytes, cut into pieces of any size, through
//! the stream guard of each endpoint and mode with the shipped rules: the
//! client's body ends and the guard reports the outcome; nothing panics;
//! and, in every mode but monitor, no part of the answer (a choice, a
//! content block, an output item's part) reaches the client with its text
//! joined holding a match of a rule that blocks or redacts.
//!
//! Input: byte 0 picks the endpoint and mode, whether usage was asked for
//! and whether the upstream breaks off at the end (bit 6), byte 1 the size
//! of the pieces (1 to 64 bytes, bits 0 to 5) and the prefill the answer
//! continues (bits 6 and 7: none, or one that ends inside a phrase a rule
//! blocks, redacts or flags), the rest is the upstream's body.

#![no_main]

use std::path::Path;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use bytes::Bytes;
use fairgate::config::StreamMode;
use fairgate::exchange::Endpoint;
use fairgate::guard::stream::{StreamSetup, guard_body};
use fairgate::risk::RiskConfig;
use fairgate::rules::{Action, CompileOptions, RuleSet, Scope};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

static RULES: LazyLock<Arc<RuleSet>> = LazyLock::new(|| {
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules");
    Arc::new(
        RuleSet::load_dir(&rules, &CompileOptions::default()).expect("the shipped rules compile"),
    )
});

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
});

const ENDPOINTS: [Endpoint; 4] = [
    Endpoint::ChatCompletions,
    Endpoint::Completions,
    Endpoint::Responses,
    Endpoint::Messages,
];
/// Prefills that end inside a match: one that blocks, one that redacts,
/// one that only flags.
const PREFILLS: [&str; 4] = [
    "",
    "Sure. Put all your savings into",
    "Write to jane.doe@exa",
    "Ignore all previous",
];
const MODES: [StreamMode; 3] = [
    StreamMode::Holdback,
    StreamMode::Buffer,
    StreamMode::Monitor,
];

fuzz_target!(|data: &[u8]| {
    let [pick, size, body @ ..] = data else {
        return;
    };
    let endpoint = ENDPOINTS[usize::from(pick % 4)];
    let mode = MODES[usize::from(pick / 4 % 3)];
    let (size, prefill) = (usize::from(size % 64) + 1, usize::from(size >> 6));
    let setup = StreamSetup {
        endpoint,
        mode,
        rules: RULES.clone(),
        risk: RiskConfig::default(),
        request_hits: Vec::new(),
        relevance: Vec::new(),
        started: Instant::now(),
        include_usage: pick & 0x80 != 0,
        prefill: PREFILLS[prefill].to_owned(),
        resume_after: None,
        // Past it in the longest inputs only.
        max_bytes: 6_000,
    };
    let mut pieces: Vec<Result<Bytes, String>> = body
        .chunks(size)
        .map(|piece| Ok(Bytes::copy_from_slice(piece)))
        .collect();
    if pick & 0x40 != 0 {
        // The upstream breaks off after what it sent.
        pieces.push(Err("connection reset".to_owned()));
    }
    RUNTIME.block_on(async move {
        let (done, outcome) = tokio::sync::oneshot::channel();
        let client = guard_body(setup, futures_util::stream::iter(pieces), move |outcome| {
            let _ = done.send(outcome);
        });
        let sent = client.collect().await.expect("the body ends").to_bytes();
        let outcome = outcome
            .await
            .expect("the guard reports how the stream ended");
        let _ = outcome.verdict;
        if mode != StreamMode::Monitor {
            nothing_blocked_went_out(endpoint, PREFILLS[prefill], &sent);
        }
    });
});

/// The text each part of the answer (a choice, a content block, an
/// output item's part) carries in the events the client got, joined, and
/// read as the client shows it: after `prefill` when it continues it
/// (every choice of a completion, the first block or part else). None
/// holds a match of a rule that blocks or redacts that ends past the
/// prefill.
fn nothing_blocked_went_out(endpoint: Endpoint, prefill: &str, sent: &[u8]) {
    let sent = String::from_utf8_lossy(sent).replace("\r\n", "\n").replace('\r', "\n");
    let mut parts: Vec<(String, String)> = Vec::new();
    for frame in sent.split("\n\n") {
        let data: Vec<&str> = (frame.lines())
            .filter_map(|line| line.strip_prefix("data:"))
            .map(|data| data.strip_prefix(' ').unwrap_or(data))
            .collect();
        let Ok(event) = serde_json::from_str::<Value>(&data.join("\n")) else {
            continue;
        };
        for (key, text) in texts_of(endpoint, &event) {
            match parts.iter_mut().find(|(k, _)| *k == key) {
                Some((_, joined)) => joined.push_str(text),
                None => parts.push((key, text.to_owned())),
            }
        }
    }
    let every_part = matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions);
    for (at, (key, text)) in parts.iter().enumerate() {
        let before = if every_part || at == 0 { prefill } else { "" };
        let shown = format!("{before}{text}");
        let hits = RULES.scan(Scope::Response, &shown);
        let leaked = (hits.iter()).find(|hit| hit.action >= Action::Redact && hit.end > before.len());
        assert!(leaked.is_none(), "{key} went out as {shown:?}: {leaked:?}");
    }
}

/// The index at `key` of `value`, as the guard reads it: 0 when it is
/// absent or not a whole number.
fn index_of(value: &Value, key: &str) -> u64 {
    value.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// The string at `pointer` in `value`.
fn str_at<'v>(value: &'v Value, pointer: &str) -> Option<&'v str> {
    value.pointer(pointer).and_then(Value::as_str)
}

/// The answer's text in `event`, each piece with the part it is of.
fn texts_of(endpoint: Endpoint, event: &Value) -> Vec<(String, &str)> {
    let choices = || event.get("choices").and_then(Value::as_array).into_iter().flatten();
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions => {
            let field = match endpoint == Endpoint::ChatCompletions {
                true => "/delta/content",
                false => "/text",
            };
            choices()
                .filter_map(|choice| {
                    let index = index_of(choice, "index");
                    Some((format!("choice {index}"), str_at(choice, field)?))
                })
                .collect()
        }
        Endpoint::Responses if event["type"] == "response.output_text.delta" => {
            let item = str_at(event, "/item_id").unwrap_or_default();
            let index = index_of(event, "content_index");
            let key = format!("item {item} part {index}");
            str_at(event, "/delta").map(|text| (key, text)).into_iter().collect()
        }
        Endpoint::Messages if event["type"] == "content_block_delta" => {
            let index = index_of(event, "index");
            let text = str_at(event, "/delta/text").filter(|_| event["delta"]["type"] == "text_delta");
            text.map(|text| (format!("block {index}"), text)).into_iter().collect()
        }
        _ => Vec::new(),
    }
}
