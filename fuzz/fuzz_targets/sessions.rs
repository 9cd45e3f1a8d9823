//! A WebSocket session's messages, either side's, in any order, through
//! the guard of a Realtime API session or a Responses API socket with the
//! shipped rules: nothing panics, and in a guarded Realtime session no
//! text delta the client gets joins, with the others of its part, into a
//! text a rule blocks or redacts, nor does any text an event of a
//! response carries whole hold such a match.
//!
//! Input: byte 0 picks the kind of session (bit 0: Realtime, Responses
//! API socket), the mode (bits 1 and 2: holdback, buffer, monitor) and
//! the limits (bit 3: the embedded defaults, or small ones that the
//! longer inputs pass); the rest is messages, one a line: a line that
//! begins with `>` is the client's (the `>` not sent), any other the
//! upstream's.

#![no_main]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, LazyLock, Mutex};

use fairgate::config::{Config, StreamMode};
use fairgate::proxy::State;
use fairgate::proxy::replay::{Kind, Replay, Sent};
use fairgate::record::{QueueItem, StreamEnd};
use fairgate::rules::{Action, Scope};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tokio::sync::mpsc::Receiver;

/// A state on the shipped rules, with the limits of `small`, and the
/// receiver of its side queue, drained after each input.
fn state(small: bool) -> (Arc<State>, Mutex<Receiver<QueueItem>>) {
    let mut config = Config::default();
    config.rules.dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules");
    config.rules.watch = false;
    if small {
        config.guard.max_response_bytes = 2_000;
        config.guard.max_stream_bytes = 3_000;
    }
    let state = State::new(config).expect("a state on the shipped rules");
    let records = state.queue.take_receiver().expect("the queue's receiver");
    (Arc::new(state), Mutex::new(records))
}

static STATES: LazyLock<[(Arc<State>, Mutex<Receiver<QueueItem>>); 2]> =
    LazyLock::new(|| [state(false), state(true)]);

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
});

const MODES: [StreamMode; 4] = [
    StreamMode::Holdback,
    StreamMode::Buffer,
    StreamMode::Monitor,
    StreamMode::Holdback,
];

fuzz_target!(|data: &[u8]| {
    let [pick, messages @ ..] = data else {
        return;
    };
    let kind = match pick & 1 {
        0 => Kind::Realtime,
        _ => Kind::ResponsesSocket,
    };
    let mode = MODES[usize::from(pick >> 1 & 3)];
    let (state, records) = &STATES[usize::from(pick >> 3 & 1)];
    let _runtime = RUNTIME.enter();
    let mut session = Replay::new(state.clone(), kind, mode);
    let mut to_client = Vec::new();
    for line in messages.split(|&b| b == b'\n') {
        let sent = match line.strip_prefix(b">") {
            Some(message) => session.from_client(message),
            None => session.from_upstream(line),
        };
        to_client.extend(sent.into_iter().filter(|s| s.to_client));
    }
    session.end(StreamEnd::ClientClosed);
    if kind == Kind::Realtime && mode != StreamMode::Monitor {
        nothing_blocked_went_out(state, &to_client);
    }
    let mut records = records.lock().expect("the receiver");
    while records.try_recv().is_ok() {}
});

/// Each text part's deltas that reached the client, joined, and every
/// text an event of a response carries whole (a part's, an item's, a
/// call's arguments): none holds a match of a rule that blocks or
/// redacts.
fn nothing_blocked_went_out(state: &State, to_client: &[Sent]) {
    let rules = state.rules.snapshot();
    let unsafe_in = |text: &str| {
        let hits = rules.scan(Scope::Response, text);
        hits.into_iter().find(|hit| hit.action >= Action::Redact)
    };
    let mut parts: HashMap<(String, String, String, String), String> = HashMap::new();
    // The response of each item, as the events that name both tell (the
    // guard's own reading of an event that names only its item).
    let mut items: HashMap<String, String> = HashMap::new();
    for text in to_client.iter().filter_map(|s| s.text.as_deref()) {
        let Ok(event) = serde_json::from_str::<Value>(text) else {
            continue;
        };
        let of_response = event.get("response_id").is_some_and(Value::is_string)
            || event.pointer("/response/id").is_some_and(Value::is_string);
        if of_response {
            let mut whole = Vec::new();
            whole_texts(&event, &mut whole);
            for text in whole {
                let leaked = unsafe_in(text);
                assert!(leaked.is_none(), "{event} went out: {leaked:?}");
            }
        }
        let field = |name: &str| event.get(name).and_then(Value::as_str);
        let item = field("item_id").or_else(|| event.pointer("/item/id")?.as_str());
        if let (Some(response), Some(item)) = (field("response_id"), item) {
            items.entry(item.to_owned()).or_insert_with(|| response.to_owned());
        }
        let response = field("response_id").or_else(|| Some(items.get(item?)?.as_str()));
        let (Some(kind), Some(response), Some(delta)) = (field("type"), response, field("delta"))
        else {
            continue;
        };
        if !kind.ends_with("text.delta") {
            continue;
        }
        // As the guard reads it: 0 when absent.
        let index = event.get("content_index").and_then(Value::as_u64);
        let key = (
            response.to_owned(),
            field("item_id").unwrap_or_default().to_owned(),
            index.unwrap_or(0).to_string(),
            kind.to_owned(),
        );
        parts.entry(key).or_default().push_str(delta);
    }
    for (key, text) in parts {
        let leaked = unsafe_in(&text);
        assert!(leaked.is_none(), "{key:?} went out as {text:?}: {leaked:?}");
    }
}

/// The strings under the keys that carry a response's texts whole, in
/// `value` and all it holds.
fn whole_texts<'v>(value: &'v Value, texts: &mut Vec<&'v str>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("text" | "transcript" | "arguments" | "refusal", Value::String(text)) => {
                        texts.push(text)
                    }
                    _ => whole_texts(value, texts),
                }
            }
        }
        Value::Array(values) => values.iter().for_each(|value| whole_texts(value, texts)),
        _ => {}
    }
}
