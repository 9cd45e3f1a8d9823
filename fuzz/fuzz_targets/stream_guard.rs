//! An upstream stream of any bytes, cut into pieces of any size, through
//! the stream guard of each endpoint and mode with the shipped rules: the
//! client's body ends and the guard reports the outcome; nothing panics.
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
use fairgate::rules::{CompileOptions, RuleSet};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;

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
        let _ = (sent, outcome.verdict);
    });
});
