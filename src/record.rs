//! The exchange record: what the proxy hands to the side queue after every
//! guarded exchange, and the feedback record of `POST /v1/feedback`.
//!
//! A record never holds `Authorization` or `x-api-key`: it is built from the
//! exchange's texts, verdict and timings, and from the client metadata of
//! fairgate's own `x-fairgate-*` headers or the body's `metadata.fairgate_*`
//! keys, never from the request headers as a whole.

use http::HeaderMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::json::Reader;
use crate::risk::{Decision, Risk, Verdict};
use crate::rules::{Action, Hit, Scope};

/// The version of the record's JSON shape; bumped on incompatible changes.
pub const SCHEMA_VERSION: u32 = 1;

/// The `route`s of requests fairgate reads outside an exchange: it scans
/// what they give a model and passes their answers on unread, so that
/// their records have no response for the answer's metrics to score.
pub mod unread_answer {
    /// A request whose tokens are counted.
    pub const TOKEN_COUNT: &str = "token_count";
    /// A conversation given to be compacted.
    pub const COMPACTION: &str = "compaction";
    /// Items added to a conversation.
    pub const CONVERSATION_ITEMS: &str = "conversation_items";
    /// What an image, video or speech model is told to make.
    pub const MEDIA: &str = "media";
    /// How a Realtime session held elsewhere is set up (a browser's key,
    /// a call): what is said in the session does not pass through
    /// fairgate.
    pub const REALTIME_SETUP: &str = "realtime_setup";

    /// Whether `route` is one of these.
    pub fn is(route: &str) -> bool {
        [
            TOKEN_COUNT,
            COMPACTION,
            CONVERSATION_ITEMS,
            MEDIA,
            REALTIME_SETUP,
        ]
        .contains(&route)
    }
}

/// The `route` of a batch's answer, recorded as its results are fetched
/// (see [`ExchangeRecord::custom_id`]): fairgate sees the answer apart from
/// its request, so that its record has no prompt and no time of its own.
pub const BATCH_RESULTS: &str = "batch_results";

/// The `route` of a batch's request, recorded when the batch is created
/// (see [`ExchangeRecord::custom_id`]): its answer comes later, in the
/// batch's results, with a record of its own ([`BATCH_RESULTS`]).
pub const BATCH_REQUESTS: &str = "batches";

/// One item of the side queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum QueueItem {
    Exchange(Box<ExchangeRecord>),
    Feedback(FeedbackRecord),
}

impl QueueItem {
    /// The request id the item is about: the key that makes processing
    /// idempotent.
    pub fn request_id(&self) -> &str {
        match self {
            QueueItem::Exchange(record) => &record.request_id,
            QueueItem::Feedback(feedback) => &feedback.request_id,
        }
    }

    /// When the item was made, in milliseconds since the Unix epoch.
    pub fn created_ms(&self) -> i64 {
        match self {
            QueueItem::Exchange(record) => record.finished_ms,
            QueueItem::Feedback(feedback) => feedback.received_ms,
        }
    }
}

/// Everything about one guarded exchange that is not needed for its block
/// decision. Written as JSON by [`crate::line`], field by field: a new
/// field goes there too (its tests fail until it does).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeRecord {
    pub schema_version: u32,
    pub request_id: String,
    /// When the request arrived and when the exchange ended, milliseconds
    /// since the Unix epoch.
    pub started_ms: i64,
    pub finished_ms: i64,
    /// `chat_completions`, `completions`, `responses` or `messages`.
    pub route: String,
    /// `openai` or `anthropic`.
    pub dialect: String,
    pub upstream: String,
    /// The upstream's own id of the request, from its answer's
    /// `x-request-id` (OpenAI) or `request-id` (Anthropic) header: what
    /// the vendor's logs and support know the exchange by.
    #[serde(default)]
    pub upstream_request_id: Option<String>,
    pub model: Option<String>,
    pub stream: bool,
    /// The HTTP status the client got.
    pub status: u16,
    /// How a streamed answer ended (`None` for an answer that was not
    /// streamed): a stream's status is the one its head carried, whatever
    /// came after it.
    #[serde(default)]
    pub stream_end: Option<StreamEnd>,
    /// The `custom_id` of a batch's request ([`BATCH_REQUESTS`]), or of
    /// the request a batch's answer ([`BATCH_RESULTS`]) answers: what ties
    /// the two records together.
    #[serde(default)]
    pub custom_id: Option<String>,
    pub texts: Texts,
    pub verdict: Decision,
    pub risk: Risk,
    pub hits: Vec<RecordHit>,
    /// Upstream time (request sent to response head, or to the end of a
    /// stream) and the time fairgate added, in milliseconds; `None` when the
    /// upstream was never called.
    pub upstream_ms: Option<f64>,
    pub proxy_ms: f64,
    pub total_ms: f64,
    /// The upstream's `usage` object, when it reported one.
    pub usage: Option<Usage>,
    pub client: ClientMeta,
}

/// The upstream's `usage` object as compact JSON text. A non-streamed
/// answer's is kept as the answer wrote it, less the whitespace between
/// tokens (so that it fits on a result line), and written out as it came:
/// parsing it into a tree on the serving thread, to write it out again on
/// the side queue's, cost some 2% of an exchange's instructions.
#[derive(Debug, Clone)]
pub struct Usage(Box<str>);

impl Usage {
    /// From the JSON text of an object as the body reader took it from an
    /// answer: valid JSON (the reader checked it while skipping it).
    pub fn from_json_text(text: &str) -> Usage {
        let blank = |b: &u8| matches!(b, b' ' | b'\n' | b'\r' | b'\t');
        if !text.as_bytes().iter().any(blank) {
            return Usage(text.into());
        }
        let mut out = Vec::with_capacity(text.len());
        let (mut in_string, mut escaped) = (false, false);
        for &b in text.as_bytes() {
            if in_string {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    in_string = false;
                }
            } else if blank(&b) {
                continue;
            } else if b == b'"' {
                in_string = true;
            }
            out.push(b);
        }
        // Only ASCII whitespace was left out, so the bytes are still UTF-8.
        match String::from_utf8(out) {
            Ok(compact) => Usage(compact.into()),
            Err(_) => Usage(text.into()),
        }
    }

    /// From a usage object read as a tree (a record read back).
    pub fn from_value(value: &Value) -> Usage {
        // Written straight into a buffer: `Display` (`to_string`) goes
        // through the formatter, a call per piece. A `Value` always
        // serializes (its keys are strings).
        Usage(serde_json::to_string(value).unwrap_or_default().into())
    }

    /// The object's JSON text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Serialize for Usage {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // serde_json writes a RawValue as it is; `line` writes the text
        // itself (sonic-rs does not know serde_json's RawValue).
        serde_json::from_str::<&serde_json::value::RawValue>(&self.0)
            .map_err(serde::ser::Error::custom)?
            .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Usage {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Usage, D::Error> {
        // As a tree, not as a RawValue: a record comes inside an internally
        // tagged `QueueItem`, which serde reads ahead into a buffer that
        // keeps no raw text. (Keys come back sorted, hence `PartialEq`.)
        Value::deserialize(deserializer).map(|value| Usage::from_value(&value))
    }
}

/// Two usages are equal when they hold the same JSON value, whatever the
/// order of their keys.
impl PartialEq for Usage {
    fn eq(&self, other: &Usage) -> bool {
        let parsed = |usage: &Usage| serde_json::from_str::<Value>(usage.as_str()).ok();
        self.0 == other.0 || parsed(self).is_some_and(|value| Some(value) == parsed(other))
    }
}

/// The texts of an exchange after redaction, or only their SHA-256 when the
/// configuration keeps no texts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Texts {
    /// `full` or `hashes`.
    pub mode: TextMode,
    pub prompt: Vec<String>,
    pub context: Vec<String>,
    pub response: Vec<String>,
}

/// How a streamed answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamEnd {
    /// The upstream's stream ran to its end, and the client had it all.
    Complete,
    /// A rule blocked the answer: the guard ended the stream (OpenAI's
    /// `content_filter`, Anthropic's `refusal`).
    Blocked,
    /// The client went away before the end; the record holds the text
    /// read until then.
    ClientClosed,
    /// The upstream's stream broke off, or ran past its deadline, before
    /// its end: the client got an error event.
    UpstreamFailed,
    /// An event the guard could not read ended the stream (holdback and
    /// buffer modes; monitor mode passes it on and goes on).
    Malformed,
    /// A fault of fairgate's own while guarding: the client got an error
    /// event.
    Fault,
}

impl StreamEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamEnd::Complete => "complete",
            StreamEnd::Blocked => "blocked",
            StreamEnd::ClientClosed => "client_closed",
            StreamEnd::UpstreamFailed => "upstream_failed",
            StreamEnd::Malformed => "malformed",
            StreamEnd::Fault => "fault",
        }
    }
}

/// Whether records keep texts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextMode {
    #[default]
    Full,
    Hashes,
}

impl Texts {
    /// The texts as given, or each replaced by `sha256:<hex>`.
    pub fn new(
        mode: TextMode,
        prompt: Vec<String>,
        context: Vec<String>,
        response: Vec<String>,
    ) -> Texts {
        let keep = |texts: Vec<String>| match mode {
            TextMode::Full => texts,
            TextMode::Hashes => texts.iter().map(|t| sha256(t)).collect(),
        };
        Texts {
            mode,
            prompt: keep(prompt),
            context: keep(context),
            response: keep(response),
        }
    }

    pub fn prompt_text(&self) -> String {
        self.prompt.join("\n")
    }

    pub fn context_text(&self) -> String {
        self.context.join("\n")
    }

    pub fn response_text(&self) -> String {
        self.response.join("\n")
    }
}

/// `sha256:` and the hex digest of `text`.
pub fn sha256(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for byte in digest.iter() {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// A rule hit as recorded: the matched text of a `redact` rule is never
/// kept, and no matched text is kept when the record keeps no texts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordHit {
    pub rule: String,
    pub category: String,
    pub scope: Scope,
    pub action: Action,
    pub start: usize,
    pub end: usize,
    pub snippet: Option<String>,
}

impl RecordHit {
    pub fn new(hit: &Hit, mode: TextMode) -> RecordHit {
        let snippet = match (mode, hit.action) {
            (TextMode::Hashes, _) => None,
            (TextMode::Full, Action::Redact) => Some(hit.placeholder.to_string()),
            (TextMode::Full, _) => Some(hit.snippet.clone()),
        };
        RecordHit {
            rule: hit.rule.to_string(),
            category: hit.category.to_string(),
            scope: hit.scope,
            action: hit.action,
            start: hit.start,
            end: hit.end,
            snippet,
        }
    }
}

/// The verdict's parts as recorded.
pub fn record_hits(verdict: &Verdict, mode: TextMode) -> Vec<RecordHit> {
    verdict
        .hits
        .iter()
        .map(|hit| RecordHit::new(hit, mode))
        .collect()
}

/// What the client said about the exchange.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientMeta {
    pub session: Option<String>,
    pub user: Option<String>,
    /// A reference answer whose emotions the response is compared with.
    pub ground_truth: Option<String>,
    /// The expected answer, for exact match and keyword recall.
    pub expected: Option<String>,
}

impl ClientMeta {
    /// Reads `x-fairgate-session`, `-user`, `-ground-truth` and `-expected`
    /// (URL-encoded text), falling back to the `fairgate_session`, ... keys
    /// of the body's `metadata` object.
    pub fn read(headers: &HeaderMap, metadata: Option<&str>) -> ClientMeta {
        const KEYS: [&str; 4] = [
            "fairgate_session",
            "fairgate_user",
            "fairgate_ground_truth",
            "fairgate_expected",
        ];
        const HEADERS: [&str; 4] = [
            "x-fairgate-session",
            "x-fairgate-user",
            "x-fairgate-ground-truth",
            "x-fairgate-expected",
        ];
        // The body's strings; none when the object holds a key twice.
        let mut from_body: [Option<String>; 4] = Default::default();
        if let Some(metadata) = metadata {
            let mut reader = Reader::new(metadata);
            let read = reader.is_object().and_then(|_| {
                reader.object(KEYS, |reader, key| {
                    from_body[key] = reader.string()?.map(|t| t.value.into_owned());
                    Ok(())
                })
            });
            if read.is_err() {
                from_body = Default::default();
            }
        }
        // Most requests carry none of these headers: one look at the names
        // saves four lookups, each of which would parse the name it is given.
        let ours = headers
            .keys()
            .any(|name| name.as_str().starts_with("x-fairgate-"));
        let [session, user, ground_truth, expected] = std::array::from_fn(|i| {
            if ours && let Some(value) = headers.get(HEADERS[i]) {
                let raw = String::from_utf8_lossy(value.as_bytes());
                let decoded = percent_encoding::percent_decode_str(&raw.replace('+', " "))
                    .decode_utf8_lossy()
                    .into_owned();
                return Some(decoded);
            }
            from_body[i].take()
        });
        ClientMeta {
            session,
            user,
            ground_truth,
            expected,
        }
    }
}

/// `POST /v1/feedback`: what the user did after the exchange.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeedbackRecord {
    pub schema_version: u32,
    pub request_id: String,
    /// `saved` or `spent`.
    pub user_action: UserAction,
    /// `social`, `anti_charity`, `loss_pool` or `none`.
    pub stake_type: Option<StakeType>,
    pub goal_completed: Option<bool>,
    pub received_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UserAction {
    Saved,
    Spent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StakeType {
    Social,
    AntiCharity,
    LossPool,
    None,
}

impl StakeType {
    /// The expected success rate of a commitment with this kind of stake.
    pub fn expected_success(self) -> f64 {
        match self {
            StakeType::Social => 0.78,
            StakeType::AntiCharity => 0.85,
            StakeType::LossPool => 0.72,
            StakeType::None => 0.35,
        }
    }
}

/// The body of `POST /v1/feedback`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackRequest {
    pub request_id: String,
    pub user_action: UserAction,
    pub stake_type: Option<StakeType>,
    pub goal_completed: Option<bool>,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_kept_compact_with_its_strings_as_written() {
        // As OpenAI writes answers: indented, one key a line.
        let written = "{\n  \"prompt_tokens\": 9,\n  \"details\": {\"cached\" : [1, 2.5e3, null, true]},\t\"k e\\\" y\": \" a\\\\\",\r\n  \"u\": \"\\u00e9 €\"\n}";
        let usage = Usage::from_json_text(written);
        assert_eq!(
            usage.as_str(),
            "{\"prompt_tokens\":9,\"details\":{\"cached\":[1,2.5e3,null,true]},\"k e\\\" y\":\" a\\\\\",\"u\":\"\\u00e9 €\"}"
        );
        let parsed = |text: &str| serde_json::from_str::<Value>(text).unwrap();
        assert_eq!(parsed(usage.as_str()), parsed(written));
        // Compact text is kept as it is.
        assert_eq!(Usage::from_json_text(r#"{"a":1}"#).as_str(), r#"{"a":1}"#);
        assert_eq!(
            Usage::from_value(&parsed(written)),
            Usage::from_json_text(&parsed(written).to_string())
        );
    }

    #[test]
    fn usage_goes_through_serde_json_as_its_text() {
        let usage = Usage::from_json_text("{ \"total_tokens\": 12 }");
        let text = serde_json::to_string(&Some(usage.clone())).unwrap();
        assert_eq!(text, r#"{"total_tokens":12}"#);
        let back: Option<Usage> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, Some(usage));
        let spaced: Usage = serde_json::from_str("{\n \"a\" : [ 1 ] }").unwrap();
        assert_eq!(spaced.as_str(), r#"{"a":[1]}"#);
        // Equal as values, whatever the order of keys.
        assert_eq!(
            Usage::from_json_text(r#"{"b":1,"a":2}"#),
            Usage::from_json_text(r#"{"a":2,"b":1}"#)
        );
        assert_ne!(
            Usage::from_json_text(r#"{"b":1}"#),
            Usage::from_json_text(r#"{"b":2}"#)
        );
    }

    #[test]
    fn client_meta_from_headers_wins_over_body_metadata() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-fairgate-expected",
            "Save%20%E2%82%AC50+a%20week".parse().unwrap(),
        );
        let metadata = r#"{"fairgate_expected": "no", "fairgate_user": "u-7", "fairgate_ground_truth": "calm", "fairgate_session": 7}"#;
        let meta = ClientMeta::read(&headers, Some(metadata));
        assert_eq!(meta.expected.as_deref(), Some("Save €50 a week"));
        assert_eq!(meta.user.as_deref(), Some("u-7"));
        assert_eq!(meta.ground_truth.as_deref(), Some("calm"));
        assert_eq!(meta.session, None);

        // Without fairgate's headers, the body's metadata alone; other
        // headers do not count.
        let mut headers = HeaderMap::new();
        headers.insert("x-request-id", "r-1".parse().unwrap());
        let meta = ClientMeta::read(&headers, Some(metadata));
        assert_eq!(meta.expected.as_deref(), Some("no"));
        assert_eq!(meta.user.as_deref(), Some("u-7"));
        // A metadata object with one of fairgate's keys twice is not read.
        let twice = r#"{"fairgate_user": "a", "fairgate_user": "b"}"#;
        let meta = ClientMeta::read(&headers, Some(twice));
        assert_eq!(meta.user, None);
    }

    #[test]
    fn hashes_mode_keeps_no_text() {
        let texts = Texts::new(TextMode::Hashes, vec!["abc".into()], vec![], vec![]);
        assert_eq!(
            texts.prompt,
            ["sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"]
        );
    }
}
