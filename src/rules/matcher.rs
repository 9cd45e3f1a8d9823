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
//! occurrences together; a regex is then tried, anchored, only at the few
//! places before each trigger where a match could start. On
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
use std::sync::Arc;

use aho_corasick::automaton::Automaton;
use aho_corasick::dfa::DFA as LiteralDfa;
use aho_corasick::{Anchored as LiteralAnchored, MatchKind};
use regex::{RegexSet, RegexSetBuilder};
use regex_automata::{Anchored, Input, meta};
use regex_syntax::hir::Hir;
use serde::Serialize;

use super::compile::{CompileOptions, MAX_REGEX_SIZE, ScopePatterns};
use super::normalize::Normalized;
use super::open::{OpenMatches, Pattern};
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
    /// The regex starts with `\b`, so a match can only start at a word
    /// boundary.
    pub word_start: bool,
    /// The bytes the first few bytes of a match can be, when the syntax
    /// says (see `compile::prefix_bytes`).
    pub prefix_bytes: Vec<[bool; 256]>,
}

impl Trigger {
    /// Whether a match could start at byte `at`: the cheap checks that save
    /// most attempts.
    #[inline]
    fn could_start(&self, hay: &str, at: usize) -> bool {
        let bytes = hay.as_bytes();
        at < bytes.len()
            && hay.is_char_boundary(at)
            && self
                .prefix_bytes
                .iter()
                .enumerate()
                .all(|(j, set)| bytes.get(at + j).is_some_and(|&b| set[usize::from(b)]))
            && (!self.word_start || is_word_boundary(hay, at))
    }
}

/// A compiled regex of one rule, shared by the matchers of its scopes.
#[derive(Debug)]
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

/// The automaton holds at most this many bytes of each literal. A longer
/// keyword is checked in full where its first bytes occur. A small automaton
/// stays in the processor's caches; that matters more than the few extra
/// checks.
const LITERAL_PREFIX: usize = 16;

/// What one literal of the automaton stands for.
#[derive(Debug, Default)]
struct Target {
    /// Keywords starting with this literal, with their rules.
    keywords: Vec<(Box<[u8]>, usize)>,
    /// Regexes (indexes into `ViewMatcher::regexes`) with this trigger.
    regexes: Vec<usize>,
}

/// The literals of the automaton, each with its [`Target`].
#[derive(Default)]
struct LiteralTable {
    index: HashMap<Vec<u8>, usize>,
    literals: Vec<Vec<u8>>,
    targets: Vec<Target>,
}

impl LiteralTable {
    /// The target of the first [`LITERAL_PREFIX`] bytes of `literal`.
    fn entry(&mut self, literal: &[u8]) -> &mut Target {
        let literal = &literal[..literal.len().min(LITERAL_PREFIX)];
        let next = self.targets.len();
        let t = *self.index.entry(literal.to_vec()).or_insert(next);
        if t == next {
            self.literals.push(literal.to_vec());
            self.targets.push(Target::default());
        }
        &mut self.targets[t]
    }
}

/// Every pattern of one scope that runs on one view of the text.
#[derive(Debug, Default)]
struct ViewMatcher {
    literals: Option<LiteralDfa>,
    /// The longest literal in `literals`, in bytes.
    longest_literal: usize,
    targets: Vec<Target>,
    regexes: Vec<Arc<PatternSpec>>,
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
    fn build(keywords: &[(String, usize)], regexes: Vec<Arc<PatternSpec>>) -> Result<Self, String> {
        let mut table = LiteralTable::default();
        for (keyword, rule) in keywords {
            let entry = table.entry(keyword.as_bytes());
            let keyword: Box<[u8]> = keyword.as_bytes().into();
            if !entry.keywords.contains(&(keyword.clone(), *rule)) {
                entry.keywords.push((keyword, *rule));
            }
        }
        let mut untriggered = Vec::new();
        for (i, spec) in regexes.iter().enumerate() {
            match &spec.trigger {
                Some(trigger) => {
                    for literal in &trigger.literals {
                        let entry = table.entry(literal);
                        if !entry.regexes.contains(&i) {
                            entry.regexes.push(i);
                        }
                    }
                }
                None => untriggered.push(i),
            }
        }
        let LiteralTable {
            literals, targets, ..
        } = table;
        let longest_literal = literals.iter().map(Vec::len).max().unwrap_or(0);
        let automaton = if literals.is_empty() {
            None
        } else {
            // Standard semantics, every occurrence reported (see
            // `scan_literals`), so a keyword that fails its word-boundary
            // check cannot hide one that passes, nor a keyword a trigger.
            Some(
                LiteralDfa::builder()
                    .match_kind(MatchKind::Standard)
                    .prefilter(false)
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
            longest_literal,
            targets,
            regexes,
            untriggered,
        })
    }

    fn is_empty(&self) -> bool {
        self.literals.is_none() && self.untriggered.is_none()
    }

    fn find(&self, hay: &str, view: View, found: &mut Vec<Candidate>) {
        // Per regex: where its last trigger was, and the first start not yet
        // tried (or inside a match already found), as `find_iter` would skip
        // it. Allocated on the first trigger only.
        let mut cursors: Vec<(usize, usize)> = Vec::new();
        if let Some(dfa) = &self.literals {
            scan_literals(
                dfa,
                hay.as_bytes(),
                self.longest_literal,
                |pattern, start| {
                    let target = &self.targets[pattern];
                    for (keyword, rule) in &target.keywords {
                        let span = start..start + keyword.len();
                        if hay.as_bytes()[start..].starts_with(keyword)
                            && at_word_boundaries(hay, span.clone())
                        {
                            found.push(Candidate {
                                rule: *rule,
                                span,
                                view,
                            });
                        }
                    }
                    for &r in &target.regexes {
                        if cursors.is_empty() {
                            cursors = vec![(usize::MAX, 0); self.regexes.len()];
                        }
                        self.try_regex(hay, view, r, start, &mut cursors[r], found);
                    }
                },
            );
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

    /// Tries regex `r` for a trigger literal at byte `at`: an anchored
    /// attempt at each place a match could start, `lead` bytes or fewer
    /// before the literal. Failed attempts cost some 20 ns each, and the
    /// cheap checks of [`Trigger::could_start`] rule out most places first.
    fn try_regex(
        &self,
        hay: &str,
        view: View,
        r: usize,
        at: usize,
        (last_at, next_start): &mut (usize, usize),
        found: &mut Vec<Candidate>,
    ) {
        let spec = &self.regexes[r];
        let Some(trigger) = &spec.trigger else {
            return;
        };
        if *last_at == at {
            return;
        }
        // Literals of different lengths end in order, so a trigger can start
        // before the previous one; then nothing before it was tried.
        let first = if *last_at != usize::MAX && at < *last_at {
            at.saturating_sub(trigger.lead)
        } else {
            at.saturating_sub(trigger.lead).max(*next_start)
        };
        *last_at = at;
        for start in first..=at {
            if !trigger.could_start(hay, start) {
                continue;
            }
            let input = Input::new(hay).range(start..).anchored(Anchored::Yes);
            if let Some(m) = spec.regex.search(&input) {
                found.push(Candidate {
                    rule: spec.rule,
                    span: m.range(),
                    view,
                });
                *next_start = (*next_start).max(m.end()).max(start + 1);
                return;
            }
        }
        *next_start = (*next_start).max(at + 1);
    }
}

/// Every pattern of every rule of one scope.
#[derive(Debug, Default)]
pub(crate) struct ScopeMatcher {
    normalized: ViewMatcher,
    raw: ViewMatcher,
    pub limits: MatchLimits,
    /// The patterns of each view, to tell where a match may be under way
    /// (response scope only).
    open_normalized: Option<OpenMatches>,
    open_raw: Option<OpenMatches>,
}

impl ScopeMatcher {
    pub fn empty() -> Self {
        ScopeMatcher::default()
    }

    pub fn build(
        scope: Scope,
        patterns: &ScopePatterns,
        options: &CompileOptions,
    ) -> Result<Self, String> {
        let cap = |s: &Arc<PatternSpec>| s.max_len.unwrap_or(options.unbounded_match_cap);
        let (normalized, raw): (Vec<Arc<PatternSpec>>, Vec<Arc<PatternSpec>>) = patterns
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
        // Only a streamed response is released piece by piece.
        let (mut open_normalized, mut open_raw) = (None, None);
        if scope == Scope::Response {
            let keywords = patterns
                .keywords
                .iter()
                .map(|(k, _)| Ok(Pattern::Keyword(k.clone())));
            let regexes = normalized
                .iter()
                .map(|s| pattern_hir(s).map(Pattern::Regex));
            open_normalized =
                OpenMatches::build(keywords.chain(regexes).collect::<Result<_, _>>()?)?;
            let regexes = raw.iter().map(|s| pattern_hir(s).map(Pattern::Regex));
            open_raw = OpenMatches::build(regexes.collect::<Result<_, _>>()?)?;
        }
        Ok(ScopeMatcher {
            normalized: ViewMatcher::build(&patterns.keywords, normalized)?,
            raw: ViewMatcher::build(&[], raw)?,
            limits,
            open_normalized,
            open_raw,
        })
    }

    /// The first byte of `range` of `text` (whose normalized view is
    /// `view`) from which a match could be under way at the range's end, a
    /// point where normalization starts clean; the end when there is none,
    /// `None` when the search gives up. See [`OpenMatches`].
    pub fn open_match_start(
        &self,
        text: &str,
        view: &Normalized,
        range: Range<usize>,
    ) -> Option<usize> {
        let mut first = range.end;
        if let Some(open) = &self.open_normalized {
            let starts = view.view_offset(range.start)..view.view_offset(range.end);
            let at = open.first(&view.text, starts.clone(), starts.end)?;
            if at < starts.end {
                first = view.original_span(at..at).start;
            }
        }
        if let Some(open) = &self.open_raw {
            first = open.first(text, range.start..first, range.end)?;
        }
        Some(first)
    }

    /// The hits of `text`, and its normalized view when the scope has
    /// patterns that use it.
    pub fn scan(&self, rules: &[Rule], scope: Scope, text: &str) -> (Vec<Hit>, Option<Normalized>) {
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
            return (Vec::new(), mapped);
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
        let hits = hits
            .into_iter()
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
            .collect();
        (hits, mapped)
    }
}

/// Calls `report(pattern, start)` for every occurrence of every literal of
/// `dfa` in `hay`, in order of position.
///
/// Each step of an automaton waits on the one before, so the haystack is
/// walked as two halves at once, which keeps the processor busy: about twice
/// the speed of one walk on this machine. The first half's walk goes on for
/// `longest - 1` bytes past the middle to catch literals that straddle it,
/// and reports only those starting before the middle; the second half's walk
/// starts fresh at the middle and so reports only literals starting there or
/// later. The second half's occurrences are buffered to keep the order.
fn scan_literals(
    dfa: &LiteralDfa,
    hay: &[u8],
    longest: usize,
    mut report: impl FnMut(usize, usize),
) {
    let Ok(start) = dfa.start_state(LiteralAnchored::No) else {
        return;
    };
    // Start states may be special too (with a prefilter); only match states
    // have occurrences.
    let occurrences = |sid, end: usize, out: &mut dyn FnMut(usize, usize)| {
        if !dfa.is_match(sid) {
            return;
        }
        for i in 0..dfa.match_len(sid) {
            let pattern = dfa.match_pattern(sid, i);
            out(pattern.as_usize(), end - dfa.pattern_len(pattern));
        }
    };
    let middle = hay.len() / 2;
    if hay.len() < 128 || longest >= middle {
        let mut sid = start;
        for (i, &b) in hay.iter().enumerate() {
            sid = dfa.next_state(LiteralAnchored::No, sid, b);
            if dfa.is_special(sid) {
                occurrences(sid, i + 1, &mut report);
            }
        }
        return;
    }
    let first_end = middle + longest - 1;
    let mut later: Vec<(usize, usize)> = Vec::new();
    let (mut a, mut b) = (start, start);
    for (k, (&x, &y)) in hay[..first_end].iter().zip(&hay[middle..]).enumerate() {
        a = dfa.next_state(LiteralAnchored::No, a, x);
        b = dfa.next_state(LiteralAnchored::No, b, y);
        if dfa.is_special(a) {
            occurrences(a, k + 1, &mut |p, s| {
                if s < middle {
                    report(p, s);
                }
            });
        }
        if dfa.is_special(b) {
            occurrences(b, middle + k + 1, &mut |p, s| later.push((p, s)));
        }
    }
    // Whichever walk is longer finishes alone.
    let steps = first_end.min(hay.len() - middle);
    for (k, &x) in hay[steps..first_end].iter().enumerate() {
        a = dfa.next_state(LiteralAnchored::No, a, x);
        if dfa.is_special(a) {
            occurrences(a, steps + k + 1, &mut |p, s| {
                if s < middle {
                    report(p, s);
                }
            });
        }
    }
    for (k, &y) in hay[middle + steps..].iter().enumerate() {
        b = dfa.next_state(LiteralAnchored::No, b, y);
        if dfa.is_special(b) {
            occurrences(b, middle + steps + k + 1, &mut |p, s| later.push((p, s)));
        }
    }
    for (p, s) in later {
        report(p, s);
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

/// The syntax of a compiled pattern, parsed as it was compiled.
fn pattern_hir(spec: &PatternSpec) -> Result<Hir, String> {
    regex_syntax::ParserBuilder::new()
        .case_insensitive(spec.view == View::Normalized)
        .build()
        .parse(&spec.pattern)
        .map_err(|e| format!("invalid regex {:?}: {e}", spec.pattern))
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
    fn literal_scan_in_two_halves_finds_every_occurrence_in_order() {
        let literals = ["ab", "b", "abcab", "ca", "zz"];
        let dfa = LiteralDfa::builder()
            .match_kind(MatchKind::Standard)
            .build(literals)
            .unwrap();
        let reference = aho_corasick::AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .build(literals)
            .unwrap();
        let mut rng = crate::testing::Lcg(7);
        for len in [0, 5, 127, 128, 129, 200, 1023, 1024, 2000, 4099] {
            let text: Vec<u8> = (0..len).map(|_| *rng.pick(b"abcz ")).collect();
            let mut expected: Vec<(usize, usize)> = reference
                .find_overlapping_iter(&text[..])
                .map(|m| (m.pattern().as_usize(), m.start()))
                .collect();
            let mut got = Vec::new();
            scan_literals(&dfa, &text, 5, |p, s| got.push((p, s)));
            let starts: Vec<usize> = got.iter().map(|&(_, s)| s).collect();
            // In order of position within each half, and the halves in order.
            assert!(starts.windows(2).all(|w| w[0] <= w[1] + 5), "len {len}");
            expected.sort_unstable();
            got.sort_unstable();
            assert_eq!(got, expected, "len {len}");
        }
    }

    #[test]
    fn overlapping_spans_of_one_rule_merge() {
        let mut hits = vec![(1, 5..9), (0, 0..4), (1, 0..6), (0, 10..12)];
        merge_overlaps(&mut hits);
        assert_eq!(hits, vec![(0, 0..4), (1, 0..9), (0, 10..12)]);
    }
}
