//! Where a match may still be under way at the end of a text.
//!
//! The stream guard releases text only where no match could cover it. The
//! longest possible match bounds that from afar, but for rules such as
//! secrets (`sk-...{20,}`) it is a cap of hundreds of bytes, and most of the
//! time nothing is under way at all. [`OpenMatches`] answers the exact
//! question instead: from which bytes of a text's end could some pattern
//! still match, given more text? A byte is such a start when the patterns'
//! automaton, run anchored from it over the rest of the text, has not died.
//!
//! The automaton is a lazy DFA of every pattern of one view, with their
//! assertions (`\b`, `^`, `$`) removed: that only lets more texts match, so
//! a start it rules out is ruled out for the real patterns too. Rule
//! validators and `unless` windows are ignored for the same reason. The
//! one assertion kept is the word boundary that opens most patterns (and
//! that keywords have implicitly): those patterns form a second automaton,
//! run only from where a word may start, so that `get` inside `budget`
//! does not look like the start of "get rich quick". Most starts die
//! within a byte or two (the first byte of each start is looked up in a
//! table before any walk), so a check reads a few bytes per byte of its
//! range.

use std::ops::Range;
use std::panic::{RefUnwindSafe, UnwindSafe};

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::nfa::thompson::{self, WhichCaptures};
use regex_automata::util::pool::Pool;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};
use regex_syntax::hir::{Hir, HirKind, Look, Repetition};
use regex_syntax::is_word_character;

type NewCache = Box<dyn Fn() -> Cache + Send + Sync + UnwindSafe + RefUnwindSafe>;

/// Walks allowed per byte of a range before [`OpenMatches::first`] gives up
/// and answers conservatively.
const STEPS_PER_BYTE: usize = 64;

/// A pattern for [`OpenMatches::build`].
pub(crate) enum Pattern {
    /// A keyword: it matches only where it is not glued to a letter or a
    /// digit before it.
    Keyword(String),
    Regex(Hir),
}

/// The patterns of one view, as two anchored automata: those that can
/// begin only at the start of a word (keywords, regexes that open with
/// `\b`) are run only from where a word may start, the others from
/// anywhere.
#[derive(Debug)]
pub(crate) struct OpenMatches {
    at_word_start: Option<Automaton>,
    anywhere: Option<Automaton>,
}

impl OpenMatches {
    /// The automata of `patterns`, or `None` when there are none.
    pub fn build(patterns: Vec<Pattern>) -> Result<Option<Self>, String> {
        let (mut at_word_start, mut anywhere) = (Vec::new(), Vec::new());
        for pattern in patterns {
            match pattern {
                Pattern::Keyword(keyword) => at_word_start.push(Hir::literal(keyword.as_bytes())),
                Pattern::Regex(hir) if begins_a_word(&hir) => {
                    at_word_start.push(without_assertions(&hir));
                }
                Pattern::Regex(hir) => anywhere.push(without_assertions(&hir)),
            }
        }
        let open = OpenMatches {
            at_word_start: Automaton::build(&at_word_start)?,
            anywhere: Automaton::build(&anywhere)?,
        };
        Ok((open.at_word_start.is_some() || open.anywhere.is_some()).then_some(open))
    }

    /// The first byte in `starts` from which a match could be under way at
    /// `to`: an automaton, run from there over `hay[..to]`, is still alive.
    /// `starts.end` when there is none; `None` when the walks grow too long
    /// or an automaton fails.
    pub fn first(&self, hay: &str, starts: Range<usize>, to: usize) -> Option<usize> {
        let mut budget = STEPS_PER_BYTE * to.saturating_sub(starts.start) + 1024;
        // Each automaton with a cache, and whether it starts only at words.
        let mut walks = [(&self.at_word_start, true), (&self.anywhere, false)]
            .map(|(a, at_words)| a.as_ref().map(|a| (a, a.caches.get(), at_words)));
        let bytes = hay.as_bytes();
        for start in starts.clone() {
            let byte = bytes[start];
            for walk in &mut walks {
                let Some((automaton, cache, at_words)) = walk else {
                    continue;
                };
                if !automaton.begins[usize::from(byte)]
                    || (*at_words && !may_start_word(hay, start))
                {
                    continue;
                }
                if automaton.alive(cache, &bytes[start..to], &mut budget)? {
                    return Some(start);
                }
            }
        }
        Some(starts.end)
    }
}

/// One anchored lazy DFA, with the bytes a match can begin with.
#[derive(Debug)]
struct Automaton {
    dfa: DFA,
    /// Whether a match can begin with each byte.
    begins: [bool; 256],
    caches: Pool<Cache, NewCache>,
}

impl Automaton {
    fn build(patterns: &[Hir]) -> Result<Option<Self>, String> {
        if patterns.is_empty() {
            return Ok(None);
        }
        let nfa = thompson::Compiler::new()
            .configure(
                thompson::Config::new()
                    .which_captures(WhichCaptures::None)
                    .nfa_size_limit(None),
            )
            .build_many_from_hir(patterns)
            .map_err(|e| format!("the patterns together do not compile: {e}"))?;
        let dfa = DFA::builder()
            .configure(
                DFA::config()
                    .match_kind(MatchKind::All)
                    .skip_cache_capacity_check(true),
            )
            .build_from_nfa(nfa)
            .map_err(|e| format!("the patterns together do not compile: {e}"))?;
        let mut cache = dfa.create_cache();
        let mut begins = [true; 256];
        if let Ok(first) = dfa.start_state(&mut cache, &anchored()) {
            for (byte, begins) in (0..=255u8).zip(&mut begins) {
                *begins = dfa
                    .next_state(&mut cache, first, byte)
                    .map_or(true, |next| !next.is_dead());
            }
        }
        let for_pool = dfa.clone();
        let caches = Pool::new(Box::new(move || for_pool.create_cache()) as NewCache);
        Ok(Some(Automaton {
            dfa,
            begins,
            caches,
        }))
    }

    /// Whether the automaton is still alive after `text`; `None` when the
    /// budget of steps runs out or the automaton fails.
    fn alive(&self, cache: &mut Cache, text: &[u8], budget: &mut usize) -> Option<bool> {
        // State ids belong to one cache, and only until it is cleared.
        let mut state = self.dfa.start_state(cache, &anchored()).ok()?;
        for &byte in text {
            *budget = budget.checked_sub(1)?;
            state = self.dfa.next_state(cache, state, byte).ok()?;
            if state.is_dead() {
                return Some(false);
            }
            if state.is_quit() {
                return None;
            }
        }
        Some(true)
    }
}

fn anchored() -> start::Config {
    start::Config::new().anchored(Anchored::Yes)
}

/// Whether a word may start at byte `at` of `hay` as a keyword or `\b`
/// sees it: not where a letter or digit follows another (nor inside a
/// character).
fn may_start_word(hay: &str, at: usize) -> bool {
    if !hay.is_char_boundary(at) {
        return false;
    }
    let glued = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() && is_word_character(c));
    !(glued(hay[..at].chars().next_back()) && glued(hay[at..].chars().next()))
}

/// Whether every match of `hir` begins with a Unicode word boundary (or the
/// start of a word).
fn begins_a_word(hir: &Hir) -> bool {
    match hir.kind() {
        HirKind::Look(look) => matches!(
            look,
            Look::WordUnicode | Look::WordStartUnicode | Look::WordStartHalfUnicode
        ),
        HirKind::Capture(capture) => begins_a_word(&capture.sub),
        HirKind::Concat(subs) => subs.first().is_some_and(begins_a_word),
        HirKind::Alternation(subs) => subs.iter().all(begins_a_word),
        _ => false,
    }
}

/// `hir` with its zero-width assertions (word boundaries, line and text
/// anchors) removed; it matches every text `hir` matches, and more.
fn without_assertions(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Look(_) => Hir::empty(),
        HirKind::Capture(capture) => without_assertions(&capture.sub),
        HirKind::Repetition(repetition) => Hir::repetition(Repetition {
            sub: Box::new(without_assertions(&repetition.sub)),
            ..repetition.clone()
        }),
        HirKind::Concat(subs) => Hir::concat(subs.iter().map(without_assertions).collect()),
        HirKind::Alternation(subs) => {
            Hir::alternation(subs.iter().map(without_assertions).collect())
        }
        HirKind::Empty | HirKind::Literal(_) | HirKind::Class(_) => hir.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(keywords: &[&str], regexes: &[&str]) -> OpenMatches {
        let keywords = keywords.iter().map(|k| Pattern::Keyword(k.to_string()));
        let regexes = regexes
            .iter()
            .map(|p| Pattern::Regex(regex_syntax::parse(p).unwrap()));
        OpenMatches::build(keywords.chain(regexes).collect())
            .unwrap()
            .unwrap()
    }

    fn first(open: &OpenMatches, text: &str) -> Option<usize> {
        open.first(text, 0..text.len(), text.len())
    }

    #[test]
    fn finds_the_first_start_a_match_could_grow_from() {
        let open = open(
            &["get rich quick"],
            &[r"\bguaranteed returns\b", r"sk-[a-z0-9]{20,}"],
        );
        // Nothing under way: every start dies.
        assert_eq!(first(&open, "we offer advice. "), Some(17));
        // A phrase half written, at the end.
        assert_eq!(first(&open, "these are guaranteed ret"), Some(10));
        assert_eq!(first(&open, "how to get ri"), Some(7));
        // A secret may go on for ever, however long it is already.
        let key = format!("key: sk-{}", "a1".repeat(300));
        assert_eq!(first(&open, &key), Some(5));
        // Once the secret ends with a space, nothing is open.
        assert_eq!(first(&open, &format!("{key} ok")), Some(key.len() + 3));
        // Keywords and patterns that open with `\b` start only at a word's
        // start; the others anywhere.
        assert_eq!(first(&open, "a budget ri"), Some(11));
        assert_eq!(first(&open, "xguaran"), Some(7));
        assert_eq!(first(&open, "ask-a1"), Some(1));
        // Other assertions are gone: `\b` at the end does not rule a
        // start out.
        assert_eq!(first(&open, "guaranteed returnsx"), Some(0));
    }

    #[test]
    fn starts_are_limited_to_the_range_and_walks_to_its_end() {
        let open = open(&[], &["abc"]);
        // The walk stops at `to`: "ab" is alive there, though "abx" is not.
        assert_eq!(open.first("zzabx", 0..3, 4), Some(2));
        // No start in range.
        assert_eq!(open.first("zzabx", 0..2, 4), Some(2));
    }

    #[test]
    fn a_word_starts_where_no_letter_or_digit_comes_before() {
        // Not inside "budget", "1st" or "café"; `_` is no letter.
        let text = "a budget, 1st café_x";
        let starts: Vec<usize> = (0..=text.len())
            .filter(|&at| may_start_word(text, at))
            .collect();
        let at = |s: &str| text.find(s).unwrap();
        let expected = [
            0,
            1,
            2,
            8,
            9,
            10,
            13,
            at("café"),
            at("_x"),
            at("x"),
            text.len(),
        ];
        assert_eq!(starts, expected);
    }

    #[test]
    fn walks_too_long_give_no_answer() {
        // Every start lives for hundreds of bytes and dies at the end.
        let open = open(&[], &["a{1,2000}b"]);
        let text = format!("{}c", "a".repeat(1500));
        assert_eq!(first(&open, &text), None);
        assert_eq!(open.first("aac", 0..3, 3), Some(3));
    }
}
