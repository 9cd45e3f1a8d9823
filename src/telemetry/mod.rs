//! Prometheus metrics: the only module that creates collectors. Names live
//! here; labels are low-cardinality values (routes, upstream names from the
//! configuration, rule ids, scopes, actions, verdicts), never request ids or
//! model-controlled strings. Beside them, the [`BlockLog`] of the latest
//! blocked exchanges that the admin dashboard lists.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::record::{ExchangeRecord, RecordHit};
use crate::rules::{Action, Hit, Scope};

/// Every metric fairgate exports.
pub struct Metrics {
    registry: Registry,
    /// `fairgate_requests_total{route, upstream, model, verdict}`
    pub requests: IntCounterVec,
    /// `fairgate_blocks_total{route, model, scope}`: exchanges blocked, by the scope
    /// that decided.
    pub blocks: IntCounterVec,
    /// `fairgate_rule_hits_total{rule, category, scope, action}`
    pub rule_hits: IntCounterVec,
    /// `fairgate_risk_score{scope}` of each scope (prompt, response,
    /// context, total), resolved once: a label lookup hashes the labels
    /// twice (SipHash) on every observation. See [`Metrics::observe_risk`].
    risk_by_scope: [Histogram; 4],
    /// `fairgate_upstream_latency_seconds{upstream}`: to the response head.
    pub upstream_latency: HistogramVec,
    /// `fairgate_proxy_added_latency_seconds{route}`: total minus upstream.
    pub added_latency: HistogramVec,
    /// `fairgate_stream_first_byte_seconds{route}`: to the first byte sent
    /// to the client of a streamed response.
    pub stream_first_byte: HistogramVec,
    /// `fairgate_upstream_errors_total{upstream, kind}`
    pub upstream_errors: IntCounterVec,
    /// `fairgate_stream_errors_total{route, kind}`
    pub stream_errors: IntCounterVec,
    /// `fairgate_stream_ends_total{route, end}`: how streamed answers
    /// ended (complete, blocked, client_closed, upstream_failed,
    /// malformed, fault), as their records say.
    pub stream_ends: IntCounterVec,
    /// `fairgate_faults_total{stage}`: faults (panics) of fairgate's own,
    /// while answering a request, guarding a stream or a WebSocket session.
    pub faults: IntCounterVec,
    /// `fairgate_error_answers_total{code}`: requests fairgate answered
    /// with an error of its own (not a block, not the upstream's answer).
    pub error_answers: IntCounterVec,
    /// `fairgate_tunnels_total{upstream}`: upgraded connections (WebSocket)
    /// relayed unscanned.
    pub tunnels: IntCounterVec,
    /// `fairgate_tunnels_open`: upgraded connections open now (tunnels
    /// and Realtime API sessions).
    pub tunnels_open: IntGauge,
    /// `fairgate_connections_open`: client connections to the proxy port
    /// open now.
    pub connections_open: IntGauge,
    /// `fairgate_rules_info{version}`: 1 for the version serving.
    pub rules_info: IntGaugeVec,
    /// `fairgate_rules_loaded`: the number of rules serving.
    pub rules_loaded: IntGauge,
    /// `fairgate_rules_reloads_total{result}`: `ok` or `error`.
    pub reloads: IntCounterVec,
    /// `fairgate_rules_reload_errors_total`
    pub reload_errors: IntCounter,
    /// `fairgate_rules_reload_failing`: 1 while the last reload failed.
    pub reload_failing: IntGauge,
    /// `fairgate_queue_depth`: records waiting in the in-process queue.
    pub queue_depth: IntGauge,
    /// `fairgate_queue_records_total{event}`.
    pub queue_records: QueueRecords,
    /// `fairgate_queue_lag_seconds`: from the end of an exchange to its
    /// stored results.
    pub queue_lag: Histogram,
    /// `fairgate_quality_score{metric}`: every computed metric score (see
    /// [`Metrics::observe_quality`]).
    quality: HistogramVec,
    /// `quality` of each metric seen so far, resolved once.
    quality_by_name: std::sync::Mutex<Vec<(String, Histogram)>>,
    /// Each metric's name and label names, as registered.
    described: Vec<Described>,
}

/// A metric's name and the names of its labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    pub name: String,
    pub labels: Vec<String>,
}

/// Latency buckets from 50 µs to 60 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Quality scores: most are in [0, 1]; entropy goes to 3 bits, lengths and
/// latencies higher.
const QUALITY_BUCKETS: &[f64] = &[
    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 2.5, 3.0, 10.0, 100.0, 1000.0,
    10000.0,
];

const RISK_BUCKETS: &[f64] = &[0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// What happened to a side-queue record: the `event` label of
/// `fairgate_queue_records_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueEvent {
    Enqueued,
    Spilled,
    Replayed,
    Dropped,
    Published,
    Processed,
    Duplicate,
    Failed,
}

impl QueueEvent {
    const ALL: [QueueEvent; 8] = [
        QueueEvent::Enqueued,
        QueueEvent::Spilled,
        QueueEvent::Replayed,
        QueueEvent::Dropped,
        QueueEvent::Published,
        QueueEvent::Processed,
        QueueEvent::Duplicate,
        QueueEvent::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            QueueEvent::Enqueued => "enqueued",
            QueueEvent::Spilled => "spilled",
            QueueEvent::Replayed => "replayed",
            QueueEvent::Dropped => "dropped",
            QueueEvent::Published => "published",
            QueueEvent::Processed => "processed",
            QueueEvent::Duplicate => "duplicate",
            QueueEvent::Failed => "failed",
        }
    }
}

/// `fairgate_queue_records_total`, one counter per [`QueueEvent`] resolved
/// once (records are counted several times each, and a labelled lookup
/// hashes its labels under a lock). Cheap to clone: the spill writer and
/// the queue hold it too.
#[derive(Clone)]
pub struct QueueRecords([IntCounter; 8]);

impl QueueRecords {
    fn resolve(vec: &IntCounterVec) -> QueueRecords {
        QueueRecords(QueueEvent::ALL.map(|event| vec.with_label_values(&[event.as_str()])))
    }

    pub fn count(&self, event: QueueEvent) {
        self.0[event as usize].inc();
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let described = std::cell::RefCell::new(Vec::new());
        // Names are fixed and distinct, so registration cannot collide.
        let register = |collector: Box<dyn prometheus::core::Collector>| {
            described
                .borrow_mut()
                .extend(collector.desc().into_iter().map(|desc| Described {
                    name: desc.fq_name.clone(),
                    labels: desc.variable_labels.clone(),
                }));
            let _ = registry.register(collector);
        };
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)
                .unwrap_or_else(|e| unreachable_metric(name, e));
            register(Box::new(c.clone()));
            c
        };
        let histogram = |name: &str, help: &str, labels: &[&str], buckets: &[f64]| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                labels,
            )
            .unwrap_or_else(|e| unreachable_metric(name, e));
            register(Box::new(h.clone()));
            h
        };
        let requests = counter(
            "fairgate_requests_total",
            "Guarded requests by route, upstream, model (as metrics.models lists them, else other) and verdict.",
            &["route", "upstream", "model", "verdict"],
        );
        let blocks = counter(
            "fairgate_blocks_total",
            "Blocked exchanges by route, model (as metrics.models lists them, else other) and deciding scope.",
            &["route", "model", "scope"],
        );
        let rule_hits = counter(
            "fairgate_rule_hits_total",
            "Rule hits by rule, category, scope and action.",
            &["rule", "category", "scope", "action"],
        );
        let upstream_errors = counter(
            "fairgate_upstream_errors_total",
            "Upstream failures by kind (connect, timeout, body, ambiguous, encoded, not_json, malformed).",
            &["upstream", "kind"],
        );
        let stream_errors = counter(
            "fairgate_stream_errors_total",
            "Malformed or broken upstream streams.",
            &["route", "kind"],
        );
        let stream_ends = counter(
            "fairgate_stream_ends_total",
            "How streamed answers ended: complete, blocked, client_closed (the client left first), upstream_failed, malformed, fault.",
            &["route", "end"],
        );
        let faults = counter(
            "fairgate_faults_total",
            "Faults (panics) of fairgate's own, answered with an error: while handling a request (request), guarding a stream (stream) or a WebSocket session (session).",
            &["stage"],
        );
        let error_answers = counter(
            "fairgate_error_answers_total",
            "Requests fairgate answered with an error of its own, not a block nor the upstream's answer, by code (request_too_large, invalid_json, ambiguous_json, request_timeout, upstream_unreachable, upstream_timeout, ...).",
            &["code"],
        );
        let tunnels = counter(
            "fairgate_tunnels_total",
            "Upgraded connections (WebSocket) relayed unscanned, by upstream.",
            &["upstream"],
        );
        let reloads = counter(
            "fairgate_rules_reloads_total",
            "Rule reloads by result.",
            &["result"],
        );
        let risk = histogram(
            "fairgate_risk_score",
            "Risk scores by scope.",
            &["scope"],
            RISK_BUCKETS,
        );
        let upstream_latency = histogram(
            "fairgate_upstream_latency_seconds",
            "Time from forwarding a request to the upstream's response head.",
            &["upstream"],
            LATENCY_BUCKETS,
        );
        let added_latency = histogram(
            "fairgate_proxy_added_latency_seconds",
            "Time fairgate adds to an exchange: total minus upstream.",
            &["route"],
            LATENCY_BUCKETS,
        );
        let stream_first_byte = histogram(
            "fairgate_stream_first_byte_seconds",
            "Time to the first byte of a streamed response sent to the client.",
            &["route"],
            LATENCY_BUCKETS,
        );
        let queue_records = QueueRecords::resolve(&counter(
            "fairgate_queue_records_total",
            "Side-queue records by event: enqueued, spilled, replayed, dropped, published, processed, duplicate, failed.",
            &["event"],
        ));
        let queue_lag = Histogram::with_opts(
            HistogramOpts::new(
                "fairgate_queue_lag_seconds",
                "Time from the end of an exchange to its stored results.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )
        .unwrap_or_else(|e| unreachable_metric("fairgate_queue_lag_seconds", e));
        register(Box::new(queue_lag.clone()));
        let quality = histogram(
            "fairgate_quality_score",
            "Quality metric scores by metric.",
            &["metric"],
            QUALITY_BUCKETS,
        );
        let rules_info = IntGaugeVec::new(
            Opts::new("fairgate_rules_info", "The rule set serving, by version."),
            &["version"],
        )
        .unwrap_or_else(|e| unreachable_metric("fairgate_rules_info", e));
        register(Box::new(rules_info.clone()));
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).unwrap_or_else(|e| unreachable_metric(name, e));
            register(Box::new(g.clone()));
            g
        };
        let rules_loaded = gauge("fairgate_rules_loaded", "Rules serving.");
        let queue_depth = gauge(
            "fairgate_queue_depth",
            "Records waiting in the in-process queue.",
        );
        let tunnels_open = gauge(
            "fairgate_tunnels_open",
            "Upgraded connections (WebSocket) open now.",
        );
        let connections_open = gauge(
            "fairgate_connections_open",
            "Client connections to the proxy port open now (at most max_connections).",
        );
        let reload_failing = gauge(
            "fairgate_rules_reload_failing",
            "1 while the last rule reload failed.",
        );
        let reload_errors = IntCounter::new(
            "fairgate_rules_reload_errors_total",
            "Rule reloads that failed.",
        )
        .unwrap_or_else(|e| unreachable_metric("fairgate_rules_reload_errors_total", e));
        register(Box::new(reload_errors.clone()));
        let risk_by_scope = ["prompt", "response", "context", "total"]
            .map(|scope| risk.with_label_values(&[scope]));
        Metrics {
            registry,
            requests,
            blocks,
            rule_hits,
            risk_by_scope,
            upstream_latency,
            added_latency,
            stream_first_byte,
            upstream_errors,
            stream_errors,
            stream_ends,
            faults,
            error_answers,
            tunnels,
            tunnels_open,
            connections_open,
            rules_info,
            rules_loaded,
            reloads,
            reload_errors,
            reload_failing,
            queue_depth,
            queue_records,
            queue_lag,
            quality,
            quality_by_name: Default::default(),
            described: described.into_inner(),
        }
    }

    /// Records the risk scores of an exchange.
    pub fn observe_risk(&self, risk: &crate::risk::Risk) {
        let values = [risk.prompt, risk.response, risk.context, risk.total];
        for (histogram, value) in self.risk_by_scope.iter().zip(values) {
            histogram.observe(value);
        }
    }

    /// Records the score of the quality metric `name`.
    pub fn observe_quality(&self, name: &str, score: f64) {
        let Ok(mut resolved) = self.quality_by_name.lock() else {
            return self.quality.with_label_values(&[name]).observe(score);
        };
        match resolved.iter().find(|(known, _)| known == name) {
            Some((_, histogram)) => histogram.observe(score),
            None => {
                let histogram = self.quality.with_label_values(&[name]);
                histogram.observe(score);
                resolved.push((name.to_owned(), histogram));
            }
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Every metric's current values, for the admin dashboard's summary.
    pub fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.registry.gather()
    }

    /// Each metric fairgate registers, with its label names: what a
    /// dashboard may query, whether or not it has a value yet.
    pub fn described(&self) -> &[Described] {
        &self.described
    }

    /// Records a newly serving rule set.
    pub fn rules_swapped(&self, version: &str, rules: usize) {
        self.rules_info.reset();
        self.rules_info.with_label_values(&[version]).set(1);
        self.rules_loaded.set(rules as i64);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Metric definitions are constants: an invalid one is a programming error
/// that the tests catch on the first run.
fn unreachable_metric<T>(name: &str, error: prometheus::Error) -> T {
    panic!("metric {name} is invalid: {error}")
}

/// The last [`BlockLog::KEPT`] blocked exchanges, for the admin dashboard:
/// where each was blocked and by which rules, never its texts (a blocked
/// prompt may hold the very card number a rule caught).
#[derive(Default)]
pub struct BlockLog {
    entries: std::sync::Mutex<std::collections::VecDeque<Blocked>>,
}

/// One blocked exchange, as the dashboard lists it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Blocked {
    pub request_id: String,
    pub finished_ms: i64,
    pub route: String,
    pub upstream: String,
    /// The model the client asked for, as it wrote it (up to
    /// [`Blocked::MODEL_CHARS`] characters): shown, never a label.
    pub model: Option<String>,
    pub stream: bool,
    /// `prompt`, `context` or `response`: what was blocked.
    pub scope: &'static str,
    /// The HTTP status the client got; none for a block in a stored
    /// answer's stream.
    pub status: Option<u16>,
    pub risk: f64,
    /// The rules that hit, blocking ones first.
    pub rules: Vec<BlockedRule>,
}

impl Blocked {
    /// How much of a model name the log keeps: a client may send any
    /// string, of any length, and the log keeps a hundred.
    pub const MODEL_CHARS: usize = 100;

    /// The entry of a block, now, by `verdict`, of `scope` in what
    /// `request_id` carried on `route`; no model, not a stream.
    pub fn new(
        request_id: &str,
        route: &str,
        upstream: &str,
        scope: &'static str,
        status: Option<u16>,
        verdict: &crate::risk::Verdict,
    ) -> Blocked {
        Blocked {
            request_id: request_id.to_owned(),
            finished_ms: crate::record::now_ms(),
            route: route.to_owned(),
            upstream: upstream.to_owned(),
            model: None,
            stream: false,
            scope,
            status,
            risk: verdict.risk.total,
            rules: BlockedRule::of(&verdict.hits),
        }
    }

    /// The entry of a blocked exchange's record, as it is made or as it is
    /// read back after a restart: blocked in the response once the upstream
    /// was called, else where its first blocking rule hit (the prompt when
    /// the total risk blocked it).
    pub fn of_record(record: &ExchangeRecord) -> Blocked {
        let blocking = record.hits.iter().find(|h| h.action == Action::Block);
        let scope = match (record.upstream_ms, blocking) {
            (Some(_), _) => Scope::Response,
            (None, Some(hit)) => hit.scope,
            (None, None) => Scope::Prompt,
        };
        Blocked {
            request_id: record.request_id.clone(),
            finished_ms: record.finished_ms,
            route: record.route.clone(),
            upstream: record.upstream.clone(),
            model: (record.model.as_ref())
                .map(|model| model.chars().take(Self::MODEL_CHARS).collect()),
            stream: record.stream,
            scope: scope.as_str(),
            status: Some(record.status),
            risk: record.risk.total,
            rules: BlockedRule::of_record(&record.hits),
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BlockedRule {
    pub rule: String,
    pub category: String,
    pub scope: &'static str,
    pub action: &'static str,
}

impl BlockedRule {
    /// The rules of `hits`, each once a scope, blocking ones first.
    pub fn of(hits: &[Hit]) -> Vec<BlockedRule> {
        Self::of_each(
            hits.iter()
                .map(|hit| (&*hit.rule, &*hit.category, hit.scope, hit.action)),
        )
    }

    /// The same of the hits an exchange record keeps.
    pub fn of_record(hits: &[RecordHit]) -> Vec<BlockedRule> {
        Self::of_each(
            hits.iter()
                .map(|hit| (&*hit.rule, &*hit.category, hit.scope, hit.action)),
        )
    }

    /// Of each hit's rule, category, scope and action.
    fn of_each<'a>(
        hits: impl ExactSizeIterator<Item = (&'a str, &'a str, Scope, Action)>,
    ) -> Vec<BlockedRule> {
        let mut rules: Vec<BlockedRule> = Vec::with_capacity(hits.len());
        for (rule, category, scope, action) in hits {
            let scope = scope.as_str();
            if !rules.iter().any(|r| r.rule == rule && r.scope == scope) {
                rules.push(BlockedRule {
                    rule: rule.to_owned(),
                    category: category.to_owned(),
                    scope,
                    action: action.as_str(),
                });
            }
        }
        // Stable: the hits' order otherwise.
        rules.sort_by_key(|rule| rule.action != Action::Block.as_str());
        rules
    }
}

impl BlockLog {
    /// How many blocked exchanges the log keeps.
    pub const KEPT: usize = 100;

    /// Adds a blocked exchange, forgetting the oldest beyond [`Self::KEPT`].
    pub fn push(&self, blocked: Blocked) {
        // A poisoned lock only means a panic elsewhere mid-push: the log is
        // still a list of whole entries.
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() == Self::KEPT {
            entries.pop_back();
        }
        entries.push_front(blocked);
    }

    /// Fills the log with the blocked exchanges that the JSON-lines
    /// results in `dir` hold (the newest [`Self::KEPT`] of the last two
    /// days' files), so that the dashboard's list survives a restart. Blocks
    /// that have no exchange record (of stored answers fetched again) are
    /// not among them.
    pub fn restore(&self, dir: &std::path::Path) -> anyhow::Result<usize> {
        let records = crate::sink::jsonl::recent_blocks(dir, Self::KEPT)?;
        Ok(self.restore_older(&records))
    }

    /// Adds blocked exchanges older than those the log holds (`records`
    /// newest first), as far as there is room, but for those it holds
    /// already: a read-back that ends after the first live blocks came.
    pub fn restore_older(&self, records: &[ExchangeRecord]) -> usize {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let mut restored = 0;
        for record in records {
            if entries.len() == Self::KEPT {
                break;
            }
            if entries.iter().all(|b| b.request_id != record.request_id) {
                entries.push_back(Blocked::of_record(record));
                restored += 1;
            }
        }
        restored
    }

    /// The blocked exchanges kept, newest first.
    pub fn newest_first(&self) -> Vec<Blocked> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked_record(request_id: &str) -> ExchangeRecord {
        serde_json::from_value(serde_json::json!({
            "schema_version": 1, "request_id": request_id, "started_ms": 0, "finished_ms": 1,
            "route": "chat_completions", "dialect": "openai", "upstream": "openai", "model": null,
            "stream": false, "status": 400,
            "texts": {"mode": "full", "prompt": [], "context": [], "response": []},
            "verdict": "block", "risk": {"prompt": 1.0, "response": 0.0, "context": 0.0, "total": 1.0},
            "hits": [], "upstream_ms": null, "proxy_ms": 0.0, "total_ms": 0.0, "usage": null,
            "client": {"session": null, "user": null, "ground_truth": null, "expected": null}
        }))
        .unwrap()
    }

    /// Blocks read back go behind the live ones, newest first, once each,
    /// as far as the log has room.
    #[test]
    fn older_blocks_go_behind_the_live_ones_once_each() {
        let log = BlockLog::default();
        log.push(Blocked::of_record(&blocked_record("live-1")));
        log.push(Blocked::of_record(&blocked_record("live-2")));
        let read: Vec<ExchangeRecord> = ["live-1", "old-1", "old-2"]
            .into_iter()
            .map(blocked_record)
            .collect();
        assert_eq!(log.restore_older(&read), 2);
        let ids: Vec<String> = log
            .newest_first()
            .into_iter()
            .map(|b| b.request_id)
            .collect();
        assert_eq!(ids, ["live-2", "live-1", "old-1", "old-2"]);

        let many: Vec<ExchangeRecord> = (0..2 * BlockLog::KEPT)
            .map(|i| blocked_record(&format!("older-{i}")))
            .collect();
        assert_eq!(log.restore_older(&many), BlockLog::KEPT - 4);
        let listed = log.newest_first();
        assert_eq!(listed.len(), BlockLog::KEPT);
        assert_eq!(listed[4].request_id, "older-0");
        assert_eq!(
            listed[BlockLog::KEPT - 1].request_id,
            format!("older-{}", BlockLog::KEPT - 5)
        );
    }
}
