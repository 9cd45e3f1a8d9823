//! The guard of the Responses API's WebSocket mode: the socket that
//! `client.responses.connect()` of OpenAI's SDKs (and the Agents SDK's
//! WebSocket transport) opens at the base URL's `/responses` (`GET
//! /v1/responses`, upgraded), read event by event.
//!
//! **What the client sends.** Each event (`response.create`; a
//! `response.steer`, which adds input to a response under way) is read as
//! the body of `POST /v1/responses` is, its instructions, input, tools and
//! a stored prompt's variables, and scanned as a request before it goes
//! upstream. A block keeps it from the upstream and answers the client
//! with the API's `error` event: `status: 400`, an error of type
//! `invalid_request_error` and `code: "content_filter"` with fairgate's
//! rule ids beside it, on the event's lane (its `stream_id`). A redaction
//! rewrites the event. An event that is not JSON, gives a key the guard
//! reads twice, or a `type` or `stream_id` that is not a string, is not
//! sent on: the client gets an `error` event (`invalid_json`,
//! `ambiguous_json`, `invalid_type`).
//!
//! **What the upstream answers.** A response opens on its lane (the
//! `stream_id` of its events, or the connection's own) with the first
//! event of it the upstream sends (its `response.created`), whether a
//! `response.create` asked for it or it follows one on its own (a
//! steered response's successor). Its events, up to its last
//! (`response.completed`, `.failed`, `.incomplete`, or an `error`), go
//! through the stream guard of the Responses API
//! ([`crate::guard::stream`]) as the events of a streamed `POST
//! /v1/responses` do, in the route's stream mode. In `holdback` text is
//! re-framed and released once no match may be under way in it, and
//! `sequence_number`s follow the events sent; a block ends the response as
//! a blocked stream ends (its `response.incomplete`, reason
//! `content_filter`), and what the upstream sends of it after that is
//! dropped. The mode has no cancel: the blocked response runs on
//! upstream, which takes no other on its lane until it ends, so a
//! `response.create` the client sends on the lane meanwhile (it had the
//! response's end) waits, and goes up once the upstream's last event of
//! the blocked one comes. An event the guard writes itself carries the lane's
//! `stream_id`. An `error` that refuses a request before any response
//! of it and a steer's acknowledgements (`response.steer.*`) pass as
//! they came, as do closes (a binary message is read as a text one is,
//! see `realtime::as_text`); an `error` that refuses a
//! second `response.create` on a lane (`response_already_in_flight`)
//! leaves the response under way open. An upstream event that is not JSON is dropped
//! and counted (`fairgate_upstream_errors_total{kind="malformed"}`).
//!
//! Each response is an exchange record (route `responses`), with the
//! prompt of the `response.create` that asked for it (a successor's:
//! the steering input sent since); so is each blocked event, and each
//! request the upstream refuses. A response the session's end cuts off
//! is recorded with what had come of it; a request it leaves unanswered
//! (sent up, or waiting to be), with no response and status 499 when the
//! client went first, 502 when the upstream did.
//!
//! A fault of fairgate's own (a panic) while the session takes an event
//! ends the session, not the proxy: each response under way ends on its
//! lane with the API's `error` event (`internal_error`), as a stream
//! whose guard faults does (the socket's own `error` event, status 500,
//! when none is), then both sides are closed; counted in
//! `fairgate_faults_total{stage="session"}`, and what it cut off recorded
//! (unanswered requests with status 500).

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytestring::ByteString;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

use super::realtime::{
    Limits, Relay, Send, SessionRecords, Turn, content_filter_error, unanswered_status,
};
use super::respond::{self, Failure};
use super::{RecordDraft, State};
use crate::config::StreamMode;
use crate::exchange::{Dialect, Endpoint, RequestBody};
use crate::guard::stream::{EventGuard, StreamOutcome, StreamSetup};
use crate::guard::{self, rule_ids};
use crate::record::{ClientMeta, StreamEnd};
use crate::risk::{Decision, Verdict};

/// Whether an upgrade to `path` opens a Responses API socket.
pub fn is_responses_socket(path: &str) -> bool {
    Endpoint::from_path(path) == Some(Endpoint::Responses)
}

/// What a session knows from its handshake.
pub struct Handshake {
    pub request_id: String,
    pub upstream: String,
    pub client: ClientMeta,
    pub mode: StreamMode,
}

/// Relays a Responses API socket, each event through the guard.
pub async fn run(state: Arc<State>, handshake: Handshake, client: Upgraded, upstream: Upgraded) {
    let limits = Limits::of(&state);
    let session = Session::new(state, handshake);
    let (client, upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    super::realtime::relay(session, (client, upstream), limits).await;
}

/// A session of `handshake` without its sockets ([`super::replay`]).
pub(super) fn unsocketed(state: Arc<State>, handshake: Handshake) -> Box<dyn Relay> {
    Box::new(Session::new(state, handshake))
}

/// The events that end a response.
const LAST_EVENTS: [&str; 4] = [
    "response.completed",
    "response.failed",
    "response.incomplete",
    "error",
];

/// What the session reads of every event: its type, its lane, and an
/// error's code.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    stream_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    error: Option<ErrorHead<'a>>,
    /// An error's HTTP status (read leniently: an event is not dropped
    /// for an odd one).
    #[serde(default)]
    status: Option<Value>,
}

/// What the session reads of a client's event: its type and its lane.
#[derive(Deserialize)]
struct ClientHead<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    stream_id: Option<Cow<'a, str>>,
}

/// The error of a client event whose `type` or `stream_id` is not a
/// string: the session could not tell its lane, nor the upstream's
/// answer to it.
fn mistyped(error: &serde_json::Error) -> Value {
    json!({
        "message": format!("The event's `type` and `stream_id` must be strings: {error}."),
        "type": "invalid_request_error",
        "param": null,
        "code": "invalid_type",
    })
}

#[derive(Deserialize)]
struct ErrorHead<'a> {
    #[serde(borrow, default)]
    code: Option<Cow<'a, str>>,
}

struct Session {
    state: Arc<State>,
    handshake: Handshake,
    /// The responses under way, by lane (`""`: the connection's own).
    lanes: HashMap<String, Lane>,
    /// What the client asked on each lane, oldest first, each for the
    /// response that answers it.
    asked: HashMap<String, VecDeque<Asked>>,
    /// The steering input sent since the last response opened: a steer
    /// names no lane.
    steered: Turn,
    /// The model of the last request, for a response no request asked for.
    model: Option<String>,
    records: SessionRecords,
    ended: Option<StreamEnd>,
}

/// A request sent upstream, waiting for its response.
struct Asked {
    turn: Turn,
    model: Option<String>,
    started: Instant,
    prefill: String,
}

/// A response under way.
struct Lane {
    guard: EventGuard,
    /// Records the response once it ends; taken then.
    record: Option<Box<dyn FnOnce(StreamOutcome) + std::marker::Send>>,
    /// The requests the client sent on the lane once the guard had ended
    /// the response (blocked it) for the client, while it still runs
    /// upstream, which takes no other on the lane until it ends: sent
    /// then, in order.
    waiting: Vec<Message>,
}

impl Lane {
    fn record(&mut self) {
        if let Some(record) = self.record.take() {
            record(self.guard.outcome());
        }
    }
}

impl Relay for Session {
    fn client_event(&mut self, text: Utf8Bytes) -> Vec<Send> {
        let started = Instant::now();
        let read = match RequestBody::read(Endpoint::Responses, text.as_bytes()) {
            Ok(read) => read,
            Err(error) => {
                let (failure, message) = respond::unreadable_failure(&error, "The event");
                let mut body = respond::failure_body(Dialect::OpenAi, failure, Some(&message));
                return vec![error_event(400, body["error"].take(), None)];
            }
        };
        let head: ClientHead = match serde_json::from_str(text.as_str()) {
            Ok(head) => head,
            Err(error) => return vec![error_event(400, mistyped(&error), None)],
        };
        let lane = head.stream_id.as_deref().unwrap_or_default().to_owned();
        let model = read.model.as_deref().map(str::to_owned);
        let rules = self.state.rules.snapshot();
        let config = &self.state.config;
        let context_tags = &config.guard.context_tags;
        let scan = guard::scan_request(&rules, &config.risk, context_tags, &read.texts);
        if scan.verdict.decision == Decision::Block {
            return vec![self.block_event(scan, model, lane, started)];
        }
        let forwarded = match scan.redacted(text.as_bytes()) {
            Some(body) => match Utf8Bytes::try_from(body) {
                Ok(body) => body,
                Err(_) => unreachable!("a splice of JSON strings into UTF-8 is UTF-8"),
            },
            None => text.clone(),
        };
        let create = head.kind.as_deref() == Some("response.create");
        if create {
            if model.is_some() {
                self.model.clone_from(&model);
            }
            let prefill = read.prefill.map(Cow::into_owned).unwrap_or_default();
            let mut turn = Turn::default();
            turn.add(scan);
            let asked = Asked {
                turn,
                model,
                started,
                prefill,
            };
            self.asked.entry(lane.clone()).or_default().push_back(asked);
        } else {
            self.steered.add(scan);
        }
        let forwarded = Message::Text(forwarded);
        // The client had the end of the lane's response; the upstream
        // has not ended it yet.
        if let Some(open) = self.lanes.get_mut(&lane)
            && create
            && open.guard.finished()
        {
            open.waiting.push(forwarded);
            return Vec::new();
        }
        vec![Send::Upstream(forwarded)]
    }

    fn upstream_event(&mut self, text: Utf8Bytes) -> Vec<Send> {
        let Ok(head) = serde_json::from_str::<Head>(text.as_str()) else {
            tracing::warn!("a Responses API socket event that is not a JSON object: dropped");
            super::realtime::count_malformed(&self.state, &self.handshake.upstream);
            return Vec::new();
        };
        let key = head.stream_id.as_deref().unwrap_or_default();
        let kind = head.kind.as_deref().unwrap_or_default();
        let code = head.error.as_ref().and_then(|e| e.code.as_deref());
        let open = self.lanes.contains_key(key);
        // Of no response: a request refused, or its steering acknowledged.
        let aside = kind.starts_with("response.steer.")
            || (kind == "error" && (!open || code == Some("response_already_in_flight")));
        if aside {
            if kind == "error" {
                // A request on the lane gets no response: the one that
                // came while another was in flight, or the next one.
                let status = head.status.as_ref().and_then(Value::as_u64);
                let status = status.and_then(|s| u16::try_from(s).ok()).unwrap_or(400);
                let latest = code == Some("response_already_in_flight");
                if let Some(asked) = self.take_asked(key, latest) {
                    self.unanswered(asked, status, "upstream_error");
                }
            }
            return vec![Send::Client(Message::Text(text))];
        }
        if !open {
            self.open(key);
        }
        let Some(lane) = self.lanes.get_mut(key) else {
            unreachable!("a lane is open once its first event has come")
        };
        let last = LAST_EVENTS.contains(&kind);
        let mut sent = lane.guard.on_event(text.as_str());
        if last {
            sent.extend(lane.guard.on_end());
        }
        if lane.guard.finished() || last {
            lane.record();
        }
        let waiting = match last {
            true => self.lanes.remove(key).map(|lane| lane.waiting),
            false => None,
        };
        let sent = sent
            .into_iter()
            .map(|data| Send::Client(Message::Text(on_lane(data, key))));
        let waiting = waiting.into_iter().flatten().map(Send::Upstream);
        sent.chain(waiting).collect()
    }

    fn ending(&mut self, end: StreamEnd) {
        self.ended.get_or_insert(end);
    }

    /// Each response under way ends for the client with the API's error
    /// event, as a stream whose guard faults does; with none, the session's
    /// own error event tells the client.
    fn fault(&mut self) -> Vec<Send> {
        self.ended = Some(super::realtime::session_fault(
            &self.state,
            &self.handshake.request_id,
        ));
        let mut sends = Vec::new();
        for (key, lane) in &mut self.lanes {
            if !lane.guard.finished() {
                let ending = lane.guard.fault_ending().into_iter();
                sends.extend(ending.map(|data| Send::Client(Message::Text(on_lane(data, key)))));
            }
        }
        if sends.is_empty() {
            let mut body = respond::failure_body(Dialect::OpenAi, Failure::Fault, None);
            sends.push(error_event(500, body["error"].take(), None));
        }
        sends
    }
}

impl Session {
    fn new(state: Arc<State>, handshake: Handshake) -> Session {
        let records = SessionRecords::new(
            &handshake.request_id,
            &handshake.upstream,
            &handshake.client,
        );
        Session {
            state,
            handshake,
            lanes: HashMap::new(),
            asked: HashMap::new(),
            steered: Turn::default(),
            model: None,
            records,
            ended: None,
        }
    }

    /// Opens a response on lane `key`, for what was asked on it (or, for
    /// a response none asked for, the steering sent since).
    fn open(&mut self, key: &str) {
        let steered = std::mem::take(&mut self.steered);
        let asked = self.take_asked(key, false).unwrap_or_else(|| Asked {
            turn: steered,
            model: self.model.clone(),
            started: Instant::now(),
            prefill: String::new(),
        });
        let config = &self.state.config;
        let setup = StreamSetup {
            endpoint: Endpoint::Responses,
            mode: self.handshake.mode,
            rules: self.state.rules.snapshot(),
            risk: config.risk.clone(),
            request_hits: asked.turn.hits,
            relevance: asked.turn.relevance,
            started: asked.started,
            include_usage: false,
            prefill: asked.prefill,
            resume_after: None,
            max_bytes: config.guard.max_stream_bytes,
        };
        let request_id = self.records.next_id();
        let mut draft = self.draft(request_id, asked.started, asked.model, asked.turn.prompt);
        draft.context = asked.turn.context;
        let route = Endpoint::Responses.route();
        let spent = asked.started.elapsed();
        let record = super::stream_recorder(&self.state, route, 101, spent, draft);
        let lane = Lane {
            guard: EventGuard::new(setup),
            record: Some(Box::new(record)),
            waiting: Vec::new(),
        };
        self.lanes.insert(key.to_owned(), lane);
    }

    /// The oldest request waiting for its response on lane `key`, or
    /// the `latest`.
    fn take_asked(&mut self, key: &str, latest: bool) -> Option<Asked> {
        let waiting = self.asked.get_mut(key)?;
        let asked = match latest {
            true => waiting.pop_back(),
            false => waiting.pop_front(),
        };
        if waiting.is_empty() {
            self.asked.remove(key);
        }
        asked
    }

    /// Records a request that got no response, with `status`, and counts
    /// it as `counted`.
    fn unanswered(&mut self, asked: Asked, status: u16, counted: &str) {
        let route = Endpoint::Responses.route();
        let (turn, model, started) = (asked.turn, asked.model, asked.started);
        self.records
            .unanswered(&self.state, route, turn, model, started, status, counted);
    }

    /// Answers a blocked client event, and records it.
    fn block_event(
        &mut self,
        scan: guard::RequestScan,
        model: Option<String>,
        lane: String,
        started: Instant,
    ) -> Send {
        let verdict = scan.verdict;
        let request_id = self.records.next_id();
        let (scope, error) = content_filter_error(&verdict.hits, &request_id);
        let rules = rule_ids(&verdict.hits);
        tracing::info!(request_id, scope, ?rules, "responses socket event blocked");
        self.count(&verdict, model.as_deref(), scope);
        let send = error_event(400, error, Some(lane).filter(|l| !l.is_empty()));
        let mut draft = self.draft(request_id, started, model, scan.texts.prompt);
        draft.context = scan.texts.context;
        draft.finish_unanswered(&self.state, &verdict, 400, None);
        send
    }

    /// Counts a blocked client event: its verdict and its block (a
    /// response's own are counted with its record).
    fn count(&self, verdict: &Verdict, model: Option<&str>, scope: &str) {
        let metrics = &self.state.metrics;
        let route = Endpoint::Responses.route();
        let model = self.state.config.metrics.model_label(model);
        super::record_verdict(metrics, verdict);
        metrics
            .requests
            .with_label_values(&[route, &self.handshake.upstream, model, "block"])
            .inc();
        metrics
            .blocks
            .with_label_values(&[route, model, scope])
            .inc();
    }

    fn draft(
        &self,
        request_id: String,
        started: Instant,
        model: Option<String>,
        prompt: Vec<String>,
    ) -> RecordDraft {
        let route = Endpoint::Responses.route();
        self.records
            .draft(route, request_id, started, model, prompt)
    }
}

/// The session ended, however it did: the responses still under way are
/// recorded with what came of them (ended as the upstream's failure when
/// it went first), and the requests no response answered with no
/// response and the status of [`unanswered_status`].
impl Drop for Session {
    fn drop(&mut self) {
        // Dropped by a fault's unwind: a second one would abort the
        // process.
        if std::thread::panicking() {
            return;
        }
        let end = self.ended.unwrap_or(StreamEnd::ClientClosed);
        for lane in self.lanes.values_mut() {
            if end != StreamEnd::ClientClosed {
                lane.guard.on_end();
            }
            lane.record();
        }
        let (status, counted) = unanswered_status(end);
        let mut unanswered: Vec<Asked> = self.asked.drain().flat_map(|(_, asked)| asked).collect();
        unanswered.sort_by_key(|asked| asked.started);
        for asked in unanswered {
            self.unanswered(asked, status, counted);
        }
    }
}

/// The API's `error` event of a socket: `status`, `error` (the object of
/// an error envelope), on `lane`.
fn error_event(status: u16, error: Value, lane: Option<String>) -> Send {
    let mut event = json!({"type": "error", "status": status, "error": error});
    if let Some(lane) = lane {
        event["stream_id"] = json!(lane);
    }
    Send::Client(Message::text(event.to_string()))
}

/// An event the guard sends on lane `key`: with the lane's `stream_id`
/// when the guard wrote it without one.
fn on_lane(data: ByteString, key: &str) -> Utf8Bytes {
    if !key.is_empty()
        && !data.contains("\"stream_id\"")
        && let Ok(Value::Object(mut event)) = serde_json::from_str::<Value>(&data)
    {
        event.insert("stream_id".into(), json!(key));
        return Utf8Bytes::from(Value::Object(event).to_string());
    }
    match Utf8Bytes::try_from(data.into_bytes()) {
        Ok(text) => text,
        Err(_) => unreachable!("an event's data is UTF-8"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::record::QueueItem;

    /// A fault in a session ends each response under way on its lane
    /// with the API's error event (`internal_error`), as a stream whose
    /// guard faults ends; the response is recorded as ended by the
    /// fault, and a request still waiting for its response with status
    /// 500. The fault is counted.
    #[tokio::test]
    async fn a_fault_ends_each_response_under_way_and_is_recorded() {
        let state = Arc::new(State::new(Config::default()).unwrap());
        let mut records = state.queue.take_receiver().unwrap();
        let handshake = Handshake {
            request_id: "fg-socket".to_owned(),
            upstream: "openai".to_owned(),
            client: ClientMeta::default(),
            mode: StreamMode::Holdback,
        };
        let mut session = Session::new(state.clone(), handshake);
        let create = |text: &str, lane: &str| {
            let event = json!({"type": "response.create", "model": "gpt-5", "input": text,
                "stream_id": lane});
            Utf8Bytes::from(event.to_string())
        };
        let sent = session.client_event(create("Tips?", "a"));
        assert!(matches!(sent[..], [Send::Upstream(_)]));
        session.client_event(create("More tips?", "b"));
        for event in [
            json!({"type": "response.created", "stream_id": "a", "sequence_number": 0,
                "response": {"id": "resp_a", "status": "in_progress", "output": []}}),
            json!({"type": "response.output_text.delta", "stream_id": "a", "item_id": "m",
                "output_index": 0, "content_index": 0, "delta": "Save a little", "sequence_number": 1}),
        ] {
            session.upstream_event(Utf8Bytes::from(event.to_string()));
        }

        let sent = session.fault();
        let [Send::Client(Message::Text(ending))] = &sent[..] else {
            panic!("one event for the client");
        };
        let ending: Value = serde_json::from_str(ending.as_str()).unwrap();
        assert_eq!(ending["type"], "error", "{ending}");
        assert_eq!(ending["code"], "internal_error", "{ending}");
        assert_eq!(ending["stream_id"], "a", "{ending}");
        drop(session);

        let mut got = Vec::new();
        while let Ok(QueueItem::Exchange(record)) = records.try_recv() {
            got.push((
                record.texts.prompt.clone(),
                record.status,
                record.stream_end,
            ));
        }
        got.sort_by_key(|(_, status, _)| *status);
        let prompt = |text: &str| vec![text.to_owned()];
        assert_eq!(
            got,
            [
                (prompt("Tips?"), 101, Some(StreamEnd::Fault)),
                (prompt("More tips?"), 500, None),
            ]
        );
        let faults = state.metrics.faults.with_label_values(&["session"]);
        assert_eq!(faults.get(), 1);
    }
}
