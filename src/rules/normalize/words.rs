//! Phase 2 of normalization: words. Whitespace runs collapse, leetspeak is
//! folded inside words, spaced-out letters are joined. The [`super::skim`]
//! automaton finds the few places that change; everything else is copied.

use std::ops::Range;

use super::skim::find_changes;

/// Characters that may separate the letters of a spaced-out word.
pub(super) const fn is_letter_separator(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'.' | b'-' | b'_' | b'*' | b',' | b'|' | b'/' | b'+' | b'~' | b':'
    )
}

// Byte classes for the word scan. Bytes from 0x80 up start or continue a
// multi-byte character, classified by `class_at`.
pub(super) const OTHER: u8 = 0;
pub(super) const SPACE: u8 = 1;
pub(super) const LETTER: u8 = 2;
pub(super) const DIGIT: u8 = 3;
pub(super) const DOLLAR: u8 = 4;
/// `'` and `@`: part of a word (`don't`, `jane@example`), never folded.
pub(super) const JOINER: u8 = 5;
pub(super) const NON_ASCII: u8 = 6;

pub(super) const CLASS: [u8; 256] = {
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

pub(super) fn fold_words(s: &str, out: &mut String, runs: &mut Vec<(u32, u32)>) {
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

/// Phase 2 entirely word by word, without the skimming automaton: the
/// reference the automaton is tested against.
#[cfg(test)]
pub(super) fn fold_words_word_by_word(s: &str) -> String {
    let mut out = String::new();
    let mut runs = Vec::new();
    let mut words = Words {
        s,
        out: &mut out,
        runs: &mut runs,
        copy: 0..0,
        run: Vec::new(),
        pending_separator: None,
        after_space: true,
    };
    fold_words_slowly(&mut words, 0, s.len());
    words.flush_run();
    words.flush_copy();
    out
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
