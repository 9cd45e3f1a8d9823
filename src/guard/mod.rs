//! The inline guard: scans the prompt and context of a request before it goes
//! upstream, and the response before it reaches the client (see [`stream`]
//! for streamed responses). Redactions are applied in place.

pub mod stream;

use serde_json::Value;

use crate::exchange::{Endpoint, request_texts, response_texts};
use crate::risk::{self, RiskConfig, Verdict};
use crate::rules::{Action, Hit, RuleSet, Scope, redact};
use crate::text;

/// What the request scan found.
pub struct RequestScan {
    pub verdict: Verdict,
    /// The relevance of each context text to the prompt, for the response
    /// stage's verdict.
    pub relevance: Vec<f64>,
}

/// Scans every prompt and context text of a request body and redacts the
/// `redact` hits in place.
pub fn scan_request(
    rules: &RuleSet,
    risk: &RiskConfig,
    endpoint: Endpoint,
    body: &mut Value,
) -> RequestScan {
    let mut hits = Vec::new();
    let mut question = String::new();
    let mut contexts = Vec::new();
    request_texts(endpoint, body, &mut |scope, text| {
        let found = rules.scan(scope, text);
        match scope {
            Scope::Prompt => {
                question.push_str(text);
                question.push('\n');
            }
            Scope::Context => contexts.push(text.clone()),
            Scope::Response => {}
        }
        if found.iter().any(|h| h.action == Action::Redact) {
            *text = redact(text, &found);
        }
        hits.extend(found);
    });
    let relevance: Vec<f64> = if question.trim().is_empty() {
        Vec::new()
    } else {
        contexts
            .iter()
            .map(|c| text::cosine(&question, c))
            .collect()
    };
    RequestScan {
        verdict: risk::assess(risk, hits, &relevance),
        relevance,
    }
}

/// Scans every text of a response body, redacting in place; returns the
/// hits.
pub fn scan_response(rules: &RuleSet, endpoint: Endpoint, body: &mut Value) -> Vec<Hit> {
    let mut hits = Vec::new();
    response_texts(endpoint, body, &mut |text| {
        let found = rules.scan(Scope::Response, text);
        if found.iter().any(|h| h.action == Action::Redact) {
            *text = redact(text, &found);
        }
        hits.extend(found);
    });
    hits
}

/// The message shown for a block: the first blocking rule's, else the
/// generic one for a total over the threshold.
pub fn block_message(hits: &[Hit]) -> String {
    hits.iter()
        .find(|h| h.action == Action::Block)
        .map(|h| h.message.to_string())
        .unwrap_or_else(|| {
            "This exchange was blocked by the content policy: its combined risk is too high.".into()
        })
}

/// The ids of the rules that hit, once each, in order.
pub fn rule_ids(hits: &[Hit]) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for hit in hits {
        if !ids.iter().any(|id| **id == *hit.rule) {
            ids.push(hit.rule.to_string());
        }
    }
    ids
}
