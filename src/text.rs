//! Word tokens and lexical similarity, shared by context relevance (risk) and
//! the quality metrics.

use std::collections::HashSet;
use std::sync::LazyLock;

use regex::Regex;

/// A non-ASCII character that belongs to words: a letter, a combining mark
/// or a decimal digit.
static WORD_CHAR: LazyLock<Regex> = LazyLock::new(|| {
    // A fixed pattern: it compiles or the crate's tests fail.
    #[allow(clippy::unwrap_used)]
    Regex::new(r"^[\p{L}\p{M}\p{Nd}]$").unwrap()
});

/// What an ASCII byte is to words: part of one (letters, digits and the
/// apostrophe) or a separator. Bytes from 0x80 start or continue another
/// character and are decoded ([`wide_word_char_len`]).
const ASCII_WORD: [bool; 128] = {
    let mut table = [false; 128];
    let mut byte = 0;
    while byte < 128 {
        table[byte] = (byte as u8).is_ascii_alphanumeric() || byte == b'\'' as usize;
        byte += 1;
    }
    table
};

/// The length of the character at byte `at` (a character boundary, not
/// ASCII) when it belongs to words; `None` for another character. Kept out
/// of the word loop, which decides ASCII bytes by a table.
#[inline(never)]
fn wide_word_char_len(text: &str, at: usize) -> Option<usize> {
    let c = text[at..].chars().next()?;
    is_word_char(c).then(|| c.len_utf8())
}

/// The length of the UTF-8 character that `first` starts.
fn char_len(first: u8) -> usize {
    match first {
        0..0x80 => 1,
        0xc0..0xe0 => 2,
        0xe0..0xf0 => 3,
        _ => 4,
    }
}

fn is_word_char(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphanumeric() || c == '\'';
    }
    WORD_CHAR.is_match(c.encode_utf8(&mut [0; 4]))
}

/// A text lower-cased once (U+2019 read as an apostrophe), read as words
/// without copying them: maximal runs of letters, combining marks, decimal
/// digits and apostrophes, with apostrophes trimmed from both ends and empty
/// words dropped.
pub struct Words {
    lower: String,
}

impl Words {
    pub fn new(text: &str) -> Words {
        let mut lower = text.to_lowercase();
        if lower.contains('\u{2019}') {
            lower = lower.replace('\u{2019}', "'");
        }
        Words { lower }
    }

    /// The words in order. Runs of word characters are found by a loop over
    /// the bytes: an ASCII byte is decided by a table, and only a byte that
    /// starts another character is decoded and looked up by its Unicode
    /// class. Most text is ASCII, and this is a hot path of the workers.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let text = self.lower.as_str();
        let bytes = text.as_bytes();
        let mut at = 0;
        // Past the run of word characters that starts at `at`.
        let run_end = move |mut at: usize| {
            while let Some(&byte) = bytes.get(at) {
                match ASCII_WORD.get(usize::from(byte)) {
                    Some(true) => at += 1,
                    Some(false) => break,
                    None => match wide_word_char_len(text, at) {
                        Some(len) => at += len,
                        None => break,
                    },
                }
            }
            at
        };
        std::iter::from_fn(move || {
            while let Some(&byte) = bytes.get(at) {
                if ASCII_WORD.get(usize::from(byte)) == Some(&false) {
                    at += 1;
                    continue;
                }
                let start = at;
                at = run_end(at);
                if at == start {
                    // Another character that is not a word character.
                    at += char_len(byte);
                    continue;
                }
                let mut word = &text[start..at];
                // Most words neither start nor end with an apostrophe.
                if word.starts_with('\'') || word.ends_with('\'') {
                    word = word.trim_matches('\'');
                }
                if !word.is_empty() {
                    return Some(word);
                }
            }
            None
        })
    }

    /// The words in order, in a vector made large enough at once: room for
    /// a word every 4 bytes, where English takes some 6 with its space.
    /// Grown from empty, it was reallocated four times for a short answer.
    pub fn list(&self) -> Vec<&str> {
        let mut words = Vec::with_capacity(self.lower.len() / 4 + 1);
        words.extend(self.iter());
        words
    }

    /// The distinct words.
    pub fn set(&self) -> HashSet<&str> {
        self.iter().collect()
    }
}

/// The [`Words`] of a text, as owned strings.
///
/// ```
/// assert_eq!(fairgate::text::tokens("Don’t PANIC, 'friend'!"), ["don't", "panic", "friend"]);
/// ```
pub fn tokens(text: &str) -> Vec<String> {
    Words::new(text).iter().map(str::to_owned).collect()
}

/// Cosine similarity of the binary token-set vectors of two texts:
/// `|A ∩ B| / sqrt(|A| · |B|)`, and 0.0 when either has no tokens.
///
/// ```
/// let r = fairgate::text::cosine("How do I save for a house?", "Saving for a house takes years.");
/// // {how, do, i, save, for, a, house} and {saving, for, a, house, takes, years} share 3.
/// assert!((r - 3.0 / (7.0f64 * 6.0).sqrt()).abs() < 1e-12);
/// ```
pub fn cosine(a: &str, b: &str) -> f64 {
    let (a, b) = (Words::new(a), Words::new(b));
    cosine_of_sets(&a.set(), &b.set())
}

/// [`cosine`] of two word sets.
pub fn cosine_of_sets(a: &HashSet<&str>, b: &HashSet<&str>) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let shared = a.intersection(b).count() as f64;
    shared / ((a.len() * b.len()) as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_keep_unicode_letters_marks_and_digits() {
        assert_eq!(
            tokens("Café 2024 naïve e\u{301}"),
            ["café", "2024", "naïve", "e\u{301}"]
        );
        assert_eq!(tokens("''' -- !!"), Vec::<String>::new());
        assert_eq!(tokens("rock'n'roll"), ["rock'n'roll"]);
        // Word characters outside ASCII, and separators outside ASCII.
        assert_eq!(
            tokens("Ελληνικά—日本語\u{a0}٣٤ ½ x²"),
            ["ελληνικά", "日本語", "٣٤", "x"]
        );
        assert_eq!(tokens("'quoted' it's"), ["quoted", "it's"]);
    }

    #[test]
    fn word_chars_are_letters_marks_decimal_digits_and_apostrophes() {
        let class = Regex::new(r"^[\p{L}\p{M}\p{Nd}']$").unwrap();
        for c in (0..0x3_0000).filter_map(char::from_u32) {
            assert_eq!(
                is_word_char(c),
                class.is_match(c.encode_utf8(&mut [0; 4])),
                "{c:?}"
            );
        }
    }

    #[test]
    fn words_are_the_runs_a_regex_finds() {
        let run = Regex::new(r"[\p{L}\p{M}\p{Nd}']+").unwrap();
        let reference = |text: &str| -> Vec<String> {
            let lower = text.to_lowercase().replace('\u{2019}', "'");
            run.find_iter(&lower)
                .map(|m| m.as_str().trim_matches('\'').to_owned())
                .filter(|w| !w.is_empty())
                .collect()
        };
        // Every string of up to four characters over ASCII and other word
        // characters and separators, including ones whose lower case is
        // longer (İ) and U+2019.
        let alphabet = [
            'a', 'Z', '7', '\'', ' ', '-', 'é', '\u{301}', '日', '—', '\u{a0}', '½', 'İ',
            '\u{2019}',
        ];
        let mut texts = vec![String::new()];
        for _ in 0..4 {
            texts = texts
                .iter()
                .flat_map(|t| alphabet.iter().map(move |c| format!("{t}{c}")))
                .collect();
            for text in &texts {
                assert_eq!(tokens(text), reference(text), "{text:?}");
            }
        }
    }

    #[test]
    fn cosine_of_identical_disjoint_and_empty_texts() {
        assert!((cosine("a b c", "c b a") - 1.0).abs() < 1e-12);
        assert_eq!(cosine("alpha beta", "gamma delta"), 0.0);
        assert_eq!(cosine("", "gamma"), 0.0);
        assert_eq!(cosine("!!!", "gamma"), 0.0);
    }
}
