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
//!    folded (`0→o 1→i 3→e 4→a 5→s 7→t 8→b 9→g`, and `@→a`, `$→s` inside a
//!    word), but only in a word that has letters and no more digits than
//!    letters and is not a number with a short unit, so `$100`, `2024`,
//!    `10x`, `$1k`, `3rd` and `401k` stay as they are; runs of two
//!    or more single letters separated by exactly one space or punctuation
//!    mark (`g u a r a n t e e d`, `g.u.a.r.a.n.t.e.e.d`) are joined into one
//!    word. Two spaces end such a run, so `g u a r a n t e e d  r e t u r n s`
//!    becomes `guaranteed returns`.
//!
//! Every byte of the view remembers where it came from, so a match in the view
//! maps back to a byte span of the original text ([`Normalized::original_span`]).
//! The map costs memory, so [`normalize`] builds only the text (the common case:
//! no rule matched) and [`Normalized::new`] builds text and map.

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
    /// For each byte of `text`, the byte of the phase-1 text it was copied from.
    words: Vec<u32>,
}

impl Normalized {
    /// Normalizes `original` and keeps the map back to it.
    pub fn new(original: &str) -> Self {
        let mut chars_map = Vec::new();
        let phase1 = fold_chars(original, Some(&mut chars_map));
        let chars = (!original.is_ascii()).then_some(chars_map);
        let mut words = Vec::with_capacity(phase1.len());
        let mut text = String::with_capacity(phase1.len());
        fold_words(&phase1, &mut text, Some(&mut words));
        Normalized { text, chars, words }
    }

    /// Maps a byte span of [`Normalized::text`] back to the byte span of the
    /// original text it was made from. An empty span maps to an empty span.
    pub fn original_span(&self, span: Range<usize>) -> Range<usize> {
        if span.is_empty() || span.end > self.words.len() {
            let at = self.original_offset(span.start);
            return at..at;
        }
        let first = self.words[span.start] as usize;
        let last = self.words[span.end - 1] as usize;
        match &self.chars {
            None => first..last + 1,
            Some(map) => map[first].0 as usize..map[last].1 as usize,
        }
    }

    fn original_offset(&self, at: usize) -> usize {
        match self.words.get(at) {
            Some(&p) => match &self.chars {
                None => p as usize,
                Some(map) => map[p as usize].0 as usize,
            },
            None => match (&self.chars, self.words.last()) {
                (None, Some(&p)) => p as usize + 1,
                (Some(map), Some(&p)) => map[p as usize].1 as usize,
                _ => 0,
            },
        }
    }
}

/// Normalizes a text without keeping the map: the fast path for texts in which
/// nothing matches.
pub fn normalize(original: &str) -> String {
    let phase1 = fold_chars(original, None);
    let mut text = String::with_capacity(phase1.len());
    fold_words(&phase1, &mut text, None);
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
            m.extend(std::iter::repeat_n((start as u32, end as u32), out.len() - before));
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
fn is_letter_separator(b: u8) -> bool {
    matches!(
        b,
        b' ' | b'.' | b'-' | b'_' | b'*' | b',' | b'|' | b'/' | b'+' | b'~' | b':' | b'\''
    )
}

/// Length and word-ness of the character at byte `i` of `s`.
fn class_at(s: &str, i: usize) -> (bool, usize) {
    let b = s.as_bytes()[i];
    if b < 0x80 {
        let word = b.is_ascii_alphanumeric() || matches!(b, b'\'' | b'@' | b'$');
        return (word, 1);
    }
    let c = s[i..].chars().next().unwrap_or(' ');
    (c.is_alphanumeric(), c.len_utf8())
}

fn fold_words(s: &str, out: &mut String, map: Option<&mut Vec<u32>>) {
    let mut words = Words {
        s,
        out,
        map,
        run: Vec::new(),
        pending_separator: None,
        after_space: true,
    };
    let mut i = 0;
    while i < s.len() {
        let (word, len) = class_at(s, i);
        let mut j = i + len;
        while j < s.len() {
            let (w, l) = class_at(s, j);
            if w != word {
                break;
            }
            j += l;
        }
        if word {
            words.token(i, j);
        } else {
            words.gap(i, j);
        }
        i = j;
    }
    words.flush_run();
}

struct Words<'a> {
    s: &'a str,
    out: &'a mut String,
    map: Option<&'a mut Vec<u32>>,
    /// Single-character words (letters or leet digits) that may be the
    /// letters of a spaced-out word, each with the separator that followed it.
    run: Vec<(Range<usize>, Option<usize>)>,
    /// The one-character gap after the last entry of `run`: dropped if the
    /// run goes on, kept if it ends.
    pending_separator: Option<usize>,
    after_space: bool,
}

impl Words<'_> {
    fn token(&mut self, start: usize, end: usize) {
        let mut chars = self.s[start..end].chars();
        let single = matches!((chars.next(), chars.next()), (Some(c), None) if c.is_alphabetic() || leet_digit(c).is_some());
        if single {
            // A non-empty run always ends in a pending separator: any other
            // gap has flushed it.
            if let Some(last) = self.run.last_mut() {
                last.1 = self.pending_separator.take();
            }
            self.run.push((start..end, None));
            return;
        }
        self.flush_run();
        self.push_token(start, end);
    }

    fn gap(&mut self, start: usize, end: usize) {
        if !self.run.is_empty() && end - start == 1 && is_letter_separator(self.s.as_bytes()[start]) {
            self.pending_separator = Some(start);
            return;
        }
        self.flush_run();
        self.push_gap(start, end);
    }

    /// Ends a run of single characters: two or more, with letters and no more
    /// digits than letters, are joined into one word; anything else is
    /// written as it was.
    fn flush_run(&mut self) {
        let run = std::mem::take(&mut self.run);
        let digits = run.iter().filter(|(r, _)| self.s.as_bytes()[r.start].is_ascii_digit()).count();
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
        for (i, c) in self.s[start..end].char_indices() {
            if c == ' ' {
                if self.after_space {
                    continue;
                }
                self.after_space = true;
            } else {
                self.after_space = false;
            }
            self.out.push(c);
            self.record(start + i, c.len_utf8());
        }
    }

    /// Writes a word, folding its leetspeak when it has letters, no more
    /// digits than letters, and is not a number with a unit.
    fn push_token(&mut self, start: usize, end: usize) {
        let token = &self.s[start..end];
        let (mut letters, mut digits) = (0usize, 0usize);
        for c in token.chars() {
            if c.is_ascii_digit() {
                digits += 1;
            } else if c.is_alphabetic() {
                letters += 1;
            }
        }
        let interior = &token.as_bytes()[1..token.len().saturating_sub(1).max(1)];
        let symbols = interior.iter().any(|&b| b == b'@' || b == b'$');
        let fold_digits = digits > 0 && digits <= letters && !is_number_with_unit(token, letters);
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
                '@' if i > 0 && i < last => 'a',
                '$' if i > 0 && i < last => 's',
                _ => c,
            };
            self.out.push(folded);
            self.record(range.start + i, c.len_utf8());
        }
        self.after_space = false;
    }

    fn push_slice(&mut self, range: Range<usize>) {
        self.out.push_str(&self.s[range.clone()]);
        self.record(range.start, range.len());
        self.after_space = false;
    }

    fn record(&mut self, from: usize, len: usize) {
        if let Some(m) = self.map.as_deref_mut() {
            m.extend((from..from + len).map(|p| p as u32));
        }
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
        assert_eq!(Normalized::new(input).text, expected, "Normalized::new({input:?})");
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
        check("guar\u{200B}an\u{200D}teed re\u{00AD}turns\u{FEFF}", "guaranteed returns");
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
        check("g\u{0332}u\u{0332}a\u{0332}r\u{0332}a\u{0332}n\u{0332}t\u{0332}e\u{0332}e\u{0332}d\u{0332}", "guaranteed");
        // Marks that are letters in their script stay.
        check("क्षमा", "क्षमा");
    }

    #[test]
    fn folds_leetspeak_only_in_words_with_letters() {
        check("gu4r4nt33d r3turn5", "guaranteed returns");
        check("g3t r1ch qu1ck", "get rich quick");
        check("ca$h we@lth", "cash wealth");
        check("$100 in 2024, 100% or 10x and a 401k", "$100 in 2024, 100% or 10x and a 401k");
        check("@user pays $5", "@user pays $5");
        check("turn $1k into 5x, the 3rd time", "turn $1k into 5x, the 3rd time");
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
        assert_eq!(&original[span], "G\u{200B}U\u{200B}A\u{200B}R\u{200B}A\u{200B}N\u{200B}T\u{200B}E\u{200B}E\u{200B}D");

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

    #[test]
    fn survives_arbitrary_input() {
        for input in ["", " ", "\u{0301}", "a\u{0301}\u{0301}", "\u{200B}\u{200B}", "ǅ", "İstanbul", "ß", "$", "'", "a b"] {
            let n = Normalized::new(input);
            assert_eq!(n.text, normalize(input));
            for end in 0..=n.text.len() {
                if n.text.is_char_boundary(end) {
                    let span = n.original_span(0..end);
                    assert!(span.end <= input.len() && span.start <= span.end, "{input:?} {end}");
                }
            }
        }
    }
}
