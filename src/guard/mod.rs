//! The inline guard: scans the prompt and context of a request before it goes
//! upstream, and the response before it reaches the client (see [`stream`]
//! for streamed responses). A redaction rewrites only the redacted strings
//! of a body ([`crate::json::splice`]).

pub mod stream;

use std::ops::Range;

use bytes::Bytes;

use serde_json::Value;

use crate::exchange::{self, Text};
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
    /// The texts a `redact` hit rewrote: where each lies in the body and
    /// its new value.
    pub edits: Vec<(Range<usize>, String)>,
    /// The prompt and context texts as forwarded (redacted), for the
    /// exchange record.
    pub texts: RequestTexts,
    /// The text the answer continues, as the client wrote it (see
    /// [`exchange::RequestBody::prefill`]): the response's scan reads the
    /// answer after it.
    pub prefill: Option<String>,
}

impl RequestScan {
    /// The body as it goes upstream, when a `redact` hit rewrote it.
    pub fn redacted(&self, body: &[u8]) -> Option<Bytes> {
        (!self.edits.is_empty()).then(|| json::splice(body, &self.edits))
    }
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
    request_texts: &[Text],
) -> RequestScan {
    let mut hits = Vec::new();
    let mut question = String::new();
    let mut contexts = Vec::new();
    let mut texts = RequestTexts::default();
    let mut edits = Vec::new();
    for (i, text) in request_texts.iter().enumerate() {
        if text.definition {
            hits.extend(scan_definitions(rules, text, &mut edits));
            continue;
        }
        let Text {
            scope, text, span, ..
        } = text;
        // The texts before the last one (a system prompt, the turns before
        // the latest) are mostly sent again by the next request, and their
        // hits are remembered; the last one is new by nature.
        let again = i + 1 < request_texts.len();
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
            let found = if again {
                rules.scan_remembered(part_scope, part)
            } else {
                rules.scan(part_scope, part)
            };
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
        edits,
        texts,
        prefill: None,
    }
}

/// The hits of a request's tool definitions (a [`Text::definition`]),
/// each text of them scanned as context, and their redactions added to
/// `edits`. They are the model's context, but not what the exchange is
/// about: their texts are not recorded, nor weighed for relevance.
fn scan_definitions(
    rules: &RuleSet,
    definitions: &Text,
    edits: &mut Vec<(Range<usize>, String)>,
) -> Vec<Hit> {
    let before = edits.len();
    let hits = rules.scan_definitions(&definitions.text, || {
        scan_definition_texts(rules, definitions, edits)
    });
    // Hits remembered from an earlier request carry no edits: a redaction
    // scans again, for its places (personal data in a tool's definition
    // is rare).
    if edits.len() == before && hits.iter().any(|h| h.action == Action::Redact) {
        scan_definition_texts(rules, definitions, edits);
    }
    hits
}

/// The hits of each text of a request's tool definitions, and their
/// redactions added to `edits`.
fn scan_definition_texts(
    rules: &RuleSet,
    definitions: &Text,
    edits: &mut Vec<(Range<usize>, String)>,
) -> Vec<Hit> {
    // The JSON text of a request read whole; should it not read, it is
    // scanned as it stands (every word of it is still seen), and what a
    // redaction would rewrite there blocks.
    let (texts, whole) = match exchange::definition_texts(&definitions.text, definitions.span.start)
    {
        Ok(texts) => (texts, false),
        Err(_) => (vec![definitions.clone()], true),
    };
    let mut hits = Vec::new();
    for text in texts {
        let mut found = rules.scan(Scope::Context, &text.text);
        if whole {
            redactions_block(&mut found);
        }
        if found.iter().any(|h| h.action == Action::Redact) {
            edits.push((text.span.clone(), redact(&text.text, &found)));
        }
        hits.extend(found);
    }
    hits
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
    /// What hosted tools gave the model in the answer (a search's
    /// results, an MCP tool's output), redacted: the exchange's context
    /// too.
    pub context: Vec<String>,
    /// The body as it goes to the client, when a `redact` hit rewrote it
    /// (and without its `logprobs`, whose tokens are the text as written).
    pub redacted: Option<Bytes>,
}

/// Scans the texts of a response body (read by
/// [`crate::exchange::ResponseBody`]) and redacts the `redact` hits. The
/// texts that continue the request's `prefill`, if any, are scanned after
/// it ([`Text::continues`], [`scan_continuation`]).
pub fn scan_response(
    rules: &RuleSet,
    body: &[u8],
    response_texts: &[Text],
    prefill: Option<&str>,
) -> ResponseScan {
    let mut hits = Vec::new();
    let (mut texts, mut context) = (Vec::new(), Vec::new());
    let mut edits = Vec::new();
    let mut continued = false;
    for Text {
        scope,
        text,
        span,
        whole,
        continues,
        ..
    } in response_texts
    {
        // The answer's texts are the response; what a hosted tool gave the
        // model in it (a search's results, an MCP tool's output) is
        // context, scanned as such and not recorded as the answer.
        let mut found = match prefill.filter(|_| *continues) {
            Some(prefill) => {
                let mut found = scan_continuation(rules, prefill, text);
                // Each choice continues the prefill; the matches wholly in
                // it (ending at 0 of the text) are counted once.
                if continued {
                    found.retain(|hit| hit.end > 0);
                }
                continued = true;
                found
            }
            None => rules.scan(*scope, text),
        };
        if *whole {
            // What it is the text of cannot be redacted: the text blocks.
            redactions_block(&mut found);
        }
        // A text that is JSON itself (a call's arguments, a tool's input)
        // reaches the client's code parsed, its escapes decoded.
        let escaped = unescaped_hits(rules, *scope, text, &found);
        let redacted = found
            .iter()
            .any(|h| h.action == Action::Redact)
            .then(|| redact(text, &found));
        let kept = redacted
            .clone()
            .unwrap_or_else(|| text.clone().into_owned());
        match scope {
            Scope::Response => texts.push(kept),
            _ => context.push(kept),
        }
        if let Some(redacted) = redacted {
            edits.push((span.clone(), redacted));
        }
        hits.extend(found);
        hits.extend(escaped);
    }
    // An answer with no text of its own is still shown after its prefill.
    if let Some(prefill) = prefill.filter(|_| !continued) {
        hits.extend(scan_continuation(rules, prefill, ""));
    }
    hits.extend(scan_across(rules, response_texts));
    ResponseScan {
        hits,
        texts,
        context,
        redacted: (!edits.is_empty()).then(|| without_logprobs(json::splice(body, &edits))),
    }
}

/// The matches that run from one of an answer's texts into the next:
/// the client shows an answer's texts as one (Anthropic splits its text
/// into blocks where a citation starts and ends), so they are read as one,
/// a line break between each two, as the stream guard reads them; each
/// choice of a chat completion apart (its content [`Text::continues`] a
/// prefill). A redaction there blocks: no one text holds it to redact.
/// Only an answer of two texts or more is joined and read again.
fn scan_across(rules: &RuleSet, response_texts: &[Text]) -> Vec<Hit> {
    let answer = response_texts
        .iter()
        .filter(|t| t.scope == Scope::Response && !t.whole);
    // No text but the first of each choice: nothing to join (nor to copy).
    if answer.clone().skip(1).all(|text| text.continues) {
        return Vec::new();
    }
    let mut hits = Vec::new();
    let (mut joined, mut breaks) = (String::new(), Vec::new());
    for (at, text) in answer.enumerate() {
        if at > 0 && text.continues {
            hits.append(&mut scan_joined(rules, &joined, &breaks));
            (joined, breaks) = (String::new(), Vec::new());
        } else if at > 0 {
            breaks.push(joined.len());
            joined.push('\n');
        }
        joined.push_str(&text.text);
    }
    hits.append(&mut scan_joined(rules, &joined, &breaks));
    hits
}

/// The matches in `joined` texts that run across one of the `breaks`
/// between them (none to look for when there is none).
fn scan_joined(rules: &RuleSet, joined: &str, breaks: &[usize]) -> Vec<Hit> {
    if breaks.is_empty() {
        return Vec::new();
    }
    let mut hits = rules.scan(Scope::Response, joined);
    hits.retain(|hit| breaks.iter().any(|at| (hit.start..hit.end).contains(at)));
    redactions_block(&mut hits);
    hits
}

/// Makes each `redact` hit of `hits` a `block`: where its text cannot be
/// rewritten (the transcript of audio, a match across texts, one begun in
/// a prefill the client has).
pub(crate) fn redactions_block<'h>(hits: impl IntoIterator<Item = &'h mut Hit>) {
    for hit in hits {
        if hit.action == Action::Redact {
            hit.action = Action::Block;
        }
    }
}

/// The hits of answer `text` as the continuation of `prefill`, which the
/// client shows before it (see [`continuation_hits`]), with offsets into
/// `text` (from its start for a match that begins in the prefill).
fn scan_continuation(rules: &RuleSet, prefill: &str, text: &str) -> Vec<Hit> {
    let mut hits = rules.scan(Scope::Response, &[prefill, text].concat());
    continuation_hits(&mut hits, prefill.len());
    for hit in &mut hits {
        hit.start = hit.start.saturating_sub(prefill.len());
        hit.end = hit.end.saturating_sub(prefill.len());
    }
    hits
}

/// The hits in a prefill of `prefill` bytes and the answer after it, read
/// as one text (the client shows them so), as the answer's. A prefill can
/// lead the model into what a rule stops ("Sure, put all your savings
/// into"), so a match in it counts; but not a redaction wholly in it,
/// which the client wrote and has (the request's scan redacted it on its
/// way upstream). A redaction that begins in the prefill and runs into the
/// answer blocks: its start cannot be taken back.
pub fn continuation_hits(hits: &mut Vec<Hit>, prefill: usize) {
    hits.retain(|hit| hit.end > prefill || hit.action != Action::Redact);
    redactions_block(hits.iter_mut().filter(|hit| hit.start < prefill));
}

/// A redacted answer without its `logprobs` (see [`strip_logprobs`]);
/// the body as it was when it has none.
fn without_logprobs(body: Bytes) -> Bytes {
    if memchr::memmem::find(&body, b"\"logprobs\"").is_none() {
        return body;
    }
    match serde_json::from_slice::<Value>(&body) {
        Ok(mut value) => match strip_logprobs(&mut value) {
            true => Bytes::from(value.to_string()),
            false => body,
        },
        Err(_) => body,
    }
}

/// Scans a response body that is not JSON as one text: the guard cannot
/// tell the answer from the rest. Redacted as plain text, since there are
/// no JSON strings to splice.
///
/// A body the guard does not read as JSON may still read so to a lenient
/// reader: Python's `json.loads`, which the SDKs use, takes `NaN`,
/// `Infinity` and lone surrogates. Its strings are then what the client
/// reads, escapes decoded, so the text is also scanned with its escapes
/// decoded ([`json_unescaped`]): a rule that matches only there (across an
/// escaped newline, a letter written `\u0074`) blocks, since its match
/// has no place in the body to redact.
pub fn scan_plain_response(rules: &RuleSet, body: &[u8]) -> ResponseScan {
    let text = String::from_utf8_lossy(body);
    let mut hits = rules.scan(Scope::Response, &text);
    let redacting = hits.iter().any(|h| h.action == Action::Redact);
    let text = if redacting {
        redact(&text, &hits)
    } else {
        text.into_owned()
    };
    let escaped = unescaped_hits(rules, Scope::Response, &text, &hits);
    hits.extend(escaped);
    ResponseScan {
        redacted: redacting.then(|| Bytes::from(text.clone())),
        texts: vec![text],
        context: Vec::new(),
        hits,
    }
}

/// The hits of `text` (of `scope`) that only its view with JSON's
/// escapes decoded ([`json_unescaped`]) has, of rules `found` (its own
/// hits) lacks: none when it has no escape. They block, a redaction too,
/// since their match has no place in `text` to rewrite; their spans are
/// the decoded view's.
pub(crate) fn unescaped_hits(rules: &RuleSet, scope: Scope, text: &str, found: &[Hit]) -> Vec<Hit> {
    let Some(unescaped) = json_unescaped(text) else {
        return Vec::new();
    };
    let mut more = rules.scan(scope, &unescaped);
    more.retain(|hit| !found.iter().any(|h| h.rule == hit.rule));
    redactions_block(&mut more);
    more
}

/// `text` with JSON's string escapes decoded (`\n`, `\"`, `\u0074`, a
/// surrogate pair as its character, a lone surrogate as U+FFFD; an escape
/// JSON does not have kept as it stands), as a reader decodes a string;
/// `None` when it has no escape. Applied to a whole body, it gives the
/// text of each of its strings, whatever a reader makes of the rest.
pub(crate) fn json_unescaped(text: &str) -> Option<String> {
    unescaped(text, true)
}

/// [`json_unescaped`] of a text that more may follow: an escape at its end
/// that what follows may complete is left out ([`unescape_into`]).
pub(crate) fn json_unescaped_start(text: &str) -> Option<String> {
    unescaped(text, false)
}

fn unescaped(text: &str, last: bool) -> Option<String> {
    // memchr's search: a text without an escape, as most are, costs a
    // scan of its bytes and nothing more.
    memchr::memchr(b'\\', text.as_bytes())?;
    let mut out = String::with_capacity(text.len());
    unescape_into(&mut out, text, last);
    Some(out)
}

/// Appends `text` to `out` with JSON's string escapes decoded, as
/// [`json_unescaped`] decodes them; returns how much of `text` it took.
/// Unless `last`, it stops before an escape that more text may still
/// complete or change (a `\` at the end, a `\u` without its four digits,
/// a high surrogate whose low half may follow), so that text that comes in
/// pieces decodes as it would whole.
pub(crate) fn unescape_into(out: &mut String, text: &str, last: bool) -> usize {
    let mut rest = text;
    while let Some(at) = memchr::memchr(b'\\', rest.as_bytes()) {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let (decoded, len) = match rest.as_bytes().get(1) {
            None if !last => return text.len() - rest.len(),
            Some(b'u') if !last && unfinished_unicode_escape(rest) => {
                return text.len() - rest.len();
            }
            Some(b'"') => ('"', 2),
            Some(b'\\') => ('\\', 2),
            Some(b'/') => ('/', 2),
            Some(b'b') => ('\u{8}', 2),
            Some(b'f') => ('\u{c}', 2),
            Some(b'n') => ('\n', 2),
            Some(b'r') => ('\r', 2),
            Some(b't') => ('\t', 2),
            Some(b'u') => unicode_escape(rest).unwrap_or(('\\', 1)),
            _ => ('\\', 1),
        };
        out.push(decoded);
        rest = &rest[len..];
    }
    out.push_str(rest);
    text.len()
}

/// Whether the `\u` escape at `escape`'s start may still read otherwise
/// once more text follows: its digits are cut short, or it is a high
/// surrogate and what follows it could yet be the low half's escape.
fn unfinished_unicode_escape(escape: &str) -> bool {
    if escape.len() < 6 {
        return escape.as_bytes()[2..].iter().all(u8::is_ascii_hexdigit);
    }
    let unit = escape
        .get(2..6)
        .and_then(|digits| u32::from_str_radix(digits, 16).ok());
    let high = unit.is_some_and(|unit| (0xd800..0xdc00).contains(&unit));
    // The low half's escape, `\uDC00` to `\uDFFF`, as far as it has come.
    let low = escape.as_bytes()[6..].iter().take(6);
    let could_be_low = low.clone().zip(*b"\\u").all(|(b, want)| *b == want)
        && low.skip(2).all(u8::is_ascii_hexdigit);
    high && escape.len() < 12 && could_be_low
}

/// The character that the `\uXXXX` escape at `escape`'s start (with the
/// low half after it, for a high surrogate) stands for, and the escape's
/// length; `None` for one without four hex digits.
fn unicode_escape(escape: &str) -> Option<(char, usize)> {
    let unit = |at: usize| {
        let digits = escape.get(at + 2..at + 6)?;
        (escape.get(at..at + 2)? == "\\u" && digits.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(digits, 16).ok())
            .flatten()
    };
    let high = unit(0)?;
    if (0xd800..0xdc00).contains(&high)
        && let Some(low) = unit(6).filter(|low| (0xdc00..0xe000).contains(low))
    {
        let c = char::from_u32(0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00));
        return Some((c.unwrap_or(char::REPLACEMENT_CHARACTER), 12));
    }
    Some((
        char::from_u32(high).unwrap_or(char::REPLACEMENT_CHARACTER),
        6,
    ))
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

/// The scope a block is reported in: the first blocking rule's; a block
/// by total risk is that of the text `scanned` (a request's: the prompt).
pub fn block_scope(hits: &[Hit], scanned: Scope) -> &'static str {
    hits.iter()
        .find(|h| h.action == Action::Block)
        .map_or(scanned, |h| h.scope)
        .as_str()
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

/// Empties every `logprobs` in `value`, at any depth (an object becomes
/// `null`, a list of tokens `[]`): their tokens are the text as the model
/// wrote it, so they go wherever that text was redacted or refused.
/// Whether anything changed.
pub fn strip_logprobs(value: &mut Value) -> bool {
    match value {
        Value::Object(members) => {
            let mut changed = false;
            for (key, value) in members.iter_mut() {
                changed |= match (key.as_str(), &*value) {
                    ("logprobs", Value::Object(_)) => {
                        *value = Value::Null;
                        true
                    }
                    ("logprobs", Value::Array(tokens)) if !tokens.is_empty() => {
                        *value = Value::Array(Vec::new());
                        true
                    }
                    _ => strip_logprobs(value),
                };
            }
            changed
        }
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| strip_logprobs(item) | changed),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Lcg;

    /// Random strings written as JSON writes them, and with every
    /// character but ASCII letters escaped as `\uXXXX` (as Python's
    /// `json.dumps` does for all but ASCII): decoded as a JSON reader
    /// decodes them.
    #[test]
    fn escapes_are_decoded_as_a_json_reader_decodes_them() {
        let alphabet = [
            'a', 'Z', ' ', '"', '\\', '/', '\n', '\t', '\u{1}', 'é', '€', '😀', '\u{2028}',
        ];
        let mut random = Lcg(7);
        for _ in 0..2_000 {
            let len = random.below(12);
            let text: String = (0..len).map(|_| *random.pick(&alphabet)).collect();
            let written = serde_json::to_string(&text).unwrap();
            assert_eq!(
                json_unescaped(&written).unwrap_or(written.clone()),
                format!("\"{text}\"")
            );
            let escaped = |c: char| match c.is_ascii_alphabetic() {
                true => c.to_string(),
                // Hex digits in capitals, as some writers put them.
                false => crate::testing::unicode_escaped(c)
                    .to_uppercase()
                    .replace("\\U", "\\u"),
            };
            let ascii: String = text.chars().map(escaped).collect();
            assert_eq!(
                json_unescaped(&ascii).unwrap_or(ascii.clone()),
                text,
                "{ascii}"
            );
        }
        assert_eq!(json_unescaped("plain"), None);
        // Lone surrogates, as Python reads them, then shown as U+FFFD.
        assert_eq!(
            json_unescaped(r"a\ud800b\udc00").unwrap(),
            "a\u{fffd}b\u{fffd}"
        );
        assert_eq!(json_unescaped(r"\ud83d\ud83d\ude00").unwrap(), "\u{fffd}😀");
        // Not escapes JSON has: kept as they stand.
        assert_eq!(
            json_unescaped(r"\x \u12 \u12G4 \").unwrap(),
            r"\x \u12 \u12G4 \"
        );
    }

    /// Text that comes in pieces, cut anywhere (inside an escape, between
    /// a surrogate's halves), decodes as it does whole.
    #[test]
    fn escapes_cut_into_pieces_decode_as_whole() {
        let texts = [
            r#"{"a": "x\ny\"z\\"}"#,
            r"\u0061\ud83d\ude00\ud83d\u0062\ud83d",
            r"\u12G4 \x \ud83d\n\udc00 \",
            r"é\u00e9€\ud83dé",
        ];
        for text in texts {
            let whole = json_unescaped(text).unwrap();
            let cuts: Vec<usize> = (0..=text.len())
                .filter(|&at| text.is_char_boundary(at))
                .collect();
            for &first in &cuts {
                for &second in cuts.iter().filter(|&&at| at >= first) {
                    let (mut out, mut pending) = (String::new(), String::new());
                    for piece in [&text[..first], &text[first..second], &text[second..]] {
                        pending.push_str(piece);
                        let used = unescape_into(&mut out, &pending, false);
                        pending.drain(..used);
                        // Only an escape cut short waits.
                        assert!(pending.is_empty() || pending.starts_with('\\'), "{pending}");
                        assert!(pending.len() < 12, "{pending}");
                    }
                    unescape_into(&mut out, &pending, true);
                    assert_eq!(out, whole, "{text} cut at {first} and {second}");
                }
            }
        }
    }

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

    /// `value` as JSON text with the members of each object in random order
    /// and each character of a string, at random, escaped (`\uXXXX`, a
    /// surrogate pair beyond the BMP, `\/`) or as it is.
    fn write_randomly(value: &serde_json::Value, rng: &mut Lcg, out: &mut String) {
        use serde_json::Value;
        match value {
            Value::Object(map) => {
                let mut members: Vec<_> = map.iter().collect();
                for i in (1..members.len()).rev() {
                    members.swap(i, rng.below(i + 1));
                }
                out.push('{');
                for (i, (key, member)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::from(key.as_str()).to_string());
                    out.push(':');
                    write_randomly(member, rng, out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_randomly(item, rng, out);
                }
                out.push(']');
            }
            Value::String(text) => {
                out.push('"');
                for c in text.chars() {
                    match (c, rng.below(4)) {
                        ('/', 0) => out.push_str("\\/"),
                        (_, 0) => {
                            let mut units = [0; 2];
                            for unit in c.encode_utf16(&mut units) {
                                out.push_str(&format!("\\u{unit:04x}"));
                            }
                        }
                        ('"' | '\\', _) => {
                            out.push('\\');
                            out.push(c);
                        }
                        ('\n', _) => out.push_str("\\n"),
                        _ => out.push(c),
                    }
                }
                out.push('"');
            }
            other => out.push_str(&other.to_string()),
        }
    }

    /// The texts of a request (or response) body of `endpoint` and, when
    /// the guard redacts some, the body as it would go on.
    fn guard_body<'a>(
        rules: &RuleSet,
        tags: &[String],
        endpoint: crate::exchange::Endpoint,
        request: bool,
        body: &'a [u8],
    ) -> (Vec<crate::exchange::Text<'a>>, Option<Bytes>) {
        use crate::exchange::{RequestBody, ResponseBody};
        let unreadable = String::from_utf8_lossy(body);
        if request {
            let read = RequestBody::read(endpoint, body).expect(&unreadable);
            let scan = scan_request(rules, &RiskConfig::default(), tags, &read.texts);
            (read.texts, scan.redacted(body))
        } else {
            let read = ResponseBody::read(endpoint, body).expect(&unreadable);
            let scan = scan_response(rules, body, &read.texts, None);
            (read.texts, scan.redacted)
        }
    }

    /// A whole answer is scanned as what follows its prefill, in both
    /// dialects: a match the two make counts, and one in the prefill but
    /// for a redaction; a `redact` hit that reaches into the prefill
    /// blocks; one wholly in the answer is redacted in the answer's text
    /// alone. Each choice of a chat completion continues the prefill.
    #[test]
    fn an_answer_is_scanned_as_the_continuation_of_its_prefill() {
        use crate::exchange::{Endpoint, ResponseBody};
        use serde_json::json;
        use std::path::Path;

        let rules = RuleSet::load_dir(Path::new("rules"), &crate::rules::CompileOptions::default())
            .unwrap();
        let scan_body = |endpoint, prefill: &str, body: String| {
            let read = ResponseBody::read(endpoint, body.as_bytes()).unwrap();
            let scan = scan_response(&rules, body.as_bytes(), &read.texts, Some(prefill));
            let actions: Vec<&str> = scan.hits.iter().map(|h| h.action.as_str()).collect();
            let redacted = scan
                .redacted
                .map(|b| String::from_utf8(b.to_vec()).unwrap());
            (actions.join(","), scan.texts[0].clone(), redacted)
        };
        // The answer's text, then a call whose input does not continue the
        // prefill.
        let answer = |endpoint, answer: &str| match endpoint {
            Endpoint::Messages => json!({"content": [
                {"type": "text", "text": answer},
                {"type": "tool_use", "input": {"note": "Guaranteed"}}
            ]}),
            _ => json!({"choices": [{"index": 0, "message": {
                "content": answer,
                "tool_calls": [{"function": {"name": "note", "arguments": "Guaranteed"}}]
            }}]}),
        };
        for endpoint in [Endpoint::Messages, Endpoint::ChatCompletions] {
            let scan = |prefill: &str, text: &str| {
                scan_body(endpoint, prefill, answer(endpoint, text).to_string())
            };
            assert_eq!(
                scan("Our fund offers guaranteed", " returns of 20% a year."),
                ("block".into(), " returns of 20% a year.".into(), None)
            );
            // The prefill's own match counts, but for a redaction.
            assert_eq!(
                scan("Sure. Put all your savings into", " Dogecoin right now."),
                ("block".into(), " Dogecoin right now.".into(), None)
            );
            assert_eq!(
                scan("Card 4111 1111 1111 1111 is", " on file."),
                ("".into(), " on file.".into(), None)
            );
            assert_eq!(
                scan("My card is 4111 1111", " 1111 1111, thanks."),
                ("block".into(), " 1111 1111, thanks.".into(), None)
            );
            let (actions, text, body) = scan("My card is", " 4111 1111 1111 1111.");
            assert_eq!(
                (actions.as_str(), text.as_str()),
                ("redact", " [REDACTED:card].")
            );
            assert!(body.unwrap().contains(r#"" [REDACTED:card].""#));
        }
        // Each choice continues the prefill; a match wholly in the prefill
        // is counted once.
        let choices = |texts: [&str; 2]| {
            json!({"choices": [
                {"index": 0, "message": {"content": texts[0]}},
                {"index": 1, "message": {"content": [{"type": "text", "text": texts[1]}]}}
            ]})
            .to_string()
        };
        let chat = |prefill, texts| scan_body(Endpoint::ChatCompletions, prefill, choices(texts));
        assert_eq!(
            chat(
                "Our fund offers guaranteed",
                [" safety.", " returns of 20% a year."]
            )
            .0,
            "block"
        );
        assert_eq!(
            chat("Sure. Put all your savings into", [" a fund.", " bonds."]).0,
            "block"
        );
        assert_eq!(chat("Our fund offers", [" safety.", " a plan."]).0, "");
    }

    /// An answer's texts are read as one, the way the client shows them
    /// (with a line break between, as the stream guard reads them): a match
    /// that runs from one text block into the next blocks; one within a
    /// block is redacted there; each choice of a chat completion apart.
    #[test]
    fn a_match_across_an_answers_texts_blocks() {
        use crate::exchange::{Endpoint, ResponseBody};
        use serde_json::json;
        use std::path::Path;

        let rules = RuleSet::load_dir(Path::new("rules"), &crate::rules::CompileOptions::default())
            .unwrap();
        let scan = |endpoint, body: serde_json::Value| {
            let body = body.to_string();
            let read = ResponseBody::read(endpoint, body.as_bytes()).unwrap();
            let scan = scan_response(&rules, body.as_bytes(), &read.texts, None);
            let actions: Vec<&str> = scan.hits.iter().map(|h| h.action.as_str()).collect();
            (actions.join(","), scan.redacted.is_some())
        };
        let blocks = |texts: [&str; 2]| json!({"content": [{"type": "text", "text": texts[0]}, {"type": "text", "text": texts[1]}]});
        let anthropic = |texts| scan(Endpoint::Messages, blocks(texts));
        assert_eq!(
            anthropic(["Our fund offers guaranteed", " returns of 20% a year."]),
            ("block".into(), false)
        );
        assert_eq!(
            anthropic(["Pay with card", " 4111 1111 1111 1111 today."]),
            ("redact".into(), true)
        );
        assert_eq!(
            anthropic(["Our fund offers", " bonds."]),
            ("".into(), false)
        );
        let choices = json!({"choices": [
            {"index": 0, "message": {"content": "Our fund offers guaranteed"}},
            {"index": 1, "message": {"content": " returns of 20% a year."}}
        ]});
        assert_eq!(scan(Endpoint::ChatCompletions, choices), ("".into(), false));
    }

    /// Random request and response bodies of every endpoint, with personal
    /// data and keys here and there, written with escapes and members in
    /// random order: the guard never panics; a body it redacted is JSON that
    /// reads back to as many texts, each as it was or with a placeholder;
    /// and scanning it again finds nothing left to redact.
    #[test]
    fn redacted_bodies_read_back_with_nothing_left_to_redact() {
        use crate::exchange::Endpoint;
        use serde_json::{Value, json};
        use std::path::Path;

        let rules = RuleSet::load_dir(Path::new("rules"), &crate::rules::CompileOptions::default())
            .unwrap();
        let tags = vec!["context".to_owned()];
        let snippets = [
            "How should I start saving?",
            "Café, naïve résumé; 😀 and ✓",
            "a \"quote\", a back\\slash and a\nnew line",
            "my card is 4111 1111 1111 1111",
            "4111111111111111",
            "write to jane.doe+bank@example.co.uk today",
            "IBAN: DE89370400440532013000",
            "call 415-555-0134",
            "my key is sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
            "<context>card 5500-0000-0000-0004</context>",
            "<context>nothing here</context> then j.smith@mail.example.com",
        ];
        let mut rng = Lcg(11);
        let t = |rng: &mut Lcg| -> Value {
            let parts: Vec<&str> = (0..1 + rng.below(3))
                .map(|_| *rng.pick(&snippets))
                .collect();
            Value::from(parts.join(" "))
        };
        let mut redacted_seen = 0;
        for round in 0..400 {
            let endpoint = *rng.pick(&[
                Endpoint::ChatCompletions,
                Endpoint::Completions,
                Endpoint::Responses,
                Endpoint::Messages,
            ]);
            let request = match endpoint {
                Endpoint::ChatCompletions => json!({"model": "m", "messages": [
                    {"role": "system", "content": t(&mut rng)},
                    {"role": "user", "content": [{"type": "text", "text": t(&mut rng)},
                        {"type": "text", "text": t(&mut rng)}]},
                    {"role": "tool", "tool_call_id": "1", "content": t(&mut rng)}]}),
                Endpoint::Completions => {
                    json!({"model": "m", "prompt": [t(&mut rng), t(&mut rng)]})
                }
                Endpoint::Responses => json!({"model": "m", "instructions": t(&mut rng), "input": [
                    {"role": "user", "content": t(&mut rng)},
                    {"type": "function_call_output", "call_id": "1", "output": t(&mut rng)}]}),
                Endpoint::Messages => json!({"model": "m", "max_tokens": 9,
                    "system": [{"type": "text", "text": t(&mut rng)}], "messages": [
                    {"role": "user", "content": [{"type": "text", "text": t(&mut rng)},
                        {"type": "tool_result", "tool_use_id": "1", "content": t(&mut rng)},
                        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": t(&mut rng)}}]}]}),
            };
            let response = match endpoint {
                Endpoint::ChatCompletions => json!({"choices": [{"index": 0, "message":
                    {"role": "assistant", "content": t(&mut rng)}, "finish_reason": "stop"}]}),
                Endpoint::Completions => json!({"choices": [{"text": t(&mut rng)}]}),
                Endpoint::Responses => json!({"output": [{"type": "message", "content":
                    [{"type": "output_text", "text": t(&mut rng)}]}]}),
                Endpoint::Messages => json!({"type": "message", "content":
                    [{"type": "text", "text": t(&mut rng)}], "stop_reason": "end_turn"}),
            };
            let (mut request_text, mut response_text) = (String::new(), String::new());
            write_randomly(&request, &mut rng, &mut request_text);
            write_randomly(&response, &mut rng, &mut response_text);
            let context = format!("round {round}, {endpoint:?}:\n{request_text}\n{response_text}");

            for (request, body) in [(true, &request_text), (false, &response_text)] {
                let (texts, redacted) =
                    guard_body(&rules, &tags, endpoint, request, body.as_bytes());
                let Some(redacted) = redacted else { continue };
                redacted_seen += 1;
                assert!(
                    serde_json::from_slice::<Value>(&redacted).is_ok(),
                    "{context}"
                );
                // As many texts, each as it was or with a placeholder, and
                // nothing left to redact.
                let (again, left) = guard_body(&rules, &tags, endpoint, request, &redacted);
                assert_eq!(again.len(), texts.len(), "{context}");
                for (old, new) in texts.iter().zip(&again) {
                    assert!(
                        old.text == new.text || new.text.contains("[REDACTED:"),
                        "{context}"
                    );
                }
                assert!(left.is_none(), "{context}");
            }
        }
        assert!(redacted_seen > 100, "{redacted_seen}");
    }
}
