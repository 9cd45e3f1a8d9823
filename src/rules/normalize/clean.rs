//! Clean points: where a text may be cut without changing how it
//! normalizes. The stream guard releases text, and starts its scan
//! windows, only at such points.

use unicode_normalization::char::is_combining_mark;

use super::chars::fold_chars;

/// The last position at or before `at` where normalization starts clean,
/// as it would in the whole text: no word, spaced-out word or whitespace
/// run spans it. That is just after a space or line break that follows a
/// word of two letters or more, in any script, or a punctuation mark (a gap
/// of two characters ends a run of spaced-out letters), or just after a CJK
/// sentence mark followed by a letter (CJK text has no spaces: without such
/// points, a Japanese answer would be held whole, and rescanned from its
/// start at every check).
pub fn clean_point_at_or_before(text: &str, at: usize) -> Option<usize> {
    clean_point_in(text, 2, at)
}

/// The last clean point (see [`clean_point_at_or_before`]) from `low` to
/// `at`.
pub fn clean_point_in(text: &str, low: usize, at: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    (low.max(2)..=at.min(bytes.len()))
        .rev()
        .find(|&p| match bytes[p - 1] {
            b' ' | b'\n' => ends_word(&text[..p - 1]),
            // The last bytes of 、 。 ！ ？ in UTF-8.
            0x81 | 0x82 | 0x9f => {
                CJK_STOPS.iter().any(|m| bytes[..p].ends_with(m.as_bytes()))
                    && text[p..].chars().next().is_some_and(char::is_alphanumeric)
            }
            _ => false,
        })
}

/// Marks that end a CJK sentence or clause: 、 。 ！ ？.
const CJK_STOPS: [&str; 4] = ["\u{3001}", "\u{3002}", "\u{ff01}", "\u{ff1f}"];

/// Marks that end a sentence or clause in scripts without ASCII
/// punctuation, a space after them: । ॥ (Devanagari, Bengali), ، ؟ ۔
/// (Arabic, Urdu), ։ (Armenian), ። (Ethiopic), ။ (Myanmar), ។ (Khmer).
const STOPS: [char; 9] = [
    '\u{0964}', '\u{0965}', '\u{060c}', '\u{061f}', '\u{06d4}', '\u{0589}', '\u{1362}', '\u{104b}',
    '\u{17d4}',
];

/// Whether `text` ends with a word of two letters or more, or a
/// punctuation mark, so that a space after it ends its word and any run of
/// spaced-out letters.
fn ends_word(text: &str) -> bool {
    match text.chars().next_back() {
        // `$`, `'` and `@` belong to words.
        Some(c) if c.is_ascii_punctuation() => !matches!(c, '$' | '\'' | '@'),
        Some(c) if STOPS.contains(&c) || CJK_STOPS.iter().any(|m| m.starts_with(c)) => true,
        Some(_) => ends_in_a_word(text),
        None => false,
    }
}

/// Whether `text` ends with a word that phase 1 folds to two letters or
/// more: a space after it ends that word and any run of spaced-out
/// letters, so what follows cannot change how `text` normalizes. Any
/// script: `ab`, `деньги`, `करें` (whose vowel signs are letters that
/// stay); not a single letter, nor one that only looks like two (`e` with
/// a combining accent, which folds to `e`).
fn ends_in_a_word(text: &str) -> bool {
    let bytes = text.as_bytes();
    match bytes {
        [.., a, b] if a.is_ascii_alphabetic() && b.is_ascii_alphabetic() => return true,
        [.., b] if b.is_ascii() && !b.is_ascii_alphabetic() => return false,
        [] => return false,
        _ => {}
    }
    // Phase 1 folds each character with the combining marks after it on
    // its own: fold the last two such clusters as it would.
    let clusters = text.char_indices().rev().take(MOST_CHARS_FOLDED);
    let mut starts = clusters.filter(|&(_, c)| !is_combining_mark(c));
    let Some((start, _)) = starts.nth(1) else {
        return false;
    };
    let folded = fold_chars(&text[start..], None);
    let mut last = folded.chars().rev();
    last.next().is_some_and(char::is_alphabetic) && last.next().is_some_and(char::is_alphabetic)
}

/// How far back [`ends_in_a_word`] looks for its two characters: a letter
/// under more combining marks than this is not taken for a word's end.
const MOST_CHARS_FOLDED: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::normalize::normalize;

    #[test]
    fn clean_points_are_where_no_word_spans() {
        let points = |text: &str| -> Vec<usize> {
            let mut points = Vec::new();
            let mut at = text.len();
            while let Some(p) = clean_point_at_or_before(text, at) {
                points.push(p);
                at = p - 1;
            }
            points.reverse();
            points
        };
        // After two letters or a mark, then a space or a line break.
        assert_eq!(points("ab cd. ef\ngh"), [3, 7, 10]);
        // Not after a single letter (`a b c` joins), nor a word's `$`.
        assert_eq!(points("x y 5$ z"), Vec::<usize>::new());
        // After a CJK mark that a letter follows; not before a space.
        let text = "予算です。次に、貯金！ 最後";
        let after = |mark: &str| text.find(mark).unwrap() + mark.len();
        assert_eq!(
            points(text),
            [after("です。"), after("次に、"), after("貯金！ ")]
        );
        // After a word of any script, and the sentence marks of scripts
        // without ASCII punctuation.
        for (text, ends) in [
            ("бюджет деньги", &["бюджет "][..]),
            ("जमा करें। हर", &["जमा ", "करें। "]),
            ("ادخر، ثم", &["ادخر، "]),
        ] {
            let ends: Vec<usize> = ends
                .iter()
                .map(|end| text.find(end).unwrap() + end.len())
                .collect();
            assert_eq!(points(text), ends, "{text}");
        }
        // Not after what folds to one letter: a letter under an accent,
        // spaced-out letters of two scripts, a letter and a character that
        // folds to a space (U+037A).
        assert_eq!(points("x e\u{301} y"), Vec::<usize>::new());
        assert_eq!(points("г u а r"), Vec::<usize>::new());
        assert_eq!(points("x a\u{37a} b"), Vec::<usize>::new());
    }

    /// Normalization of the text before a clean point is the start of the
    /// whole text's, and of the text after it the end: on random texts of
    /// words, single letters, marks and look-alikes in several scripts.
    #[test]
    fn clean_points_keep_the_view() {
        const PIECES: &[&str] = &[
            "ab",
            "деньги",
            "करें",
            "ने",
            "ฉุกเฉิน",
            "예산",
            "ادخر",
            "Φτιάξτε",
            "x",
            "г",
            "а",
            "е\u{301}",
            "a\u{903}\u{903}",
            "\u{37a}",
            "ß",
            "æ",
            "ﬁ",
            "Ａ",
            "5$",
            "b3",
            "\u{200b}",
            " ",
            "  ",
            "\n",
            ". ",
            "। ",
            "، ",
            "。",
            "、",
            "-",
            "'",
            "\u{301}",
        ];
        let mut lcg = crate::testing::Lcg(17);
        for round in 0..3000 {
            let text: String = (0..lcg.below(12) + 1).map(|_| *lcg.pick(PIECES)).collect();
            let whole = normalize(&text);
            let mut at = text.len();
            while let Some(p) = clean_point_at_or_before(&text, at) {
                let (before, after) = (normalize(&text[..p]), normalize(&text[p..]));
                assert!(
                    whole.starts_with(&before) && whole.ends_with(after.trim_start()),
                    "round {round}: {text:?} at {p}: {whole:?} against {before:?} + {after:?}"
                );
                at = p - 1;
            }
        }
    }
}
