//! Workers: turn a queue item into its results (the quality metrics of
//! [`crate::quality`]) and store them in the [`crate::sink`]s.
//!
//! The same [`Processor`] runs inside the proxy (memory queue) and in
//! `fairgate worker` processes (NATS JetStream, see
//! [`crate::queue::nats::run_worker`]).

use std::sync::Arc;

use crate::config::Config;
use crate::quality::{self, Answer, MetricResult, Outcome};
use crate::record::{
    BATCH_REQUESTS, BATCH_RESULTS, ExchangeRecord, QueueItem, TextMode, now_ms, unread_answer,
};
use crate::sink::{Processed, Sinks, Stored};
use crate::telemetry::{Metrics, QueueEvent};

/// The metrics that read the answer: a record of a request whose answer
/// fairgate passes on unread ([`unread_answer`]) has no score for them.
const ANSWER_METRICS: &[&str] = &[
    "emotional_entropy",
    "ground_truth_spearman",
    "exact_match",
    "keyword_recall",
    "answer_length",
    "politeness",
];

/// Whether metric `name` reads texts (the answer's, or the question and
/// context): a record that keeps only hashes has no score for them.
fn reads_texts(name: &str) -> bool {
    ANSWER_METRICS.contains(&name) || name == "context_relevance"
}

/// Loads the quality metrics' settings; a missing lexicon leaves the
/// emotion metrics without a score, and says why.
pub fn quality_metrics(config: &Config) -> quality::Metrics {
    let path = &config.quality.lexicon;
    let lexicon = quality::lexicon::Lexicon::load(path)
        .map_err(|e| format!("{e} (import one with `fairgate lexicon import`, see the README)"));
    quality::Metrics::new(lexicon, config.quality.politeness_markers.clone())
}

pub struct Processor {
    pub quality: quality::Metrics,
    sinks: Sinks,
    telemetry: Arc<Metrics>,
}

impl Processor {
    /// Opens the sinks of `config`.
    pub async fn open(config: &Config, telemetry: Arc<Metrics>) -> anyhow::Result<Processor> {
        Ok(Processor {
            quality: quality_metrics(config),
            sinks: Sinks::open(&config.sinks, &config.queue.nats.url).await?,
            telemetry,
        })
    }

    /// The results of one item.
    pub fn results(&self, item: QueueItem) -> Processed {
        let processed_ms = now_ms();
        match item {
            QueueItem::Exchange(record) => Processed {
                kind: "exchange".into(),
                request_id: record.request_id.clone(),
                processed_ms,
                metrics: exchange_metrics(&self.quality, &record),
                exchange: Some(record),
                feedback: None,
            },
            QueueItem::Feedback(feedback) => Processed {
                kind: "feedback".into(),
                request_id: feedback.request_id.clone(),
                processed_ms,
                metrics: quality::outcome(Some(&Outcome {
                    user_action: feedback.user_action,
                    stake_type: feedback.stake_type,
                    goal_completed: feedback.goal_completed,
                })),
                exchange: None,
                feedback: Some(feedback),
            },
        }
    }

    /// Writes out what the sinks buffered.
    pub fn flush(&self) -> anyhow::Result<()> {
        self.sinks.flush()
    }

    /// Computes and stores the results of `item` (buffered until
    /// [`Processor::flush`]); counts and times it. On failure the item comes
    /// back, so that the caller can keep it.
    pub async fn process(&self, item: QueueItem) -> Result<Stored, (anyhow::Error, QueueItem)> {
        let created = item.created_ms();
        let processed = self.results(item);
        let stored = match self.sinks.write(&processed).await {
            Ok(stored) => stored,
            Err(error) => return Err((error, processed.into_item())),
        };
        match stored {
            Stored::New => {
                self.telemetry.queue_records.count(QueueEvent::Processed);
                let lag = (now_ms() - created).max(0) as f64 / 1000.0;
                self.telemetry.queue_lag.observe(lag);
                for metric in &processed.metrics {
                    if let Some(score) = metric.score {
                        self.telemetry.observe_quality(&metric.name, score);
                    }
                }
            }
            Stored::Duplicate => self.telemetry.queue_records.count(QueueEvent::Duplicate),
        }
        Ok(stored)
    }
}

/// The answer metrics of an exchange record.
pub fn exchange_metrics(quality: &quality::Metrics, record: &ExchangeRecord) -> Vec<MetricResult> {
    let (question, context, response) = (
        record.texts.prompt_text(),
        record.texts.context_text(),
        record.texts.response_text(),
    );
    let answer = Answer {
        question: &question,
        context: &context,
        response: &response,
        expected: record.client.expected.as_deref(),
        ground_truth: record.client.ground_truth.as_deref(),
        latency_ms: Some(record.total_ms),
        hits: &record.hits,
    };
    let mut metrics = quality.answer(&answer);
    let unscored = |metrics: &mut [MetricResult], unread: fn(&str) -> bool, reason: String| {
        for metric in metrics.iter_mut() {
            if unread(&metric.name) {
                metric.score = None;
                metric.reason = reason.clone().into();
                metric.details = serde_json::Value::Null;
            }
        }
    };
    if record.texts.mode == TextMode::Hashes {
        let reason = "the record keeps no texts (records.texts: hashes)";
        unscored(&mut metrics, reads_texts, reason.into());
    }
    if unread_answer::is(&record.route) {
        let reason = format!(
            "fairgate passes the answer of a {} request on unread",
            record.route
        );
        unscored(&mut metrics, |name| ANSWER_METRICS.contains(&name), reason);
    }
    if record.route == BATCH_RESULTS {
        // Its request went up with the batch, long before: no question to
        // hold the context to, and no time the answer took.
        let reason = "a batch's answer is read apart from its request";
        let apart = |name: &str| ["context_relevance", "latency"].contains(&name);
        unscored(&mut metrics, apart, reason.into());
    }
    if record.route == BATCH_REQUESTS {
        let reason = "a batch's request is answered in the batch's results, recorded apart";
        let answered = |name: &str| ANSWER_METRICS.contains(&name) || name == "latency";
        unscored(&mut metrics, answered, reason.into());
    }
    metrics
}
