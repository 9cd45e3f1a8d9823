//! The built-in dashboard: `GET /dashboard`, one page (with its script and
//! style) that polls `GET /admin/summary` every two seconds and shows what
//! fairgate blocks and why: requests by verdict, blocks by scope and route,
//! the rules that hit most, the latest blocked exchanges, the time fairgate
//! adds, upstream and stream errors, the side queue and the quality scores.
//!
//! The summary is read from the same Prometheus registry as `/metrics`
//! (counts since the process started; the page works out rates between two
//! polls), plus the [`BlockLog`](crate::telemetry::BlockLog) of the latest
//! blocks: of exchanges, of a batch's requests and answers, of stored
//! answers fetched again. It holds no texts, and neither does the log.
//!
//! The page and its assets hold no data, so they are served without the
//! admin token; the summary needs it like every other admin path. The page
//! asks for the token when the summary answers 401 and keeps it for the
//! browser tab (sessionStorage). Everything the page shows is set as text,
//! never as markup: a model name or a rule id cannot inject a script, and
//! the Content-Security-Policy allows only the page's own script.

use std::collections::BTreeMap;

use prometheus::proto::{Metric, MetricFamily, MetricType};
use serde_json::{Map, Value, json};

use crate::proxy::State;

pub const PAGE: &str = include_str!("dashboard.html");
pub const SCRIPT: &str = include_str!("dashboard.js");
pub const STYLE: &str = include_str!("dashboard.css");

/// The page's Content-Security-Policy: its own script, style and summary.
pub const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// How many of the rules that hit most the summary lists.
const TOP_RULES: usize = 20;

/// What the dashboard shows, as JSON.
pub fn summary(state: &State) -> Value {
    let families = Families(state.metrics.gather());
    let rules = state.rules.snapshot();
    let requests = families.by("fairgate_requests_total", "verdict");
    let total: f64 = requests.values().sum();
    let mut top_rules = families.series("fairgate_rule_hits_total");
    top_rules.sort_by(|a, b| b.1.total_cmp(&a.1));
    top_rules.truncate(TOP_RULES);
    let top_rules: Vec<Value> = top_rules
        .into_iter()
        .map(|(labels, hits)| {
            let mut row: Map<String, Value> = labels
                .into_iter()
                .map(|(name, value)| (name.to_owned(), Value::from(value)))
                .collect();
            row.insert("hits".into(), count(hits));
            Value::Object(row)
        })
        .collect();
    let latency = |name: &str| {
        let histogram = families.histogram(name, |_| true);
        json!({
            "count": histogram.count,
            "p50_ms": histogram.quantile(0.5).map(|s| s * 1000.0),
            "p99_ms": histogram.quantile(0.99).map(|s| s * 1000.0),
        })
    };
    let means = |name: &str, label: &str| -> Map<String, Value> {
        families
            .values(name, label)
            .into_iter()
            .filter_map(|value| {
                let histogram =
                    families.histogram(name, |labels| labels.get(label) == Some(&value));
                let mean = histogram.mean()?;
                Some((
                    value.to_owned(),
                    json!({"mean": mean, "count": histogram.count}),
                ))
            })
            .collect()
    };
    json!({
        "generated_ms": crate::record::now_ms(),
        "rules": {
            "version": rules.version(),
            "loaded": rules.rules().len(),
            "reload": state.rules.status(),
        },
        "requests": {
            "total": count(total),
            "by_verdict": counts(requests),
            "by_route": families.by_two("fairgate_requests_total", "route", "verdict"),
            "by_model": families.by_two("fairgate_requests_total", "model", "verdict"),
        },
        "blocks": {
            "by_scope": counts(families.by("fairgate_blocks_total", "scope")),
            "by_route": counts(families.by("fairgate_blocks_total", "route")),
        },
        "top_rules": top_rules,
        "latency": {
            "added": latency("fairgate_proxy_added_latency_seconds"),
            "upstream": latency("fairgate_upstream_latency_seconds"),
            "stream_first_byte": latency("fairgate_stream_first_byte_seconds"),
        },
        "risk": means("fairgate_risk_score", "scope"),
        "errors": {
            "upstream": counts(families.by("fairgate_upstream_errors_total", "kind")),
            "stream": counts(families.by("fairgate_stream_errors_total", "kind")),
            "fault": counts(families.by("fairgate_faults_total", "stage")),
            "answered": counts(families.by("fairgate_error_answers_total", "code")),
        },
        "stream_ends": counts(families.by("fairgate_stream_ends_total", "end")),
        "queue": {
            "depth": families.total("fairgate_queue_depth"),
            "records": counts(families.by("fairgate_queue_records_total", "event")),
            "lag": latency("fairgate_queue_lag_seconds"),
        },
        "quality": means("fairgate_quality_score", "metric"),
        "tunnels_open": families.total("fairgate_tunnels_open"),
        "recent_blocks": state.blocked.newest_first(),
    })
}

/// A counter's value as a JSON integer (counters count whole events).
fn count(value: f64) -> Value {
    Value::from(value as u64)
}

fn counts(values: BTreeMap<String, f64>) -> Map<String, Value> {
    values.into_iter().map(|(k, v)| (k, count(v))).collect()
}

/// A gathered registry, read by metric name and labels.
struct Families(Vec<MetricFamily>);

/// A series' labels, by name.
type Labels<'a> = BTreeMap<&'a str, &'a str>;

impl Families {
    fn family(&self, name: &str) -> Option<&MetricFamily> {
        self.0.iter().find(|family| family.name() == name)
    }

    fn metrics(&self, name: &str) -> &[Metric] {
        self.family(name).map_or(&[], |family| &family.metric)
    }

    /// Each series of a counter or gauge: its labels and value.
    fn series(&self, name: &str) -> Vec<(Labels<'_>, f64)> {
        let Some(family) = self.family(name) else {
            return Vec::new();
        };
        let gauge = family.type_() == MetricType::GAUGE;
        family
            .metric
            .iter()
            .map(|metric| {
                let value = if gauge {
                    metric.gauge.value()
                } else {
                    metric.counter.value()
                };
                (labels(metric), value)
            })
            .collect()
    }

    /// The sum of every series of a counter or gauge.
    fn total(&self, name: &str) -> f64 {
        self.series(name).iter().map(|(_, value)| value).sum()
    }

    /// A counter's values summed by one label.
    fn by(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let mut sums = BTreeMap::new();
        for (labels, value) in self.series(name) {
            let key = labels.get(label).copied().unwrap_or_default();
            *sums.entry(key.to_owned()).or_default() += value;
        }
        sums
    }

    /// A counter's values summed by two labels: `{outer: {inner: n}}`.
    fn by_two(&self, name: &str, outer: &str, inner: &str) -> Map<String, Value> {
        let mut sums: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
        for (labels, value) in self.series(name) {
            let (a, b) = (labels.get(outer), labels.get(inner));
            let (a, b) = (
                a.copied().unwrap_or_default(),
                b.copied().unwrap_or_default(),
            );
            *sums
                .entry(a.to_owned())
                .or_default()
                .entry(b.to_owned())
                .or_default() += value;
        }
        sums.into_iter()
            .map(|(k, inner)| (k, Value::Object(counts(inner))))
            .collect()
    }

    /// The values one label takes across a metric's series.
    fn values(&self, name: &str, label: &str) -> Vec<&str> {
        let mut values: Vec<&str> = self
            .metrics(name)
            .iter()
            .filter_map(|metric| labels(metric).get(label).copied())
            .collect();
        values.sort_unstable();
        values.dedup();
        values
    }

    /// The series of histogram `name` whose labels `keep` accepts, merged.
    fn histogram(&self, name: &str, keep: impl Fn(&Labels) -> bool) -> Merged {
        let mut merged = Merged::default();
        for metric in self.metrics(name) {
            if !keep(&labels(metric)) {
                continue;
            }
            let histogram = &metric.histogram;
            merged.count += histogram.sample_count();
            merged.sum += histogram.sample_sum();
            for (i, bucket) in histogram.bucket.iter().enumerate() {
                match merged.buckets.get_mut(i) {
                    Some(merged) => merged.1 += bucket.cumulative_count(),
                    None => merged
                        .buckets
                        .push((bucket.upper_bound(), bucket.cumulative_count())),
                }
            }
        }
        merged
    }
}

fn labels(metric: &Metric) -> Labels<'_> {
    metric
        .label
        .iter()
        .map(|pair| (pair.name(), pair.value()))
        .collect()
}

/// Histogram series merged: cumulative counts by upper bound (every series
/// of a metric has the same bounds), observation count and sum.
#[derive(Debug, Default)]
struct Merged {
    buckets: Vec<(f64, u64)>,
    count: u64,
    sum: f64,
}

impl Merged {
    fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// The `q` quantile, as Prometheus' `histogram_quantile` estimates it:
    /// linear within the bucket it falls in; the highest finite bound when
    /// it falls beyond them.
    fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q * self.count as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(upper, cumulative) in &self.buckets {
            if cumulative as f64 >= rank && cumulative > below {
                let within = (rank - below as f64) / (cumulative - below) as f64;
                return Some(lower + (upper - lower) * within);
            }
            (lower, below) = (upper, cumulative);
        }
        Some(lower)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn merged(buckets: &[(f64, u64)], count: u64) -> Merged {
        Merged {
            buckets: buckets.to_vec(),
            count,
            sum: 0.0,
        }
    }

    #[test]
    fn quantiles_interpolate_within_their_bucket() {
        // 10 observations at or below 1, 10 more at or below 2.
        let histogram = merged(&[(1.0, 10), (2.0, 20), (4.0, 20)], 20);
        assert_eq!(histogram.quantile(0.5), Some(1.0));
        assert_eq!(histogram.quantile(0.25), Some(0.5));
        assert_eq!(histogram.quantile(0.75), Some(1.5));
        assert_eq!(histogram.quantile(1.0), Some(2.0));
    }

    #[test]
    fn a_quantile_beyond_every_bound_is_the_highest_one() {
        // Two observations, one above the last finite bound (+Inf is not
        // listed among the buckets).
        let histogram = merged(&[(1.0, 1), (2.0, 1)], 2);
        assert_eq!(histogram.quantile(0.99), Some(2.0));
        assert_eq!(merged(&[(1.0, 0)], 0).quantile(0.5), None);
    }

    #[test]
    fn series_merge_by_label() {
        let metrics = crate::telemetry::Metrics::new();
        metrics
            .requests
            .with_label_values(&["chat", "openai", "gpt-4o", "allow"])
            .inc_by(3);
        metrics
            .requests
            .with_label_values(&["messages", "anthropic", "other", "block"])
            .inc_by(2);
        metrics
            .requests
            .with_label_values(&["chat", "openai", "other", "block"])
            .inc();
        let families = Families(metrics.gather());
        let by_verdict = families.by("fairgate_requests_total", "verdict");
        assert_eq!(by_verdict["allow"], 3.0);
        assert_eq!(by_verdict["block"], 3.0);
        let by_route = families.by_two("fairgate_requests_total", "route", "verdict");
        assert_eq!(by_route["chat"], json!({"allow": 3, "block": 1}));
        assert_eq!(by_route["messages"], json!({"block": 2}));
        let by_model = families.by_two("fairgate_requests_total", "model", "verdict");
        assert_eq!(by_model["gpt-4o"], json!({"allow": 3}));
        assert_eq!(by_model["other"], json!({"block": 3}));
        assert_eq!(families.total("fairgate_requests_total"), 6.0);
        assert!(families.series("fairgate_no_such_metric").is_empty());
    }
}
