//! `fairgate eval`: the rules and quality metrics run offline over a JSON
//! lines dataset of `{input, output, context?, expected?, ground_truth?,
//! user_action?, stake_type?, goal_completed?}` rows.
//!
//! It prints a summary per metric and the verdicts, writes row-level results
//! (`--out`), and with `--compare BASELINE_RULES` lists the rows whose
//! verdict a rule change would change.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, Write};
use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::config::Config;
use crate::quality::{self, Answer, MetricResult, Outcome};
use crate::record::{RecordHit, StakeType, TextMode, UserAction};
use crate::risk::{self, Decision, Verdict};
use crate::rules::{RuleSet, Scope};
use crate::text;

/// One dataset row.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    pub input: String,
    pub output: String,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub expected: Option<String>,
    #[serde(default)]
    pub ground_truth: Option<String>,
    #[serde(default)]
    pub user_action: Option<UserAction>,
    #[serde(default)]
    pub stake_type: Option<StakeType>,
    #[serde(default)]
    pub goal_completed: Option<bool>,
}

/// The metrics `eval` reports, in order.
pub const METRICS: [&str; 11] = [
    "emotional_entropy",
    "ground_truth_spearman",
    "exact_match",
    "keyword_recall",
    "answer_length",
    "politeness",
    "context_relevance",
    "financial_safety",
    "tone_banned_words",
    "intervention_success",
    "stake_effectiveness",
];

/// Reads a dataset; a line that is not a row is an error naming the line.
pub fn read_dataset(path: &Path) -> Result<Vec<Row>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut rows = Vec::new();
    for (n, line) in io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let row = serde_json::from_str(&line)
            .map_err(|e| format!("{}:{}: not a dataset row: {e}", path.display(), n + 1))?;
        rows.push(row);
    }
    Ok(rows)
}

/// The verdict of a row under `rules`.
pub fn verdict(rules: &RuleSet, config: &Config, row: &Row) -> Verdict {
    let mut hits = rules.scan(Scope::Prompt, &row.input);
    let mut relevance = Vec::new();
    if let Some(context) = row.context.as_deref().filter(|c| !c.is_empty()) {
        hits.extend(rules.scan(Scope::Context, context));
        if !row.input.trim().is_empty() {
            relevance.push(text::cosine(&row.input, context));
        }
    }
    hits.extend(rules.scan(Scope::Response, &row.output));
    risk::assess(&config.risk, hits, &relevance)
}

/// The metrics of a row, keyed by name in [`METRICS`] order.
pub fn row_metrics(metrics: &quality::Metrics, row: &Row, verdict: &Verdict) -> Vec<MetricResult> {
    let hits: Vec<RecordHit> = verdict
        .hits
        .iter()
        .map(|h| RecordHit::new(h, TextMode::Full))
        .collect();
    let context = row.context.as_deref().unwrap_or_default();
    let answer = Answer {
        question: &row.input,
        context,
        response: &row.output,
        expected: row.expected.as_deref(),
        ground_truth: row.ground_truth.as_deref(),
        latency_ms: None,
        hits: &hits,
    };
    let mut results: Vec<MetricResult> = metrics
        .answer(&answer)
        .into_iter()
        .filter(|m| m.name != "latency")
        .collect();
    let outcome = row.user_action.map(|user_action| Outcome {
        user_action,
        stake_type: row.stake_type,
        goal_completed: row.goal_completed,
    });
    results.extend(quality::outcome(outcome.as_ref()));
    results
}

/// What `eval` was asked to do.
pub struct EvalRequest<'a> {
    pub dataset: &'a Path,
    pub rules_dir: &'a Path,
    pub compare: Option<&'a Path>,
    pub lexicon: Option<&'a Path>,
    pub out: Option<&'a Path>,
}

#[derive(Default)]
struct Summary {
    scores: Vec<f64>,
    nulls: usize,
}

/// Runs `eval`; returns whether it could (a bad dataset or rule set is an
/// error message).
pub fn run(config: &Config, request: &EvalRequest, out: &mut dyn Write) -> anyhow::Result<bool> {
    let rows = match read_dataset(request.dataset) {
        Ok(rows) => rows,
        Err(e) => {
            writeln!(out, "error: {e}")?;
            return Ok(false);
        }
    };
    let load = |dir: &Path| RuleSet::load_dir(dir, &config.rules.compile_options());
    let rules = match load(request.rules_dir) {
        Ok(rules) => rules,
        Err(errors) => {
            writeln!(out, "{errors}")?;
            return Ok(false);
        }
    };
    let baseline = match request.compare.map(load).transpose() {
        Ok(baseline) => baseline,
        Err(errors) => {
            writeln!(out, "{errors}")?;
            return Ok(false);
        }
    };
    let mut config = config.clone();
    if let Some(lexicon) = request.lexicon {
        config.quality.lexicon = lexicon.to_owned();
    }
    let metrics = crate::worker::quality_metrics(&config);
    if let Some(lexicon) = metrics.lexicon.as_ref() {
        writeln!(out, "lexicon: {} words", lexicon.len())?;
    } else {
        writeln!(out, "no lexicon: {}", metrics.lexicon_missing)?;
    }

    let mut writer = match request.out {
        Some(path) => Some(io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        )),
        None => None,
    };
    let progress = indicatif::ProgressBar::new(rows.len() as u64);
    if rows.len() < 1000 {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut summaries: BTreeMap<&str, Summary> = BTreeMap::new();
    let mut blocked = 0;
    let mut violated: HashMap<String, usize> = HashMap::new();
    let mut changed = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let verdict = verdict(&rules, &config, row);
        let results = row_metrics(&metrics, row, &verdict);
        if verdict.decision == Decision::Block {
            blocked += 1;
        }
        let ids = crate::guard::rule_ids(&verdict.hits);
        for id in &ids {
            *violated.entry(id.clone()).or_default() += 1;
        }
        for result in &results {
            let name = METRICS
                .iter()
                .find(|m| **m == result.name)
                .copied()
                .unwrap_or("other");
            let summary = summaries.entry(name).or_default();
            match result.score {
                Some(score) => summary.scores.push(score),
                None => summary.nulls += 1,
            }
        }
        if let Some(baseline) = &baseline {
            let before = self::verdict(baseline, &config, row);
            if before.decision != verdict.decision {
                changed.push((i, before.decision, verdict.decision, ids.join(", ")));
            }
        }
        if let Some(writer) = writer.as_mut() {
            let mut metrics_json = Map::new();
            for r in &results {
                metrics_json.insert(
                    r.name.to_string(),
                    json!({"score": r.score, "reason": r.reason, "details": r.details}),
                );
            }
            let line = json!({
                "row": i,
                "verdict": verdict.decision.as_str(),
                "rules": ids,
                "risk": verdict.risk,
                "metrics": Value::Object(metrics_json),
            });
            writeln!(writer, "{line}")?;
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    if let Some(mut writer) = writer {
        writer.flush()?;
    }

    writeln!(out, "{} rows", rows.len())?;
    writeln!(
        out,
        "{:<24} {:>10} {:>10} {:>10} {:>7} {:>6}",
        "metric", "mean", "min", "max", "count", "null"
    )?;
    for name in METRICS {
        let summary = summaries.remove(name).unwrap_or_default();
        let n = summary.scores.len();
        let (mean, min, max) = if n == 0 {
            ("-".to_owned(), "-".to_owned(), "-".to_owned())
        } else {
            let sum: f64 = summary.scores.iter().sum();
            let min = summary.scores.iter().copied().fold(f64::INFINITY, f64::min);
            let max = summary
                .scores
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            (
                format!("{:.4}", sum / n as f64),
                format!("{min:.4}"),
                format!("{max:.4}"),
            )
        };
        writeln!(
            out,
            "{name:<24} {mean:>10} {min:>10} {max:>10} {n:>7} {:>6}",
            summary.nulls
        )?;
    }
    let total = rows.len().max(1);
    writeln!(
        out,
        "pass rate {:.1}% ({} of {} rows not blocked), blocked {blocked}",
        100.0 * (rows.len() - blocked) as f64 / total as f64,
        rows.len() - blocked,
        rows.len()
    )?;
    let mut top: Vec<(String, usize)> = violated.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    if !top.is_empty() {
        writeln!(out, "top rules:")?;
        for (rule, count) in top.iter().take(10) {
            writeln!(out, "  {count:>6}  {rule}")?;
        }
    }
    if let Some(baseline_dir) = request.compare {
        writeln!(
            out,
            "verdicts changed against {}: {}",
            baseline_dir.display(),
            changed.len()
        )?;
        for (row, before, after, rules) in &changed {
            writeln!(
                out,
                "  row {row}: {} -> {}{}",
                before.as_str(),
                after.as_str(),
                if rules.is_empty() {
                    String::new()
                } else {
                    format!("  ({rules})")
                }
            )?;
        }
    }
    Ok(true)
}
