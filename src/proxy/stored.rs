//! `GET`s of answers the API stored (OpenAI's stored responses, chat
//! completions and conversation items): relayed as the answers were when
//! they were made, after the same response scan. Without it a client
//! could fetch, by its id, a response whose creation fairgate refused.
//!
//! A stored response or chat completion that a rule blocks comes back as
//! the refusal its creation got (or the 400 error, with `on_block:
//! error`); a list or a conversation item, which has no refusal shape,
//! gets the 400 error. `redact` hits are redacted in place. A stored
//! response fetched as a stream (`?stream=true`) goes through the stream
//! guard. There is no exchange record: a fetch makes no exchange.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response, header};
use hyper::body::Incoming;

use super::respond;
use super::{ProxyBody, Relayed, State, upstream};
use crate::config::OnBlock;
use crate::exchange::{Dialect, Endpoint, ResponseBody, Stored};
use crate::guard::stream::{StreamOutcome, StreamSetup, guard_body};
use crate::guard::{self, block_message, rule_ids};
use crate::json::ReadError;
use crate::risk::{self, Decision, Verdict};
use crate::rules::Scope;

/// The route label of these fetches in the metrics.
const ROUTE: &str = "stored";

/// Fetches a stored answer and relays it as the guard allows.
pub(super) async fn fetch(
    state: &Arc<State>,
    req: Request<Incoming>,
    stored: Stored,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = Dialect::OpenAi;
    let Relayed {
        upstream,
        stream_mode,
        response,
        deadline,
    } = match super::relay(state, req, dialect, request_id, true).await {
        Ok(relayed) => relayed,
        Err(out) => return out,
    };
    let stream_mode = stream_mode.unwrap_or(state.config.guard.stream_mode);
    if !response.status().is_success() {
        return super::stream_back(response, deadline, request_id, None);
    }
    let rules = state.rules.snapshot();
    let (head, body) = response.into_parts();
    let broken = |kind| super::upstream_broken(state, &upstream, kind, dialect, request_id);
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
            started: Instant::now(),
            include_usage: false,
        };
        let counted = state.clone();
        let done = move |outcome: StreamOutcome| {
            count(
                &counted,
                ROUTE,
                &upstream,
                Scope::Response,
                &outcome.verdict,
            )
        };
        let body = guard_body(setup, upstream::body_stream(body, deadline), done);
        return super::guarded_response(head.status, head.headers, body, request_id, None);
    }
    if super::is_encoded(&head.headers) {
        return broken("encoded");
    }
    let limit = state.config.guard.max_response_bytes;
    let body = match upstream::read_body(body, limit, deadline).await {
        Ok(body) => body,
        Err(error) => {
            tracing::warn!(%error, "stored answer could not be read");
            return broken("body");
        }
    };
    let (scanned, json) = match ResponseBody::read_stored(stored, &body) {
        Ok(read) => (guard::scan_response(&rules, &body, &read.texts), true),
        Err(error @ ReadError::Ambiguous(_)) => {
            tracing::warn!(%error, "stored answer holds a key twice");
            return broken("ambiguous");
        }
        Err(_) => (guard::scan_plain_response(&rules, &body), false),
    };
    let verdict = risk::assess(&state.config.risk, scanned.hits, &[]);
    count(state, ROUTE, &upstream, Scope::Response, &verdict);
    let body = if verdict.decision == Decision::Block {
        let message = block_message(&verdict.hits);
        tracing::info!(request_id, rules = ?rule_ids(&verdict.hits), "stored answer blocked");
        // Fetched as it was refused when it was made.
        let refused_as = match stored {
            Stored::Response => Some(Endpoint::Responses),
            Stored::ChatCompletion => Some(Endpoint::ChatCompletions),
            _ => None,
        };
        match refused_as.filter(|_| json && state.config.guard.on_block == OnBlock::Refusal) {
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

/// Counts the verdict of a text scanned outside an exchange (a fetch, a
/// batch's request or answer) on `route`: its hits, risk and block.
pub(super) fn count(state: &State, route: &str, upstream: &str, scanned: Scope, verdict: &Verdict) {
    let metrics = &state.metrics;
    super::record_verdict(metrics, verdict);
    let decision = verdict.decision;
    metrics
        .requests
        .with_label_values(&[route, upstream, decision.as_str()])
        .inc();
    if decision == Decision::Block {
        let scope = guard::block_scope(&verdict.hits, scanned);
        metrics.blocks.with_label_values(&[route, scope]).inc();
    }
}
