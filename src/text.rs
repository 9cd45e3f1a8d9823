//! Word tokens and lexical similarity, shared by context relevance (risk) and
//! the quality metrics.

use std::collections::HashSet;
use std::sync::LazyLock;

use regex::Regex;

static TOKEN: LazyLock<Regex> = LazyLock::new(|| {
    // A fixed pattern: it compiles or the crate's tests fail.
    #[allow(clippy::unwrap_used)]
    Regex::new(r"[\p{L}\p{M}\p{Nd}']+").unwrap()
});

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

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        TOKEN
            .find_iter(&self.lower)
            .map(|m| m.as_str().trim_matches('\''))
            .filter(|t| !t.is_empty())
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
    }

    #[test]
    fn cosine_of_identical_disjoint_and_empty_texts() {
        assert!((cosine("a b c", "c b a") - 1.0).abs() < 1e-12);
        assert_eq!(cosine("alpha beta", "gamma delta"), 0.0);
        assert_eq!(cosine("", "gamma"), 0.0);
        assert_eq!(cosine("!!!", "gamma"), 0.0);
    }
}
