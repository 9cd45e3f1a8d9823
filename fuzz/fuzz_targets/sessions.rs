//! A WebSocket session's messages, either side's, in any order, through
//! the guard of a Realtime API session or a Responses API socket with the
//! shipped rules: nothing panics, and in a guarded session (holdback or
//! buffer) no text delta the client gets joins, with the others of its
//! part, into a text a rule blocks or redacts, nor does any text an event
//! of a response carries whole hold such a match (in a Responses API
//! socket, where the API repeats a response's texts: see
//! `repeated_texts`).
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
    if mode != StreamMode::Monitor {
        nothing_blocked_went_out(state, kind, &to_client);
    }
    let mut records = records.lock().expect("the receiver");
    while records.try_recv().is_ok() {}
});

/// Each text part's deltas that reached the client, joined, and every
/// text an event of a response carries whole (a part's, an item's, a
/// call's arguments): none holds a match of a rule that blocks or
/// redacts.
fn nothing_blocked_went_out(state: &State, kind: Kind, to_client: &[Sent]) {
    let rules = state.rules.snapshot();
    let unsafe_in = |text: &str| {
        let hits = rules.scan(Scope::Response, text);
        hits.into_iter().find(|hit| hit.action >= Action::Redact)
    };
    let mut read = match kind {
        Kind::Realtime => realtime_reading(),
        Kind::ResponsesSocket => lanes_reading(),
    };
    let mut parts: HashMap<String, String> = HashMap::new();
    for text in to_client.iter().filter_map(|s| s.text.as_deref()) {
        let Ok(event) = serde_json::from_str::<Value>(text) else {
            continue;
        };
        let Reading { of_response, part } = read(&event);
        if of_response {
            let mut whole = Vec::new();
            match kind {
                Kind::Realtime => whole_texts(&event, &mut whole),
                Kind::ResponsesSocket => repeated_texts(&event, &mut whole),
            }
            for text in whole {
                let leaked = unsafe_in(text);
                assert!(leaked.is_none(), "{event} went out: {leaked:?}");
            }
        }
        let field = |name: &str| event.get(name).and_then(Value::as_str);
        let (Some(part), Some(kind), Some(delta)) = (part, field("type"), field("delta")) else {
            continue;
        };
        if kind.ends_with("text.delta") {
            parts
                .entry(format!("{part} {kind}"))
                .or_default()
                .push_str(delta);
        }
    }
    for (key, text) in parts {
        let leaked = unsafe_in(&text);
        assert!(leaked.is_none(), "{key} went out as {text:?}: {leaked:?}");
    }
}

/// What the check reads of an event the client got: whether it is of a
/// response, and the part its delta (if any) is of, as the guard tells
/// them apart.
struct Reading {
    of_response: bool,
    part: Option<String>,
}

/// The content index of `event`, as the guard reads it: 0 when absent.
fn content_index(event: &Value) -> u64 {
    event
        .get("content_index")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// A Realtime session's events: of a response when they name one; a
/// part is a response's item's content index, the response of an event
/// that names only its item told by the events that name both (the
/// guard's own reading).
fn realtime_reading() -> Box<dyn FnMut(&Value) -> Reading> {
    let mut items: HashMap<String, String> = HashMap::new();
    Box::new(move |event| {
        let field = |name: &str| event.get(name).and_then(Value::as_str);
        let of_response = field("response_id").is_some()
            || event.pointer("/response/id").is_some_and(Value::is_string);
        let item = field("item_id").or_else(|| event.pointer("/item/id")?.as_str());
        if let (Some(response), Some(item)) = (field("response_id"), item) {
            items
                .entry(item.to_owned())
                .or_insert_with(|| response.to_owned());
        }
        let response = field("response_id").or_else(|| Some(items.get(item?)?.as_str()));
        let part = response.map(|response| {
            let item = field("item_id").unwrap_or_default();
            format!("{response} {item} {}", content_index(event))
        });
        Reading { of_response, part }
    })
}

/// A Responses API socket's events: every `response.*` event but a
/// steer's acknowledgement (which passes as it came) is of the response
/// under way on its lane (its `stream_id`), which ends with its last
/// event; a part is that response's item's content index.
fn lanes_reading() -> Box<dyn FnMut(&Value) -> Reading> {
    // Of each lane, how many of its responses have ended.
    let mut ended: HashMap<String, u64> = HashMap::new();
    Box::new(move |event| {
        let field = |name: &str| event.get(name).and_then(Value::as_str);
        let kind = field("type").unwrap_or_default();
        let lane = field("stream_id").unwrap_or_default();
        let of_response = kind.starts_with("response.") && !kind.starts_with("response.steer.");
        let response = ended.get(lane).copied().unwrap_or(0);
        let item = field("item_id").unwrap_or_default();
        let part = of_response.then(|| format!("{lane} {response} {item} {}", content_index(event)));
        let in_flight = event.pointer("/error/code").and_then(Value::as_str)
            == Some("response_already_in_flight");
        let last = matches!(
            kind,
            "response.completed" | "response.failed" | "response.incomplete" | "error"
        );
        if last && !in_flight {
            *ended.entry(lane.to_owned()).or_default() += 1;
        }
        Reading { of_response, part }
    })
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

/// The `text`, `arguments` and `refusal` strings where the Responses API
/// repeats a response's texts, the members the SDKs read: a done event's, its `part`'s and `item`'s, and
/// those of the `content` and `summary` of the items of the `output` of
/// its `response`. (The guard reads these; a member the API does not
/// define passes unread, as the stream guard's doc says.)
fn repeated_texts<'v>(value: &'v Value, texts: &mut Vec<&'v str>) {
    let Value::Object(map) = value else {
        return;
    };
    for (key, value) in map {
        match (key.as_str(), value) {
            ("text" | "arguments" | "refusal", Value::String(text)) => texts.push(text),
            ("part" | "item" | "response", _) => repeated_texts(value, texts),
            ("output" | "content" | "summary", Value::Array(values)) => {
                values.iter().for_each(|value| repeated_texts(value, texts))
            }
            _ => {}
        }
    }
}
