//! The automaton that skims phase-1 text for the places phase 2 would
//! change: a digit or `$` in a word, two spaces in a row, a run of single
//! letters, non-ASCII. Most text has few, so phase 2 copies the rest.

use super::words::{CLASS, DIGIT, DOLLAR, JOINER, LETTER, NON_ASCII, SPACE, is_letter_separator};

// States of the skimming automaton. `W1`/`N1`: a word of one letter / one
// digit so far; `S1*`: such a word and one separator; `R1*`: then another
// one-character word, which may be a spaced-out word.
const START: u8 = 0;
const AFTER_SPACE: u8 = 1;
const AFTER_PUNCT: u8 = 2;
const W1: u8 = 3;
const N1: u8 = 4;
const WORD: u8 = 5;
const NUMBER: u8 = 6;
const S1_SPACE: u8 = 7;
const S1_PUNCT: u8 = 8;
const R1_LETTER: u8 = 9;
const R1_DIGIT: u8 = 10;
const STATES: usize = 11;
/// Not a state: the text needs the word-by-word path here.
const CHANGE: u8 = 255;

// Input classes of the automaton.
const K_SPACE: usize = 0;
const K_SEPARATOR: usize = 1;
const K_OTHER: usize = 2;
const K_LETTER: usize = 3;
const K_DIGIT: usize = 4;
const K_NON_ASCII: usize = 5;

const SKIM_CLASS: [u8; 256] = {
    let mut table = [K_OTHER as u8; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = match CLASS[b] {
            SPACE => K_SPACE,
            LETTER | JOINER => K_LETTER,
            DIGIT | DOLLAR => K_DIGIT,
            NON_ASCII => K_NON_ASCII,
            _ if is_letter_separator(byte) => K_SEPARATOR,
            _ => K_OTHER,
        } as u8;
        b += 1;
    }
    table
};

const SKIM_BY_CLASS: [[u8; 6]; STATES] = {
    const C: u8 = CHANGE;
    let mut t = [[C; 6]; STATES];
    //                 space        separator    other        letter      digit      non-ASCII
    t[START as usize] = [C, AFTER_PUNCT, AFTER_PUNCT, W1, N1, C];
    t[AFTER_SPACE as usize] = [C, AFTER_PUNCT, AFTER_PUNCT, W1, N1, C];
    t[AFTER_PUNCT as usize] = [AFTER_SPACE, AFTER_PUNCT, AFTER_PUNCT, W1, N1, C];
    t[W1 as usize] = [S1_SPACE, S1_PUNCT, AFTER_PUNCT, WORD, C, C];
    t[N1 as usize] = [S1_SPACE, S1_PUNCT, AFTER_PUNCT, C, NUMBER, C];
    t[WORD as usize] = [AFTER_SPACE, AFTER_PUNCT, AFTER_PUNCT, WORD, C, C];
    t[NUMBER as usize] = [AFTER_SPACE, AFTER_PUNCT, AFTER_PUNCT, C, NUMBER, C];
    t[S1_SPACE as usize] = [C, AFTER_PUNCT, AFTER_PUNCT, R1_LETTER, R1_DIGIT, C];
    t[S1_PUNCT as usize] = [
        AFTER_SPACE,
        AFTER_PUNCT,
        AFTER_PUNCT,
        R1_LETTER,
        R1_DIGIT,
        C,
    ];
    t[R1_LETTER as usize] = [C, C, C, WORD, C, C];
    t[R1_DIGIT as usize] = [C, C, C, C, NUMBER, C];
    t
};

/// The automaton as one flat table indexed by `state * 256 + byte`, so that
/// each step is a single dependent load. `CHANGE` rows stay `CHANGE`.
static SKIM: [u8; 256 * 256] = {
    let mut t = [CHANGE; 256 * 256];
    let mut state = 0;
    while state < STATES {
        let mut b = 0;
        while b < 256 {
            t[state * 256 + b] = SKIM_BY_CLASS[state][SKIM_CLASS[b] as usize];
            b += 1;
        }
        state += 1;
    }
    t
};

/// The places where phase 2 changes the text, in order: for each, where the
/// word-by-word path must start and the clean point from which the automaton
/// went on (it covers everything up to there).
///
/// Each step of the automaton waits on the previous one, so the text is
/// walked as two halves at once, which keeps the processor busy.
pub(super) fn find_changes(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut changes = Vec::new();
    let Some(middle) = clean_split(bytes, bytes.len() / 2) else {
        Walk::new(0, START).run(bytes, bytes.len(), &mut changes);
        return changes;
    };
    let mut first = Walk::new(0, START);
    let mut second = Walk::new(middle, AFTER_SPACE);
    let mut second_changes = Vec::new();
    loop {
        let n = (middle - first.at).min(bytes.len() - second.at);
        let (a, b, k) = lockstep(
            &bytes[first.at..first.at + n],
            &bytes[second.at..second.at + n],
            first.state,
            second.state,
        );
        (first.state, second.state) = (a, b);
        first.at += k;
        second.at += k;
        if k == n {
            break;
        }
        // One of them found a change: take one byte each, the slow way.
        first.step(bytes, middle, &mut changes);
        second.step(bytes, bytes.len(), &mut second_changes);
    }
    first.run(bytes, middle, &mut changes);
    second.run(bytes, bytes.len(), &mut second_changes);
    changes.append(&mut second_changes);
    changes
}

/// The automaton over two slices at once, until either finds a change or
/// they end: the states reached and how many bytes were taken.
#[inline]
fn lockstep(x: &[u8], y: &[u8], mut a: u8, mut b: u8) -> (u8, u8, usize) {
    for (k, (&p, &q)) in x.iter().zip(y).enumerate() {
        let (next_a, next_b) = (
            SKIM[(a as usize) << 8 | p as usize],
            SKIM[(b as usize) << 8 | q as usize],
        );
        if next_a == CHANGE || next_b == CHANGE {
            return (a, b, k);
        }
        (a, b) = (next_a, next_b);
    }
    (a, b, x.len())
}

/// One walk of the automaton.
struct Walk {
    at: usize,
    state: u8,
    /// Where the current clean stretch began; episodes reach back no further.
    clean_from: usize,
}

impl Walk {
    fn new(at: usize, state: u8) -> Self {
        Walk {
            at,
            state,
            clean_from: at,
        }
    }

    /// Walks to `end`, recording changes.
    fn run(&mut self, bytes: &[u8], end: usize, changes: &mut Vec<(usize, usize)>) {
        loop {
            let mut state = self.state;
            let mut taken = 0;
            for &b in &bytes[self.at.min(end)..end] {
                let next = SKIM[(state as usize) << 8 | b as usize];
                if next == CHANGE {
                    break;
                }
                state = next;
                taken += 1;
            }
            self.state = state;
            self.at += taken;
            if self.at >= end {
                self.finish(bytes, end, changes);
                return;
            }
            self.change(bytes, end, changes);
        }
    }

    /// Takes one byte, if any is left before `end`.
    fn step(&mut self, bytes: &[u8], end: usize, changes: &mut Vec<(usize, usize)>) {
        if self.at >= end {
            return;
        }
        let next = SKIM[(self.state as usize) << 8 | bytes[self.at] as usize];
        if next == CHANGE {
            self.change(bytes, end, changes);
        } else {
            self.state = next;
            self.at += 1;
            if self.at == end {
                self.finish(bytes, end, changes);
            }
        }
    }

    /// At `end`: a run of two single characters open at the very end of the
    /// text is a change.
    fn finish(&mut self, bytes: &[u8], end: usize, changes: &mut Vec<(usize, usize)>) {
        if end == bytes.len() && (self.state == R1_LETTER || self.state == R1_DIGIT) {
            changes.push((episode_start(bytes, self.clean_from, end), end));
            self.state = AFTER_SPACE;
        }
    }

    /// Records the change at `at` and restarts at the next clean point.
    #[cold]
    fn change(&mut self, bytes: &[u8], end: usize, changes: &mut Vec<(usize, usize)>) {
        let episode = episode_start(bytes, self.clean_from, self.at);
        let resume = clean_split(bytes, self.at + 1)
            .filter(|&p| p < end)
            .unwrap_or(bytes.len());
        changes.push((episode, resume));
        self.at = resume.min(end);
        self.clean_from = self.at;
        self.state = AFTER_SPACE;
    }
}

/// The first position from `at` on where the automaton is known to be in
/// `AFTER_SPACE` whatever came before: just after a space that follows two
/// letters, before a non-space.
fn clean_split(bytes: &[u8], at: usize) -> Option<usize> {
    let letter = |b: u8| b.is_ascii_lowercase();
    (at.max(3)..bytes.len()).find(|&p| {
        bytes[p - 1] == b' ' && letter(bytes[p - 2]) && letter(bytes[p - 3]) && bytes[p] != b' '
    })
}

/// Where the word-by-word path must start to handle a change at `at`: the
/// start of the word at or before `at`, and of the single characters that
/// lead up to it separated by one separator each.
fn episode_start(bytes: &[u8], from: usize, at: usize) -> usize {
    let word = |b: u8| SKIM_CLASS[b as usize] as usize >= K_LETTER;
    let mut start = at;
    while start > from && word(bytes[start - 1]) {
        start -= 1;
    }
    // Single characters before it, each followed by one separator.
    while start >= from + 2
        && is_letter_separator(bytes[start - 1])
        && word(bytes[start - 2])
        && (start - 2 == from || !word(bytes[start - 3]))
    {
        start -= 2;
    }
    start
}
