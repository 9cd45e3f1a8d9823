//! The hits of texts scanned lately, so that a text sent again is not
//! scanned again.
//!
//! Most of a chat request has been sent before: the system prompt comes
//! with every request of an app, and each turn of a conversation sends the
//! turns before it again, as retrieval sends the same documents, and the
//! lines of a batch file mostly share one system prompt. Each thread that
//! scans requests (a serving thread, a batch upload's reader while it
//! lives) remembers, per rule set, the hits of the prompt and
//! context texts it scanned before a request's last text (the last is new
//! by nature: the user's latest turn), in two generations of [`BUDGET`]
//! bytes each: when the newer one is full, the older one is dropped and the
//! newer takes its place, and a text found in the older one moves to the
//! newer. So what a thread keeps is bounded (two generations, the texts and
//! their hits), texts in use stay, and forgetting costs no bookkeeping per
//! lookup. A text is found by its content, compared whole, never by a hash
//! alone; results are kept per rule set (a reload starts afresh).

use std::cell::RefCell;
use std::collections::HashMap;
use std::mem;

use super::{Hit, Scope};

/// Bytes per generation, per thread: the texts and their hits (see
/// [`cost`]).
pub const BUDGET: usize = 256 << 10;

/// What an entry costs beside its text and hits (its allocation and its
/// slot in the table, about), so that many short texts are bounded too.
const ENTRY_COST: usize = 64;

/// The bytes an entry is counted for: its text, its hits (a text full of
/// matches keeps many) and [`ENTRY_COST`].
fn cost(text: &str, hits: &[Hit]) -> usize {
    let hits: usize = hits
        .iter()
        .map(|hit| mem::size_of::<Hit>() + hit.snippet.len())
        .sum();
    text.len() + hits + ENTRY_COST
}

/// An entry counted for more than this (see [`cost`]) is not kept, nor
/// a text this long looked up: it would take a large share of a generation.
const LARGEST: usize = BUDGET / 8;

/// [`LARGEST`] for a request's tool definitions: agents send tens of
/// tools (some 570 bytes each in the benchmark's), the same with every
/// request, and reading them again costs far more than remembering them
/// (60 tools, 34 KB: 4.4 times the CPU of a request without them).
const LARGEST_DEFINITIONS: usize = BUDGET / 2;

thread_local! {
    static REMEMBERED: RefCell<Remembered> = RefCell::new(Remembered::default());
}

/// What a text was scanned as.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// A text in this scope.
    Scope(Scope),
    /// The JSON text of a request's tool definitions: the hits of every
    /// text in them (`RuleSet::scan_definitions`).
    Definitions,
}

impl Kind {
    /// The largest entry of this kind kept.
    fn largest(self) -> usize {
        match self {
            Kind::Scope(_) => LARGEST,
            Kind::Definitions => LARGEST_DEFINITIONS,
        }
    }

    fn index(self) -> usize {
        match self {
            Kind::Scope(scope) => scope.index(),
            Kind::Definitions => Scope::ALL.len(),
        }
    }
}

impl From<Scope> for Kind {
    fn from(scope: Scope) -> Kind {
        Kind::Scope(scope)
    }
}

/// The hits of `text` scanned as `kind` under rule set `set` (see
/// `RuleSet::scan_remembered`): remembered by this thread, or from `scan`.
pub fn hits(
    set: u64,
    kind: impl Into<Kind>,
    text: &str,
    scan: impl FnOnce() -> Vec<Hit>,
) -> Vec<Hit> {
    let kind = kind.into();
    if text.len() > kind.largest() {
        return scan();
    }
    REMEMBERED.with_borrow_mut(|remembered| remembered.hits(set, kind, text, scan))
}

/// One thread's memory of scanned texts.
#[derive(Default)]
pub struct Remembered {
    /// The rule set the hits were found with.
    set: u64,
    newer: Generation,
    older: Generation,
}

/// Texts and their hits, per [`Kind`].
#[derive(Default)]
struct Generation {
    by_kind: [HashMap<Box<str>, Vec<Hit>>; Scope::ALL.len() + 1],
    /// What the entries held are counted for (see [`cost`]).
    bytes: usize,
}

impl Remembered {
    pub fn hits(
        &mut self,
        set: u64,
        kind: impl Into<Kind>,
        text: &str,
        scan: impl FnOnce() -> Vec<Hit>,
    ) -> Vec<Hit> {
        if self.set != set {
            *self = Remembered {
                set,
                ..Remembered::default()
            };
        }
        let kind = kind.into();
        let at = kind.index();
        if let Some(hits) = self.newer.by_kind[at].get(text) {
            return hits.clone();
        }
        let hits = match self.older.by_kind[at].remove_entry(text) {
            Some((text, hits)) => {
                self.older.bytes -= cost(&text, &hits);
                self.keep(kind, text, hits.clone());
                return hits;
            }
            None => scan(),
        };
        self.keep(kind, text.into(), hits.clone());
        hits
    }

    /// Puts a text into the newer generation, which first becomes the
    /// older one if the text would take it over [`BUDGET`]; not an entry
    /// over its kind's largest ([`LARGEST`]).
    fn keep(&mut self, kind: Kind, text: Box<str>, hits: Vec<Hit>) {
        let cost = cost(&text, &hits);
        if cost > kind.largest() {
            return;
        }
        if self.newer.bytes + cost > BUDGET {
            self.older = mem::take(&mut self.newer);
        }
        self.newer.bytes += cost;
        self.newer.by_kind[kind.index()].insert(text, hits);
    }

    /// Bytes held by both generations.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.newer.bytes + self.older.bytes
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::Arc;

    use super::*;
    use crate::rules::Action;

    fn hit(snippet: &str) -> Hit {
        Hit {
            rule: Arc::from("rule"),
            category: Arc::from("category"),
            scope: Scope::Prompt,
            action: Action::Block,
            weight: 1.0,
            message: Arc::from(""),
            placeholder: Arc::from(""),
            start: 0,
            end: snippet.len(),
            snippet: snippet.to_owned(),
        }
    }

    /// Looks `text` up, counting the scans it takes.
    fn look_up(
        remembered: &mut Remembered,
        set: u64,
        scope: Scope,
        text: &str,
        scans: &Cell<usize>,
    ) -> Vec<Hit> {
        remembered.hits(set, scope, text, || {
            scans.set(scans.get() + 1);
            vec![hit(text)]
        })
    }

    #[test]
    fn a_text_seen_before_is_not_scanned_again() {
        let mut remembered = Remembered::default();
        let scans = Cell::new(0);
        let mut look = |set, scope, text| look_up(&mut remembered, set, scope, text, &scans);
        let text = "You are a careful assistant.";
        let first = look(1, Scope::Prompt, text);
        assert_eq!(look(1, Scope::Prompt, text), first);
        assert_eq!(scans.get(), 1);
        // Another text, another scope, another rule set: scanned.
        look(1, Scope::Prompt, "You are a careful assistant!");
        look(1, Scope::Context, text);
        assert_eq!(scans.get(), 3);
        look(2, Scope::Prompt, text);
        assert_eq!(scans.get(), 4);
        // The new rule set's hits replaced the old one's.
        look(1, Scope::Prompt, text);
        assert_eq!(scans.get(), 5);
    }

    #[test]
    fn memory_stays_within_two_generations_and_texts_in_use_stay() {
        let mut remembered = Remembered::default();
        let scans = Cell::new(0);
        let system = "S".repeat(1000);
        for i in 0..5_000 {
            let text = format!("{i:0>200}");
            look_up(&mut remembered, 1, Scope::Prompt, &text, &scans);
            look_up(&mut remembered, 1, Scope::Prompt, &system, &scans);
            assert!(
                remembered.bytes() <= 2 * BUDGET,
                "{} bytes",
                remembered.bytes()
            );
        }
        // 5,000 different texts, and the one sent every time scanned once.
        assert_eq!(scans.get(), 5_001);
        // The first texts were forgotten.
        look_up(
            &mut remembered,
            1,
            Scope::Prompt,
            &format!("{:0>200}", 0),
            &scans,
        );
        assert_eq!(scans.get(), 5_002);
    }

    #[test]
    fn the_hits_of_a_text_count_toward_the_bound() {
        let mut remembered = Remembered::default();
        let text = "4111 1111 1111 1111 ".repeat(100);
        let many = vec![hit(&text[..80]); 100];
        remembered.hits(1, Scope::Context, &text, || many.clone());
        assert!(remembered.bytes() >= text.len() + 100 * (mem::size_of::<Hit>() + 80));
        for i in 0..200 {
            remembered.hits(1, Scope::Context, &format!("{i} {text}"), || many.clone());
            assert!(
                remembered.bytes() <= 2 * BUDGET,
                "{} bytes",
                remembered.bytes()
            );
        }
        // An entry that would take over an eighth of a generation is not kept.
        let scans = Cell::new(0);
        for _ in 0..2 {
            remembered.hits(1, Scope::Context, "too many", || {
                scans.set(scans.get() + 1);
                vec![hit("x"); BUDGET / mem::size_of::<Hit>()]
            });
        }
        assert_eq!(scans.get(), 2);
    }

    #[test]
    fn a_text_longer_than_the_limit_is_scanned_every_time() {
        let scans = Cell::new(0);
        // The scans of a text looked up twice.
        let twice = |kind: Kind, text: &str| {
            let before = scans.get();
            for _ in 0..2 {
                hits(7, kind, text, || {
                    scans.set(scans.get() + 1);
                    Vec::new()
                });
            }
            scans.get() - before
        };
        let long = "x".repeat(LARGEST + 1);
        assert_eq!(twice(Scope::Prompt.into(), &long), 2);
        // Tool definitions that long are remembered; longer ones are not.
        assert_eq!(twice(Kind::Definitions, &long), 1);
        let longer = "x".repeat(LARGEST_DEFINITIONS + 1);
        assert_eq!(twice(Kind::Definitions, &longer), 2);
    }
}
