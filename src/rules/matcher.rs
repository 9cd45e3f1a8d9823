//! The compiled matchers of one scope, and the scan that runs them.
//!
//! A text is scanned in one pass per view, never once per rule:
//!
//! * the **normalized view** ([`super::normalize`]) goes through one
//!   Aho-Corasick automaton holding every keyword of every rule of the scope,
//!   and one `RegexSet` holding every regex of rules that match normalized
//!   text (compiled case-insensitive);
//! * the **raw view**, the text as sent, goes through one `RegexSet` holding
//!   the regexes of rules with `normalize: false` (keys, card numbers: tokens
//!   whose exact characters matter).
//!
//! Only the regexes a set reports are run again to find their spans. Hits then
//! pass their rule's `unless` window and validator, and normalized spans are
//! mapped back to the original text. The map is built only when something
//! matched, so the common case — nothing does — costs one normalization and
//! the automata.

use std::ops::Range;

use aho_corasick::{AhoCorasick, MatchKind};
use regex::{Regex, RegexSet, RegexSetBuilder};
use serde::Serialize;

use super::compile::{CompileOptions, MAX_REGEX_SIZE, ScopePatterns};
use super::normalize::{Normalized, normalize};
use super::{Hit, Rule, SNIPPET_CHARS, Scope};

/// Which text a pattern runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    Normalized,
    Raw,
}

/// A compiled regex of one rule.
#[derive(Debug, Clone)]
pub(crate) struct PatternSpec {
    pub regex: Regex,
    pub view: View,
    /// The longest match, when the pattern bounds it.
    pub max_len: Option<usize>,
    pub rule: usize,
}

/// Words that cancel a match when they stand shortly before it.
#[derive(Debug)]
pub(crate) struct Unless {
    pub regex: Regex,
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

#[derive(Debug)]
struct PatternGroup {
    set: RegexSet,
    regexes: Vec<Regex>,
    rules: Vec<usize>,
}

impl PatternGroup {
    fn build(specs: &[&PatternSpec], case_insensitive: bool) -> Result<Option<PatternGroup>, String> {
        if specs.is_empty() {
            return Ok(None);
        }
        let set = RegexSetBuilder::new(specs.iter().map(|s| s.regex.as_str()))
            .case_insensitive(case_insensitive)
            .size_limit(MAX_REGEX_SIZE.saturating_mul(specs.len()))
            .dfa_size_limit(64 << 20)
            .build()
            .map_err(|e| format!("the regexes together do not compile: {e}"))?;
        Ok(Some(PatternGroup {
            set,
            regexes: specs.iter().map(|s| s.regex.clone()).collect(),
            rules: specs.iter().map(|s| s.rule).collect(),
        }))
    }

    fn find(&self, text: &str, view: View, found: &mut Vec<Candidate>) {
        for i in self.set.matches(text).iter() {
            for m in self.regexes[i].find_iter(text) {
                found.push(Candidate {
                    rule: self.rules[i],
                    span: m.range(),
                    view,
                });
            }
        }
    }
}

struct Candidate {
    rule: usize,
    span: Range<usize>,
    view: View,
}

/// Every pattern of every rule of one scope.
#[derive(Debug)]
pub(crate) struct ScopeMatcher {
    keywords: Option<AhoCorasick>,
    keyword_rules: Vec<usize>,
    normalized: Option<PatternGroup>,
    raw: Option<PatternGroup>,
    pub limits: MatchLimits,
}

impl ScopeMatcher {
    pub fn empty() -> Self {
        ScopeMatcher {
            keywords: None,
            keyword_rules: Vec::new(),
            normalized: None,
            raw: None,
            limits: MatchLimits::default(),
        }
    }

    pub fn build(patterns: &ScopePatterns, options: &CompileOptions) -> Result<Self, String> {
        let mut matcher = ScopeMatcher::empty();
        if !patterns.keywords.is_empty() {
            // Overlapping search with the standard semantics reports every
            // keyword occurrence, so one that fails the word-boundary check
            // cannot hide an overlapping one that passes.
            let ac = AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                .build(patterns.keywords.iter().map(|(k, _)| k))
                .map_err(|e| format!("keywords do not compile: {e}"))?;
            matcher.keywords = Some(ac);
            matcher.keyword_rules = patterns.keywords.iter().map(|(_, r)| *r).collect();
            matcher.limits.normalized = patterns.keywords.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        }
        let cap = |s: &PatternSpec| s.max_len.unwrap_or(options.unbounded_match_cap);
        let (normalized, raw): (Vec<&PatternSpec>, Vec<&PatternSpec>) =
            patterns.regexes.iter().partition(|s| s.view == View::Normalized);
        let longest = |specs: &[&PatternSpec]| specs.iter().map(|s| cap(s)).max().unwrap_or(0);
        matcher.limits.normalized = matcher.limits.normalized.max(longest(&normalized));
        matcher.limits.raw = longest(&raw);
        matcher.normalized = PatternGroup::build(&normalized, true)?;
        matcher.raw = PatternGroup::build(&raw, false)?;
        Ok(matcher)
    }

    pub fn scan(&self, rules: &[Rule], scope: Scope, text: &str) -> Vec<Hit> {
        let mut found = Vec::new();
        if self.keywords.is_some() || self.normalized.is_some() {
            let view = normalize(text);
            if let Some(ac) = &self.keywords {
                for m in ac.find_overlapping_iter(&view) {
                    if at_word_boundaries(&view, m.range()) {
                        found.push(Candidate {
                            rule: self.keyword_rules[m.pattern().as_usize()],
                            span: m.range(),
                            view: View::Normalized,
                        });
                    }
                }
            }
            if let Some(group) = &self.normalized {
                group.find(&view, View::Normalized, &mut found);
            }
        }
        if let Some(group) = &self.raw {
            group.find(text, View::Raw, &mut found);
        }
        if found.is_empty() {
            return Vec::new();
        }
        let mapped = found
            .iter()
            .any(|c| c.view == View::Normalized)
            .then(|| Normalized::new(text));
        let mut hits: Vec<(usize, Range<usize>)> = Vec::with_capacity(found.len());
        for candidate in found {
            let rule = &rules[candidate.rule];
            let (view_text, span) = match (&mapped, candidate.view) {
                (Some(n), View::Normalized) => (n.text.as_str(), n.original_span(candidate.span.clone())),
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

/// Keywords match whole words: a keyword that starts (ends) with a letter or
/// digit must not be preceded (followed) by one.
fn at_word_boundaries(text: &str, span: Range<usize>) -> bool {
    let word = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    let (head, tail) = (&text[..span.start], &text[span.end..]);
    let matched = &text[span];
    let first = matched.chars().next();
    let last = matched.chars().next_back();
    !(word(first) && word(head.chars().next_back())) && !(word(last) && word(tail.chars().next()))
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
            Some((r, last)) if *r == rule && span.start < last.end => last.end = last.end.max(span.end),
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
    }

    #[test]
    fn overlapping_spans_of_one_rule_merge() {
        let mut hits = vec![(1, 5..9), (0, 0..4), (1, 0..6), (0, 10..12)];
        merge_overlaps(&mut hits);
        assert_eq!(hits, vec![(0, 0..4), (1, 0..9), (0, 10..12)]);
    }
}
