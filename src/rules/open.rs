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
//! validators and `unless` windows are ignored for the same reason. Most
//! starts die within a byte or two (the first byte of each start is looked
//! up in a table before any walk), so a check reads a few bytes per byte of
//! its range.

use std::ops::Range;
use std::panic::{RefUnwindSafe, UnwindSafe};

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::nfa::thompson::{self, WhichCaptures};
use regex_automata::util::pool::Pool;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};
use regex_syntax::hir::{Hir, HirKind, Repetition};

type NewCache = Box<dyn Fn() -> Cache + Send + Sync + UnwindSafe + RefUnwindSafe>;

/// Walks allowed per byte of a range before [`OpenMatches::first`] gives up
/// and answers conservatively.
const STEPS_PER_BYTE: usize = 64;

/// The anchored automaton of one view's patterns.
#[derive(Debug)]
pub(crate) struct OpenMatches {
    dfa: DFA,
    /// Whether a match can begin with each byte.
    begins: [bool; 256],
    caches: Pool<Cache, NewCache>,
}

impl OpenMatches {
    /// The automaton of `patterns`, or `None` when there are none.
    pub fn build(patterns: &[Hir]) -> Result<Option<Self>, String> {
        if patterns.is_empty() {
            return Ok(None);
        }
        let patterns: Vec<Hir> = patterns.iter().map(without_assertions).collect();
        let nfa = thompson::Compiler::new()
            .configure(
                thompson::Config::new()
                    .which_captures(WhichCaptures::None)
                    .nfa_size_limit(None),
            )
            .build_many_from_hir(&patterns)
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
        Ok(Some(OpenMatches {
            dfa,
            begins,
            caches,
        }))
    }

    /// The first byte in `starts` from which a match could be under way at
    /// `to`: the automaton, run from there over `hay[..to]`, is still alive.
    /// `starts.end` when there is none; `None` when the walks grow too long
    /// or the automaton fails.
    pub fn first(&self, hay: &[u8], starts: Range<usize>, to: usize) -> Option<usize> {
        let mut cache = self.caches.get();
        let first = self.dfa.start_state(&mut cache, &anchored()).ok()?;
        let mut budget = STEPS_PER_BYTE * to.saturating_sub(starts.start) + 1024;
        'starts: for start in starts.clone() {
            if !self.begins[usize::from(hay[start])] {
                continue;
            }
            let mut state = first;
            for &byte in &hay[start..to] {
                if budget == 0 {
                    return None;
                }
                budget -= 1;
                match self.dfa.next_state(&mut cache, state, byte) {
                    Ok(next) if next.is_dead() => continue 'starts,
                    Ok(next) if !next.is_quit() => state = next,
                    _ => return None,
                }
            }
            return Some(start);
        }
        Some(starts.end)
    }
}

fn anchored() -> start::Config {
    start::Config::new().anchored(Anchored::Yes)
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

    fn open(patterns: &[&str]) -> OpenMatches {
        let hirs: Vec<Hir> = patterns
            .iter()
            .map(|p| regex_syntax::parse(p).unwrap())
            .collect();
        OpenMatches::build(&hirs).unwrap().unwrap()
    }

    fn first(open: &OpenMatches, text: &str) -> Option<usize> {
        open.first(text.as_bytes(), 0..text.len(), text.len())
    }

    #[test]
    fn finds_the_first_start_a_match_could_grow_from() {
        let open = open(&[r"\bguaranteed returns\b", r"\bsk-[a-z0-9]{20,}"]);
        // Nothing under way: every start dies.
        assert_eq!(first(&open, "we offer advice. "), Some(17));
        // A keyword half written, at the end.
        assert_eq!(first(&open, "these are guaranteed ret"), Some(10));
        // A secret may go on for ever, however long it is already.
        let key = format!("key: sk-{}", "a1".repeat(300));
        assert_eq!(first(&open, &key), Some(5));
        // Once the secret ends with a space, nothing is open.
        assert_eq!(first(&open, &format!("{key} ok")), Some(key.len() + 3));
        // The assertions are gone: `\b` does not rule a start out.
        assert_eq!(first(&open, "xguaran"), Some(1));
    }

    #[test]
    fn starts_are_limited_to_the_range_and_walks_to_its_end() {
        let open = open(&["abc"]);
        // The walk stops at `to`: "ab" is alive there, though "abx" is not.
        assert_eq!(open.first(b"zzabx", 0..3, 4), Some(2));
        // No start in range.
        assert_eq!(open.first(b"zzabx", 0..2, 4), Some(2));
    }

    #[test]
    fn walks_too_long_give_no_answer() {
        // Every start lives for hundreds of bytes and dies at the end.
        let open = open(&["a{1,2000}b"]);
        let text = format!("{}c", "a".repeat(1500));
        assert_eq!(first(&open, &text), None);
        assert_eq!(open.first(b"aac", 0..3, 3), Some(3));
    }
}
