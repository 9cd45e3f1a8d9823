//! The inline guard: scans the prompt and context of a request before it goes
//! upstream, and the response before it reaches the client (see [`stream`]
//! for streamed responses). A redaction rewrites only the redacted strings
//! of a body ([`crate::json::splice`]).

pub mod stream;

use bytes::Bytes;

use crate::exchange::Text;
use crate::json;
use crate::risk::{self, RiskConfig, Verdict};
use crate::rules::{Action, Hit, RuleSet, Scope, redact};
use crate::text;

/// What the request scan found.
pub struct RequestScan {
    pub verdict: Verdict,
    /// The relevance of each context text to the prompt, for the response
    /// stage's verdict.
    pub relevance: Vec<f64>,
    /// The body as it goes upstream, when a `redact` hit rewrote it.
    pub redacted: Option<Bytes>,
    /// The prompt and context texts as forwarded (redacted), for the
    /// exchange record.
    pub texts: RequestTexts,
}

/// The texts of a request by scope, after redaction.
#[derive(Debug, Clone, Default)]
pub struct RequestTexts {
    pub prompt: Vec<String>,
    pub context: Vec<String>,
}

/// Scans the prompt and context texts of a request body (read by
/// [`crate::exchange::RequestBody`]) and redacts the `redact` hits.
pub fn scan_request(
    rules: &RuleSet,
    risk: &RiskConfig,
    context_tags: &[String],
    body: &[u8],
    request_texts: &[Text],
) -> RequestScan {
    let mut hits = Vec::new();
    let mut question = String::new();
    let mut contexts = Vec::new();
    let mut texts = RequestTexts::default();
    let mut edits = Vec::new();
    for Text { scope, text, span } in request_texts {
        let mut rewritten = String::new();
        let mut changed = false;
        for (range, part_scope) in split_context(text, *scope, context_tags) {
            let part = &text[range.clone()];
            match part_scope {
                Scope::Prompt => {
                    question.push_str(part);
                    question.push('\n');
                }
                Scope::Context => contexts.push(part.to_owned()),
                Scope::Response => {}
            }
            let found = rules.scan(part_scope, part);
            // The part as it goes upstream and into the record.
            let kept = if found.iter().any(|h| h.action == Action::Redact) {
                changed = true;
                redact(part, &found)
            } else {
                part.to_owned()
            };
            rewritten.push_str(&kept);
            match part_scope {
                Scope::Context => texts.context.push(kept),
                _ => texts.prompt.push(kept),
            }
            hits.extend(found.into_iter().map(|mut hit| {
                hit.start += range.start;
                hit.end += range.start;
                hit
            }));
        }
        if changed {
            edits.push((span.clone(), rewritten));
        }
    }
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
        redacted: (!edits.is_empty()).then(|| json::splice(body, &edits)),
        texts,
    }
}

/// The parts of a prompt text with their scope: the text between
/// `<tag>` and `</tag>` (for a configured tag) is context; the rest keeps
/// `scope`. Tags themselves belong to the surrounding part.
fn split_context(
    text: &str,
    scope: Scope,
    tags: &[String],
) -> Vec<(std::ops::Range<usize>, Scope)> {
    if scope != Scope::Prompt || tags.is_empty() {
        return vec![(0..text.len(), scope)];
    }
    let mut parts = Vec::new();
    let mut at = 0;
    loop {
        // The earliest opening tag from `at` on.
        let next = tags
            .iter()
            .filter_map(|tag| {
                let open = format!("<{tag}>");
                let start = text[at..].find(&open)? + at + open.len();
                let end = text[start..].find(&format!("</{tag}>"))? + start;
                Some((start, end))
            })
            .min();
        let Some((start, end)) = next else { break };
        parts.push((at..start, scope));
        parts.push((start..end, Scope::Context));
        at = end;
    }
    parts.push((at..text.len(), scope));
    parts.retain(|(range, _)| !range.is_empty());
    parts
}

/// What the scan of a (non-streaming) response found.
pub struct ResponseScan {
    pub hits: Vec<Hit>,
    /// The response texts as the client gets them (redacted).
    pub texts: Vec<String>,
    /// The body as it goes to the client, when a `redact` hit rewrote it.
    pub redacted: Option<Bytes>,
}

/// Scans the texts of a response body (read by
/// [`crate::exchange::ResponseBody`]) and redacts the `redact` hits.
pub fn scan_response(rules: &RuleSet, body: &[u8], response_texts: &[Text]) -> ResponseScan {
    let mut hits = Vec::new();
    let mut texts = Vec::new();
    let mut edits = Vec::new();
    for Text { text, span, .. } in response_texts {
        let found = rules.scan(Scope::Response, text);
        if found.iter().any(|h| h.action == Action::Redact) {
            let redacted = redact(text, &found);
            texts.push(redacted.clone());
            edits.push((span.clone(), redacted));
        } else {
            texts.push(text.clone().into_owned());
        }
        hits.extend(found);
    }
    ResponseScan {
        hits,
        texts,
        redacted: (!edits.is_empty()).then(|| json::splice(body, &edits)),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_parts_of_a_prompt_are_context() {
        let tags = vec!["documents".to_owned(), "context".to_owned()];
        let text = "Q: <documents>doc one</documents> and <context>two</context>!";
        let parts: Vec<(&str, Scope)> = split_context(text, Scope::Prompt, &tags)
            .into_iter()
            .map(|(r, s)| (&text[r], s))
            .collect();
        assert_eq!(
            parts,
            [
                ("Q: <documents>", Scope::Prompt),
                ("doc one", Scope::Context),
                ("</documents> and <context>", Scope::Prompt),
                ("two", Scope::Context),
                ("</context>!", Scope::Prompt)
            ]
        );
        // Unclosed tags and other scopes are left alone.
        assert_eq!(
            split_context("<documents>open", Scope::Prompt, &tags),
            [(0..15, Scope::Prompt)]
        );
        assert_eq!(
            split_context("<context>x</context>", Scope::Context, &tags),
            [(0..20, Scope::Context)]
        );
    }
}
