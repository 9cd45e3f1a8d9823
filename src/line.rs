//! Records and results as JSON lines: a [`Processed`] (the line a sink
//! stores) and a [`QueueItem`] (the message a NATS queue carries, and the
//! line a spill file keeps), written as the JSON of their `Serialize`
//! derives, byte for byte, at a fraction of the cost.
//!
//! A result line is written once per exchange, on the side queue's thread,
//! and was the largest single cost of an exchange (21.7k of some 120k
//! instructions, by callgrind): a serde serializer writes each of the
//! line's some 90 keys as a string it has to check for characters to
//! escape (about 100 instructions a key in sonic-rs). Here each key, with
//! the punctuation around it, is one copy of bytes made from the field's
//! name when compiling (`fields!`, `object!`), and only the values go
//! through sonic-rs, so that strings, numbers and `details` are escaped
//! and formatted exactly as before; `usage` is written as the compact JSON
//! text it is kept as ([`Usage`](crate::record::Usage)). Tests hold the
//! writer to the bytes serde_json writes for records with every field set.
//!
//! The rare feedback record is written by its derive.

use serde::Serialize;

use crate::record::{ExchangeRecord, QueueItem};
use crate::sink::Processed;

/// `,"name":value` for each field of `$of` named, in the order given: each
/// key, made from the field's name when compiling, then the value as serde
/// writes it.
macro_rules! fields {
    ($out:expr, $of:expr; $($field:ident),+) => {
        $(value($out, concat!(",\"", stringify!($field), "\":").as_bytes(), &$of.$field)?;)+
    };
}

/// `{"name":value,...}`: the fields of `$of` named, as `fields!` writes
/// them, in an object.
macro_rules! object {
    ($out:expr, $of:expr; $first:ident $(, $field:ident)*) => {
        value($out, concat!("{\"", stringify!($first), "\":").as_bytes(), &$of.$first)?;
        $(fields!($out, $of; $field);)*
        $out.push(b'}');
    };
}

/// Appends `processed` as one line of JSON (without the newline).
pub fn write(out: &mut Vec<u8>, processed: &Processed) -> sonic_rs::Result<()> {
    value(out, br#"{"kind":"#, &processed.kind)?;
    fields!(out, processed; request_id, processed_ms);
    if let Some(exchange) = &processed.exchange {
        out.extend_from_slice(br#","exchange":"#);
        exchange_record(out, br#"{"schema_version":"#, exchange)?;
    }
    if let Some(feedback) = &processed.feedback {
        value(out, br#","feedback":"#, feedback)?;
    }
    out.extend_from_slice(br#","metrics":"#);
    list(out, &processed.metrics, |out, metric| {
        object!(out, metric; name, score, reason, details);
        Ok(())
    })?;
    out.push(b'}');
    Ok(())
}

/// Appends `item` as one message of JSON: its fields after its `kind`.
pub fn write_item(out: &mut Vec<u8>, item: &QueueItem) -> sonic_rs::Result<()> {
    match item {
        QueueItem::Exchange(record) => {
            exchange_record(out, br#"{"kind":"exchange","schema_version":"#, record)
        }
        QueueItem::Feedback(_) => sonic_rs::to_writer(&mut *out, item),
    }
}

/// `key` (with the punctuation before and after it), then `value` as
/// serde writes it.
fn value<T: Serialize + ?Sized>(
    out: &mut Vec<u8>,
    key: &'static [u8],
    value: &T,
) -> sonic_rs::Result<()> {
    out.extend_from_slice(key);
    sonic_rs::to_writer(&mut *out, value)
}

/// A JSON array of `items`, each written by `write`.
fn list<T>(
    out: &mut Vec<u8>,
    items: &[T],
    write: fn(&mut Vec<u8>, &T) -> sonic_rs::Result<()>,
) -> sonic_rs::Result<()> {
    out.push(b'[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(out, item)?;
    }
    out.push(b']');
    Ok(())
}

/// An exchange record's fields, `open` being what comes before the value of
/// the first (`schema_version`).
fn exchange_record(
    out: &mut Vec<u8>,
    open: &'static [u8],
    record: &ExchangeRecord,
) -> sonic_rs::Result<()> {
    value(out, open, &record.schema_version)?;
    fields!(out, record;
        request_id, started_ms, finished_ms, route, dialect, upstream, upstream_request_id, model,
        stream, status, stream_end, custom_id);
    out.extend_from_slice(br#","texts":"#);
    object!(out, record.texts; mode, prompt, context, response);
    fields!(out, record; verdict);
    out.extend_from_slice(br#","risk":"#);
    object!(out, record.risk; prompt, response, context, total);
    out.extend_from_slice(br#","hits":"#);
    list(out, &record.hits, |out, hit| {
        object!(out, hit; rule, category, scope, action, start, end, snippet);
        Ok(())
    })?;
    fields!(out, record; upstream_ms, proxy_ms, total_ms);
    out.extend_from_slice(br#","usage":"#);
    match &record.usage {
        Some(usage) => out.extend_from_slice(usage.as_str().as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(br#","client":"#);
    object!(out, record.client; session, user, ground_truth, expected);
    out.push(b'}');
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::quality::MetricResult;
    use crate::record::{
        ClientMeta, FeedbackRecord, RecordHit, StakeType, StreamEnd, TextMode, Texts, Usage,
        UserAction,
    };
    use crate::risk::{Decision, Risk};
    use crate::rules::{Action, Scope};

    fn line(processed: &Processed) -> String {
        let mut out = Vec::new();
        write(&mut out, processed).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// An exchange with every field set, and strings that need escaping.
    fn exchange() -> Processed {
        let hit = |scope, action, snippet: Option<&str>| RecordHit {
            rule: "fin.guarantee".into(),
            category: "financial_safety".into(),
            scope,
            action,
            start: 3,
            end: 17,
            snippet: snippet.map(str::to_owned),
        };
        let record = ExchangeRecord {
            schema_version: 1,
            request_id: "fg-1-\"quoted\"".into(),
            started_ms: 1_795_300_000_000,
            finished_ms: 1_795_300_000_042,
            route: "chat_completions".into(),
            dialect: "openai".into(),
            upstream: "openai".into(),
            upstream_request_id: Some("req_7\u{e9}".into()),
            model: Some("gpt-4o-mini".into()),
            stream: true,
            status: 200,
            stream_end: Some(StreamEnd::ClientClosed),
            custom_id: Some("request \"1\"".into()),
            texts: Texts::new(
                TextMode::Full,
                vec!["line\none \\ \u{1} é €".into(), "two".into()],
                vec!["<doc>\t\"x\"</doc>".into()],
                vec!["Guaranteed returns 😀".into()],
            ),
            verdict: Decision::Block,
            risk: Risk {
                prompt: 0.25,
                response: 1.0,
                context: 0.0,
                total: 0.7000000000000001,
            },
            hits: vec![
                hit(Scope::Response, Action::Block, Some("guaranteed returns")),
                hit(Scope::Prompt, Action::Redact, None),
            ],
            upstream_ms: Some(12.5),
            proxy_ms: 0.041,
            total_ms: 12.541,
            usage: Some(Usage::from_json_text(
                "{\n  \"prompt_tokens\": 20,\n  \"completion_tokens\": 25, \"nested\": {\"a\": [1, 2.5, null], \"k e\\\" y\": \" \\\\\"}\n}",
            )),
            client: ClientMeta {
                session: Some("s-1".into()),
                user: Some("u-7".into()),
                ground_truth: Some("calm".into()),
                expected: Some("Save €50 a week".into()),
            },
        };
        Processed {
            kind: "exchange".into(),
            request_id: record.request_id.clone(),
            processed_ms: 1_795_300_000_050,
            exchange: Some(Box::new(record)),
            feedback: None,
            metrics: vec![
                MetricResult {
                    name: "politeness".into(),
                    score: Some(0.5),
                    reason: "1 politeness marker".into(),
                    details: json!({"markers": ["please"]}),
                },
                MetricResult {
                    name: "exact_match".into(),
                    score: None,
                    reason: format!("no \"expected\" answer {}", 7).into(),
                    details: serde_json::Value::Null,
                },
                MetricResult {
                    name: "latency".into(),
                    score: Some(f64::NAN),
                    reason: "not a number".into(),
                    details: json!(-0.0),
                },
            ],
        }
    }

    #[test]
    fn an_exchange_line_is_what_serde_writes() {
        let processed = exchange();
        let serde = serde_json::to_string(&processed).unwrap();
        assert_eq!(line(&processed), serde);
        // And reads back as the same results.
        let mut back: Processed = serde_json::from_str(&line(&processed)).unwrap();
        let nan = back.metrics[2].score.take();
        assert!(nan.is_none(), "NaN is written as null");
        let mut expected = processed;
        expected.metrics[2].score = None;
        assert_eq!(back, expected);
    }

    #[test]
    fn a_queue_message_is_what_serde_writes() {
        let record = exchange().exchange.unwrap();
        let item = QueueItem::Exchange(record);
        let mut out = Vec::new();
        write_item(&mut out, &item).unwrap();
        assert_eq!(out, serde_json::to_vec(&item).unwrap());
        let back: QueueItem = serde_json::from_slice(&out).unwrap();
        assert_eq!(back, item);
    }

    #[test]
    fn empty_lists_and_absent_values_are_what_serde_writes() {
        let mut processed = exchange();
        let record = processed.exchange.as_mut().unwrap();
        record.hits.clear();
        record.texts = Texts::new(TextMode::Hashes, vec![], vec![], vec!["a".into()]);
        record.model = None;
        record.upstream_ms = None;
        record.usage = None;
        record.client = ClientMeta::default();
        processed.metrics.clear();
        assert_eq!(line(&processed), serde_json::to_string(&processed).unwrap());
    }

    #[test]
    fn a_feedback_line_is_what_serde_writes() {
        let processed = Processed {
            kind: "feedback".into(),
            request_id: "fg-2".into(),
            processed_ms: 1_795_300_000_000,
            exchange: None,
            feedback: Some(FeedbackRecord {
                schema_version: 1,
                request_id: "fg-2".into(),
                user_action: UserAction::Saved,
                stake_type: Some(StakeType::AntiCharity),
                goal_completed: Some(true),
                received_ms: 1_795_299_999_000,
            }),
            metrics: vec![MetricResult {
                name: "commitment_success".into(),
                score: Some(1.0),
                reason: "goal completed".into(),
                details: json!({"expected_success": 0.85}),
            }],
        };
        assert_eq!(line(&processed), serde_json::to_string(&processed).unwrap());
        let item = QueueItem::Feedback(processed.feedback.unwrap());
        let mut out = Vec::new();
        write_item(&mut out, &item).unwrap();
        assert_eq!(out, serde_json::to_vec(&item).unwrap());
    }
}
