//! The compiled matchers of one scope, and the scan that runs them.
//!
//! A text is read once per view, never once per rule:
//!
//! * the **normalized view** ([`super::normalize`]) serves keywords and the
//!   regexes of rules that match normalized text (compiled case-insensitive);
//! * the **raw view**, the text as sent, serves the regexes of rules with
//!   `normalize: false`.
//!
//! Per view, one Aho-Corasick automaton holds every keyword of every rule of
//! the scope *and* the trigger literals of every regex: for each regex, the
//! compile step reads from its syntax a set of literals one of which every
//! match must contain, and how far before that literal a match may start
//! ([`Trigger`]). The single pass reports keyword hits and trigger
//! occurrences together; a regex is then run only in the small window around
//! its triggers (anchored, when the trigger is the start of the match). On
//! this machine a full automaton pass costs about 2 ns a byte, so reading the
//! text once for keywords and once more for every regex would be several
//! times slower than this one pass.
//!
//! Regexes with no usable literal (`\w+\d`, `(?:^|\s)x`) go into one
//! `RegexSet` per view that does read the whole text; only the regexes it
//! reports are run again for their spans.
//!
//! Matches then pass their rule's `unless` window and validator, and
//! normalized spans are mapped back to the original text through the map
//! that normalization keeps. The common case, nothing matches, costs one
//! normalization and one automaton pass.

use std::collections::HashMap;
use std::ops::Range;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};
use regex::{RegexSet, RegexSetBuilder};
use regex_automata::{Anchored, Input, meta};
use serde::Serialize;

use super::compile::{CompileOptions, MAX_REGEX_SIZE, ScopePatterns};
use super::normalize::Normalized;
use super::{Hit, Rule, SNIPPET_CHARS, Scope};

/// Which text a pattern runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    Normalized,
    Raw,
}

/// Where a regex can match, read from its syntax: every match contains one of
/// `literals`, starting at most `lead` bytes after the match starts.
#[derive(Debug, Clone)]
pub(crate) struct Trigger {
    pub literals: Vec<Vec<u8>>,
    pub lead: usize,
    /// The regex starts with `\b`, so with `lead == 0` a trigger that is not
    /// at a word boundary cannot start a match.
    pub word_start: bool,
}

/// A compiled regex of one rule.
#[derive(Debug, Clone)]
pub(crate) struct PatternSpec {
    pub pattern: String,
    pub regex: meta::Regex,
    pub view: View,
    /// The longest match, when the pattern bounds it.
    pub max_len: Option<usize>,
    /// `None`: the regex has no usable literal and is run on the whole text.
    pub trigger: Option<Trigger>,
    pub rule: usize,
}

/// Words that cancel a match when they stand shortly before it.
#[derive(Debug)]
pub(crate) struct Unless {
    pub regex: regex::Regex,
    /// How many words before the match to look at; the window never reaches
    /// back past the start of the sentence.
    pub before: usize,
}

/// The longest text the rules of a scope can match, in bytes of each view.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MatchLimits {
    /// Bytes of normalized text (keywords and normalized-view regexes).
    pub normalized: usize,
    /// Bytes of original text (raw-view regexes).
    pub raw: usize,
}

/// What one literal of the automaton stands for.
#[derive(Debug, Default)]
struct Target {
    /// Rules with this keyword.
    keyword_rules: Vec<usize>,
    /// Regexes (indexes into `ViewMatcher::regexes`) with this trigger.
    regexes: Vec<usize>,
}

/// Every pattern of one scope that runs on one view of the text.
#[derive(Debug, Default)]
struct ViewMatcher {
    literals: Option<AhoCorasick>,
    targets: Vec<Target>,
    regexes: Vec<PatternSpec>,
    /// The regexes without a trigger, as one set, with their indexes.
    untriggered: Option<(RegexSet, Vec<usize>)>,
}

/// A match before its rule's checks: rule, span in the view's text.
struct Candidate {
    rule: usize,
    span: Range<usize>,
    view: View,
}

impl ViewMatcher {
    fn build(keywords: &[(String, usize)], regexes: Vec<PatternSpec>) -> Result<Self, String> {
        let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
        let mut literals: Vec<Vec<u8>> = Vec::new();
        let mut targets: Vec<Target> = Vec::new();
        let mut target = |literal: &[u8]| {
            *index.entry(literal.to_vec()).or_insert_with(|| {
                literals.push(literal.to_vec());
                targets.push(Target::default());
                targets.len() - 1
            })
        };
        let mut slots: Vec<(usize, Option<usize>, Option<usize>)> = Vec::new();
        for (keyword, rule) in keywords {
            slots.push((target(keyword.as_bytes()), Some(*rule), None));
        }
        let mut untriggered = Vec::new();
        for (i, spec) in regexes.iter().enumerate() {
            match &spec.trigger {
                Some(trigger) => {
                    for literal in &trigger.literals {
                        slots.push((target(literal), None, Some(i)));
                    }
                }
                None => untriggered.push(i),
            }
        }
        for (t, rule, regex) in slots {
            let entry = &mut targets[t];
            if let Some(rule) = rule
                && !entry.keyword_rules.contains(&rule)
            {
                entry.keyword_rules.push(rule);
            }
            if let Some(regex) = regex
                && !entry.regexes.contains(&regex)
            {
                entry.regexes.push(regex);
            }
        }
        let automaton = if literals.is_empty() {
            None
        } else {
            // Standard semantics with overlapping search report every
            // occurrence of every literal, so a keyword that fails its
            // word-boundary check cannot hide one that passes, nor a keyword
            // a trigger. A DFA is the fastest kind for a pass over every byte.
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::Standard)
                    .kind(Some(AhoCorasickKind::DFA))
                    .build(&literals)
                    .map_err(|e| format!("keywords do not compile: {e}"))?,
            )
        };
        let untriggered = if untriggered.is_empty() {
            None
        } else {
            let set =
                RegexSetBuilder::new(untriggered.iter().map(|&i| regexes[i].pattern.as_str()))
                    .case_insensitive(regexes[untriggered[0]].view == View::Normalized)
                    .size_limit(MAX_REGEX_SIZE.saturating_mul(untriggered.len()))
                    .dfa_size_limit(64 << 20)
                    .build()
                    .map_err(|e| format!("the regexes together do not compile: {e}"))?;
            Some((set, untriggered))
        };
        Ok(ViewMatcher {
            literals: automaton,
            targets,
            regexes,
            untriggered,
        })
    }

    fn is_empty(&self) -> bool {
        self.literals.is_none() && self.untriggered.is_none()
    }

    fn find(&self, hay: &str, view: View, found: &mut Vec<Candidate>) {
        // Trigger occurrences, as (regex, position of the literal).
        let mut triggered: Vec<(usize, usize)> = Vec::new();
        if let Some(ac) = &self.literals {
            for m in ac.find_overlapping_iter(hay) {
                let target = &self.targets[m.pattern().as_usize()];
                if !target.keyword_rules.is_empty() && at_word_boundaries(hay, m.range()) {
                    for &rule in &target.keyword_rules {
                        found.push(Candidate {
                            rule,
                            span: m.range(),
                            view,
                        });
                    }
                }
                triggered.extend(target.regexes.iter().map(|&r| (r, m.start())));
            }
        }
        if !triggered.is_empty() {
            triggered.sort_unstable();
            triggered.dedup();
            self.run_triggered(hay, view, &triggered, found);
        }
        if let Some((set, indexes)) = &self.untriggered {
            for i in set.matches(hay).iter() {
                let spec = &self.regexes[indexes[i]];
                for m in spec.regex.find_iter(hay) {
                    found.push(Candidate {
                        rule: spec.rule,
                        span: m.range(),
                        view,
                    });
                }
            }
        }
    }

    /// Runs each triggered regex around its trigger occurrences (sorted by
    /// regex, then position).
    fn run_triggered(
        &self,
        hay: &str,
        view: View,
        triggered: &[(usize, usize)],
        found: &mut Vec<Candidate>,
    ) {
        let mut i = 0;
        while i < triggered.len() {
            let r = triggered[i].0;
            let spec = &self.regexes[r];
            let Some(trigger) = &spec.trigger else {
                i += 1;
                continue;
            };
            // Matches already found by this regex end here; a later window
            // starts its search no earlier, as `find_iter` would.
            let mut searched = 0;
            while i < triggered.len() && triggered[i].0 == r {
                let at = triggered[i].1;
                i += 1;
                if trigger.lead == 0 {
                    if at < searched || trigger.word_start && !is_word_boundary(hay, at) {
                        continue;
                    }
                    let input = Input::new(hay).range(at..).anchored(Anchored::Yes);
                    if let Some(m) = spec.regex.search(&input) {
                        searched = m.end().max(at + 1);
                        found.push(Candidate {
                            rule: spec.rule,
                            span: m.range(),
                            view,
                        });
                    }
                    continue;
                }
                // The match starts in [at - lead, at]; merge the windows of
                // occurrences that follow closely.
                let mut last = at;
                while i < triggered.len()
                    && triggered[i].0 == r
                    && triggered[i].1 <= last + trigger.lead
                {
                    last = triggered[i].1;
                    i += 1;
                }
                let start = floor_char_boundary(hay, at.saturating_sub(trigger.lead)).max(searched);
                let end = match spec.max_len {
                    Some(len) => ceil_char_boundary(hay, (last + len).min(hay.len())),
                    None => hay.len(),
                };
                if start > last || start >= end {
                    continue;
                }
                for m in spec.regex.find_iter(Input::new(hay).range(start..end)) {
                    if m.start() > last {
                        break;
                    }
                    searched = m.end();
                    found.push(Candidate {
                        rule: spec.rule,
                        span: m.range(),
                        view,
                    });
                }
            }
        }
    }
}

/// Every pattern of every rule of one scope.
#[derive(Debug, Default)]
pub(crate) struct ScopeMatcher {
    normalized: ViewMatcher,
    raw: ViewMatcher,
    pub limits: MatchLimits,
}

impl ScopeMatcher {
    pub fn empty() -> Self {
        ScopeMatcher::default()
    }

    pub fn build(patterns: &ScopePatterns, options: &CompileOptions) -> Result<Self, String> {
        let cap = |s: &PatternSpec| s.max_len.unwrap_or(options.unbounded_match_cap);
        let (normalized, raw): (Vec<PatternSpec>, Vec<PatternSpec>) = patterns
            .regexes
            .iter()
            .cloned()
            .partition(|s| s.view == View::Normalized);
        let keyword_len = patterns
            .keywords
            .iter()
            .map(|(k, _)| k.len())
            .max()
            .unwrap_or(0);
        let limits = MatchLimits {
            normalized: normalized
                .iter()
                .map(cap)
                .max()
                .unwrap_or(0)
                .max(keyword_len),
            raw: raw.iter().map(cap).max().unwrap_or(0),
        };
        Ok(ScopeMatcher {
            normalized: ViewMatcher::build(&patterns.keywords, normalized)?,
            raw: ViewMatcher::build(&[], raw)?,
            limits,
        })
    }

    pub fn scan(&self, rules: &[Rule], scope: Scope, text: &str) -> Vec<Hit> {
        let mut found = Vec::new();
        let mapped = (!self.normalized.is_empty()).then(|| Normalized::new(text));
        if let Some(normalized) = &mapped {
            self.normalized
                .find(&normalized.text, View::Normalized, &mut found);
        }
        if !self.raw.is_empty() {
            self.raw.find(text, View::Raw, &mut found);
        }
        if found.is_empty() {
            return Vec::new();
        }
        let mut hits: Vec<(usize, Range<usize>)> = Vec::with_capacity(found.len());
        for candidate in found {
            let rule = &rules[candidate.rule];
            let (view_text, span) = match (&mapped, candidate.view) {
                (Some(n), View::Normalized) => {
                    (n.text.as_str(), n.original_span(candidate.span.clone()))
                }
                _ => (text, candidate.span.clone()),
            };
            if let Some(unless) = &rule.unless {
                let window = window_before(view_text, candidate.span.start, unless.before);
                if unless.regex.is_match(window) {
                    continue;
                }
            }
            if let Some(validator) = rule.validator
                && !validator.check(&text[span.clone()])
            {
                continue;
            }
            hits.push((candidate.rule, span));
        }
        merge_overlaps(&mut hits);
        hits.into_iter()
            .map(|(r, span)| {
                let rule = &rules[r];
                Hit {
                    rule: rule.id.clone(),
                    category: rule.category.clone(),
                    scope,
                    action: rule.action,
                    weight: rule.weight,
                    message: rule.message.clone(),
                    placeholder: rule.placeholder.clone(),
                    snippet: snippet(&text[span.clone()]),
                    start: span.start,
                    end: span.end,
                }
            })
            .collect()
    }
}

fn is_word_char(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || c == '_')
}

/// Whether a (Unicode) word boundary stands at byte `at`.
fn is_word_boundary(text: &str, at: usize) -> bool {
    is_word_char(text[..at].chars().next_back()) != is_word_char(text[at..].chars().next())
}

/// Keywords match whole words: a keyword that starts (ends) with a letter or
/// digit must not be preceded (followed) by one.
fn at_word_boundaries(text: &str, span: Range<usize>) -> bool {
    let word = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    let (head, tail) = (&text[..span.start], &text[span.end..]);
    let matched = &text[span];
    let first = matched.chars().next();
    let last = matched.chars().next_back();
    let glued_before = word(first) && word(head.chars().next_back());
    let glued_after = word(last) && word(tail.chars().next());
    !glued_before && !glued_after
}

fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn ceil_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// The up to `words` words before byte `at`, not reaching back past the start
/// of the sentence.
fn window_before(text: &str, at: usize, words: usize) -> &str {
    let head = &text[..at];
    let bytes = head.as_bytes();
    let sentence = (0..bytes.len())
        .rev()
        .find(|&i| {
            matches!(bytes[i], b'.' | b'!' | b'?' | b';' | b'\n')
                && bytes.get(i + 1).is_none_or(|b| b.is_ascii_whitespace())
        })
        .map_or(0, |i| i + 1);
    let mut seen = 0;
    let mut in_word = false;
    for (i, c) in head[sentence..].char_indices().rev() {
        if c.is_whitespace() {
            if in_word {
                seen += 1;
                in_word = false;
                if seen == words {
                    return &head[sentence + i + 1..];
                }
            }
        } else {
            in_word = true;
        }
    }
    &head[sentence..]
}

/// Sorts hits by position and merges overlapping spans of the same rule.
fn merge_overlaps(hits: &mut Vec<(usize, Range<usize>)>) {
    hits.sort_by_key(|(rule, span)| (*rule, span.start, span.end));
    let mut merged: Vec<(usize, Range<usize>)> = Vec::with_capacity(hits.len());
    for (rule, span) in hits.drain(..) {
        match merged.last_mut() {
            Some((r, last)) if *r == rule && span.start < last.end => {
                last.end = last.end.max(span.end)
            }
            _ => merged.push((rule, span)),
        }
    }
    merged.sort_by_key(|(rule, span)| (span.start, span.end, *rule));
    *hits = merged;
}

fn snippet(matched: &str) -> String {
    match matched.char_indices().nth(SNIPPET_CHARS) {
        Some((cut, _)) => format!("{}…", &matched[..cut]),
        None => matched.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_stops_at_the_word_count_and_the_sentence() {
        let text = "i would never put all of it. invest everything now";
        let at = text.find("invest").unwrap();
        assert_eq!(window_before(text, at, 3), " ");
        let at = text.find("put").unwrap();
        assert_eq!(window_before(text, at, 2), "would never ");
        assert_eq!(window_before(text, at, 10), "i would never ");
        // A decimal point is not a sentence end.
        let text = "never put 1.5 everything";
        let at = text.find("everything").unwrap();
        assert_eq!(window_before(text, at, 3), "never put 1.5 ");
    }

    #[test]
    fn word_boundaries_apply_only_at_word_characters() {
        assert!(at_word_boundaries("get rich now", 0..8));
        assert!(!at_word_boundaries("forget rich", 3..11));
        assert!(!at_word_boundaries("get richer", 0..8));
        assert!(at_word_boundaries("x$$$y", 1..4));
        assert!(is_word_boundary("a b", 2));
        assert!(!is_word_boundary("ab", 1));
        assert!(is_word_boundary("é", 0));
    }

    #[test]
    fn overlapping_spans_of_one_rule_merge() {
        let mut hits = vec![(1, 5..9), (0, 0..4), (1, 0..6), (0, 10..12)];
        merge_overlaps(&mut hits);
        assert_eq!(hits, vec![(0, 0..4), (1, 0..9), (0, 10..12)]);
    }
}
