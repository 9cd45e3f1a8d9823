//! The eight-emotion word table behind emotional entropy and the
//! ground-truth Spearman correlation.
//!
//! The NRC Emotion Lexicon may not be redistributed, so fairgate ships none:
//! `fairgate lexicon import` reads it from the `nrclex` package's wheel (or
//! the `nrclex/data/nrc_en.json` inside it, a JSON object from each word to
//! its list of affects), or from NRC's own `word<TAB>emotion<TAB>0|1` file,
//! and writes fairgate's table: a JSON object
//! `{"format": "fairgate-emotions", "emotions": [...], "words": {word: [emotion, ...]}}`.
//! Affects other than the eight emotions (`positive`, `negative`) are left
//! out.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Plutchik's eight emotions, in the order of every count vector.
pub const EMOTIONS: [&str; 8] = [
    "anger",
    "anticipation",
    "disgust",
    "fear",
    "joy",
    "sadness",
    "surprise",
    "trust",
];

const FORMAT: &str = "fairgate-emotions";

/// Words and the emotions each is associated with, as bits in the order of
/// [`EMOTIONS`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lexicon {
    words: HashMap<String, u8>,
}

#[derive(Serialize, Deserialize)]
struct Table {
    format: String,
    emotions: Vec<String>,
    words: BTreeMap<String, Vec<String>>,
}

fn emotion_bit(name: &str) -> Option<u8> {
    EMOTIONS.iter().position(|e| *e == name).map(|i| 1 << i)
}

impl Lexicon {
    /// A lexicon from words and their emotion names; other names are
    /// ignored.
    pub fn from_words<'a>(entries: impl IntoIterator<Item = (&'a str, Vec<&'a str>)>) -> Lexicon {
        let mut words = HashMap::new();
        for (word, emotions) in entries {
            let bits = emotions
                .iter()
                .filter_map(|e| emotion_bit(e))
                .fold(0, |a, b| a | b);
            if bits != 0 {
                *words.entry(word.to_lowercase()).or_insert(0) |= bits;
            }
        }
        Lexicon { words }
    }

    pub fn len(&self) -> usize {
        self.words.len()
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// The emotions of `word` (lower-case), as bits in the order of
    /// [`EMOTIONS`].
    pub fn emotions(&self, word: &str) -> u8 {
        self.words.get(word).copied().unwrap_or(0)
    }

    /// Reads a table written by [`Lexicon::to_json`].
    pub fn load(path: &Path) -> Result<Lexicon, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read the lexicon: {e}", path.display()))?;
        let table: Table = serde_json::from_str(&text).map_err(|e| {
            format!(
                "{}: not a fairgate emotion table ({e}); make one with `fairgate lexicon import`",
                path.display()
            )
        })?;
        if table.format != FORMAT {
            return Err(format!(
                "{}: format {:?}, expected {FORMAT:?}",
                path.display(),
                table.format
            ));
        }
        Ok(Lexicon::from_words(table.words.iter().map(
            |(word, emotions)| (word.as_str(), emotions.iter().map(String::as_str).collect()),
        )))
    }

    /// The table as fairgate stores it, words sorted.
    pub fn to_json(&self) -> String {
        let words = self
            .words
            .iter()
            .map(|(word, bits)| {
                let emotions = EMOTIONS
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| bits & (1 << i) != 0)
                    .map(|(_, e)| (*e).to_owned())
                    .collect();
                (word.clone(), emotions)
            })
            .collect();
        let table = Table {
            format: FORMAT.to_owned(),
            emotions: EMOTIONS.iter().map(|e| (*e).to_owned()).collect(),
            words,
        };
        serde_json::to_string(&table).unwrap_or_default()
    }

    /// Reads the NRC lexicon from an `nrclex` wheel (`.whl`), its
    /// `nrc_en.json`, or NRC's tab-separated word-level file.
    pub fn import(path: &Path) -> Result<Lexicon, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let lexicon = if bytes.starts_with(b"PK") {
            let json = json_from_wheel(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
            from_nrclex_json(&json)
        } else if bytes.trim_ascii_start().starts_with(b"{") {
            from_nrclex_json(&String::from_utf8_lossy(&bytes))
        } else {
            from_nrc_tsv(&String::from_utf8_lossy(&bytes))
        }
        .map_err(|e| format!("{}: {e}", path.display()))?;
        if lexicon.is_empty() {
            return Err(format!(
                "{}: no word with one of the eight emotions",
                path.display()
            ));
        }
        Ok(lexicon)
    }
}

/// The text of `nrclex/data/nrc_en.json` inside a wheel.
fn json_from_wheel(bytes: &[u8]) -> Result<String, String> {
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| format!("not a readable wheel: {e}"))?;
    let mut file = archive
        .by_name("nrclex/data/nrc_en.json")
        .map_err(|_| "the wheel has no nrclex/data/nrc_en.json".to_owned())?;
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(|e| format!("nrclex/data/nrc_en.json: {e}"))?;
    Ok(text)
}

/// `{"word": ["anger", "negative", ...], ...}`.
fn from_nrclex_json(text: &str) -> Result<Lexicon, String> {
    let map: BTreeMap<String, Vec<String>> =
        serde_json::from_str(text).map_err(|e| format!("not the nrclex JSON table: {e}"))?;
    Ok(Lexicon::from_words(map.iter().map(|(word, emotions)| {
        (word.as_str(), emotions.iter().map(String::as_str).collect())
    })))
}

/// `word<TAB>emotion<TAB>0|1` per line.
fn from_nrc_tsv(text: &str) -> Result<Lexicon, String> {
    let mut entries: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let [word, emotion, flag] = fields[..] else {
            return Err(format!(
                "line {}: expected word<TAB>emotion<TAB>0|1, got {line:?}",
                n + 1
            ));
        };
        match flag.trim() {
            "1" => entries.entry(word.trim()).or_default().push(emotion.trim()),
            "0" => {}
            other => return Err(format!("line {}: flag {other:?} is not 0 or 1", n + 1)),
        }
    }
    Ok(Lexicon::from_words(entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nrclex_json_and_tsv_alike() {
        let json = r#"{"abandon": ["fear", "negative", "sadness"], "zest": ["joy", "positive"], "neutral": ["positive"]}"#;
        let tsv = "abandon\tanger\t0\nabandon\tfear\t1\nabandon\tsadness\t1\nzest\tjoy\t1\nneutral\tpositive\t1\n";
        let a = from_nrclex_json(json).unwrap();
        let b = from_nrc_tsv(tsv).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 2, "words with no emotion are left out");
        assert_eq!(a.emotions("abandon"), (1 << 3) | (1 << 5));
        let round = Lexicon::load_str(&a.to_json());
        assert_eq!(round, a);
    }

    #[test]
    fn tsv_errors_name_the_line() {
        let e = from_nrc_tsv("a\tjoy\t1\nb joy 1\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
    }

    impl Lexicon {
        fn load_str(text: &str) -> Lexicon {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("l.json");
            std::fs::write(&path, text).unwrap();
            Lexicon::load(&path).unwrap()
        }
    }
}
