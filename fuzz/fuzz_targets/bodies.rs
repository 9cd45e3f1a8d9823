//! Request and response bodies of every guarded endpoint, Realtime API
//! client events and batch lines, read and scanned with the shipped
//! rules: whatever the bytes, a result or an error, never a panic.

#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use fairgate::exchange::{self, Endpoint, RequestBody, ResponseBody};
use fairgate::guard;
use fairgate::risk::RiskConfig;
use fairgate::rules::{CompileOptions, RuleSet};
use libfuzzer_sys::fuzz_target;

static RULES: LazyLock<RuleSet> = LazyLock::new(|| {
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules");
    RuleSet::load_dir(&rules, &CompileOptions::default()).expect("the shipped rules compile")
});

const ENDPOINTS: [Endpoint; 4] = [
    Endpoint::ChatCompletions,
    Endpoint::Completions,
    Endpoint::Responses,
    Endpoint::Messages,
];

fuzz_target!(|data: &[u8]| {
    let tags = ["documents".to_owned()];
    for endpoint in ENDPOINTS {
        if let Ok(request) = RequestBody::read(endpoint, data) {
            let scan = guard::scan_request(&RULES, &RiskConfig::default(), &tags, &request.texts);
            if !scan.edits.is_empty() {
                // A redacted body is JSON still, and reads as it did.
                let redacted = fairgate::json::splice(data, &scan.edits);
                let again = RequestBody::read(endpoint, &redacted);
                assert!(again.is_ok(), "a redaction broke the body: {again:?}");
            }
        }
        if let Ok(response) = ResponseBody::read(endpoint, data) {
            // As an answer of its own, and as the continuation of a prefill
            // that ends inside a match.
            for prefill in [None, Some("Sure. Put all your savings into")] {
                let scan = guard::scan_response(&RULES, data, &response.texts, prefill);
                if let Some(redacted) = scan.redacted {
                    // A redacted answer is JSON still, and reads as it did.
                    let again = ResponseBody::read(endpoint, &redacted);
                    assert!(again.is_ok(), "a redaction broke the answer: {again:?}");
                }
            }
        }
    }
    if let Ok(event) = exchange::read_realtime_event(data) {
        let scan = guard::scan_request(&RULES, &RiskConfig::default(), &tags, &event.texts);
        if !scan.edits.is_empty() {
            // A redacted Realtime event is JSON still, and reads as it did.
            let redacted = fairgate::json::splice(data, &scan.edits);
            let again = exchange::read_realtime_event(&redacted);
            assert!(again.is_ok(), "a redaction broke the event: {again:?}");
        }
    }
    let _ = exchange::read_batch_input(data);
    let _ = exchange::read_batch(data);
    let _ = exchange::read_batch_line(exchange::Dialect::OpenAi, data);
    let _ = exchange::read_batch_line(exchange::Dialect::Anthropic, data);
});
