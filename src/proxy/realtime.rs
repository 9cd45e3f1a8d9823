//! The guard of Realtime API sessions: the WebSocket that OpenAI's SDKs
//! open at the base URL's `/realtime` (`/v1/realtime`; Azure OpenAI's
//! `/openai/realtime` and `/openai/v1/realtime`), read event by event.
//!
//! **What the client sends.** A `session.update` (its instructions,
//! tools and a stored prompt's variables), a `conversation.item.create`
//! (the item it adds) and a `response.create` (the same, and its input
//! items) are
//! scanned as a request is, before they go upstream
//! ([`exchange::read_realtime_event`]). A block keeps the event from the
//! upstream and answers the client with the API's `error` event, of
//! `code: "content_filter"`, naming the event; a redaction rewrites it. An
//! event that is not JSON, or gives a key the guard reads twice, is not
//! sent on either: the client gets an `error` event (`invalid_json`,
//! `ambiguous_json`). Audio the client appends is not read; the
//! transcript the API makes of it (`...input_audio_transcription.completed`,
//! when the session asks for one) is scanned as prompt when it comes, and
//! a block there stops the response that follows it.
//!
//! **What the upstream answers.** A response's events, from the first
//! that names it (its `response.created`) to its `response.done` (every
//! event that names the response, or an item of it, as the
//! conversation's `conversation.item.*` events do), are held until its
//! `response.done` (but for a text answer's, which go as they come:
//! below); what comes of it after that is dropped. Then its
//! texts are scanned: each part's text, transcript and function or MCP
//! call arguments (its deltas joined; a delta of a kind the guard does not
//! know is read as arguments are) and every text the `.done` events,
//! items and `response.done` repeat, with the hits of the prompt it
//! answers; what a hosted tool (an MCP server) gave the model, an item's
//! `output`, is scanned as context. If it passes, the events go out as
//! they came. A `redact` hit in a text part rewrites it: its first delta
//! carries the part's redacted text, its other deltas are dropped, and
//! the redacted text replaces the original wherever an event repeats it
//! (the item too, whenever an event carries it later: the conversation
//! holds it as the model wrote it); one in a transcript (the audio says
//! the words) or in a call's arguments blocks. A blocked response
//! reaches the client as its `response.created` and a `response.done` of
//! `status: "incomplete"` with `status_details: {"type": "incomplete",
//! "reason": "content_filter"}` (the API's own shape for a filtered
//! response, with fairgate's rule ids beside it), its output emptied and
//! its usage kept; no text, audio or call of it goes out. Its items are
//! then deleted from the conversation upstream
//! (`conversation.item.delete`), so that no later response reads them,
//! and the acknowledgements of the deletions are not relayed.
//!
//! **Text goes out as it comes.** A response whose output so far is
//! text only (no audio, transcript, call or hosted tool's output), in a
//! session whose client has sent no audio, is released as a stream is in
//! `holdback` ([`Session::stream_early`]): its held events go out in
//! order through the last text delta in which no match may be under way
//! (`guard::stream::safe_end` on the part's text so far), the events
//! that carry no text (its `response.created`, an item or a part added
//! empty) and those that repeat text parts' whole text (a part's or an
//! item's `.done`, redacted as the text was; the part is then done, and
//! its text goes out to its end, no match being under way at an end that
//! no text follows) with them, as long as neither the part's text nor the prompt it
//! answers has a hit but flags and redactions (the text read from the
//! longest match before what the client has, as the stream guard reads
//! it; once it has a backslash, with its JSON escapes decoded too, as the
//! end's scan reads every text), and these do not weigh enough together
//! to block (`risk.block_threshold`). A redaction goes out as a stream's
//! does: once its match is whole, its placeholder in place of it, the
//! deltas that carry the match going as one (the first of them carrying
//! their text redacted); the events that repeat the text at its end carry
//! it redacted ([`release`]).
//! Any other hit, or anything but text, ends that: the rest is held to
//! the `response.done` and decided whole, as above. A block then
//! ends the response for the client after the text that went before it,
//! and the client, which had the item, hears of its deletion; a
//! redaction rewrites what is still held, from where the text sent ends
//! (no match reaches back into the text sent).
//! A client that sends audio gets every response whole at its end: the
//! transcript of what a response answers may come after it began, and a
//! block there stops it.
//!
//! *Guarantees*: nothing a rule blocks reaches the client, whatever the
//! deltas. *Cost*: a text response reaches the client as a stream does in
//! `holdback`; any other once the model has finished it, as a stream does
//! in `buffer` mode; audio could not go sooner in any mode, since a piece
//! of audio may say words its transcript has not sent yet. A response
//! that ends `cancelled` (the user spoke over it, or the client cancelled
//! it) goes out without its
//! audio: held, none of it was heard, and played now it would talk over
//! the user. A route in `monitor` mode passes every event on as it
//! comes, and scans and records only. Held events are bounded by
//! `guard.max_response_bytes`, and all of a response's events, held or
//! gone out (its texts are kept for the scan at its end), by
//! `guard.max_stream_bytes`, in every mode: a response beyond either is
//! cancelled upstream, its items deleted, and ends, for the client,
//! `failed` with `response_too_large`; what comes of it after is dropped.
//!
//! A binary message is read as its text, an event like any ([`as_text`]):
//! the SDKs read either kind of message as JSON. Everything else passes
//! as it comes: events of no response (the session's, the input audio
//! buffer's, rate limits, errors). Each side's pings are answered by fairgate; a close is passed
//! on. An upstream event that is not a JSON object with a `type`, a
//! response's text event (a `response.*` delta or `.done`) that names no
//! response nor an item of one, and a delta that carries a text besides
//! its `delta` (an item, a `text`: the API sends none such) are dropped
//! and counted (`fairgate_upstream_errors_total{kind="malformed"}`), but
//! in `monitor` mode, which passes the last two.
//!
//! Each response is an exchange record (route `realtime`, with the
//! prompt the client sent since the response before it), as is each
//! blocked client event; a response the session's end cuts off is
//! recorded with what had come of it, and what the client said that no
//! response answered, with no response and the status of
//! [`unanswered_status`]. A fault of fairgate's own (a
//! panic) while the session takes an event ends the session, not the
//! proxy: the client gets an `error` event (`internal_error`), the held
//! events are dropped with the session, both sides are closed, and the
//! fault is counted (`fairgate_faults_total{stage="session"}`) and its
//! responses recorded as it ended them (`fault`; what was unanswered,
//! status 500).
//!
//! A session held elsewhere (a browser's, with a key from
//! `/v1/realtime/client_secrets`; a WebRTC or SIP call) is seen only as it
//! is set up: [`setup`] scans its configuration as a prompt.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response, header};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Value, json};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::error::{CapacityError, ProtocolError};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use super::batch;
use super::respond::{self, Failure};
use super::{Ending, ProxyBody, ReadRequest, RecordDraft, State};
use crate::config::Upgrades;
use crate::exchange::{self, Dialect};
use crate::guard::stream::{hold, safe_end, window_start};
use crate::guard::{self, block_message, rule_ids};
use crate::record::{ClientMeta, StreamEnd, Usage, now_ms};
use crate::risk::{self, Decision, RiskConfig, Verdict};
use crate::rules::normalize::Normalized;
use crate::rules::{Action, Hit, RuleSet, Scope, redact, redact_spans, redacted_spans};

/// The route label of Realtime sessions, in metrics and records.
const ROUTE: &str = "realtime";
/// The route of a session's setup for a session held elsewhere.
const SETUP: &str = crate::record::unread_answer::REALTIME_SETUP;

/// The prefix of the ids of events fairgate itself sends upstream, whose
/// answers it keeps from the client.
const OWN_EVENT: &str = "fairgate_";

/// Whether `path` is a Realtime API session's: its last segment is
/// `realtime`.
pub fn is_realtime(path: &str) -> bool {
    path.trim_end_matches('/').rsplit('/').next() == Some("realtime")
}

/// What a session knows from its handshake.
pub struct Handshake {
    pub request_id: String,
    pub upstream: String,
    /// The `model` (or Azure's `deployment`) of the handshake's query.
    pub model: Option<String>,
    pub client: ClientMeta,
    pub monitor: bool,
}

impl Handshake {
    /// The model a session's query names.
    pub fn model_of(query: Option<&str>) -> Option<String> {
        let query = query?;
        let pairs = query.split('&').filter_map(|pair| pair.split_once('='));
        let mut model = None;
        for (key, value) in pairs {
            if key == "model" || (key == "deployment" && model.is_none()) {
                let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
                model = Some(value.into_owned());
            }
        }
        model
    }
}

/// Sets up a Realtime session that will not pass through here
/// ([`exchange::sets_up_realtime`]: a browser's key, a WebRTC call, a SIP
/// call's acceptance). Its configuration is scanned as a prompt: a block
/// refuses the request with the 400 of a blocked prompt (naming the
/// `session`), a redaction rewrites it. A call's configuration is the
/// `session` field of its form; an SDP offer alone has none. Each
/// configuration read leaves a record (route
/// [`crate::record::unread_answer::REALTIME_SETUP`]), ended with the
/// status its client gets. Refused with 403 `upgrade_refused` unless
/// `guard.upgrades` is `tunnel`.
pub(super) async fn setup(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let dialect = Dialect::OpenAi;
    if state.config.guard.upgrades != Upgrades::Tunnel {
        // Nothing said in it would be read.
        return respond::failure(dialect, Failure::UpgradeRefused, request_id);
    }
    let boundary = batch::form_boundary(req.headers());
    let sdp = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/sdp"));
    let limit = state.config.guard.max_body_bytes;
    let read = match ReadRequest::of(state, req, (dialect, limit), request_id).await {
        Ok(read) => read,
        Err(answer) => return answer,
    };
    // By its path: an SDP offer names no model.
    let upstream = match read.upstream(state, None, request_id) {
        Ok(upstream) => upstream,
        Err(answer) => return *answer,
    };
    let mut records =
        batch::OutsideRecords::new(state, (dialect, &upstream), (request_id, started));
    let read_by = (state.as_ref(), upstream.as_str(), &read.parts.headers);
    let body = if let Some(boundary) = boundary {
        let (mut fields, complete) = batch::fields(&read.bytes, &boundary).await;
        if !complete {
            // What the API would read of it cannot be told.
            return respond::invalid_request(
                "The form could not be read to its end, so the session it configures was not read.",
                "invalid_form",
                request_id,
            );
        }
        let mut judged = false;
        let sessions = fields
            .iter_mut()
            .filter(|(headers, _)| batch::field_name(headers) == Some("session"));
        for (_, session) in sessions {
            match judge(read_by, session, &mut records) {
                Ok(Some(redacted)) => (*session, judged) = (redacted, true),
                Ok(None) => {}
                Err(refused) => return records.refused(*refused),
            }
        }
        match judged {
            true => batch::form_of(&fields, &boundary, read.bytes.len()),
            false => read.bytes.clone(),
        }
    } else if sdp {
        // An offer alone: the session takes its defaults.
        read.bytes.clone()
    } else {
        // Read as JSON whatever the content type says: the API may.
        match judge(read_by, &read.bytes, &mut records) {
            Ok(judged) => judged.unwrap_or_else(|| read.bytes.clone()),
            Err(refused) => return records.refused(*refused),
        }
    };
    let answer = async {
        match read.send(state, (&upstream, body), false).await {
            Ok((response, timeout)) => super::stream_back(response, timeout, request_id, None),
            Err(failure) => respond::failure(dialect, failure, request_id),
        }
    };
    records.answered_with(answer).await
}

/// A session configuration scanned (`read_by`: the upstream it goes to,
/// and the setup's headers) and recorded in `records`: `None` when it
/// goes up as it came, its redacted text, or the answer that refuses it.
fn judge(
    (state, upstream, headers): (&State, &str, &http::HeaderMap),
    config: &Bytes,
    records: &mut batch::OutsideRecords<'_>,
) -> Result<Option<Bytes>, Box<Response<ProxyBody>>> {
    let request_id = records.request_id();
    let setup = exchange::read_realtime_setup(config).map_err(|error| {
        let what = "The session's configuration";
        Box::new(respond::unreadable(
            Dialect::OpenAi,
            &error,
            Some(what),
            request_id,
        ))
    })?;
    let rules = state.rules.snapshot();
    let scan = batch::scan_recorded(state, &rules, upstream, SETUP, &setup, request_id);
    let redacted = scan.redacted(config);
    records.record(scan, SETUP, (headers, &setup, "session"))?;
    Ok(redacted)
}

/// Guards a session whose handshake both sides completed, until either
/// side closes.
pub async fn run(state: Arc<State>, handshake: Handshake, client: Upgraded, upstream: Upgraded) {
    let (client, upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    let limits = Limits::of(&state);
    relay(Session::new(state, handshake), (client, upstream), limits).await;
}

/// Counts an event from `upstream` that did not read as the API's:
/// `fairgate_upstream_errors_total{kind="malformed"}`.
pub(super) fn count_malformed(state: &State, upstream: &str) {
    (state.metrics.upstream_errors)
        .with_label_values(&[upstream, "malformed"])
        .inc();
}

/// A session of `handshake` without its sockets ([`super::replay`]).
pub(super) fn unsocketed(state: Arc<State>, handshake: Handshake) -> Box<dyn Relay> {
    Box::new(Session::new(state, handshake))
}

/// What a guarded WebSocket session does with each side's events: its
/// messages, text or binary ([`as_text`]). Closes pass as they come;
/// pings are answered by the sockets themselves.
pub(super) trait Relay {
    /// The messages to send for an event from the client.
    fn client_event(&mut self, text: Utf8Bytes) -> Vec<Send>;
    /// The messages to send for an event from the upstream.
    fn upstream_event(&mut self, text: Utf8Bytes) -> Vec<Send>;
    /// How the session ends, as the first side to close or fail tells.
    fn ending(&mut self, end: StreamEnd);
    /// The messages that end the session after a fault of fairgate's own
    /// (a panic) while it took an event: the client is told, and the
    /// session ends as [`StreamEnd::Fault`].
    fn fault(&mut self) -> Vec<Send>;
}

/// A binary message read as an event, as the SDKs read it: their
/// `json.loads` takes a message's bytes whatever its kind, so a binary
/// one passed on unread could carry an answer past the guard. Bytes that
/// are not UTF-8 are not JSON either, and read as the text they make
/// (an event that does not read).
pub(super) fn as_text(bytes: Bytes) -> Utf8Bytes {
    Utf8Bytes::try_from(bytes.clone())
        .unwrap_or_else(|_| Utf8Bytes::from(String::from_utf8_lossy(&bytes).into_owned()))
}

/// The largest message each side of a session may send, in bytes.
#[derive(Clone, Copy)]
pub(super) struct Limits {
    /// A client's events are requests: `guard.max_body_bytes`.
    pub client: usize,
    /// The upstream's events are answers: `guard.max_response_bytes`.
    pub upstream: usize,
}

impl Limits {
    pub fn of(state: &State) -> Limits {
        Limits {
            client: state.config.guard.max_body_bytes,
            upstream: state.config.guard.max_response_bytes,
        }
    }
}

/// Relays a WebSocket session between `client` and `upstream`, each
/// message through `session`, until either side closes (the other has a
/// while to answer the close) or fails. A side that sends what cannot be
/// read (a message over its limit, a broken frame) is closed with the
/// code that says so (1009, 1002, 1007), the client with 1011 when the
/// upstream's connection fails. A fault while the session takes a
/// message ends the session: what [`Relay::fault`] gives goes out, then
/// both sides are closed (the session is dropped outside the unwind, so
/// that its records are written).
pub(super) async fn relay<C, U>(mut session: impl Relay, (client, upstream): (C, U), limits: Limits)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    // No extension was let through the handshake (see `tunnel`), so
    // frames come uncompressed.
    let config = |limit: usize| {
        Some(
            WebSocketConfig::default()
                .max_message_size(Some(limit))
                .max_frame_size(Some(limit)),
        )
    };
    let client = WebSocketStream::from_raw_socket(client, Role::Server, config(limits.client));
    let upstream =
        WebSocketStream::from_raw_socket(upstream, Role::Client, config(limits.upstream));
    let (mut to_client, mut from_client) = client.await.split();
    let (mut to_upstream, mut from_upstream) = upstream.await.split();
    let mut closing: Option<tokio::time::Instant> = None;
    // The closes a failed read leaves to send to each side.
    let (mut client_close, mut upstream_close): (Option<CloseFrame>, Option<CloseFrame>) =
        (None, None);
    loop {
        // After a close, the other side has a while to answer it.
        let closed = async {
            match closing {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let (message, side) = tokio::select! {
            message = from_client.next() => match message {
                Some(Ok(message)) => (message, Side::Client),
                failed => {
                    session.ending(StreamEnd::ClientClosed);
                    client_close = failed.and_then(|read| unreadable(&read.err()?));
                    break;
                }
            },
            message = from_upstream.next() => match message {
                Some(Ok(message)) => (message, Side::Upstream),
                failed => {
                    session.ending(StreamEnd::UpstreamFailed);
                    let failed = failed.and_then(|read| read.err());
                    upstream_close = failed.as_ref().and_then(unreadable);
                    client_close = Some(upstream_failed(failed));
                    break;
                }
            },
            () = closed => break,
        };
        if matches!(message, Message::Close(_)) {
            closing.get_or_insert_with(close_deadline);
            session.ending(match side {
                Side::Client => StreamEnd::ClientClosed,
                Side::Upstream => StreamEnd::UpstreamFailed,
            });
        }
        let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            take(&mut session, message, side)
        }));
        let (sends, faulted) = match taken {
            Ok(sends) => (sends, false),
            Err(_) => (session.fault(), true),
        };
        for send in sends {
            // A side that went away ends the session at its next read.
            let _ = match send {
                Send::Client(message) => to_client.send(message).await,
                Send::Upstream(message) => to_upstream.send(message).await,
            };
        }
        if faulted {
            break;
        }
    }
    // A close sent first is the one that goes; `close` sends one only if
    // none went yet.
    let client_closed = async {
        if let Some(frame) = client_close {
            let _ = to_client.send(Message::Close(Some(frame))).await;
        }
        to_client.close().await
    };
    let upstream_closed = async {
        if let Some(frame) = upstream_close {
            let _ = to_upstream.send(Message::Close(Some(frame))).await;
        }
        to_upstream.close().await
    };
    let _ = tokio::join!(client_closed, upstream_closed);
}

/// The close that tells a side why what it sent could not be read:
/// `None` when its connection is gone (nothing can reach it).
fn unreadable(error: &WsError) -> Option<CloseFrame> {
    let (code, reason) = match error {
        &WsError::Capacity(CapacityError::MessageTooLong { size, max_size }) => (
            CloseCode::Size,
            format!("message too big: {size} bytes, the limit is {max_size}"),
        ),
        WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake) => return None,
        WsError::Protocol(error) => (CloseCode::Protocol, format!("protocol error: {error}")),
        WsError::Utf8(_) => (CloseCode::Invalid, "a text message is not UTF-8".to_owned()),
        _ => return None,
    };
    Some(CloseFrame {
        code,
        reason: reason.into(),
    })
}

/// The close that tells the client the upstream's connection failed
/// (`error`, or it ended without a close).
fn upstream_failed(error: Option<WsError>) -> CloseFrame {
    let reason = match error {
        Some(WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake)) | None => {
            "the upstream's connection ended without a close"
        }
        Some(WsError::Capacity(_)) => "the upstream sent a message too big to read",
        Some(WsError::Protocol(_) | WsError::Utf8(_)) => {
            "the upstream broke the WebSocket protocol"
        }
        Some(_) => "the upstream's connection failed",
    };
    CloseFrame {
        code: CloseCode::Error,
        reason: reason.into(),
    }
}

/// The side of a session a message came from.
#[derive(Clone, Copy)]
enum Side {
    Client,
    Upstream,
}

/// What `session` sends for `message` from `side`: a close goes to the
/// other side as it came.
fn take(session: &mut impl Relay, message: Message, side: Side) -> Vec<Send> {
    let text = match message {
        Message::Text(text) => text,
        Message::Binary(bytes) => as_text(bytes),
        Message::Close(_) => {
            return vec![match side {
                Side::Client => Send::Upstream(message),
                Side::Upstream => Send::Client(message),
            }];
        }
        Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => return Vec::new(),
    };
    match side {
        Side::Client => session.client_event(text),
        Side::Upstream => session.upstream_event(text),
    }
}

fn close_deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(5)
}

/// A message for one side.
pub(super) enum Send {
    Client(Message),
    Upstream(Message),
}

/// The prompt a response answers: what the client's events said since
/// the response before it.
#[derive(Default)]
pub(super) struct Turn {
    pub(super) prompt: Vec<String>,
    pub(super) context: Vec<String>,
    pub(super) hits: Vec<Hit>,
    pub(super) relevance: Vec<f64>,
    /// When its first text was read.
    pub(super) since: Option<Instant>,
}

impl Turn {
    pub(super) fn add(&mut self, scan: guard::RequestScan) {
        self.since.get_or_insert_with(Instant::now);
        self.prompt.extend(scan.texts.prompt);
        self.context.extend(scan.texts.context);
        self.hits.extend(scan.verdict.hits);
        self.relevance.extend(scan.relevance);
    }

    fn is_empty(&self) -> bool {
        self.prompt.is_empty() && self.context.is_empty()
    }
}

/// The error object of a client event that `hits` block (`code:
/// "content_filter"`, the rules' message and ids, the record's id), and
/// the scope they block in.
pub(super) fn content_filter_error(hits: &[Hit], request_id: &str) -> (&'static str, Value) {
    let scope = guard::block_scope(hits, Scope::Prompt);
    let error = json!({
        "message": block_message(hits),
        "type": "invalid_request_error",
        "param": null,
        "code": "content_filter",
        "fairgate": {"scope": scope, "rules": rule_ids(hits), "request_id": request_id},
    });
    (scope, error)
}

/// The records of a WebSocket session's exchanges: each of them streamed,
/// of the session's upstream and client, its id the handshake's
/// numbered.
pub(super) struct SessionRecords {
    request_id: String,
    upstream: String,
    client: ClientMeta,
    made: u64,
}

impl SessionRecords {
    pub(super) fn new(request_id: &str, upstream: &str, client: &ClientMeta) -> SessionRecords {
        SessionRecords {
            request_id: request_id.to_owned(),
            upstream: upstream.to_owned(),
            client: client.clone(),
            made: 0,
        }
    }

    /// The id of the session's next record.
    pub(super) fn next_id(&mut self) -> String {
        self.made += 1;
        format!("{}.{}", self.request_id, self.made)
    }

    /// Records what the client said in `turn`, asked of `model` on
    /// `route` at `started`, which got no response: with `status`, and
    /// counted among the requests as `counted`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn unanswered(
        &mut self,
        state: &State,
        route: &'static str,
        turn: Turn,
        model: Option<String>,
        started: Instant,
        status: u16,
        counted: &str,
    ) {
        let verdict = risk::assess(&state.config.risk, turn.hits, &turn.relevance);
        let label = state.config.metrics.model_label(model.as_deref());
        state
            .metrics
            .requests
            .with_label_values(&[route, &self.upstream, label, counted])
            .inc();
        let request_id = self.next_id();
        let mut draft = self.draft(route, request_id, started, model, turn.prompt);
        draft.context = turn.context;
        draft.finish_unanswered(state, &verdict, status, Some(started.elapsed()));
    }

    /// The draft of record `request_id`, of an exchange on `route` that
    /// began at `started`.
    pub(super) fn draft(
        &self,
        route: &'static str,
        request_id: String,
        started: Instant,
        model: Option<String>,
        prompt: Vec<String>,
    ) -> RecordDraft {
        RecordDraft {
            request_id,
            started,
            started_ms: now_ms() - started.elapsed().as_millis() as i64,
            route,
            dialect: Dialect::OpenAi,
            upstream: self.upstream.clone(),
            upstream_request_id: None,
            model,
            stream: true,
            custom_id: None,
            client: self.client.clone(),
            prompt,
            context: Vec::new(),
        }
    }
}

/// What is read of a text of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    /// A text part's: redacted in place.
    Text,
    /// A transcript of audio, a call's arguments: a redaction there
    /// blocks.
    Whole,
    /// What a hosted tool (an MCP server's) gave the model: context, and a
    /// redaction there blocks.
    Context,
}

/// One part of a response's output, by its item and index, and what its
/// deltas said.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PartKey {
    item: String,
    index: u64,
    kind: Kind,
}

/// An event held back until its response is decided, or its text may go
/// out early ([`Session::stream_early`]).
struct Held {
    response: String,
    text: Utf8Bytes,
    /// Whether it is the response's `response.created`.
    created: bool,
    /// Whether it carries a piece of audio.
    audio: bool,
    /// The part whose delta the event carries.
    part: Option<PartKey>,
    /// For a delta, the length of its part's text once it is added.
    end: usize,
    /// Whether it carries no text of the response (its `response.created`,
    /// an item or a part added empty), and so may go out early.
    plain: bool,
    /// Whether the only text it carries repeats text parts' whole text
    /// (a part's or an item's `.done`), and so may go out early too, after
    /// that text and redacted as it was.
    repeats: bool,
}

/// The bound a response passed ([`Session::too_large`]).
#[derive(Debug, Clone, Copy)]
enum Limit {
    /// Its held events, `guard.max_response_bytes`.
    Held,
    /// All its events, held or gone out, `guard.max_stream_bytes`.
    Taken,
}

impl Limit {
    fn setting(self) -> &'static str {
        match self {
            Limit::Held => "guard.max_response_bytes",
            Limit::Taken => "guard.max_stream_bytes",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Limit::Held => {
                "The response was larger than fairgate holds to check (guard.max_response_bytes)."
            }
            Limit::Taken => {
                "The response sent more than fairgate keeps to check (guard.max_stream_bytes)."
            }
        }
    }
}

/// A response from its `response.created` on.
struct Answer {
    rules: Arc<RuleSet>,
    started: Instant,
    started_ms: i64,
    turn: Turn,
    /// Each part's text, its deltas joined, in the order they began.
    parts: Vec<(PartKey, String)>,
    /// The texts that events repeat whole.
    repeats: Vec<(Kind, String)>,
    /// The ids of its output items.
    items: Vec<String>,
    held_bytes: usize,
    /// The bytes of all its events so far, held or gone out: its texts
    /// are kept to the end's scan, so `guard.max_stream_bytes` bounds it.
    taken: usize,
    /// fairgate's own time on it.
    spent: Duration,
    /// Whether its text may still go out as it comes: only text so far,
    /// and no hit in it but flags and redactions that do not make it
    /// block.
    streams: bool,
    /// The hits found in the text that went out early (flags, logs,
    /// redactions), one a rule: weighed with the prompt's hits and the
    /// next window's.
    flagged: Vec<Hit>,
    /// The redactions found in each text part's text so far, spans in
    /// it, as it streams.
    redacts: Vec<(PartKey, Vec<Hit>)>,
    /// The text parts an event has repeated whole: no more of their text
    /// comes, so no match can be under way at their end.
    done: Vec<PartKey>,
    /// How much of each text part's text the client has, once some went
    /// out early.
    shown: Vec<(PartKey, Shown)>,
}

/// What the client has of a text part, once some of it went out early.
#[derive(Debug, Clone, Copy, Default)]
struct Shown {
    /// How far into the part's text as the model wrote it.
    text: usize,
    /// How long that is as the client has it, redacted.
    redacted: usize,
}

/// What the scan of a response found.
struct Scanned {
    /// With the hits of the prompt it answers.
    verdict: Verdict,
    /// Its texts as the client gets them, for the record.
    shown: Vec<String>,
    /// What hosted tools gave the model in it, for the record.
    context: Vec<String>,
    /// The texts a redaction rewrote, and what it made of each.
    redactions: Vec<(String, String)>,
}

/// Whether the hits of `turn` (the prompt an answer answers) and `found`
/// in the answer's text only flag, log or redact, and do not weigh
/// enough together to block: the text may go on as it comes.
fn streams_on(risk: &RiskConfig, turn: &Turn, found: &[Hit]) -> bool {
    let mut hits = turn.hits.iter().chain(found);
    if hits.any(|hit| hit.action > Action::Redact) {
        return false;
    }
    let hits: Vec<Hit> = turn.hits.iter().chain(found).cloned().collect();
    hits.is_empty() && turn.relevance.is_empty()
        || risk::assess(risk, hits, &turn.relevance).decision != Decision::Block
}

/// What the client has of text part `key`, by `shown`.
fn shown_of(shown: &[(PartKey, Shown)], key: &PartKey) -> Shown {
    let found = shown.iter().find(|(k, _)| k == key);
    found.map_or(Shown::default(), |(_, shown)| *shown)
}

/// How far a text part's text may go out now ([`Answer::safe_end`]): in
/// the text as written and, once it has an escape, in the text decoded.
#[derive(Clone, Copy)]
struct SafeEnd {
    raw: usize,
    decoded: Option<usize>,
}

impl SafeEnd {
    /// Whether the start of `text` that ends at `end` may go out: in both
    /// views.
    fn covers(self, text: &str, end: usize) -> bool {
        end <= self.raw
            && self
                .decoded
                .is_none_or(|safe| decoded_len(&text[..end]) <= safe)
    }
}

/// The length of `text` with its JSON escapes decoded, as far as they
/// can be ([`guard::json_unescaped_start`]).
fn decoded_len(text: &str) -> usize {
    guard::json_unescaped_start(text).map_or(text.len(), |decoded| decoded.len())
}

impl Answer {
    /// Whether some of its events went out early: the client has its
    /// items.
    fn seen(&self) -> bool {
        !self.shown.is_empty()
    }

    /// Where the text of part `key` may go out to now: before any match
    /// that may be under way in it, at a clean point. The text is read
    /// from the longest match before what the client has (a match ending
    /// in new text begins there or after; one that ended before was found
    /// when it did), as written and, once it has a backslash, with its
    /// JSON escapes decoded too, as [`Answer::scan`] reads it at the end
    /// (a hit only that view has blocks, a redaction too). A hit that
    /// does more than flag, in it or in the prompt it answers, or flags
    /// that together weigh enough to block (`risk`), end the response's
    /// streaming: the rest waits for its end, which decides it whole.
    /// Flags alone let it go on, as in a stream.
    fn safe_end(&mut self, key: &PartKey, risk: &RiskConfig) -> SafeEnd {
        let shown = shown_of(&self.shown, key).text;
        let stop = SafeEnd {
            raw: shown,
            decoded: None,
        };
        let Some((_, text)) = self.parts.iter().find(|(k, _)| k == key) else {
            return stop;
        };
        let hold = hold(&self.rules);
        let from = window_start(text, shown, shown, hold);
        let window = &text[from..];
        let mut found = self.rules.scan(Scope::Response, window);
        let at = match self.redacts.iter().position(|(k, _)| k == key) {
            Some(at) => at,
            None => {
                self.redacts.push((key.clone(), Vec::new()));
                self.redacts.len() - 1
            }
        };
        let redacts = &mut self.redacts[at].1;
        for hit in found.iter().filter(|h| h.action == Action::Redact) {
            let (start, end) = (hit.start + from, hit.end + from);
            // A match grows as text arrives ("a@b.co", then "a@b.com").
            match (redacts.iter_mut()).find(|h| h.rule == hit.rule && h.start == start) {
                Some(known) => known.end = known.end.max(end),
                None => redacts.push(Hit {
                    start,
                    end,
                    ..hit.clone()
                }),
            }
        }
        // The text so far as a parser reads it: an escape it ends in
        // waits for what completes it.
        let decoded = guard::json_unescaped_start(text).map(|decoded| {
            let shown = decoded_len(&text[..shown]);
            let from = window_start(&decoded, shown, shown, hold);
            let mut more = self.rules.scan(Scope::Response, &decoded[from..]);
            more.retain(|hit| !found.iter().any(|h| h.rule == hit.rule));
            guard::redactions_block(&mut more);
            found.extend(more);
            (decoded, shown, from)
        });
        for hit in found {
            if !self.flagged.iter().any(|seen| seen.rule == hit.rule) {
                self.flagged.push(hit);
            }
        }
        if !streams_on(risk, &self.turn, &self.flagged) {
            self.streams = false;
            return stop;
        }
        if self.done.contains(key) {
            return SafeEnd {
                raw: text.len(),
                decoded: decoded.map(|(decoded, _, _)| decoded.len()),
            };
        }
        let view = Normalized::new(window);
        let redacts = self.redacts_of(key);
        SafeEnd {
            raw: safe_end(&self.rules, text, shown, shown, from, &view, redacts),
            decoded: decoded.map(|(decoded, shown, from)| {
                let view = Normalized::new(&decoded[from..]);
                safe_end(&self.rules, &decoded, shown, shown, from, &view, &[])
            }),
        }
    }

    /// The text of part `key` so far.
    fn text_of(&self, key: &PartKey) -> &str {
        let part = self.parts.iter().find(|(k, _)| k == key);
        part.map_or("", |(_, text)| text)
    }

    /// The redactions found so far in the text of part `key`.
    fn redacts_of(&self, key: &PartKey) -> &[Hit] {
        let redacts = self.redacts.iter().find(|(k, _)| k == key);
        redacts.map_or(&[], |(_, redacts)| redacts)
    }

    /// Each text part's text that a redaction found so far rewrites, with
    /// what it makes of it.
    fn redactions_so_far(&self) -> Vec<(String, String)> {
        let rewritten = self
            .redacts
            .iter()
            .filter(|(_, redacts)| !redacts.is_empty());
        let texts = rewritten.map(|(key, redacts)| {
            let text = self.text_of(key);
            (text.to_owned(), redact(text, redacts))
        });
        texts.collect()
    }

    /// Whether `at` in the text of part `key` lies inside a redaction.
    fn inside_redaction(&self, key: &PartKey, at: usize) -> bool {
        (self.redacts_of(key).iter()).any(|h| h.start < at && at < h.end)
    }

    /// Takes part `key`'s text from where the client's ends to `to`: the
    /// client has it to `to` then. That text redacted, when a redaction
    /// rewrites it.
    fn show(&mut self, key: &PartKey, to: usize) -> Option<String> {
        let shown = shown_of(&self.shown, key);
        let text = &self.text_of(key)[shown.text..to];
        let redacts = self.redacts_of(key).iter().filter(|h| h.end <= to);
        let spans = redacted_spans(redacts, shown.text);
        let redacted = (!spans.is_empty()).then(|| redact_spans(text, spans));
        let now = Shown {
            text: to,
            redacted: shown.redacted + redacted.as_ref().map_or(text.len(), String::len),
        };
        match self.shown.iter_mut().find(|(k, _)| k == key) {
            Some((_, shown)) => *shown = now,
            None => self.shown.push((key.clone(), now)),
        }
        redacted
    }

    /// Scans each text of the response once: each part's joined deltas,
    /// and every text the events repeated that differs from them.
    fn scan(&mut self, risk: &RiskConfig) -> Scanned {
        let mut texts: Vec<(Kind, &str)> = Vec::new();
        let parts = self
            .parts
            .iter()
            .map(|(key, text)| (key.kind, text.as_str()));
        let repeats = self
            .repeats
            .iter()
            .map(|(kind, text)| (*kind, text.as_str()));
        for (kind, text) in parts.chain(repeats) {
            if !text.is_empty() && !texts.iter().any(|(_, seen)| *seen == text) {
                texts.push((kind, text));
            }
        }
        let mut hits = std::mem::take(&mut self.turn.hits);
        let mut redactions: Vec<(String, String)> = Vec::new();
        for (kind, text) in &texts {
            let scope = match kind {
                Kind::Context => Scope::Context,
                _ => Scope::Response,
            };
            let mut found = self.rules.scan(scope, text);
            if *kind != Kind::Text {
                guard::redactions_block(&mut found);
            }
            if found.iter().any(|h| h.action == Action::Redact) {
                redactions.push(((*text).to_owned(), redact(text, &found)));
            }
            // A call's arguments reach the client's code parsed.
            let escaped = guard::unescaped_hits(&self.rules, scope, text, &found);
            hits.extend(found);
            hits.extend(escaped);
        }
        let (context, shown): (Vec<_>, Vec<_>) =
            texts.iter().partition(|(kind, _)| *kind == Kind::Context);
        let as_shown = |texts: Vec<&(Kind, &str)>| -> Vec<String> {
            let texts = texts.into_iter();
            texts
                .map(|(_, text)| redacted_of(&redactions, text).unwrap_or(text).to_owned())
                .collect()
        };
        Scanned {
            verdict: risk::assess(risk, hits, &self.turn.relevance),
            shown: as_shown(shown),
            context: as_shown(context),
            redactions,
        }
    }
}

/// The start of an upstream event: what tells which response it is of.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    response_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    item_id: Option<Cow<'a, str>>,
    #[serde(default)]
    content_index: Option<u64>,
    #[serde(default, borrow)]
    delta: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    transcript: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    response: Option<Named<'a>>,
    #[serde(default, borrow)]
    item: Option<Named<'a>>,
    #[serde(default, borrow)]
    error: Option<ErrorHead<'a>>,
}

#[derive(Deserialize)]
struct Named<'a> {
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ErrorHead<'a> {
    #[serde(default, borrow)]
    event_id: Option<Cow<'a, str>>,
}

/// The deltas of a part's text, by the API's event names (the GA API's
/// and the beta's): a text answer's stream; any other delta of a
/// response but audio (a transcript's, a call's arguments, an MCP call's,
/// and any the guard does not know, whatever its name) is read whole, at
/// the end.
fn delta_kind(event: &str) -> Option<Kind> {
    match event {
        "response.output_text.delta" | "response.text.delta" => Some(Kind::Text),
        _ if is_audio_delta(event) => None,
        _ if event.ends_with(".delta") => Some(Kind::Whole),
        _ => None,
    }
}

/// Deltas of audio: nothing to read.
fn is_audio_delta(event: &str) -> bool {
    matches!(
        event,
        "response.output_audio.delta" | "response.audio.delta"
    )
}

/// The keys under which events repeat a response's texts whole, and how
/// each is read.
fn repeat_kind(key: &str) -> Option<Kind> {
    match key {
        "text" => Some(Kind::Text),
        "transcript" | "arguments" => Some(Kind::Whole),
        "output" => Some(Kind::Context),
        _ => None,
    }
}

struct Session {
    state: Arc<State>,
    handshake: Handshake,
    turn: Turn,
    /// Responses from their `response.created` to their `response.done`.
    answers: HashMap<String, Answer>,
    /// Which response each output item is of.
    items: HashMap<String, String>,
    /// Events held back, in order.
    held: Vec<Held>,
    /// Responses decided or cut off: the API sends nothing of a response
    /// after its `response.done`, and what comes anyway is dropped (passed
    /// on, in monitor mode).
    closed: HashSet<String>,
    /// Responses fairgate cancelled for their size ([`Session::too_large`]):
    /// what comes of them is dropped in monitor mode too.
    cut: HashSet<String>,
    /// Items fairgate deleted upstream, each with whether the client had
    /// it: the acknowledgements of the others are not relayed.
    deleted: HashMap<String, bool>,
    /// The redactions of the items of responses that passed redacted.
    redacted: HashMap<String, Vec<(String, String)>>,
    records: SessionRecords,
    own_events: u64,
    /// Whether the client has sent audio: then no response's text goes
    /// out before its end, since the transcript of what it answers may
    /// come after it began, and stop it.
    heard: bool,
    /// How the session ends, once a side closed it: by the side that
    /// closed first.
    ended: Option<StreamEnd>,
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
            turn: Turn::default(),
            answers: HashMap::new(),
            items: HashMap::new(),
            held: Vec::new(),
            closed: HashSet::new(),
            cut: HashSet::new(),
            deleted: HashMap::new(),
            redacted: HashMap::new(),
            records,
            own_events: 0,
            heard: false,
            ended: None,
        }
    }

    fn client_text(&mut self, text: Utf8Bytes) -> Vec<Send> {
        let started = Instant::now();
        let event = match exchange::read_realtime_event(text.as_bytes()) {
            Ok(event) => event,
            Err(error) => {
                let (failure, message) = respond::unreadable_failure(&error, "The event");
                let mut body = respond::failure_body(Dialect::OpenAi, failure, Some(&message));
                return vec![self.error_event(body["error"].take(), None)];
            }
        };
        // The user's audio, whose transcript may come while a response
        // to it is under way.
        self.heard |= event
            .kind
            .as_deref()
            .is_some_and(|kind| kind.starts_with("input_audio_buffer."))
            || text.as_str().contains("\"input_audio\"");
        if event.texts.is_empty() {
            return vec![Send::Upstream(Message::Text(text))];
        }
        let state = self.state.clone();
        let rules = state.rules.snapshot();
        let scan = guard::scan_request(
            &rules,
            &state.config.risk,
            &state.config.guard.context_tags,
            &event.texts,
        );
        if scan.verdict.decision == Decision::Block {
            let event_id = event.event_id.map(Cow::into_owned);
            return vec![self.block_event(scan, event_id, started)];
        }
        let forwarded = match scan.redacted(text.as_bytes()) {
            Some(body) => match Utf8Bytes::try_from(body) {
                Ok(body) => body,
                Err(_) => unreachable!("a splice of JSON strings into UTF-8 is UTF-8"),
            },
            None => text,
        };
        // For the next response: one in flight was asked for before.
        self.turn.add(scan);
        vec![Send::Upstream(Message::Text(forwarded))]
    }

    /// Answers a blocked client event, and records it.
    fn block_event(
        &mut self,
        scan: guard::RequestScan,
        event_id: Option<String>,
        started: Instant,
    ) -> Send {
        let verdict = scan.verdict;
        let request_id = self.records.next_id();
        let (scope, error) = content_filter_error(&verdict.hits, &request_id);
        let rules = rule_ids(&verdict.hits);
        tracing::info!(request_id, scope, ?rules, "realtime event blocked");
        self.count(&verdict, Some(scope));
        let send = self.error_event(error, event_id);
        let mut draft = self.draft(request_id, started, now_ms(), scan.texts.prompt);
        draft.context = scan.texts.context;
        draft.finish_unanswered(&self.state, &verdict, 101, None);
        send
    }

    /// The API's `error` event for the client, of `error` (the object of
    /// an error envelope) about its event `about`.
    fn error_event(&mut self, mut error: Value, about: Option<String>) -> Send {
        error["event_id"] = about.map_or(Value::Null, Value::String);
        let event = json!({"type": "error", "event_id": self.own_event_id(), "error": error});
        Send::Client(Message::text(event.to_string()))
    }

    /// Drops an upstream event the guard does not pass on: logged with
    /// `why`, and counted as malformed.
    fn dropped(&self, why: &str) -> Vec<Send> {
        tracing::warn!(request_id = self.handshake.request_id, "{why}: dropped");
        count_malformed(&self.state, &self.handshake.upstream);
        Vec::new()
    }

    fn upstream_text(&mut self, text: Utf8Bytes) -> Vec<Send> {
        let started = Instant::now();
        let Ok(head) = serde_json::from_str::<Head>(text.as_str()) else {
            return self.dropped("a Realtime event from the upstream could not be read");
        };
        let kind = head.kind.as_ref();
        // The acknowledgements of fairgate's own deletions: relayed when
        // the client had the item.
        if kind == "conversation.item.deleted"
            && let Some(item) = &head.item_id
            && let Some(told) = self.deleted.remove(item.as_ref())
        {
            self.items.remove(item.as_ref());
            return match told {
                true => vec![Send::Client(Message::Text(text))],
                false => Vec::new(),
            };
        }
        if kind == "error"
            && let Some(id) = head.error.as_ref().and_then(|e| e.event_id.as_deref())
            && id.starts_with(OWN_EVENT)
        {
            return Vec::new();
        }
        // An item of a response that passed redacted, as the conversation
        // holds it (retrieved, say): redacted again. An event that names a
        // response is that response's, whatever item it names.
        let item = head.item_id.as_deref();
        let item = item.or_else(|| head.item.as_ref().and_then(|i| i.id.as_deref()));
        let named = (head.response_id.as_deref())
            .or_else(|| head.response.as_ref().and_then(|r| r.id.as_deref()));
        if named.is_none()
            && let Some(redactions) = item.and_then(|item| self.redacted.get(item))
        {
            // Read as the head was; what would not read does not go out.
            let Ok(mut event) = serde_json::from_str::<Value>(text.as_str()) else {
                return Vec::new();
            };
            replace_repeats(&mut event, redactions);
            return vec![Send::Client(Message::text(event.to_string()))];
        }
        if kind == "conversation.item.input_audio_transcription.completed"
            && let Some(transcript) = &head.transcript
        {
            self.transcript(transcript);
        }
        let response = (named.map(str::to_owned)).or_else(|| self.items.get(item?).cloned());
        let Some(response) = response else {
            // A response's text (its deltas, and the `.done` events that
            // repeat it) names its response, or an item of it: such an
            // event that names neither is not the text of no response.
            let text_of_none = kind.starts_with("response.")
                && (kind.ends_with(".delta") || kind.ends_with(".done"));
            if text_of_none && !self.handshake.monitor {
                return self.dropped(&format!(
                    "a Realtime response's {kind} from the upstream named no response"
                ));
            }
            return vec![Send::Client(Message::Text(text))];
        };
        if self.closed.contains(&response) {
            return match self.handshake.monitor && !self.cut.contains(&response) {
                true => vec![Send::Client(Message::Text(text))],
                false => Vec::new(),
            };
        }
        // A delta's text is its `delta`: one that also carries a text
        // elsewhere (a `text`, a `transcript`, an item's), which the API
        // never sends, would take that text out with the delta unread.
        if delta_kind(kind).is_some() && !self.handshake.monitor && repeats_a_text(&text) {
            return self.dropped(&format!(
                "a Realtime {kind} from the upstream carried more text than its delta"
            ));
        }
        // A response is read from its first event, `response.created` or
        // any other that names it.
        let answer = self
            .answers
            .entry(response.clone())
            .or_insert_with(|| Answer {
                rules: self.state.rules.snapshot(),
                started,
                started_ms: now_ms(),
                turn: std::mem::take(&mut self.turn),
                parts: Vec::new(),
                repeats: Vec::new(),
                items: Vec::new(),
                held_bytes: 0,
                taken: 0,
                spent: Duration::ZERO,
                streams: true,
                flagged: Vec::new(),
                redacts: Vec::new(),
                done: Vec::new(),
                shown: Vec::new(),
            });
        if kind == "response.output_item.added"
            && let Some(item) = head.item.as_ref().and_then(|i| i.id.as_deref())
        {
            self.items.insert(item.to_owned(), response.clone());
            answer.items.push(item.to_owned());
        }
        let (mut part, mut done, mut end, mut plain) = (None, None, 0, false);
        let mut repeats_parts = false;
        if let Some(delta_kind) = delta_kind(kind) {
            let key = PartKey {
                item: head.item_id.as_deref().unwrap_or_default().to_owned(),
                index: head.content_index.unwrap_or_default(),
                kind: delta_kind,
            };
            let delta = head.delta.as_deref().unwrap_or_default();
            end = match answer.parts.iter_mut().find(|(k, _)| *k == key) {
                Some((_, joined)) => {
                    joined.push_str(delta);
                    joined.len()
                }
                None => {
                    answer.parts.push((key.clone(), delta.to_owned()));
                    delta.len()
                }
            };
            // A transcript's words are heard in the audio, a call's
            // arguments read whole; and a part's text that goes on after
            // an event repeated it whole, as the API never sends it, may
            // end a match that began in what went out: the rest waits.
            answer.streams &= delta_kind == Kind::Text && !answer.done.contains(&key);
            part = Some(key);
        } else if !is_audio_delta(kind)
            && let Ok(value) = serde_json::from_str::<Value>(text.as_str())
        {
            let mut repeats = Vec::new();
            collect_repeats(&value, &mut repeats);
            plain = repeats.iter().all(|(_, text)| text.is_empty());
            // Its texts went out as the parts' deltas, or wait with them.
            repeats_parts = repeats.iter().all(|(kind, text)| {
                let of_part =
                    |(key, joined): &(PartKey, String)| key.kind == Kind::Text && joined == text;
                text.is_empty() || *kind == Kind::Text && answer.parts.iter().any(of_part)
            });
            // The parts whose text it repeats are done: no more of it comes.
            for (key, joined) in &answer.parts {
                let repeated = repeats.iter().any(|(_, text)| text == joined);
                if repeated && !answer.done.contains(key) {
                    answer.done.push(key.clone());
                }
            }
            for (kind, text) in repeats {
                if !answer.repeats.iter().any(|(_, seen)| *seen == text) {
                    answer.repeats.push((kind, text));
                }
            }
            // Read once: the decision takes its status and usage from it.
            done = (kind == "response.done").then_some(value);
        }
        answer.streams &= plain || repeats_parts || part.is_some();
        let created = kind == "response.created";
        let audio = is_audio_delta(kind);
        let monitor = self.handshake.monitor;
        answer.taken = answer.taken.saturating_add(text.len());
        let mut sends = Vec::new();
        if monitor {
            sends.push(Send::Client(Message::Text(text)));
        } else {
            answer.held_bytes += text.len();
            self.held.push(Held {
                response: response.clone(),
                text,
                created,
                audio,
                part,
                end,
                plain,
                repeats: repeats_parts && !plain,
            });
        }
        let streams = !monitor && !self.heard && answer.streams;
        answer.spent += started.elapsed();
        if let Some(done) = done {
            sends.extend(self.decide(&response, done));
        } else if !monitor && answer.held_bytes > self.state.config.guard.max_response_bytes {
            sends.extend(self.too_large(&response, Limit::Held));
        } else if answer.taken > self.state.config.guard.max_stream_bytes {
            sends.extend(self.too_large(&response, Limit::Taken));
        } else if streams {
            sends.extend(self.stream_early(&response));
        }
        sends
    }

    /// The events of `response` that may go out before its end, as a
    /// stream's text does in `holdback`: from its first held one, those
    /// that carry no text, and the deltas of its text parts up to where
    /// no match may be under way in the part's text ([`Answer::safe_end`]),
    /// through the last such delta (so nothing goes before some text
    /// does) that does not end inside a redaction. The deltas of a part
    /// whose text going out now holds a redaction go as one, the first of
    /// them carrying that text redacted.
    fn stream_early(&mut self, response: &str) -> Vec<Send> {
        let started = Instant::now();
        let Some(answer) = self.answers.get_mut(response) else {
            return Vec::new();
        };
        let risk = &self.state.config.risk;
        let Some(last) = releasable(answer, &self.held, response, risk) else {
            answer.spent += started.elapsed();
            return Vec::new();
        };
        let going = || self.held[..=last].iter().filter(|h| h.response == response);
        let mut ends = part_ends(answer, going());
        // What a repeat of a part's text carries: the text redacted, once
        // a redaction rewrote it.
        let redactions = match going().any(|h| h.repeats) {
            true => answer.redactions_so_far(),
            false => Vec::new(),
        };
        let mut early = Vec::new();
        let mut at = 0;
        self.held.retain_mut(|held| {
            let goes = at <= last && held.response == response;
            at += 1;
            if !goes {
                return true;
            }
            // Out, it is held no more.
            answer.held_bytes -= held.text.len();
            let text = std::mem::replace(&mut held.text, Utf8Bytes::from_static(""));
            let rewritten = (held.part.as_ref())
                .and_then(|key| ends.iter_mut().find(|(k, _, _)| k == key))
                .and_then(|(_, _, rewritten)| rewritten.as_mut());
            match rewritten {
                None if held.repeats && !redactions.is_empty() => {
                    if let Ok(mut event) = serde_json::from_str::<Value>(text.as_str()) {
                        replace_repeats(&mut event, &redactions);
                        early.push(Utf8Bytes::from(event.to_string()));
                    }
                }
                None => early.push(text),
                // The first of the part's deltas carries its text redacted,
                // the others go.
                Some(rewritten) => {
                    let Some(redacted) = rewritten.take() else {
                        return false;
                    };
                    if let Ok(mut event) = serde_json::from_str::<Value>(text.as_str()) {
                        event["delta"] = Value::from(redacted);
                        early.push(Utf8Bytes::from(event.to_string()));
                    }
                }
            }
            false
        });
        answer.spent += started.elapsed();
        early
            .into_iter()
            .map(|text| Send::Client(Message::Text(text)))
            .collect()
    }

    /// A transcript of the user's audio: prompt, scanned as it comes.
    fn transcript(&mut self, transcript: &str) {
        let text = exchange::Text {
            scope: Scope::Prompt,
            text: Cow::Borrowed(transcript),
            span: 0..0,
            whole: true,
            definition: false,
            continues: false,
        };
        let state = self.state.clone();
        let scan = guard::scan_request(
            &state.rules.snapshot(),
            &state.config.risk,
            &state.config.guard.context_tags,
            &[text],
        );
        // The transcript comes while the response to the audio is under
        // way, or before it begins.
        match self.answers.values_mut().min_by_key(|a| a.started) {
            Some(answer) => answer.turn.add(scan),
            None => self.turn.add(scan),
        }
    }

    /// Scans a response at its `response.done`, releases or replaces its
    /// held events, and records it.
    fn decide(&mut self, response: &str, done: Value) -> Vec<Send> {
        let Some(mut answer) = self.answers.remove(response) else {
            return Vec::new();
        };
        let started = Instant::now();
        let scanned = answer.scan(&self.state.config.risk);
        let (verdict, redactions) = (&scanned.verdict, &scanned.redactions);
        self.closed.insert(response.to_owned());
        let mut held: Vec<Held> = self.take_held(response);
        let usage = done.pointer("/response/usage").map(Usage::from_value);
        let status = done.pointer("/response/status");
        // A response cancelled (the user spoke over it, or the client
        // cancelled it) was never heard: held, none of its audio was
        // played, and played now it would talk over the user.
        if status.and_then(Value::as_str) == Some("cancelled") {
            held.retain(|held| !held.audio);
        }
        let request_id = self.records.next_id();
        let (sends, end) = match (verdict.decision, self.handshake.monitor) {
            (Decision::Block, false) => {
                let scope = guard::block_scope(&verdict.hits, Scope::Response);
                let details = json!({
                    "type": "incomplete",
                    "reason": "content_filter",
                    "fairgate": {
                        "message": block_message(&verdict.hits),
                        "scope": scope,
                        "rules": rule_ids(&verdict.hits),
                        "request_id": request_id,
                    },
                });
                // The items go from the conversation before the client
                // hears of the end, and may ask for another response.
                let mut sends = self.delete_items(&answer.items, answer.seen());
                sends.extend(self.replaced(response, held, Some(done), "incomplete", details));
                (sends, StreamEnd::Blocked)
            }
            (_, false) => {
                // Its items are the conversation's now, their events as
                // any other's; but the conversation holds them as the
                // model wrote them, so what a redaction rewrote is
                // rewritten again when the client asks for them.
                for item in &answer.items {
                    self.items.remove(item);
                    if !redactions.is_empty() {
                        self.redacted.insert(item.clone(), redactions.to_vec());
                    }
                }
                let sends = release(held, &answer.parts, &answer.shown, redactions)
                    .into_iter()
                    .map(|text| Send::Client(Message::Text(text)))
                    .collect();
                (sends, StreamEnd::Complete)
            }
            (_, true) => (Vec::new(), StreamEnd::Complete),
        };
        answer.spent += started.elapsed();
        self.record(answer, request_id, scanned, usage, end);
        sends
    }

    /// The held events of `response`, taken out in order.
    fn take_held(&mut self, response: &str) -> Vec<Held> {
        let (of, rest) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|held| held.response == response);
        self.held = rest;
        of
    }

    /// A response ended for the client by fairgate: its
    /// `response.created`, then a `response.done` of `status` and
    /// `details`, from the upstream's own `done` when it came, its output
    /// emptied.
    fn replaced(
        &mut self,
        response: &str,
        held: Vec<Held>,
        done: Option<Value>,
        status: &str,
        details: Value,
    ) -> Vec<Send> {
        let created = held.into_iter().find(|held| held.created);
        let created = created.and_then(|held| serde_json::from_str::<Value>(&held.text).ok());
        let mut sends: Vec<Send> = created
            .map(|mut created| {
                emptied(&mut created);
                Send::Client(Message::text(created.to_string()))
            })
            .into_iter()
            .collect();
        let mut end = done
            .filter(|done| done["response"].is_object())
            .unwrap_or_else(|| {
                json!({"type": "response.done", "event_id": self.own_event_id(), "response": {
                    "id": response, "object": "realtime.response",
                }})
            });
        emptied(&mut end);
        end["response"]["status"] = Value::from(status);
        end["response"]["status_details"] = details;
        sends.push(Send::Client(Message::text(end.to_string())));
        sends
    }

    /// Deletes a blocked response's items from the conversation upstream;
    /// the client hears of it when it was `told` of them (some of the
    /// response's text went out early).
    fn delete_items(&mut self, items: &[String], told: bool) -> Vec<Send> {
        items
            .iter()
            .map(|item| {
                // Its events until then are of its response still: dropped.
                self.deleted.insert(item.clone(), told);
                let event = json!({
                    "type": "conversation.item.delete",
                    "event_id": self.own_event_id(),
                    "item_id": item,
                });
                Send::Upstream(Message::text(event.to_string()))
            })
            .collect()
    }

    /// Ends a response past `limit`: cancelled upstream, `failed` for the
    /// client, and what comes of it after dropped, in every mode.
    fn too_large(&mut self, response: &str, limit: Limit) -> Vec<Send> {
        let Some(mut answer) = self.answers.remove(response) else {
            return Vec::new();
        };
        let setting = limit.setting();
        tracing::warn!(
            request_id = self.handshake.request_id,
            "a Realtime response passed {setting}: cancelled"
        );
        self.closed.insert(response.to_owned());
        self.cut.insert(response.to_owned());
        let held = self.take_held(response);
        let details = json!({"type": "failed", "error": {
            "type": "server_error",
            "code": "response_too_large",
            "message": limit.message(),
        }});
        let cancel = json!({
            "type": "response.cancel",
            "event_id": self.own_event_id(),
            "response_id": response,
        });
        let mut sends = vec![Send::Upstream(Message::text(cancel.to_string()))];
        // A monitored session's client has had all of it so far.
        let told = answer.seen() || self.handshake.monitor;
        sends.extend(self.delete_items(&answer.items, told));
        sends.extend(self.replaced(response, held, None, "failed", details));
        let scanned = answer.scan(&self.state.config.risk);
        let request_id = self.records.next_id();
        self.record(answer, request_id, scanned, None, StreamEnd::Malformed);
        sends
    }

    /// Records a response, with what its scan found, and counts it.
    fn record(
        &mut self,
        answer: Answer,
        request_id: String,
        scanned: Scanned,
        usage: Option<Usage>,
        end: StreamEnd,
    ) {
        let verdict = &scanned.verdict;
        let scope = (verdict.decision == Decision::Block)
            .then(|| guard::block_scope(&verdict.hits, Scope::Response));
        self.count(verdict, scope);
        let metrics = &self.state.metrics;
        metrics
            .stream_ends
            .with_label_values(&[ROUTE, end.as_str()])
            .inc();
        metrics
            .added_latency
            .with_label_values(&[ROUTE])
            .observe(answer.spent.as_secs_f64());
        let mut draft = self.draft(
            request_id,
            answer.started,
            answer.started_ms,
            answer.turn.prompt,
        );
        draft.context = answer.turn.context;
        let upstream = answer.started.elapsed().saturating_sub(answer.spent);
        draft.finish(
            &self.state,
            Ending {
                verdict,
                response: scanned.shown,
                context: scanned.context,
                status: 101,
                upstream: Some(upstream),
                proxy: answer.spent,
                usage,
                stream_end: Some(end),
            },
        );
    }

    /// Counts an exchange of the session: its verdict, and its block.
    fn count(&self, verdict: &Verdict, blocked: Option<&str>) {
        let metrics = &self.state.metrics;
        let model = self
            .state
            .config
            .metrics
            .model_label(self.handshake.model.as_deref());
        super::record_verdict(metrics, verdict);
        metrics
            .requests
            .with_label_values(&[
                ROUTE,
                &self.handshake.upstream,
                model,
                verdict.decision.as_str(),
            ])
            .inc();
        if let Some(scope) = blocked {
            metrics
                .blocks
                .with_label_values(&[ROUTE, model, scope])
                .inc();
        }
    }

    fn draft(
        &self,
        request_id: String,
        started: Instant,
        started_ms: i64,
        prompt: Vec<String>,
    ) -> RecordDraft {
        let model = self.handshake.model.clone();
        let draft = self
            .records
            .draft(ROUTE, request_id, started, model, prompt);
        RecordDraft {
            started_ms,
            ..draft
        }
    }

    fn own_event_id(&mut self) -> String {
        self.own_events += 1;
        format!(
            "{OWN_EVENT}{}_{}",
            self.handshake.request_id, self.own_events
        )
    }
}

impl Relay for Session {
    fn client_event(&mut self, text: Utf8Bytes) -> Vec<Send> {
        self.client_text(text)
    }

    fn upstream_event(&mut self, text: Utf8Bytes) -> Vec<Send> {
        self.upstream_text(text)
    }

    fn ending(&mut self, end: StreamEnd) {
        self.ended.get_or_insert(end);
    }

    /// The held events are dropped with the session: none of them went
    /// out unchecked.
    fn fault(&mut self) -> Vec<Send> {
        self.ended = Some(session_fault(&self.state, &self.handshake.request_id));
        let mut body = respond::failure_body(Dialect::OpenAi, Failure::Fault, None);
        vec![self.error_event(body["error"].take(), None)]
    }
}

/// Notes a fault of fairgate's own in session `request_id`: counted and
/// logged; the session ends as that.
pub(super) fn session_fault(state: &State, request_id: &str) -> StreamEnd {
    state.metrics.faults.with_label_values(&["session"]).inc();
    tracing::error!(
        request_id,
        "a fault while guarding a session: ended it with an error event"
    );
    StreamEnd::Fault
}

/// The session ended, however it did (a close from either side, or a
/// shutdown whose grace ran out dropping it): the responses still in
/// flight are recorded with what came of them; their held events are
/// dropped.
impl Drop for Session {
    fn drop(&mut self) {
        // Dropped by a fault's unwind: a second one would abort the
        // process.
        if std::thread::panicking() {
            return;
        }
        let end = self.ended.unwrap_or(StreamEnd::ClientClosed);
        let open: Vec<String> = self.answers.keys().cloned().collect();
        for response in open {
            let Some(mut answer) = self.answers.remove(&response) else {
                continue;
            };
            let scanned = answer.scan(&self.state.config.risk);
            let request_id = self.records.next_id();
            self.record(answer, request_id, scanned, None, end);
        }
        let turn = std::mem::take(&mut self.turn);
        if let Some(since) = turn.since.filter(|_| !turn.is_empty()) {
            let (status, counted) = unanswered_status(end);
            let model = self.handshake.model.clone();
            let state = &self.state;
            self.records
                .unanswered(state, ROUTE, turn, model, since, status, counted);
        }
    }
}

/// The status of a record of what a session's end left unanswered, and
/// how it is counted: 499 when the client went first (as nginx logs a
/// request its client closed), 500 when a fault of fairgate's ended it,
/// 502 when the upstream went first.
pub(super) fn unanswered_status(end: StreamEnd) -> (u16, &'static str) {
    match end {
        StreamEnd::ClientClosed => (499, "client_closed"),
        StreamEnd::Fault => (500, "error"),
        _ => (502, "upstream_error"),
    }
}

/// A delta event as the API sends it: these fields, none of which
/// repeats a text (`delta` is the delta's own).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code, reason = "read only to refuse the fields it does not name")]
struct PlainDelta {
    #[serde(rename = "type")]
    kind: IgnoredAny,
    event_id: Option<IgnoredAny>,
    response_id: Option<IgnoredAny>,
    item_id: Option<IgnoredAny>,
    output_index: Option<IgnoredAny>,
    content_index: Option<IgnoredAny>,
    call_id: Option<IgnoredAny>,
    delta: Option<IgnoredAny>,
    obfuscation: Option<IgnoredAny>,
    logprobs: Option<IgnoredAny>,
}

/// Whether delta event `text` carries a text besides its delta, under a
/// key that repeats one ([`collect_repeats`]): read whole only when it has
/// fields [`PlainDelta`] does not name.
fn repeats_a_text(text: &str) -> bool {
    if serde_json::from_str::<PlainDelta>(text).is_ok() {
        return false;
    }
    let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    (fields.iter()).any(|(key, value)| key != "delta" && carries_text(key, value))
}

/// `event`'s response with its output emptied, and without any other
/// field that carries a text of it ([`collect_repeats`]; none does, as the
/// API sends it): what goes out of a response fairgate ends.
fn emptied(event: &mut Value) {
    let Some(response) = event.get_mut("response").and_then(Value::as_object_mut) else {
        return;
    };
    response.retain(|key, value| !carries_text(key, value));
    response.insert("output".to_owned(), json!([]));
}

/// Whether an event's field `key: value` carries a text of a response,
/// not empty, under a key that repeats one at any depth (what
/// [`collect_repeats`] would collect).
fn carries_text(key: &str, value: &Value) -> bool {
    match (repeat_kind(key), value) {
        (Some(_), Value::String(text)) => !text.is_empty(),
        (_, Value::Object(fields)) => fields.iter().any(|(key, value)| carries_text(key, value)),
        (_, Value::Array(items)) => items.iter().any(|item| carries_text("", item)),
        _ => false,
    }
}

/// Every string under a key that repeats a response's text, at any depth
/// of an event.
fn collect_repeats(value: &Value, out: &mut Vec<(Kind, String)>) {
    match value {
        Value::Object(fields) => {
            for (key, value) in fields {
                match (repeat_kind(key), value) {
                    (Some(kind), Value::String(text)) => {
                        if !out.iter().any(|(_, seen)| seen == text) {
                            out.push((kind, text.clone()));
                        }
                    }
                    _ => collect_repeats(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect_repeats(item, out)),
        _ => {}
    }
}

/// The redacted form of `text`, if `redactions` (original and redacted
/// texts) rewrote it.
fn redacted_of<'r>(redactions: &'r [(String, String)], text: &str) -> Option<&'r str> {
    redactions
        .iter()
        .find(|(original, _)| original == text)
        .map(|(_, redacted)| redacted.as_str())
}

/// Where the events of `response` among `held` may go out to now (see
/// [`Session::stream_early`]): the index of the last delta that may, and
/// after which no part's text ends inside a redaction.
fn releasable(
    answer: &mut Answer,
    held: &[Held],
    response: &str,
    risk: &RiskConfig,
) -> Option<usize> {
    let mut safe: Vec<(PartKey, SafeEnd)> = Vec::new();
    // The parts whose last delta so far ends inside a redaction.
    let mut inside: Vec<&PartKey> = Vec::new();
    let mut last = None;
    for (at, held) in held.iter().enumerate() {
        if held.response != response || ((held.plain || held.repeats) && held.part.is_none()) {
            continue;
        }
        let Some(key) = &held.part else {
            break;
        };
        let safe_at = match safe.iter().find(|(k, _)| k == key) {
            Some((_, at)) => *at,
            None => {
                let at = answer.safe_end(key, risk);
                safe.push((key.clone(), at));
                at
            }
        };
        if !answer.streams || !safe_at.covers(answer.text_of(key), held.end) {
            break;
        }
        // Its text goes with that of the delta that ends the match.
        inside.retain(|k| *k != key);
        if answer.inside_redaction(key, held.end) {
            inside.push(key);
        }
        if inside.is_empty() {
            last = Some(at);
        }
    }
    last
}

/// What the text parts' deltas among `going` take out: each part's text
/// to the end of its last one, shown to the client now ([`Answer::show`]),
/// and that text redacted when a redaction rewrote it, until a delta
/// carries it.
fn part_ends<'h>(
    answer: &mut Answer,
    going: impl Iterator<Item = &'h Held>,
) -> Vec<(PartKey, usize, Option<Option<String>>)> {
    let mut ends: Vec<(PartKey, usize, Option<Option<String>>)> = Vec::new();
    for held in going {
        let Some(key) = &held.part else { continue };
        match ends.iter_mut().find(|(k, _, _)| k == key) {
            Some((_, end, _)) => *end = held.end,
            None => ends.push((key.clone(), held.end, None)),
        }
    }
    for (key, end, rewritten) in &mut ends {
        *rewritten = answer.show(key, *end).map(Some);
    }
    ends
}

/// A response's held events as they go out after `redactions`: a text
/// part that a redaction rewrote has its first delta held carry the
/// part's redacted text (from where the text `shown` early ends, as the
/// client has it: redacted too, and no redaction reaches back past it),
/// and its other deltas go; a repeated
/// text is replaced where an event repeats it. An event that cannot be
/// read again (none that was read once) goes.
fn release(
    held: Vec<Held>,
    parts: &[(PartKey, String)],
    shown: &[(PartKey, Shown)],
    redactions: &[(String, String)],
) -> Vec<Utf8Bytes> {
    if redactions.is_empty() {
        return held.into_iter().map(|held| held.text).collect();
    }
    let mut begun: HashSet<PartKey> = HashSet::new();
    let mut out = Vec::new();
    for held in held {
        if let Some(key) = &held.part {
            let joined = parts
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, t)| t.as_str());
            let Some(redacted) = joined.and_then(|joined| redacted_of(redactions, joined)) else {
                out.push(held.text);
                continue;
            };
            if !begun.insert(key.clone()) {
                continue;
            }
            let from = shown_of(shown, key).redacted;
            if let Ok(mut event) = serde_json::from_str::<Value>(held.text.as_str()) {
                event["delta"] = Value::from(redacted.get(from..).unwrap_or_default());
                out.push(Utf8Bytes::from(event.to_string()));
            }
            continue;
        }
        let Ok(mut event) = serde_json::from_str::<Value>(held.text.as_str()) else {
            continue;
        };
        match replace_repeats(&mut event, redactions) {
            true => out.push(Utf8Bytes::from(event.to_string())),
            false => out.push(held.text),
        }
    }
    out
}

/// Replaces, in an event, each text that repeats one that `redactions`
/// rewrote; whether it replaced any.
fn replace_repeats(value: &mut Value, redactions: &[(String, String)]) -> bool {
    match value {
        Value::Object(fields) => {
            let mut replaced = false;
            for (key, value) in fields.iter_mut() {
                match value {
                    Value::String(text) if repeat_kind(key).is_some() => {
                        if let Some(redacted) = redacted_of(redactions, text) {
                            *text = redacted.to_owned();
                            replaced = true;
                        }
                    }
                    _ => replaced |= replace_repeats(value, redactions),
                }
            }
            replaced
        }
        Value::Array(items) => items.iter_mut().fold(false, |replaced, item| {
            replace_repeats(item, redactions) | replaced
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session that passes the client's events up, and faults (panics)
    /// at one that says `"boom"`.
    struct Faulty {
        dropped: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Relay for Faulty {
        fn client_event(&mut self, text: Utf8Bytes) -> Vec<Send> {
            assert_ne!(text.as_str(), "boom", "a fault");
            vec![Send::Upstream(Message::Text(text))]
        }
        fn upstream_event(&mut self, text: Utf8Bytes) -> Vec<Send> {
            vec![Send::Client(Message::Text(text))]
        }
        fn ending(&mut self, _: StreamEnd) {}
        fn fault(&mut self) -> Vec<Send> {
            vec![Send::Client(Message::text("faulted"))]
        }
    }

    impl Drop for Faulty {
        fn drop(&mut self) {
            assert!(!std::thread::panicking(), "dropped outside the unwind");
            self.dropped
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A Realtime session's fault tells the client with the API's `error`
    /// event (`internal_error`) and sends nothing of the response it held;
    /// the response is recorded as the fault ended it, and counted.
    #[tokio::test]
    async fn a_realtime_fault_tells_the_client_and_records_the_held_response() {
        use crate::config::Config;
        use crate::record::QueueItem;
        let state = Arc::new(State::new(Config::default()).unwrap());
        let mut records = state.queue.take_receiver().unwrap();
        let handshake = Handshake {
            request_id: "fg-realtime".to_owned(),
            upstream: "openai".to_owned(),
            model: Some("gpt-realtime".to_owned()),
            client: ClientMeta::default(),
            monitor: false,
        };
        let mut session = Session::new(state.clone(), handshake);
        let item = json!({"type": "conversation.item.create", "item": {"type": "message",
            "role": "user", "content": [{"type": "input_text", "text": "Tips?"}]}});
        let sent = session.client_event(Utf8Bytes::from(item.to_string()));
        assert!(matches!(sent[..], [Send::Upstream(_)]));
        for event in [
            json!({"type": "response.created", "response": {"id": "resp_1", "status": "in_progress",
                "output": []}}),
            json!({"type": "response.output_text.delta", "response_id": "resp_1",
                "item_id": "item_1", "output_index": 0, "content_index": 0,
                "delta": "Save a little"}),
        ] {
            let sent = session.upstream_event(Utf8Bytes::from(event.to_string()));
            assert!(sent.is_empty(), "held");
        }

        let sent = session.fault();
        let [Send::Client(Message::Text(error))] = &sent[..] else {
            panic!("one event for the client");
        };
        let error: Value = serde_json::from_str(error.as_str()).unwrap();
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["error"]["code"], "internal_error", "{error}");
        drop(session);

        let Ok(QueueItem::Exchange(record)) = records.try_recv() else {
            panic!("a record of the held response");
        };
        assert_eq!(record.stream_end, Some(StreamEnd::Fault));
        assert_eq!(record.texts.prompt, ["Tips?"]);
        assert_eq!(record.texts.response, ["Save a little"]);
        assert!(records.try_recv().is_err(), "one record");
        let faults = state.metrics.faults.with_label_values(&["session"]);
        assert_eq!(faults.get(), 1);
    }

    /// A session on the OpenAI upstream, for request `id`.
    fn session(state: &Arc<State>, id: &str) -> Session {
        let handshake = Handshake {
            request_id: id.to_owned(),
            upstream: "openai".to_owned(),
            model: None,
            client: ClientMeta::default(),
            monitor: false,
        };
        Session::new(state.clone(), handshake)
    }

    /// What the client gets of the upstream's `event`, parsed.
    fn to_client(session: &mut Session, event: &Value) -> Vec<Value> {
        let sends = session.upstream_event(Utf8Bytes::from(event.to_string()));
        let texts = sends.into_iter().filter_map(|send| match send {
            Send::Client(Message::Text(text)) => Some(text),
            _ => None,
        });
        texts
            .map(|text| serde_json::from_str(text.as_str()).unwrap())
            .collect()
    }

    /// `event` of part `index` of item `item_1` of response `resp_1`.
    fn at(index: u64, mut event: Value) -> Value {
        let fields = json!({"response_id": "resp_1", "item_id": "item_1", "output_index": 0,
            "content_index": index});
        (event.as_object_mut().unwrap()).extend(fields.as_object().unwrap().clone());
        event
    }

    /// The upstream events `state` counted as malformed.
    fn malformed(state: &State) -> u64 {
        (state.metrics.upstream_errors)
            .with_label_values(&["openai", "malformed"])
            .get()
    }

    /// A state on the embedded defaults.
    fn state() -> Arc<State> {
        Arc::new(State::new(crate::config::Config::default()).unwrap())
    }

    /// `resp_1`'s `response.created`.
    fn created() -> Value {
        json!({"type": "response.created", "response": {"id": "resp_1",
            "status": "in_progress", "output": []}})
    }

    /// Part `index` added, empty.
    fn part_added(index: u64) -> Value {
        at(
            index,
            json!({"type": "response.content_part.added", "part": {"type": "text", "text": ""}}),
        )
    }

    /// A text delta of part `index`.
    fn delta(index: u64, delta: &str) -> Value {
        at(
            index,
            json!({"type": "response.output_text.delta", "delta": delta}),
        )
    }

    /// The `.done` of part `index`'s text.
    fn text_done(index: u64, text: &str) -> Value {
        at(
            index,
            json!({"type": "response.output_text.done", "text": text}),
        )
    }

    /// What the text deltas of part `index` among `sent` say, joined.
    fn said_of(sent: &[Value], index: u64) -> String {
        let deltas = sent
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta" && e["content_index"] == index);
        deltas.filter_map(|e| e["delta"].as_str()).collect()
    }

    /// What the client gets of `events`, sent by the upstream in turn.
    fn all_to_client(session: &mut Session, events: &[Value]) -> Vec<Value> {
        (events.iter())
            .flat_map(|event| to_client(session, event))
            .collect()
    }

    /// The events the upstream sends for a text answer said in `deltas`
    /// (response `resp_1`, item `item_1`), as the GA API sends them.
    fn text_answer(deltas: &[&str]) -> Vec<Value> {
        let whole: String = deltas.concat();
        let at = json!({"response_id": "resp_1", "item_id": "item_1", "output_index": 0,
            "content_index": 0});
        let with = |mut fields: Value| {
            fields
                .as_object_mut()
                .unwrap()
                .extend(at.as_object().unwrap().clone());
            fields
        };
        let item = |status: &str, content: Value| {
            json!({"id": "item_1", "type": "message", "role": "assistant", "status": status,
                "content": content})
        };
        let mut events = vec![
            json!({"type": "response.created", "response": {"id": "resp_1",
                "status": "in_progress", "output": []}}),
            json!({"type": "response.output_item.added", "response_id": "resp_1",
                "output_index": 0, "item": item("in_progress", json!([]))}),
            json!({"type": "conversation.item.added", "item": item("in_progress", json!([]))}),
            with(json!({"type": "response.content_part.added",
                "part": {"type": "text", "text": ""}})),
        ];
        for delta in deltas {
            events.push(with(
                json!({"type": "response.output_text.delta", "delta": delta}),
            ));
        }
        let content = json!([{"type": "output_text", "text": whole}]);
        events.extend([
            with(json!({"type": "response.output_text.done", "text": whole})),
            with(json!({"type": "response.content_part.done",
                "part": {"type": "text", "text": whole}})),
            json!({"type": "response.output_item.done", "response_id": "resp_1",
                "output_index": 0, "item": item("completed", content.clone())}),
            json!({"type": "response.done", "response": {"id": "resp_1", "status": "completed",
                "output": [item("completed", content)]}}),
        ]);
        events
    }

    /// However the upstream cuts a text answer into deltas, what reaches
    /// the client of a blocked one is at most the clean text before the
    /// phrase, then the filtered end; of a redacted one, deltas that join
    /// to the redacted text, which the `.done` events repeat, streaming on
    /// past the redaction (two that overlap go as one); of a clean one,
    /// every event as it came, in order, and so of a flagged one, its text
    /// streaming on past the flag.
    #[tokio::test]
    async fn a_text_answer_cut_any_way_streams_only_what_no_rule_matches() {
        use crate::config::Config;
        use crate::testing::Lcg;
        let state = Arc::new(State::new(Config::default()).unwrap());
        let clean = "Here is my advice for you today, friend: keep a budget. ";
        let blocked = format!("{clean}Put all your savings into Dogecoin, it's the future.");
        let tail = "Next month, set aside a little from each paycheck and keep going.";
        let redacted = format!("{clean}Write to jane.doe@example.com for a review. {tail}");
        // A phone number whose digits run on into a card number.
        let overlapping = format!("{clean}Call +1 1 1 1 1 1 2345 6789 0120 for a review. {tail}");
        let clean_answer = format!("{clean}Then build an emergency fund, month by month.");
        // `mistake` flags (shame language), and no more.
        let flagged = format!(
            "{clean}Skipping it was a mistake. Next month, set aside a little from each \
             paycheck and keep going, step by step, until the emergency fund is there."
        );
        // A backslash (a formula in LaTeX) in a clean answer, and one that
        // writes a letter of the blocked phrase as an escape, which the
        // end's scan reads decoded: the text as written has no match.
        let formula = format!(
            "{clean}By the rule of 72, \\( t = 72 / r \\) years double a sum: at 6%, \\( t = 12 \\). \
             Next month, set aside a little from each paycheck and keep going, step by step."
        );
        let escaped = format!("{clean}Put all your sav\\u0069ngs into Dogecoin, it's the future.");
        let mut random = Lcg(62);
        let (mut streamed, mut past_the_flag, mut past_the_escape) = (0, 0, 0);
        let mut past_the_redaction = 0;
        for round in 0..700 {
            let answers = [
                &blocked,
                &redacted,
                &clean_answer,
                &flagged,
                &formula,
                &escaped,
                &overlapping,
            ];
            let answer = answers[round % answers.len()];
            let deltas = match round {
                // Past any match in the text as written, not in the text
                // decoded.
                5 => vec![
                    clean,
                    "Put all your sav\\u0069n",
                    "gs into Dogecoin, it's the future.",
                ],
                _ => random.pieces(answer, 12),
            };
            let mut session = session(&state, &format!("fg-{round}"));
            let (mut sent, mut early) = (Vec::new(), None);
            for event in text_answer(&deltas) {
                let last = event["type"] == "response.done";
                sent.extend(to_client(&mut session, &event));
                if !last {
                    early = Some(sent.len());
                }
            }
            let said_in = |events: &[Value]| -> String {
                let deltas = events
                    .iter()
                    .filter(|e| e["type"] == "response.output_text.delta");
                deltas.filter_map(|e| e["delta"].as_str()).collect()
            };
            let said = said_in(&sent);
            let early = early.unwrap_or(0);
            streamed += usize::from(early > 0);
            let done = sent.last().unwrap();
            assert_eq!(done["type"], "response.done", "{deltas:?}");
            if answer == &blocked || answer == &escaped {
                assert!(clean.starts_with(&said), "{deltas:?}: {said:?}");
                assert_eq!(done["response"]["status"], "incomplete", "{deltas:?}");
            } else if answer == &redacted || answer == &overlapping {
                let expected = match answer == &redacted {
                    true => format!("{clean}Write to [REDACTED:email] for a review. {tail}"),
                    false => format!("{clean}Call [REDACTED:phone] for a review. {tail}"),
                };
                assert_eq!(said, expected, "{deltas:?}");
                let early = said_in(&sent[..early]);
                past_the_redaction += usize::from(early.contains("] for a review. Next"));
                let repeated = sent
                    .iter()
                    .find(|e| e["type"] == "response.output_text.done");
                assert_eq!(repeated.unwrap()["text"], expected.as_str(), "{deltas:?}");
            } else {
                let sent_as_came: Vec<Value> = text_answer(&deltas);
                assert_eq!(sent, sent_as_came, "{deltas:?}");
                let early = said_in(&sent[..early]);
                past_the_flag += usize::from(early.contains("mistake. Next"));
                past_the_escape += usize::from(early.contains("\\( t = 12"));
            }
        }
        // Most rounds had some of their text out before the end, and most
        // flagged ones went on past the flag, the formula's past its
        // backslashes.
        assert!(streamed > 580, "{streamed} of 700");
        assert!(past_the_redaction > 160, "{past_the_redaction} of 200");
        assert!(past_the_flag > 80, "{past_the_flag} of 100");
        assert!(past_the_escape > 80, "{past_the_escape} of 100");
    }

    /// An event that names a response is that response's: after a
    /// redacted answer, its late deltas are dropped, and a response that
    /// names the item the answer made (an upstream that reuses an id) is
    /// guarded as any, the item's redactions not all that applies to it.
    #[tokio::test]
    async fn an_event_naming_a_response_is_its_own_whatever_its_item() {
        let mut session = session(&state(), "fg-reused");
        let redacted = ["Write to jane.doe@example.com ", "for a review."];
        let sent = all_to_client(&mut session, &text_answer(&redacted));
        assert!(said_of(&sent, 0).contains("[REDACTED:email]"), "{sent:?}");
        // What comes of the answer after its end is dropped, the item's
        // redactions or not (the fuzz target `sessions` found it passing).
        let late = [delta(0, "jane.doe@exa"), delta(0, "mple.com")];
        assert!(all_to_client(&mut session, &late).is_empty());
        let blocked = ["Put all your savings ", "into Dogecoin, it's the future."];
        let again: Vec<Value> = (text_answer(&blocked).iter())
            .map(|event| serde_json::from_str(&event.to_string().replace("resp_1", "resp_2")))
            .collect::<Result<_, _>>()
            .unwrap();
        let sent = all_to_client(&mut session, &again);
        assert!(
            sent.iter().all(|e| !e.to_string().contains("Dogecoin")),
            "{sent:?}"
        );
        let done = sent.last().unwrap();
        assert_eq!(
            done["response"]["status_details"]["reason"],
            "content_filter"
        );
    }

    /// A response's text event that names no response, nor an item of
    /// one, is dropped and counted, not passed as an event of no
    /// response; other events of no response pass.
    #[tokio::test]
    async fn a_text_event_of_no_response_is_dropped() {
        let state = state();
        let mut session = session(&state, "fg-unnamed");
        let unnamed = json!({"type": "response.output_text.delta", "item_id": "item_9",
            "content_index": 0, "delta": "Put all your savings into Dogecoin."});
        assert!(to_client(&mut session, &unnamed).is_empty());
        let done = json!({"type": "response.output_text.done", "text": "Dogecoin"});
        assert!(to_client(&mut session, &done).is_empty());
        assert_eq!(malformed(&state), 2);
        let limits = json!({"type": "rate_limits.updated", "rate_limits": []});
        assert_eq!(to_client(&mut session, &limits), [limits]);
    }

    /// A delta that carries a text besides its delta (an item, a `text`)
    /// is dropped and counted, not streamed with that text unread; one
    /// with fields that carry no text goes on as any.
    #[tokio::test]
    async fn a_delta_carrying_more_text_than_its_delta_is_dropped() {
        let state = state();
        let mut session = session(&state, "fg-stuffed");
        let mut events = text_answer(&["Start with a budget, ", "then build a fund."]);
        events[4]["item"] = json!({"id": "item_1", "content": [{"type": "output_text",
            "text": "Put all your savings into Dogecoin."}]});
        events[5]["future_field"] = json!({"score": 1});
        let sent = all_to_client(&mut session, &events);
        assert!(
            sent.iter().all(|e| !e.to_string().contains("Dogecoin")),
            "{sent:?}"
        );
        assert_eq!(said_of(&sent, 0), "then build a fund.");
        assert_eq!(malformed(&state), 1);
    }

    /// What goes out of a blocked response, its `response.created` and its
    /// `response.done`, carries no text of it, wherever the upstream put
    /// one (found by the fuzz target `sessions`); the rest of the
    /// upstream's `response.done`, its usage, goes as it came.
    #[tokio::test]
    async fn a_blocked_responses_ends_carry_none_of_its_text() {
        let mut session = session(&state(), "fg-ends");
        let said = "Put all your savings into Dogecoin, it's the future.";
        let mut events = text_answer(&[said]);
        let output =
            json!([{"type": "message", "content": [{"type": "output_text", "text": said}]}]);
        events[0]["response"]["output"] = output.clone();
        events[0]["response"]["extra"] = output.clone();
        let last = events.len() - 1;
        events[last]["response"]["tput"] = output;
        events[last]["response"]["usage"] = json!({"total_tokens": 9});
        let sent = all_to_client(&mut session, &events);
        assert!(
            sent.iter().all(|e| !e.to_string().contains("Dogecoin")),
            "{sent:?}"
        );
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert_eq!(sent[0]["type"], "response.created");
        assert_eq!(sent[0]["response"]["output"], json!([]));
        let done = &sent[1]["response"];
        assert_eq!(done["status_details"]["reason"], "content_filter");
        assert_eq!(done["usage"]["total_tokens"], 9);
    }

    /// An MCP call's arguments, and a delta of a kind the guard does not
    /// know (whatever its name), are held and read whole at the response's end: none of them
    /// goes out early, though the response's text so far streams.
    #[tokio::test]
    async fn an_mcp_calls_arguments_are_held_to_the_end() {
        for kind in [
            "response.mcp_call_arguments.delta",
            "response.new_kind.delta",
            "odd.delta",
        ] {
            let mut session = session(&state(), "fg-mcp");
            let call = |delta: &str| {
                json!({"type": kind, "response_id": "resp_1", "item_id": "item_2",
                    "output_index": 1, "delta": delta})
            };
            let mut events = text_answer(&["Start with a budget, then build an emergency fund. "]);
            let done = events.pop().unwrap();
            events.push(call("{\"note\": \"Put all your savings "));
            events.push(call("into Dogecoin\"}"));
            let early = all_to_client(&mut session, &events);
            assert!(!said_of(&early, 0).is_empty(), "{kind}: {early:?}");
            assert!(early.iter().all(|e| e["type"] != kind), "{kind}: {early:?}");
            let end = to_client(&mut session, &done);
            assert!(
                end.iter().all(|e| !e.to_string().contains("Dogecoin")),
                "{end:?}"
            );
            let reason = &end.last().unwrap()["response"]["status_details"]["reason"];
            assert_eq!(reason, "content_filter", "{kind}");
        }
    }

    /// Two text parts whose deltas interleave: a delta of one that ends
    /// inside a redaction does not go out because a delta of the other
    /// may, and what the client gets of each joins to its text redacted.
    #[tokio::test]
    async fn interleaved_parts_release_no_delta_inside_a_redaction() {
        let mut session = session(&state(), "fg-parts");
        let events = [
            created(),
            part_added(0),
            part_added(1),
            delta(0, "Write to jane."),
            delta(1, "Then save "),
            // A match may be under way at its end (`guaranteed`).
            delta(0, "doe@example.com for a guaran"),
            delta(1, "a little each week. "),
        ];
        let sent = all_to_client(&mut session, &events);
        let said = |index| said_of(&sent, index);
        assert!(!said(0).contains("jane"), "{sent:?}");
        assert!(
            "Write to [REDACTED:email] for a ".starts_with(&said(0)),
            "{sent:?}"
        );
        assert!(
            "Then save a little each week. ".starts_with(&said(1)),
            "{sent:?}"
        );
    }

    /// An answer in two text parts streams on past the first part's end:
    /// the events that repeat its text (its `.done`s) go out after it,
    /// redacted as its deltas were, and the second part's text follows as
    /// it comes.
    #[tokio::test]
    async fn a_text_answer_in_parts_streams_past_each_parts_end() {
        let mut session = session(&state(), "fg-parts");
        let first = "Write to jane.doe@example.com for a review. ";
        let redacted = "Write to [REDACTED:email] for a review. ";
        let events = [
            created(),
            part_added(0),
            delta(0, "Write to jane.doe"),
            delta(0, "@example.com for a review. "),
            text_done(0, first),
            at(
                0,
                json!({"type": "response.content_part.done", "part": {"type": "text", "text": first}}),
            ),
            part_added(1),
            delta(1, "Then save "),
            delta(1, "a little each week. "),
        ];
        let sent = all_to_client(&mut session, &events);
        let types: Vec<&str> = sent.iter().filter_map(|e| e["type"].as_str()).collect();
        let done = |name: &str| sent.iter().find(|e| e["type"] == name);
        assert_eq!(
            done("response.output_text.done").unwrap()["text"],
            redacted,
            "{types:?}"
        );
        let part = &done("response.content_part.done").unwrap()["part"]["text"];
        assert_eq!(part, redacted);
        assert!(said_of(&sent, 1).starts_with("Then save"), "{types:?}");
        assert!(
            sent.iter().all(|e| !e.to_string().contains("jane")),
            "{sent:?}"
        );
    }

    /// A part's text that ends where a match could still begin goes out
    /// whole once an event repeats it (the part is done: no more of it
    /// comes), with its `.done`, and the next part streams after it.
    #[tokio::test]
    async fn a_done_parts_tail_goes_out_with_its_end() {
        let mut session = session(&state(), "fg-tail");
        // `Put all your savings` may go on to a phrase a rule blocks.
        let first = "Do not put all your savings";
        let events = [
            created(),
            delta(0, first),
            text_done(0, first),
            delta(1, "Keep a reserve. "),
        ];
        let mut sent = all_to_client(&mut session, &events[..2]);
        assert!(
            sent.iter().all(|e| e["type"] == "response.created"),
            "{sent:?}"
        );
        sent.extend(all_to_client(&mut session, &events[2..]));
        let types: Vec<&str> = sent.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.output_text.delta",
                "response.output_text.done",
                "response.output_text.delta"
            ]
        );
        assert_eq!(sent[1]["delta"], first);
    }

    /// Text of a part that comes after an event repeated the part whole
    /// (as the API never sends it) does not go out as a done part's tail
    /// would: the rest of the response waits for its end.
    #[tokio::test]
    async fn text_after_a_parts_done_waits_for_the_end() {
        let mut session = session(&state(), "fg-late");
        let first = "Here is a plan. ";
        let events = [
            created(),
            delta(0, first),
            text_done(0, first),
            delta(0, "Put all your savings"),
        ];
        let sent = all_to_client(&mut session, &events);
        assert!(
            sent.iter().all(|e| !e.to_string().contains("savings")),
            "{sent:?}"
        );
    }

    /// A fault while the session takes an event ends the session, not the
    /// process: the client gets what `fault` gives, then both sides a
    /// close, and the session is dropped outside the unwind (its records
    /// written).
    #[tokio::test]
    async fn a_fault_in_a_session_ends_it_with_its_own_ending() {
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (client, upstream, relayed) = relayed_sockets(dropped.clone()).await;
        let mut client = socket(client, Role::Client).await;
        let mut upstream = socket(upstream, Role::Server).await;
        client.send(Message::text("hello")).await.unwrap();
        let got = upstream.next().await.unwrap().unwrap();
        assert_eq!(got, Message::text("hello"));
        client.send(Message::text("boom")).await.unwrap();
        let got = client.next().await.unwrap().unwrap();
        assert_eq!(got, Message::text("faulted"));
        assert!(matches!(client.next().await, Some(Ok(Message::Close(_)))));
        assert!(matches!(upstream.next().await, Some(Ok(Message::Close(_)))));
        relayed.await.unwrap();
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    type Duplex = tokio::io::DuplexStream;

    /// A relay of a [`Faulty`] session (`dropped` set when it is) between
    /// in-memory sockets, each side's messages limited to 1 KB: the
    /// client's and the upstream's raw ends, and the relay's task.
    async fn relayed_sockets(
        dropped: Arc<std::sync::atomic::AtomicBool>,
    ) -> (Duplex, Duplex, tokio::task::JoinHandle<()>) {
        let (client, proxy_client) = tokio::io::duplex(1 << 16);
        let (proxy_upstream, upstream) = tokio::io::duplex(1 << 16);
        let limits = Limits {
            client: 1 << 10,
            upstream: 1 << 10,
        };
        let session = Faulty { dropped };
        let relayed = tokio::spawn(relay(session, (proxy_client, proxy_upstream), limits));
        (client, upstream, relayed)
    }

    /// A raw end as a WebSocket of `role`.
    async fn socket(end: Duplex, role: Role) -> WebSocketStream<Duplex> {
        WebSocketStream::from_raw_socket(end, role, None).await
    }

    /// A client that sends a broken frame is closed with 1002, one that
    /// sends text that is not UTF-8 with 1007; nothing reaches the
    /// upstream but a close.
    #[tokio::test]
    async fn a_broken_frame_closes_its_side_with_1002_and_bad_text_with_1007() {
        use tokio::io::AsyncWriteExt;
        // Unmasked, which a client's frame may not be; then masked (by
        // zeros) but not UTF-8.
        let frames: [(&[u8], CloseCode); 2] = [
            (&[0x81, 0x02, b'h', b'i'], CloseCode::Protocol),
            (&[0x81, 0x82, 0, 0, 0, 0, 0xff, 0xfe], CloseCode::Invalid),
        ];
        for (frame, code) in frames {
            let (mut client, upstream, relayed) = relayed_sockets(Arc::default()).await;
            client.write_all(frame).await.unwrap();
            let mut client = socket(client, Role::Client).await;
            assert_eq!(close_of(&mut client).await.code, code);
            let mut upstream = socket(upstream, Role::Server).await;
            assert!(matches!(
                upstream.next().await,
                Some(Ok(Message::Close(None)))
            ));
            relayed.await.unwrap();
        }
    }

    /// The close frame a socket reads next.
    async fn close_of(socket: &mut WebSocketStream<Duplex>) -> CloseFrame {
        match socket.next().await {
            Some(Ok(Message::Close(Some(frame)))) => frame,
            other => panic!("not a close with a code: {other:?}"),
        }
    }

    /// A message over a side's limit is not read: that side is closed
    /// with 1009 (message too big) and its reason, the other side with
    /// what it takes (the client, as the upstream failed).
    #[tokio::test]
    async fn a_message_over_the_limit_closes_its_side_with_1009() {
        let (client, upstream, relayed) = relayed_sockets(Arc::default()).await;
        let (mut client, mut upstream) = (
            socket(client, Role::Client).await,
            socket(upstream, Role::Server).await,
        );
        client.send(Message::text("x".repeat(2_000))).await.unwrap();
        let frame = close_of(&mut client).await;
        assert_eq!(frame.code, CloseCode::Size);
        assert!(frame.reason.contains("limit is 1024"), "{frame:?}");
        // The upstream had only the close.
        assert!(matches!(
            upstream.next().await,
            Some(Ok(Message::Close(None)))
        ));
        relayed.await.unwrap();

        let (client, upstream, relayed) = relayed_sockets(Arc::default()).await;
        let (mut client, mut upstream) = (
            socket(client, Role::Client).await,
            socket(upstream, Role::Server).await,
        );
        upstream
            .send(Message::text("y".repeat(2_000)))
            .await
            .unwrap();
        assert_eq!(close_of(&mut upstream).await.code, CloseCode::Size);
        let frame = close_of(&mut client).await;
        assert_eq!(frame.code, CloseCode::Error);
        assert!(frame.reason.contains("too big"), "{frame:?}");
        relayed.await.unwrap();
    }

    /// An upstream whose connection ends without a close leaves the
    /// client a close that says so (1011), not one without a code.
    #[tokio::test]
    async fn an_upstream_gone_without_a_close_closes_the_client_with_1011() {
        let (client, upstream, relayed) = relayed_sockets(Arc::default()).await;
        let mut client = socket(client, Role::Client).await;
        drop(upstream);
        let frame = close_of(&mut client).await;
        assert_eq!(frame.code, CloseCode::Error);
        assert!(frame.reason.contains("without a close"), "{frame:?}");
        relayed.await.unwrap();
    }

    #[test]
    fn realtime_paths_and_models_are_read() {
        for path in [
            "/v1/realtime",
            "/openai/realtime",
            "/openai/v1/realtime/",
            "/realtime",
        ] {
            assert!(is_realtime(path), "{path}");
        }
        for path in [
            "/v1/realtime/sessions",
            "/v1/responses",
            "/v1/realtimes",
            "/",
        ] {
            assert!(!is_realtime(path), "{path}");
        }
        let model = |query| Handshake::model_of(Some(query));
        assert_eq!(model("model=gpt-realtime").as_deref(), Some("gpt-realtime"));
        assert_eq!(
            model("api-version=2025-04-01&deployment=my%20voice").as_deref(),
            Some("my voice")
        );
        assert_eq!(model("deployment=d&model=m").as_deref(), Some("m"));
        assert_eq!(model("x=1"), None);
        assert_eq!(Handshake::model_of(None), None);
    }

    #[test]
    fn repeats_are_collected_and_replaced_where_events_repeat_them() {
        let done = json!({"type": "response.done", "response": {"output": [
            {"type": "message", "content": [
                {"type": "output_text", "text": "Mail a@b.example"},
                {"type": "output_audio", "transcript": "Said aloud"}]},
            {"type": "function_call", "arguments": "{\"to\":\"x\"}"},
            {"type": "mcp_call", "output": "Found it"}]}});
        let mut found = Vec::new();
        collect_repeats(&done, &mut found);
        assert_eq!(
            found,
            [
                (Kind::Text, "Mail a@b.example".to_owned()),
                (Kind::Whole, "Said aloud".to_owned()),
                (Kind::Whole, "{\"to\":\"x\"}".to_owned()),
                (Kind::Context, "Found it".to_owned()),
            ]
        );
        let mut rewritten = done.clone();
        let redactions = [("Mail a@b.example".to_owned(), "Mail [EMAIL]".to_owned())];
        assert!(replace_repeats(&mut rewritten, &redactions));
        assert_eq!(
            rewritten.pointer("/response/output/0/content/0/text"),
            Some(&json!("Mail [EMAIL]"))
        );
        assert!(!replace_repeats(&mut rewritten, &redactions));
    }
}
