//! Quality metrics of an answer, computed off the request path by the side
//! queue's workers and by `fairgate eval`.
//!
//! Every metric returns a [`MetricResult`]: a score, a reason that says how
//! it was reached, and details to show why. A metric that cannot be computed
//! (no lexicon, no ground truth, a constant vector) has `score: None` and
//! says why; it never makes a number up.
//!
//! Words are [`crate::text::tokens`] everywhere: lower-cased, U+2019 read as
//! an apostrophe, maximal runs of letters, marks, decimal digits and
//! apostrophes, apostrophes trimmed at the edges.

pub mod lexicon;

use std::borrow::Cow;
use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::record::{RecordHit, StakeType, UserAction};
use crate::rules::Scope;
use crate::text::{Words, cosine_of_sets, tokens};
use lexicon::{EMOTIONS, Lexicon};

/// One metric's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricResult {
    pub name: Cow<'static, str>,
    pub score: Option<f64>,
    pub reason: Cow<'static, str>,
    pub details: Value,
}

impl MetricResult {
    fn scored(
        name: &'static str,
        score: f64,
        reason: impl Into<Cow<'static, str>>,
        details: Value,
    ) -> Self {
        MetricResult {
            name: Cow::Borrowed(name),
            score: Some(score),
            reason: reason.into(),
            details,
        }
    }

    fn none(name: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        MetricResult {
            name: Cow::Borrowed(name),
            score: None,
            reason: reason.into(),
            details: Value::Null,
        }
    }
}

/// The default politeness markers.
pub const POLITENESS_MARKERS: [&str; 12] = [
    "please",
    "thank you",
    "thanks",
    "happy to help",
    "glad to help",
    "kindly",
    "appreciate",
    "sorry",
    "apologize",
    "you're welcome",
    "my pleasure",
    "hope this helps",
];

/// What the metrics of one answer read.
#[derive(Debug, Clone, Default)]
pub struct Answer<'a> {
    /// The prompt (the user's question and system text).
    pub question: &'a str,
    /// Retrieved documents and tool results.
    pub context: &'a str,
    pub response: &'a str,
    pub expected: Option<&'a str>,
    pub ground_truth: Option<&'a str>,
    pub latency_ms: Option<f64>,
    /// The rule hits of the exchange.
    pub hits: &'a [RecordHit],
}

/// What the user did afterwards, from feedback.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub user_action: UserAction,
    pub stake_type: Option<StakeType>,
    pub goal_completed: Option<bool>,
}

/// The metric set, with its settings.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub lexicon: Option<Lexicon>,
    /// Why there is no lexicon.
    pub lexicon_missing: String,
    /// The reason of the metrics that need one, when there is none.
    no_lexicon: String,
    /// The politeness markers, each with its words.
    markers: Vec<(String, Vec<String>)>,
    /// The markers (indexes) by their first word, and those by the word's
    /// first byte, so that a response is read once rather than once per
    /// marker and most of its words are passed over after one lookup.
    /// Short lists: a word is compared faster than it is hashed.
    markers_by_first_word: Box<[FirstWords; 256]>,
}

/// Marker first words that start with one byte, each with the markers
/// (indexes) it starts.
type FirstWords = Vec<(String, Vec<usize>)>;

impl Metrics {
    pub fn new(lexicon: Result<Lexicon, String>, politeness_markers: Vec<String>) -> Metrics {
        let (lexicon, lexicon_missing) = match lexicon {
            Ok(lexicon) => (Some(lexicon), String::new()),
            Err(why) => (None, why),
        };
        let no_lexicon = format!("no emotion lexicon: {lexicon_missing}");
        let markers: Vec<(String, Vec<String>)> = politeness_markers
            .into_iter()
            .map(|marker| {
                let words = tokens(&marker);
                (marker, words)
            })
            .collect();
        let mut markers_by_first_word: Box<[FirstWords; 256]> =
            Box::new(std::array::from_fn(|_| Vec::new()));
        for (i, (_, words)) in markers.iter().enumerate() {
            let Some(first) = words.first() else { continue };
            let Some(&byte) = first.as_bytes().first() else {
                continue;
            };
            let same_byte = &mut markers_by_first_word[usize::from(byte)];
            match same_byte.iter_mut().find(|(w, _)| w == first) {
                Some((_, indexes)) => indexes.push(i),
                None => same_byte.push((first.clone(), vec![i])),
            }
        }
        Metrics {
            lexicon,
            lexicon_missing,
            no_lexicon,
            markers,
            markers_by_first_word,
        }
    }

    /// Every answer metric, in a fixed order. Metrics that need an input
    /// that was not given (expected answer, ground truth, latency) say so.
    pub fn answer(&self, answer: &Answer) -> Vec<MetricResult> {
        // The response is read into words once for every metric.
        let response = Words::new(answer.response);
        let words = response.list();
        vec![
            self.entropy_of(&words),
            self.ground_truth_spearman(answer.response, answer.ground_truth),
            exact_match(answer.response, answer.expected),
            recall_of(&words, answer.expected),
            answer_length(answer.response),
            self.politeness_of(&words),
            latency(answer.latency_ms),
            context_relevance(answer.question, answer.context),
            financial_safety(answer.hits),
            tone_banned_words(answer.hits),
        ]
    }

    /// `min(0.5 × markers present, 1)`, each marker matched as whole words.
    pub fn politeness(&self, response: &str) -> MetricResult {
        self.politeness_of(&Words::new(response).list())
    }

    fn politeness_of(&self, words: &[&str]) -> MetricResult {
        let mut present = vec![false; self.markers.len()];
        for (at, word) in words.iter().enumerate() {
            let Some(&byte) = word.as_bytes().first() else {
                continue;
            };
            let starting = self.markers_by_first_word[usize::from(byte)]
                .iter()
                .filter(|(first, _)| first == word)
                .flat_map(|(_, indexes)| indexes);
            for &i in starting {
                let marker = &self.markers[i].1;
                present[i] |= words
                    .get(at..at + marker.len())
                    .is_some_and(|w| w.iter().zip(marker).all(|(a, b)| *a == b));
            }
        }
        // In the order the markers are configured.
        let found: Vec<&String> = self
            .markers
            .iter()
            .zip(&present)
            .filter(|(_, present)| **present)
            .map(|((name, _), _)| name)
            .collect();
        let score = (0.5 * found.len() as f64).min(1.0);
        MetricResult::scored(
            "politeness",
            score,
            counted(found.len(), " politeness markers"),
            json!({ "markers": found }),
        )
    }

    /// The eight emotion counts of a text: for each emotion, the number of
    /// token occurrences whose lexicon entry has it.
    fn emotion_counts(lexicon: &Lexicon, text: &str) -> [u64; 8] {
        Self::counts_of(lexicon, &Words::new(text).list())
    }

    fn counts_of(lexicon: &Lexicon, words: &[&str]) -> [u64; 8] {
        let mut counts = [0u64; 8];
        for token in words {
            let bits = lexicon.emotions(token);
            for (i, count) in counts.iter_mut().enumerate() {
                if bits & (1 << i) != 0 {
                    *count += 1;
                }
            }
        }
        counts
    }

    /// Shannon entropy (bits) of the response's emotion distribution,
    /// `P(e) = count(e) / Σ counts`.
    pub fn emotional_entropy(&self, response: &str) -> MetricResult {
        self.entropy_of(&Words::new(response).list())
    }

    fn entropy_of(&self, words: &[&str]) -> MetricResult {
        const NAME: &str = "emotional_entropy";
        let Some(lexicon) = &self.lexicon else {
            return MetricResult::none(NAME, self.no_lexicon.clone());
        };
        let counts = Self::counts_of(lexicon, words);
        let details = counts_json(&counts);
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return MetricResult::scored(NAME, 0.0, "the response has no emotion words", details);
        }
        let entropy = -counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / total as f64;
                p * p.log2()
            })
            .sum::<f64>();
        MetricResult::scored(
            NAME,
            // One emotion alone gives -0.0; report it as 0.0.
            entropy + 0.0,
            format!(
                "{total} emotion associations over {} emotions",
                counts.iter().filter(|&&c| c > 0).count()
            ),
            details,
        )
    }

    /// Spearman's rho between the emotion counts of response and ground
    /// truth.
    pub fn ground_truth_spearman(
        &self,
        response: &str,
        ground_truth: Option<&str>,
    ) -> MetricResult {
        const NAME: &str = "ground_truth_spearman";
        let Some(ground_truth) = ground_truth else {
            return MetricResult::none(NAME, "no ground truth given");
        };
        let Some(lexicon) = &self.lexicon else {
            return MetricResult::none(NAME, self.no_lexicon.clone());
        };
        let a = Self::emotion_counts(lexicon, response).map(|c| c as f64);
        let b = Self::emotion_counts(lexicon, ground_truth).map(|c| c as f64);
        let details = json!({"response": counts_json(&a.map(|c| c as u64)), "ground_truth": counts_json(&b.map(|c| c as u64))});
        match spearman(&a, &b) {
            Some(rho) => MetricResult::scored(
                NAME,
                rho,
                "Spearman's rho of the eight emotion counts",
                details,
            ),
            None => MetricResult {
                details,
                ..MetricResult::none(
                    NAME,
                    "undefined: the emotion counts of the response or the ground truth are all equal",
                )
            },
        }
    }
}

fn counts_json(counts: &[u64; 8]) -> Value {
    Value::Object(
        EMOTIONS
            .iter()
            .zip(counts)
            .map(|(e, c)| ((*e).to_owned(), json!(c)))
            .collect(),
    )
}

/// Ranks from 1, ties given the average of the ranks they span (as scipy's
/// `rankdata(method="average")`).
pub fn average_ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut ranks = vec![0.0; values.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && values[order[j + 1]] == values[order[i]] {
            j += 1;
        }
        // Positions i..=j (0-based) hold ranks i+1..=j+1.
        let rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            ranks[k] = rank;
        }
        i = j + 1;
    }
    ranks
}

/// Spearman's rho: the Pearson correlation of the average ranks; `None` when
/// either vector is constant (or the lengths differ or are below 2).
pub fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() != b.len() || a.len() < 2 {
        return None;
    }
    let (ra, rb) = (average_ranks(a), average_ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let (mut cov, mut va, mut vb) = (0.0, 0.0, 0.0);
    for (x, y) in ra.iter().zip(&rb) {
        cov += (x - ma) * (y - mb);
        va += (x - ma).powi(2);
        vb += (y - mb).powi(2);
    }
    if va == 0.0 || vb == 0.0 {
        return None;
    }
    Some((cov / (va * vb).sqrt()).clamp(-1.0, 1.0))
}

/// Lower-case, trimmed, whitespace runs collapsed to one space.
pub fn normalize_answer(text: &str) -> String {
    text.to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn exact_match(response: &str, expected: Option<&str>) -> MetricResult {
    const NAME: &str = "exact_match";
    let Some(expected) = expected else {
        return MetricResult::none(NAME, "no expected answer given");
    };
    let (a, b) = (normalize_answer(response), normalize_answer(expected));
    if a == b {
        MetricResult::scored(NAME, 1.0, "equal after normalization", Value::Null)
    } else {
        MetricResult::scored(
            NAME,
            0.0,
            "different after normalization",
            json!({"response": a, "expected": b}),
        )
    }
}

/// `|G ∩ E| / |E|` over the token sets of the response G and the expected
/// answer E; 0 when E has no tokens.
pub fn keyword_recall(response: &str, expected: Option<&str>) -> MetricResult {
    recall_of(&Words::new(response).list(), expected)
}

fn recall_of(response: &[&str], expected: Option<&str>) -> MetricResult {
    const NAME: &str = "keyword_recall";
    let Some(expected) = expected else {
        return MetricResult::none(NAME, "no expected answer given");
    };
    let g: HashSet<&str> = response.iter().copied().collect();
    let expected = Words::new(expected);
    let e = expected.set();
    if e.is_empty() {
        return MetricResult::scored(NAME, 0.0, "the expected answer has no words", Value::Null);
    }
    let mut missing: Vec<&str> = e.iter().filter(|w| !g.contains(*w)).copied().collect();
    missing.sort();
    let found = e.len() - missing.len();
    MetricResult::scored(
        NAME,
        found as f64 / e.len() as f64,
        format!("{found} of {} expected words", e.len()),
        json!({"missing": missing}),
    )
}

/// `"<n><what>"`, such as "124 characters": a reason of every exchange,
/// built without `format!`'s machinery (with the request id's, see
/// `proxy::State::request_id`, 1.8k instructions fewer per exchange), and
/// its digits by `itoa` (`to_string` goes through that machinery too).
fn counted(n: usize, what: &str) -> String {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(n);
    let mut reason = String::with_capacity(digits.len() + what.len());
    reason.push_str(digits);
    reason.push_str(what);
    reason
}

/// Characters (Unicode scalar values) of the answer.
pub fn answer_length(response: &str) -> MetricResult {
    let n = response.chars().count();
    MetricResult::scored(
        "answer_length",
        n as f64,
        counted(n, " characters"),
        Value::Null,
    )
}

pub fn latency(ms: Option<f64>) -> MetricResult {
    match ms {
        Some(ms) => MetricResult::scored(
            "latency",
            ms,
            "milliseconds from request to the end of the answer",
            Value::Null,
        ),
        None => MetricResult::none("latency", "no latency recorded"),
    }
}

/// Cosine similarity of the binary token-set vectors of question and
/// context; 0.0 when either is empty.
pub fn context_relevance(question: &str, context: &str) -> MetricResult {
    let context = Words::new(context);
    let c = context.set();
    if c.is_empty() {
        return MetricResult::scored("context_relevance", 0.0, "no context", Value::Null);
    }
    let question = Words::new(question);
    let q = question.set();
    let (score, reason) = if q.is_empty() {
        (0.0, "no question")
    } else {
        (
            cosine_of_sets(&q, &c),
            "cosine similarity of the word sets of question and context",
        )
    };
    MetricResult::scored("context_relevance", score, reason, Value::Null)
}

/// 1.0 unless a financial-safety rule hit the response.
pub fn financial_safety(hits: &[RecordHit]) -> MetricResult {
    let violations: Vec<&str> = distinct_rules(hits, "financial_safety");
    if violations.is_empty() {
        MetricResult::scored(
            "financial_safety",
            1.0,
            "no financial-safety rule hit the response",
            Value::Null,
        )
    } else {
        MetricResult::scored(
            "financial_safety",
            0.0,
            format!("violations: {}", violations.join(", ")),
            json!({"violations": violations}),
        )
    }
}

/// Score 1 (of 5) when the response uses shaming language, else no score.
pub fn tone_banned_words(hits: &[RecordHit]) -> MetricResult {
    let found: Vec<&RecordHit> = hits
        .iter()
        .filter(|h| h.scope == Scope::Response && &*h.category == "shame_language")
        .collect();
    if found.is_empty() {
        return MetricResult::none(
            "tone_banned_words",
            "no banned word found: this check gives no score",
        );
    }
    let words: Vec<&str> = found.iter().filter_map(|h| h.snippet.as_deref()).collect();
    MetricResult::scored(
        "tone_banned_words",
        1.0,
        format!(
            "shaming language ({}): tone 1 of 5",
            distinct_rules(hits, "shame_language").join(", ")
        ),
        json!({"words": words, "scale": 5}),
    )
}

fn distinct_rules<'a>(hits: &'a [RecordHit], category: &str) -> Vec<&'a str> {
    let mut seen = HashSet::new();
    hits.iter()
        .filter(|h| h.scope == Scope::Response && h.category == category)
        .map(|h| h.rule.as_str())
        .filter(|r| seen.insert(*r))
        .collect()
}

/// The outcome metrics of feedback.
pub fn outcome(outcome: Option<&Outcome>) -> Vec<MetricResult> {
    let Some(o) = outcome else {
        return vec![
            MetricResult::none("intervention_success", "no user action given"),
            MetricResult::none("stake_effectiveness", "no user action given"),
        ];
    };
    let success = match o.user_action {
        UserAction::Saved => {
            MetricResult::scored("intervention_success", 1.0, "the user saved", Value::Null)
        }
        UserAction::Spent => {
            MetricResult::scored("intervention_success", 0.0, "the user spent", Value::Null)
        }
    };
    let stake = match o.goal_completed {
        None => MetricResult::none("stake_effectiveness", "goal completion not given"),
        Some(done) => {
            let stake = o.stake_type.unwrap_or(StakeType::None);
            let rate = stake.expected_success();
            let score = (if done { 1.0 } else { 0.0 } * rate).min(1.0);
            MetricResult::scored(
                "stake_effectiveness",
                score,
                format!(
                    "goal {} × expected success {rate} of the {} stake",
                    if done { "completed" } else { "not completed" },
                    serde_json::to_value(stake)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                ),
                json!({"goal_completed": done, "expected_success": rate}),
            )
        }
    };
    vec![success, stake]
}

#[cfg(test)]
mod tests;
