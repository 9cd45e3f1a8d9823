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
//!    e-mail addresses keep their shape; runs of two or more single letters
//!    separated by exactly one space or punctuation mark (`g u a r a n t e e d`,
//!    `g.u.a.r.a.n.t.e.e.d`) are joined into one word. Two spaces end such a
//!    run, so `g u a r a n t e e d  r e t u r n s` becomes `guaranteed returns`.
//!
//! Every byte of the view remembers where it came from, so a match in the view
//! maps back to a byte span of the original text ([`Normalized::original_span`]).
//! The map is kept as the runs of text copied unchanged, so for most texts it
//! is a handful of entries; only a non-ASCII text keeps a per-byte map of its
//! characters.

mod chars;
mod clean;
mod skim;
mod words;

use std::ops::Range;

use chars::fold_chars;
pub use clean::{clean_point_at_or_before, clean_point_in};
use words::fold_words;

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

    /// The first byte of the text made from byte `at` of the original or
    /// after it (the text's length when none is).
    pub fn view_offset(&self, at: usize) -> usize {
        let (mut low, mut high) = (0, self.text.len());
        while low < high {
            let middle = (low + high) / 2;
            if self.original_offset(middle) < at {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        low
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

#[cfg(test)]
mod tests {
    use super::chars::fold_chars;
    use super::words::fold_words_word_by_word;
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
    fn maps_original_offsets_to_the_view() {
        let original = "Totally  g u 4 r a n t e e d!  Ｙｅｓ";
        let n = Normalized::new(original);
        assert_eq!(n.text, "totally guaranteed! yes");
        // An offset maps to the first view byte made from it or after it.
        assert_eq!(n.view_offset(0), 0);
        assert_eq!(n.view_offset(original.find('g').unwrap()), 8);
        assert_eq!(n.view_offset(original.find('4').unwrap()), 10);
        // The collapsed spaces map to the view byte after them.
        assert_eq!(n.view_offset(original.find("  g").unwrap() + 1), 8);
        assert_eq!(n.view_offset(original.find('Ｙ').unwrap()), 20);
        assert_eq!(n.view_offset(original.len()), n.text.len());
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
        fold_words_word_by_word(&fold_chars(original, None))
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
            let mut rng = crate::testing::Lcg(seed);
            for _ in 0..len {
                text.push_str(rng.pick::<&str>(&pieces));
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
