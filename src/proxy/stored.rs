//! `GET`s of answers the API stored (OpenAI's stored responses, chat
//! completions and conversation items), and the `POST`s answered with
//! one (a response's cancel, a chat completion's metadata update):
//! relayed as the answers were when they were made, after the same
//! response scan. Without it a client
//! could fetch, by its id, a response whose creation fairgate refused.
//! And the items a client adds to a stored conversation ([`add_items`]),
//! read as a response's input: a later response reads them without their
//! being sent again; and a conversation given to be compacted
//! ([`compact`]), which a later response reads as a summary no one else
//! can; and a request given to count its tokens ([`count_tokens`]),
//! which carries every text of the request it counts to the API.
//!
//! A stored response or chat completion that a rule blocks comes back as
//! the refusal its creation got (or the 400 error, with `on_block:
//! error`); a list or a conversation item, which has no refusal shape,
//! gets the 400 error. `redact` hits are redacted in place. A stored
//! response fetched as a stream (`?stream=true`) goes through the stream
//! guard; one resumed after the event the client got last
//! (`starting_after`) is read from its start and sent from there
//! ([`take_resume`]). A fetch leaves no record: it makes no exchange. The
//! requests read here leave one with no response
//! ([`batch::send_scanned`]).

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response, Uri, header};
use hyper::body::Incoming;

use super::batch;
use super::respond;
use super::{ProxyBody, Relayed, State, upstream};
use crate::config::OnBlock;
use crate::exchange::{self, Dialect, Endpoint, ResponseBody, Stored};
use crate::guard::stream::{StreamOutcome, StreamSetup, guard_body};
use crate::guard::{self, block_message, rule_ids};
use crate::json::ReadError;
use crate::record::unread_answer;
use crate::risk::{self, Decision, Verdict};
use crate::rules::Scope;
use crate::telemetry::Blocked;

/// The route label of these fetches in the metrics.
const ROUTE: &str = "stored";

/// The route label of items added to a conversation.
const ITEMS: &str = unread_answer::CONVERSATION_ITEMS;

/// The route label of conversations given to be compacted.
const COMPACTION: &str = unread_answer::COMPACTION;

/// The route label of requests whose tokens are counted.
const TOKEN_COUNT: &str = unread_answer::TOKEN_COUNT;

/// `POST /v1/conversations` and `POST /v1/conversations/{id}/items`: the
/// items added to a stored conversation, which a later response reads as
/// its input (`"conversation": "conv_..."`) without sending them again,
/// are read as the Responses API's input is. One that a rule blocks
/// refuses the request with the 400 a blocked prompt gets, naming
/// `items`; `redact` hits are redacted in place. There is no exchange
/// record: nothing answers them.
pub(super) async fn add_items(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let read: batch::ReadTexts =
        |body| exchange::read_conversation_items(body).map(|items| (items, "items".into()));
    batch::send_scanned(state, (req, Dialect::OpenAi), ITEMS, read, request_id).await
}

/// `POST /v1/responses/compact`: a conversation given to a model to
/// summarize into an item only the API can read, which a later response
/// reads in the conversation's place. Its `instructions` and `input` are
/// read as a response's request's are, before it goes up: one that a
/// rule blocks refuses the request with the 400 a blocked prompt gets,
/// naming them; `redact` hits are redacted in place. The answer (the
/// user's messages, as given, and the encrypted summary) passes as it
/// comes; the record has no response: nothing the client reads answers
/// it.
pub(super) async fn compact(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let read: batch::ReadTexts = |body| {
        let (request, names) = exchange::read_compaction(body)?;
        Ok((request, batch::place(&names)))
    };
    batch::send_scanned(state, (req, Dialect::OpenAi), COMPACTION, read, request_id).await
}

/// `POST /v1/messages/count_tokens` and `POST /v1/responses/input_tokens`:
/// a request given to the API to count its tokens, not to answer it. An
/// app counts what it is about to send, so without this every text a rule
/// redacts would reach the API's servers anyway, unredacted. The body is
/// read as `endpoint`'s request is, before it goes up: one that a rule
/// blocks gets the 400 that request would get, in its dialect; `redact`
/// hits are redacted in place, so the count is of the text the request
/// will carry. The answer (a number) passes as it comes; the record has
/// no response: no model answers it.
pub(super) async fn count_tokens(
    state: &Arc<State>,
    req: Request<Incoming>,
    endpoint: Endpoint,
    request_id: &str,
) -> Response<ProxyBody> {
    // The two endpoints whose tokens are counted (`exchange::counts_tokens`).
    let read: batch::ReadTexts = match endpoint {
        Endpoint::Messages => |body| read_counted(Endpoint::Messages, body),
        _ => |body| read_counted(Endpoint::Responses, body),
    };
    let counted = (req, endpoint.dialect());
    batch::send_scanned(state, counted, TOKEN_COUNT, read, request_id).await
}

/// A token count's body read as `endpoint`'s request, named as a whole.
fn read_counted(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(exchange::BatchRequest<'_>, String), ReadError> {
    exchange::read_token_count(endpoint, body).map(|request| (request, String::new()))
}

/// Fetches a stored answer and relays it as the guard allows.
pub(super) async fn fetch(
    state: &Arc<State>,
    mut req: Request<Incoming>,
    stored: Stored,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = Dialect::OpenAi;
    let resume_after = match stored {
        Stored::Response => take_resume(req.uri_mut()),
        _ => None,
    };
    let Relayed {
        upstream,
        stream_mode,
        response,
        timeout,
    } = match super::relay(state, req, dialect, request_id, true).await {
        Ok(relayed) => relayed,
        Err(out) => return out,
    };
    let stream_mode = stream_mode.unwrap_or(state.config.guard.stream_mode);
    if !response.status().is_success() {
        return super::stream_back(response, timeout, request_id, None);
    }
    let rules = state.rules.snapshot();
    let (head, body) = response.into_parts();
    let broken = |kind| super::upstream_broken(state, &upstream, kind, dialect, request_id);
    // Streamed or whole.
    if super::is_encoded(&head.headers) {
        return broken("encoded");
    }
    if head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
    {
        let setup = StreamSetup {
            endpoint: Endpoint::Responses,
            mode: stream_mode,
            rules,
            risk: state.config.risk.clone(),
            request_hits: Vec::new(),
            relevance: Vec::new(),
            prefill: String::new(),
            started: Instant::now(),
            include_usage: false,
            resume_after,
            max_bytes: state.config.guard.max_stream_bytes,
        };
        let (counted, request_id_kept) = (state.clone(), request_id.to_owned());
        let done = move |outcome: StreamOutcome| {
            let scanned_in = ScannedIn {
                route: ROUTE,
                upstream: &upstream,
                model: None,
                request_id: &request_id_kept,
                scope: Scope::Response,
                status: None,
                logged: true,
            };
            count(&counted, scanned_in, &outcome.verdict)
        };
        let body = guard_body(setup, upstream::body_stream(body, timeout), done);
        return super::guarded_response(head.status, head.headers, body, request_id, None);
    }
    let limit = state.config.guard.max_response_bytes;
    let body = match upstream::read_body(body, limit, timeout).await {
        Ok(body) => body,
        Err(error) => {
            tracing::warn!(%error, "stored answer could not be read");
            return broken("body");
        }
    };
    let Some(body) = super::as_sdks_read(body) else {
        tracing::warn!("stored answer is in UTF-16 or UTF-32, which the guard does not read");
        return broken("encoded");
    };
    let (scanned, json) = match ResponseBody::read_stored(stored, &body) {
        Ok(read) => (guard::scan_response(&rules, &body, &read.texts, None), true),
        Err(error @ ReadError::Ambiguous(_)) => {
            tracing::warn!(%error, "stored answer holds a key twice");
            return broken("ambiguous");
        }
        Err(_) => (guard::scan_plain_response(&rules, &body), false),
    };
    let verdict = risk::assess(&state.config.risk, scanned.hits, &[]);
    let refuses = json && state.config.guard.on_block == OnBlock::Refusal;
    let refused_as = match stored {
        Stored::Response => Some(Endpoint::Responses),
        Stored::ChatCompletion => Some(Endpoint::ChatCompletions),
        _ => None,
    }
    .filter(|_| refuses);
    let scanned_in = ScannedIn {
        route: ROUTE,
        upstream: &upstream,
        model: None,
        request_id,
        scope: Scope::Response,
        status: Some(if refused_as.is_some() { 200 } else { 400 }),
        logged: true,
    };
    count(state, scanned_in, &verdict);
    let body = if verdict.decision == Decision::Block {
        let message = block_message(&verdict.hits);
        tracing::info!(request_id, rules = ?rule_ids(&verdict.hits), "stored answer blocked");
        // Fetched as it was refused when it was made.
        match refused_as {
            Some(endpoint) => respond::refusal(endpoint, &body, &message),
            None => {
                let ids = rule_ids(&verdict.hits);
                return respond::blocked(dialect, "response", &message, &ids, request_id);
            }
        }
    } else {
        scanned.redacted.unwrap_or(body)
    };
    let (body, verdict) = (respond::full(body), Some(verdict.decision.as_str()));
    super::guarded_response(head.status, head.headers, body, request_id, verdict)
}

/// The event a client resumes a response's stream after
/// (`?stream=true&starting_after=N`), taken out of `uri`: the client
/// numbers events as the guard sent them, so the upstream is read from the
/// start and the guard leaves out what the client has
/// ([`StreamSetup::resume_after`]).
fn take_resume(uri: &mut Uri) -> Option<u64> {
    let query = uri.query()?;
    let (mut after, mut streamed, mut kept) = (None, false, Vec::new());
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("starting_after", number)) if let Ok(number) = number.parse() => {
                after = Some(number);
                continue;
            }
            Some(("stream", "true")) => streamed = true,
            _ => {}
        }
        kept.push(pair);
    }
    let after = after.filter(|_| streamed)?;
    let resumed = match kept.is_empty() {
        true => uri.path().to_owned(),
        false => format!("{}?{}", uri.path(), kept.join("&")),
    };
    *uri = Uri::try_from(resumed).ok()?;
    Some(after)
}

/// What was scanned outside an exchange (a fetch, a batch's request or
/// answer), for its counts and the dashboard's block log.
pub(super) struct ScannedIn<'a> {
    pub route: &'static str,
    pub upstream: &'a str,
    /// The model asked for, when known (an answer fetched later is
    /// counted as the `other` model).
    pub model: Option<&'a str>,
    /// The request whose body or answer held it.
    pub request_id: &'a str,
    pub scope: Scope,
    /// The status the client gets if it blocks (see [`Blocked::status`]).
    pub status: Option<u16>,
    /// Whether a block goes to the dashboard's log here: not when the
    /// request's record puts it there.
    pub logged: bool,
}

/// Counts the verdict of a text scanned outside an exchange: its hits,
/// risk and block; a block also goes to the dashboard's log, unless it
/// has a record to put it there.
pub(super) fn count(state: &State, scanned: ScannedIn, verdict: &Verdict) {
    let metrics = &state.metrics;
    super::record_verdict(metrics, verdict);
    let decision = verdict.decision;
    let route = scanned.route;
    let model = state.config.metrics.model_label(scanned.model);
    metrics
        .requests
        .with_label_values(&[route, scanned.upstream, model, decision.as_str()])
        .inc();
    if decision == Decision::Block {
        let scope = guard::block_scope(&verdict.hits, scanned.scope);
        metrics
            .blocks
            .with_label_values(&[route, model, scope])
            .inc();
        if !scanned.logged {
            return;
        }
        let (id, upstream, status) = (scanned.request_id, scanned.upstream, scanned.status);
        let blocked = Blocked::new(id, route, upstream, scope, status, verdict);
        state.blocked.push(blocked);
    }
}
