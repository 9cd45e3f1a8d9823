//! Phase 1 of normalization: each character on its own (NFKC, case,
//! diacritics, invisible characters, look-alikes), with the map from each
//! output byte back to the original character.

use unicode_normalization::UnicodeNormalization;
use unicode_normalization::char::is_combining_mark;

/// Folds every character; `map` receives, per output byte, the original byte
/// range of the character (with its combining marks) it came from. An ASCII
/// text is folded byte for byte and `map` is left empty.
pub(super) fn fold_chars(original: &str, mut map: Option<&mut Vec<(u32, u32)>>) -> String {
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
