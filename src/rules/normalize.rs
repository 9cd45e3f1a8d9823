//! Text normalization, so that trivial evasion does not get past a rule.
//!
//! Rules match a *normalized view* of a text. Keywords are normalized by the
//! same function, so a rule author writes plain words and the view takes care
//! of the disguises. Normalization runs in two phases:
//!
//! 1. **Characters.** Unicode NFKC (full-width forms, ligatures, mathematical
//!    letters, circled letters all become plain letters), lower-casing,
//!    diacritics stripped from Latin/Greek/Cyrillic letters (so combining-mark
//!    "zalgo" and `é` versus `e` + U+0301 both fold away), invisible format
//!    characters removed (zero-width spaces and joiners, soft hyphens, bidi
//!    controls, variation selectors, tag characters), every whitespace and
//!    control character turned into a space, Cyrillic and Greek look-alikes
//!    folded to the Latin letter they imitate, curly quotes and dashes folded
//!    to ASCII.
//! 2. **Words.** Whitespace runs collapse to one space; simple leetspeak is
//!    folded (`0→o 1→i 3→e 4→a 5→s 7→t 8→b 9→g`, and `$→s` inside a word),
//!    but only in a word that has more letters than digits (or one of each)
//!    and is not a number with a short unit, so `$100`, `2024`, `10x`, `$1k`,
//!    `3rd`, `401k` and the `GB82` of an IBAN stay as they are; `@` stays, so
//!    e-mail addresses keep their shape; runs of two
//!    or more single letters separated by exactly one space or punctuation
//!    mark (`g u a r a n t e e d`, `g.u.a.r.a.n.t.e.e.d`) are joined into one
//!    word. Two spaces end such a run, so `g u a r a n t e e d  r e t u r n s`
//!    becomes `guaranteed returns`.
//!
//! Every byte of the view remembers where it came from, so a match in the view
//! maps back to a byte span of the original text ([`Normalized::original_span`]).
//! The map is kept as the runs of text copied unchanged, so for most texts it
//! is a handful of entries; only a non-ASCII text keeps a per-byte map of its
//! characters.

use std::ops::Range;

use unicode_normalization::UnicodeNormalization;
use unicode_normalization::char::is_combining_mark;

/// The normalized view of a text, with the map back to the original.
#[derive(Debug, Clone)]
pub struct Normalized {
    /// The normalized text that rules match against.
    pub text: String,
    /// For each byte of the phase-1 text, the original byte range of the
    /// character it came from; `None` when the original is ASCII and phase 1
    /// kept every byte in place.
    chars: Option<Vec<(u32, u32)>>,
    /// The runs of `text` copied from the phase-1 text, as (start in `text`,
    /// start in phase 1), in order; a run ends where the next one starts.
    /// Most text is copied unchanged, so there are few.
    runs: Vec<(u32, u32)>,
}

impl Normalized {
    /// Normalizes `original` and keeps the map back to it.
    pub fn new(original: &str) -> Self {
        let mut chars_map = Vec::new();
        let ascii = original.is_ascii();
        let phase1 = fold_chars(original, (!ascii).then_some(&mut chars_map));
        let mut runs = Vec::new();
        let mut text = String::with_capacity(phase1.len());
        fold_words(&phase1, &mut text, &mut runs);
        Normalized {
            text,
            chars: (!ascii).then_some(chars_map),
            runs,
        }
    }

    /// Maps a byte span of [`Normalized::text`] back to the byte span of the
    /// original text it was made from. An empty span maps to an empty span.
    pub fn original_span(&self, span: Range<usize>) -> Range<usize> {
        if span.is_empty() || span.end > self.text.len() {
            let at = self.original_offset(span.start.min(self.text.len()));
            return at..at;
        }
        let first = self.phase1_offset(span.start);
        let last = self.phase1_offset(span.end - 1);
        match &self.chars {
            None => first..last + 1,
            Some(map) => map[first].0 as usize..map[last].1 as usize,
        }
    }

    /// The phase-1 byte that byte `at` of the text was copied from.
    fn phase1_offset(&self, at: usize) -> usize {
        let run = self
            .runs
            .partition_point(|&(start, _)| start as usize <= at)
            - 1;
        let (start, from) = self.runs[run];
        from as usize + (at - start as usize)
    }

    fn original_offset(&self, at: usize) -> usize {
        if at < self.text.len() {
            let p = self.phase1_offset(at);
            return self.chars.as_ref().map_or(p, |map| map[p].0 as usize);
        }
        if self.text.is_empty() {
            return 0;
        }
        let p = self.phase1_offset(self.text.len() - 1);
        self.chars.as_ref().map_or(p + 1, |map| map[p].1 as usize)
    }
}

/// Normalizes a text without keeping the map.
pub fn normalize(original: &str) -> String {
    let phase1 = fold_chars(original, None);
    let mut text = String::with_capacity(phase1.len());
    fold_words(&phase1, &mut text, &mut Vec::new());
    text
}

// ---------------------------------------------------------------------------
// Phase 1: characters.

/// Folds every character; `map` receives, per output byte, the original byte
/// range of the character (with its combining marks) it came from. An ASCII
/// text is folded byte for byte and `map` is left empty.
fn fold_chars(original: &str, mut map: Option<&mut Vec<(u32, u32)>>) -> String {
    if original.is_ascii() {
        let folded: Vec<u8> = original.bytes().map(fold_ascii).collect();
        // Every byte stays ASCII, so this cannot fail.
        return String::from_utf8(folded).unwrap_or_default();
    }
    let mut out = String::with_capacity(original.len());
    let mut scratch = String::new();
    let mut rest = original.char_indices().peekable();
    while let Some((start, c)) = rest.next() {
        if c.is_ascii() {
            out.push(fold_ascii(c as u8) as char);
            if let Some(m) = map.as_deref_mut() {
                m.push((start as u32, start as u32 + 1));
            }
            continue;
        }
        // A character and the combining marks that follow it fold together.
        let mut end = start + c.len_utf8();
        while let Some(&(i, next)) = rest.peek() {
            if !is_combining_mark(next) {
                break;
            }
            end = i + next.len_utf8();
            rest.next();
        }
        let before = out.len();
        fold_cluster(&original[start..end], &mut scratch, &mut out);
        if let Some(m) = map.as_deref_mut() {
            m.extend(std::iter::repeat_n(
                (start as u32, end as u32),
                out.len() - before,
            ));
        }
    }
    out
}

fn fold_ascii(b: u8) -> u8 {
    match b {
        b'A'..=b'Z' => b + 32,
        0..=0x1f | 0x7f => b' ',
        _ => b,
    }
}

/// Folds one base character with its combining marks.
fn fold_cluster(cluster: &str, scratch: &mut String, out: &mut String) {
    scratch.clear();
    for c in cluster.nfkc() {
        scratch.extend(c.to_lowercase());
    }
    // Diacritics on alphabetic scripts are decoration (or evasion); in scripts
    // such as Devanagari the marks are letters and stay.
    let strip_marks = scratch.chars().next().is_none_or(|c| c < '\u{0590}');
    let mut push = |c: char| {
        if is_invisible(c) || (strip_marks && is_combining_mark(c)) {
            return;
        }
        if c.is_whitespace() || c.is_control() {
            out.push(' ');
        } else {
            match fold_lookalike(c) {
                Fold::One(f) => out.push(f),
                Fold::Two(a, b) => {
                    out.push(a);
                    out.push(b);
                }
            }
        }
    };
    if strip_marks {
        scratch.nfd().for_each(&mut push);
    } else {
        scratch.chars().for_each(&mut push);
    }
}

/// Default-ignorable code points: they render as nothing and are a classic
/// way to split a keyword.
fn is_invisible(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}' | '\u{1160}' | '\u{17B4}' | '\u{17B5}'
        | '\u{180B}'..='\u{180F}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{206F}' | '\u{3164}' | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}'
        | '\u{FFA0}' | '\u{1BCA0}'..='\u{1BCA3}' | '\u{1D173}'..='\u{1D17A}'
        | '\u{E0000}'..='\u{E0FFF}')
}

enum Fold {
    One(char),
    Two(char, char),
}

/// Lower-case Cyrillic and Greek letters that pass for Latin ones, and
/// typographic punctuation that has an ASCII twin.
fn fold_lookalike(c: char) -> Fold {
    Fold::One(match c {
        // Cyrillic
        'а' => 'a',
        'в' => 'b',
        'е' | 'ё' | 'є' => 'e',
        'һ' | 'н' => 'h',
        'і' | 'ї' | 'ı' => 'i',
        'ј' => 'j',
        'к' => 'k',
        'ӏ' => 'l',
        'м' => 'm',
        'о' => 'o',
        'р' => 'p',
        'ԛ' => 'q',
        'с' => 'c',
        'ѕ' => 's',
        'т' => 't',
        'у' | 'ү' => 'y',
        'ԝ' => 'w',
        'х' => 'x',
        'ԁ' => 'd',
        'ɡ' => 'g',
        // Greek
        'α' => 'a',
        'β' => 'b',
        'ε' => 'e',
        'η' => 'n',
        'ι' => 'i',
        'κ' => 'k',
        'ν' => 'v',
        'ο' => 'o',
        'ρ' => 'p',
        'τ' => 't',
        'υ' => 'u',
        'χ' => 'x',
        'γ' => 'y',
        'ω' => 'w',
        'ς' => 's',
        // Punctuation
        '\u{2018}' | '\u{2019}' | '\u{201A}' | '\u{201B}' | '\u{2032}' | '\u{02BC}' => '\'',
        '\u{201C}' | '\u{201D}' | '\u{201E}' | '\u{201F}' | '\u{2033}' => '"',
        '\u{2010}'..='\u{2015}' | '\u{2212}' => '-',
        'ß' => return Fold::Two('s', 's'),
        other => other,
    })
}

// ---------------------------------------------------------------------------
// Phase 2: words.

/// Characters that may separate the letters of a spaced-out word.
const fn is_letter_separator(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'.' | b'-' | b'_' | b'*' | b',' | b'|' | b'/' | b'+' | b'~' | b':'
    )
}

// Byte classes for the word scan. Bytes from 0x80 up start or continue a
// multi-byte character, classified by `class_at`.
const OTHER: u8 = 0;
const SPACE: u8 = 1;
const LETTER: u8 = 2;
const DIGIT: u8 = 3;
const DOLLAR: u8 = 4;
/// `'` and `@`: part of a word (`don't`, `jane@example`), never folded.
const JOINER: u8 = 5;
const NON_ASCII: u8 = 6;

const CLASS: [u8; 256] = {
    let mut table = [OTHER; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = if byte >= 0x80 {
            NON_ASCII
        } else if byte == b' ' {
            SPACE
        } else if byte.is_ascii_alphabetic() {
            LETTER
        } else if byte.is_ascii_digit() {
            DIGIT
        } else if byte == b'$' {
            DOLLAR
        } else if byte == b'\'' || byte == b'@' {
            JOINER
        } else {
            OTHER
        };
        b += 1;
    }
    table
};

/// Length and word-ness of the (non-ASCII) character at byte `i` of `s`.
fn class_at(s: &str, i: usize) -> (bool, usize) {
    let c = s[i..].chars().next().unwrap_or(' ');
    (c.is_alphanumeric(), c.len_utf8())
}

fn fold_words(s: &str, out: &mut String, runs: &mut Vec<(u32, u32)>) {
    let mut words = Words {
        s,
        out,
        runs,
        copy: 0..0,
        run: Vec::new(),
        pending_separator: None,
        after_space: true,
    };
    let bytes = s.as_bytes();
    // Most text needs no change past phase 1: a small automaton finds the
    // places that do (a digit in a word, two spaces, single letters in a row,
    // non-ASCII), and only the words around them go through the word-by-word
    // path; the rest is copied.
    let mut at = 0;
    for (episode, resume) in find_changes(bytes) {
        if resume <= at {
            continue;
        }
        let start = episode.max(at);
        words.push_slice(at..start);
        words.after_space = start == 0 || bytes[start - 1] == b' ';
        at = fold_words_slowly(&mut words, start, resume - 1);
    }
    words.push_slice(at..bytes.len());
    words.flush_run();
    words.flush_copy();
}

/// Folds word by word from `from` (the start of a word or gap, with no run
/// pending) until past `past` at a point where nothing is pending; returns
/// where it stopped.
fn fold_words_slowly(words: &mut Words, from: usize, past: usize) -> usize {
    let s = words.s;
    let bytes = s.as_bytes();
    let mut i = from;
    while i < bytes.len() {
        let class = CLASS[bytes[i] as usize];
        let (word, mut j) = if class == NON_ASCII {
            let (word, len) = class_at(s, i);
            (word, i + len)
        } else {
            (class >= LETTER, i + 1)
        };
        // Whether the word has a digit or a `$`, the only things leetspeak
        // folding changes.
        let mut foldable = class == DIGIT || class == DOLLAR;
        while j < bytes.len() {
            let class = CLASS[bytes[j] as usize];
            if class == NON_ASCII {
                let (w, len) = class_at(s, j);
                if w != word {
                    break;
                }
                j += len;
                continue;
            }
            if (class >= LETTER) != word {
                break;
            }
            foldable |= class == DIGIT || class == DOLLAR;
            j += 1;
        }
        if word {
            words.token(i, j, foldable);
        } else {
            words.gap(i, j);
            if j > past && words.run.is_empty() && words.pending_separator.is_none() {
                return j;
            }
        }
        i = j;
    }
    i
}

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
fn find_changes(bytes: &[u8]) -> Vec<(usize, usize)> {
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

struct Words<'a> {
    s: &'a str,
    out: &'a mut String,
    /// Where each copied run of `out` came from (see [`Normalized`]).
    runs: &'a mut Vec<(u32, u32)>,
    /// Source bytes that go to `out` unchanged, copied in one piece when
    /// something else has to be written: most text is copied as it is.
    copy: Range<usize>,
    /// Single-character words (letters or leet digits) that may be the
    /// letters of a spaced-out word, each with the separator that followed it.
    run: Vec<(Range<usize>, Option<usize>)>,
    /// The one-character gap after the last entry of `run`: dropped if the
    /// run goes on, kept if it ends.
    pending_separator: Option<usize>,
    after_space: bool,
}

impl Words<'_> {
    fn token(&mut self, start: usize, end: usize, foldable: bool) {
        let single = if end - start == 1 {
            let b = self.s.as_bytes()[start];
            b.is_ascii_alphabetic() || leet_digit(b as char).is_some()
        } else {
            let mut chars = self.s[start..end].chars();
            matches!((chars.next(), chars.next()), (Some(c), None) if c.is_alphabetic())
        };
        if single {
            // A non-empty run always ends in a pending separator: any other
            // gap has flushed it.
            if let Some(last) = self.run.last_mut() {
                last.1 = self.pending_separator.take();
            }
            self.run.push((start..end, None));
            return;
        }
        if !self.run.is_empty() {
            self.flush_run();
        }
        if foldable {
            self.push_token(start, end);
        } else {
            self.push_slice(start..end);
        }
    }

    fn gap(&mut self, start: usize, end: usize) {
        if !self.run.is_empty() {
            if end - start == 1 && is_letter_separator(self.s.as_bytes()[start]) {
                self.pending_separator = Some(start);
                return;
            }
            self.flush_run();
        }
        self.push_gap(start, end);
    }

    /// Ends a run of single characters: two or more, with more letters than
    /// digits, are joined into one word; anything else is written as it was.
    fn flush_run(&mut self) {
        let run = std::mem::take(&mut self.run);
        let digits = run
            .iter()
            .filter(|(r, _)| self.s.as_bytes()[r.start].is_ascii_digit())
            .count();
        let join = run.len() >= 2 && digits * 2 < run.len();
        for (letter, separator) in &run {
            if join {
                self.push_folded(letter.clone(), true);
            } else {
                self.push_slice(letter.clone());
                if let Some(at) = separator {
                    self.push_gap(*at, at + 1);
                }
            }
        }
        if let Some(at) = self.pending_separator.take() {
            self.push_gap(at, at + 1);
        }
        self.run = run;
        self.run.clear();
    }

    fn push_gap(&mut self, start: usize, end: usize) {
        let bytes = self.s.as_bytes();
        if end - start == 1 && bytes[start] == b' ' {
            if !self.after_space {
                self.push_slice(start..end);
                self.after_space = true;
            }
            return;
        }
        for (i, c) in self.s[start..end].char_indices() {
            let at = start + i;
            if c == ' ' {
                if !self.after_space {
                    self.push_slice(at..at + 1);
                    self.after_space = true;
                }
            } else {
                self.push_slice(at..at + c.len_utf8());
            }
        }
    }

    /// Writes a word, folding its leetspeak when it has more letters than
    /// digits (or is one letter and one digit) and is not a number with a
    /// unit.
    fn push_token(&mut self, start: usize, end: usize) {
        let token = &self.s[start..end];
        let bytes = token.as_bytes();
        let (mut digits, mut symbols) = (0usize, false);
        for (i, &b) in bytes.iter().enumerate() {
            if b.is_ascii_digit() {
                digits += 1;
            } else if b == b'$' && i > 0 && i + 1 < bytes.len() {
                symbols = true;
            }
        }
        if digits == 0 && !symbols {
            self.push_slice(start..end);
            return;
        }
        let letters = token.chars().filter(|c| c.is_alphabetic()).count();
        let fold_digits = digits > 0
            && (letters > digits || letters == 1 && digits == 1)
            && !is_number_with_unit(token, letters);
        if letters == 0 || !fold_digits && !symbols {
            self.push_slice(start..end);
            return;
        }
        self.push_folded(start..end, fold_digits);
    }

    fn push_folded(&mut self, range: Range<usize>, fold_digits: bool) {
        let last = range.len().saturating_sub(1);
        for (i, c) in self.s[range.clone()].char_indices() {
            let folded = match c {
                '0'..='9' if fold_digits => leet_digit(c).unwrap_or(c),
                '$' if i > 0 && i < last => 's',
                _ => c,
            };
            let at = range.start + i;
            if folded == c {
                self.push_slice(at..at + c.len_utf8());
            } else {
                self.flush_copy();
                self.runs.push((self.out.len() as u32, at as u32));
                self.out.push(folded);
                self.copy = at + 1..at + 1;
            }
        }
        self.after_space = false;
    }

    /// Queues source bytes to be copied unchanged.
    #[inline]
    fn push_slice(&mut self, range: Range<usize>) {
        if range.start == self.copy.end {
            self.copy.end = range.end;
        } else {
            self.flush_copy();
            self.copy = range;
        }
        self.after_space = false;
    }

    fn flush_copy(&mut self) {
        let end = self.copy.end;
        let copy = std::mem::replace(&mut self.copy, end..end);
        if copy.is_empty() {
            return;
        }
        self.runs.push((self.out.len() as u32, copy.start as u32));
        self.out.push_str(&self.s[copy]);
    }
}

/// `1k`, `5x`, `3rd`, `10yr`: digits then at most three letters. Such a
/// token is a number with a unit, not leetspeak.
fn is_number_with_unit(token: &str, letters: usize) -> bool {
    let number = token.trim_start_matches('$');
    let unit = number.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.' || c == ',');
    letters <= 3 && unit.len() < number.len() && unit.chars().all(char::is_alphabetic)
}

fn leet_digit(c: char) -> Option<char> {
    Some(match c {
        '0' => 'o',
        '1' => 'i',
        '3' => 'e',
        '4' => 'a',
        '5' => 's',
        '7' => 't',
        '8' => 'b',
        '9' => 'g',
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expected: &str) {
        assert_eq!(normalize(input), expected, "normalize({input:?})");
        assert_eq!(
            Normalized::new(input).text,
            expected,
            "Normalized::new({input:?})"
        );
    }

    #[test]
    fn folds_case_and_collapses_whitespace() {
        check("Guaranteed   RETURNS\t\n now", "guaranteed returns now");
        check("  leading", "leading");
    }

    #[test]
    fn applies_nfkc_to_full_width_and_styled_letters() {
        check("ＧＵＡＲＡＮＴＥＥＤ", "guaranteed");
        check("𝐠𝐮𝐚𝐫𝐚𝐧𝐭𝐞𝐞𝐝", "guaranteed");
        check("ⓖⓤⓐⓡⓐⓝⓣⓔⓔⓓ", "guaranteed");
        check("proﬁt", "profit");
    }

    #[test]
    fn removes_invisible_characters() {
        check(
            "guar\u{200B}an\u{200D}teed re\u{00AD}turns\u{FEFF}",
            "guaranteed returns",
        );
        check("in\u{2060}vest", "invest");
    }

    #[test]
    fn folds_homoglyphs() {
        // Cyrillic а, е, о, р, с and Greek ο
        check("guаrаntееd", "guaranteed");
        check("\u{0440}\u{043E}nzi sch\u{0435}m\u{0435}", "ponzi scheme");
        check("crypt\u{03BF}", "crypto");
        check("It\u{2019}s", "it's");
    }

    #[test]
    fn strips_diacritics_and_combining_marks() {
        check("gúäránteed", "guaranteed");
        check("cafe\u{0301}", "cafe");
        check(
            "g\u{0332}u\u{0332}a\u{0332}r\u{0332}a\u{0332}n\u{0332}t\u{0332}e\u{0332}e\u{0332}d\u{0332}",
            "guaranteed",
        );
        // Marks that are letters in their script stay.
        check("क्षमा", "क्षमा");
    }

    #[test]
    fn folds_leetspeak_only_in_words_with_letters() {
        check("gu4r4nt33d r3turn5", "guaranteed returns");
        check("g3t r1ch qu1ck", "get rich quick");
        check("ca$h", "cash");
        check(
            "jane.doe@example.com gb82 west",
            "jane.doe@example.com gb82 west",
        );
        check(
            "$100 in 2024, 100% or 10x and a 401k",
            "$100 in 2024, 100% or 10x and a 401k",
        );
        check("@user pays $5", "@user pays $5");
        check(
            "turn $1k into 5x, the 3rd time",
            "turn $1k into 5x, the 3rd time",
        );
    }

    #[test]
    fn joins_spaced_out_letters() {
        check("g u a r a n t e e d returns", "guaranteed returns");
        check("g.u.a.r.a.n.t.e.e.d", "guaranteed");
        check("g-u-a-r-a-n-t-e-e-d  r-e-t-u-r-n-s", "guaranteed returns");
        check("g u a r a n t e e d  r e t u r n s!", "guaranteed returns!");
        // A single letter between words is left alone.
        check("buy a house", "buy a house");
        check("plan a, b or c", "plan a, b or c");
    }

    #[test]
    fn maps_spans_back_to_the_original() {
        let original = "Is it G\u{200B}U\u{200B}A\u{200B}R\u{200B}A\u{200B}N\u{200B}T\u{200B}E\u{200B}E\u{200B}D? Yes.";
        let n = Normalized::new(original);
        let at = n.text.find("guaranteed").unwrap();
        let span = n.original_span(at..at + "guaranteed".len());
        assert_eq!(
            &original[span],
            "G\u{200B}U\u{200B}A\u{200B}R\u{200B}A\u{200B}N\u{200B}T\u{200B}E\u{200B}E\u{200B}D"
        );

        let original = "Totally g u 4 r a n t e e d!";
        let n = Normalized::new(original);
        assert_eq!(n.text, "totally guaranteed!");
        assert_eq!(&original[n.original_span(8..18)], "g u 4 r a n t e e d");
        let original = "Ａｌｌ  ｉｎ on ＢＴＣ";
        let n = Normalized::new(original);
        assert_eq!(n.text, "all in on btc");
        let at = n.text.find("all in").unwrap();
        assert_eq!(&original[n.original_span(at..at + 6)], "Ａｌｌ  ｉｎ");
        let at = n.text.find("btc").unwrap();
        assert_eq!(&original[n.original_span(at..at + 3)], "ＢＴＣ");
    }

    #[test]
    fn maps_folded_leetspeak_and_joined_letters() {
        let original = "Make  G.U.A.R.A.N.T.E.E.D  pr0f1ts";
        let n = Normalized::new(original);
        assert_eq!(n.text, "make guaranteed profits");
        let at = n.text.find("guaranteed profits").unwrap();
        let span = n.original_span(at..n.text.len());
        assert_eq!(&original[span], "G.U.A.R.A.N.T.E.E.D  pr0f1ts");
    }

    /// The reference: phase 2 entirely word by word, without the automaton.
    fn normalize_word_by_word(original: &str) -> String {
        let phase1 = fold_chars(original, None);
        let mut out = String::new();
        let mut runs = Vec::new();
        let mut words = Words {
            s: &phase1,
            out: &mut out,
            runs: &mut runs,
            copy: 0..0,
            run: Vec::new(),
            pending_separator: None,
            after_space: true,
        };
        fold_words_slowly(&mut words, 0, phase1.len());
        words.flush_run();
        words.flush_copy();
        out
    }

    #[test]
    fn the_automaton_agrees_with_the_word_by_word_path() {
        // Texts built from pieces that exercise every transition, in a
        // deterministic pseudo-random order.
        let pieces = [
            "a", "b", "i", "to", "the", "r1ch", "4", "10x", "$5", "ca$h", " ", "  ", ".", ",", "-",
            "!", "'", "@", "é", "ｇ", "\u{200B}", "e\u{301}", "x.y", "g u a r", "2024", "1 a", "$",
            "\n", "\t", "q",
        ];
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..3000 {
            let mut text = String::new();
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 40) as usize;
            let mut x = seed;
            for _ in 0..len {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                text.push_str(pieces[(x >> 33) as usize % pieces.len()]);
            }
            assert_eq!(
                normalize(&text),
                normalize_word_by_word(&text),
                "text {text:?}"
            );
            let n = Normalized::new(&text);
            assert_eq!(n.text, normalize(&text));
            for (i, _) in n.text.char_indices() {
                let span =
                    n.original_span(i..i + n.text[i..].chars().next().map_or(0, char::len_utf8));
                assert!(
                    span.start < span.end && span.end <= text.len(),
                    "{text:?} {i}"
                );
                assert!(text.is_char_boundary(span.start) && text.is_char_boundary(span.end));
            }
        }
    }

    #[test]
    fn survives_arbitrary_input() {
        for input in [
            "",
            " ",
            "\u{0301}",
            "a\u{0301}\u{0301}",
            "\u{200B}\u{200B}",
            "ǅ",
            "İstanbul",
            "ß",
            "$",
            "'",
            "a b",
        ] {
            let n = Normalized::new(input);
            assert_eq!(n.text, normalize(input));
            for end in 0..=n.text.len() {
                if n.text.is_char_boundary(end) {
                    let span = n.original_span(0..end);
                    assert!(
                        span.end <= input.len() && span.start <= span.end,
                        "{input:?} {end}"
                    );
                }
            }
        }
    }
}
