//! Rule files -> raw packs: YAML parsed into plain structs, nothing checked
//! beyond shape, every problem kept with its file and line.
//!
//! serde reads the values; a second, event-level pass over the same text
//! records the line of every node, so that the compile step can point at the
//! exact line of a bad pattern or weight. Each rule is deserialized on its own,
//! so one broken rule does not hide the problems of the next.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use saphyr_parser::{Event, Parser};
use serde::Deserialize;
use serde_yaml_ng::Value;

use super::LoadError;

/// One `rules/*.yaml` file, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPackHeader {
    pub pack: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub defaults: RawDefaults,
    /// Free-form YAML that rules refer to by anchor (`&name` / `*name`),
    /// such as a shared `unless` list. Not read otherwise.
    #[serde(default)]
    pub shared: Option<Value>,
    #[serde(default)]
    pub rules: Vec<Value>,
}

/// Values a pack gives every rule that does not set its own.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDefaults {
    pub category: Option<String>,
    pub scopes: Option<Vec<String>>,
    pub action: Option<String>,
    pub weight: Option<f64>,
}

/// One rule, as written. Enumerations stay strings here so that the compile
/// step can report every bad value of a rule, not only the first.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    pub id: String,
    #[serde(default)]
    pub description: String,
    pub category: Option<String>,
    pub scopes: Option<Vec<String>>,
    #[serde(default)]
    pub keywords: Vec<String>,
    #[serde(default)]
    pub regex: OneOrMany,
    pub unless: Option<RawUnless>,
    pub validate: Option<String>,
    #[serde(default = "yes")]
    pub normalize: bool,
    pub weight: Option<f64>,
    pub action: Option<String>,
    pub message: Option<String>,
    pub placeholder: Option<String>,
    #[serde(default)]
    pub examples: RawExamples,
}

fn yes() -> bool {
    true
}

/// The field names of [`RawRule`], for reporting every unknown one at once.
const RULE_FIELDS: &[&str] = &[
    "id",
    "description",
    "category",
    "scopes",
    "keywords",
    "regex",
    "unless",
    "validate",
    "normalize",
    "weight",
    "action",
    "message",
    "placeholder",
    "examples",
];

#[derive(Debug, Default, Deserialize)]
#[serde(
    untagged,
    expecting = "expected `regex` to be a pattern or a list of patterns (quote patterns that contain `: ` or ` #`)"
)]
pub enum OneOrMany {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            OneOrMany::None => Vec::new(),
            OneOrMany::One(p) => vec![p.clone()],
            OneOrMany::Many(ps) => ps.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUnless {
    pub patterns: Vec<String>,
    #[serde(default = "default_before")]
    pub before: usize,
}

fn default_before() -> usize {
    3
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawExamples {
    #[serde(default)]
    pub block: Vec<String>,
    #[serde(default)]
    pub allow: Vec<String>,
}

/// A parsed pack with what the compile step needs to point at lines.
#[derive(Debug)]
pub struct LoadedPack {
    pub file: PathBuf,
    pub header: RawPackHeader,
    /// Rules that deserialized, with their index in the file.
    pub rules: Vec<(usize, RawRule)>,
    pub lines: Lines,
    /// The file's bytes, for the rule set's version hash.
    pub source: String,
}

/// Reads every `*.yaml` / `*.yml` file of `dir`, in name order. Problems are
/// pushed to `errors`; a file with a syntax error yields no pack.
pub fn load_dir(dir: &Path, errors: &mut Vec<LoadError>) -> Vec<LoadedPack> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            errors.push(LoadError::new(
                dir,
                None,
                None,
                format!("cannot read rules directory: {e}"),
            ));
            return Vec::new();
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    if files.is_empty() {
        errors.push(LoadError::new(
            dir,
            None,
            None,
            "no rule files (*.yaml) in this directory".into(),
        ));
    }
    files
        .into_iter()
        .filter_map(|file| load_file(&file, errors))
        .collect()
}

/// Parses one rule file.
pub fn load_file(file: &Path, errors: &mut Vec<LoadError>) -> Option<LoadedPack> {
    let source = match fs::read_to_string(file) {
        Ok(s) => s,
        Err(e) => {
            errors.push(LoadError::new(
                file,
                None,
                None,
                format!("cannot read: {e}"),
            ));
            return None;
        }
    };
    parse_pack(file, source, errors)
}

/// Parses the text of a rule file.
pub fn parse_pack(file: &Path, source: String, errors: &mut Vec<LoadError>) -> Option<LoadedPack> {
    let value: Value = match serde_yaml_ng::from_str(&source) {
        Ok(v) => v,
        Err(e) => {
            let line = e.location().map(|l| l.line());
            errors.push(LoadError::new(
                file,
                line,
                None,
                format!("invalid YAML: {e}"),
            ));
            return None;
        }
    };
    let lines = Lines::of(&source);
    let header: RawPackHeader = match serde_yaml_ng::from_value(value) {
        Ok(h) => h,
        Err(e) => {
            errors.push(LoadError::new(
                file,
                Some(1),
                None,
                format!("invalid pack: {e}"),
            ));
            return None;
        }
    };
    let mut rules = Vec::new();
    for (index, value) in header.rules.iter().enumerate() {
        let path = format!("rules[{index}]");
        let id = value.get("id").and_then(Value::as_str).map(str::to_owned);
        let mut value = value.clone();
        let mut unknown_field = false;
        if let Value::Mapping(map) = &mut value {
            let unknown: Vec<String> = map
                .keys()
                .filter_map(Value::as_str)
                .filter(|k| !RULE_FIELDS.contains(k))
                .map(str::to_owned)
                .collect();
            for key in unknown {
                unknown_field = true;
                let line = lines.get(&format!("{path}.{key}"));
                errors.push(LoadError::new(
                    file,
                    line,
                    id.clone(),
                    format!(
                        "unknown field `{key}`; expected one of {}",
                        RULE_FIELDS.join(", ")
                    ),
                ));
                map.remove(key.as_str());
            }
        }
        match serde_yaml_ng::from_value::<RawRule>(value) {
            Ok(rule) if !unknown_field => rules.push((index, rule)),
            Ok(_) => {}
            Err(e) => errors.push(LoadError::new(
                file,
                lines.get(&path),
                id,
                format!("invalid rule: {e}"),
            )),
        }
    }
    Some(LoadedPack {
        file: file.to_owned(),
        header,
        rules,
        lines,
        source,
    })
}

/// The 1-based line of every node of a YAML document, by path: `rules[2]`,
/// `rules[2].regex[0]`, `rules[2].weight`.
#[derive(Debug, Default)]
pub struct Lines(HashMap<String, usize>);

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, next: usize },
}

impl Lines {
    pub fn get(&self, path: &str) -> Option<usize> {
        self.0.get(path).copied()
    }

    /// Walks the parser's events; a syntax error simply ends the walk (serde
    /// has reported it already).
    pub fn of(source: &str) -> Lines {
        let mut lines = HashMap::new();
        let mut stack: Vec<Frame> = Vec::new();
        let mut parser = Parser::new_from_str(source);
        while let Some(Ok((event, span))) = parser.next_event() {
            let line = span.start.line();
            match event {
                Event::Scalar(value, ..) => {
                    if let Some(path) = place(&mut stack, Some(&value)) {
                        lines.entry(path).or_insert(line);
                    } else if let Some(Frame::Map { path, .. }) = stack.last() {
                        lines.entry(join(path, &value)).or_insert(line);
                    }
                }
                Event::MappingStart(..) | Event::SequenceStart(..) => {
                    let path = place(&mut stack, None).unwrap_or_else(|| "?".into());
                    lines.entry(path.clone()).or_insert(line);
                    stack.push(if matches!(event, Event::MappingStart(..)) {
                        Frame::Map { path, key: None }
                    } else {
                        Frame::Seq { path, next: 0 }
                    });
                }
                Event::Alias(..) => {
                    if let Some(path) = place(&mut stack, None) {
                        lines.entry(path).or_insert(line);
                    }
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    stack.pop();
                }
                _ => {}
            }
        }
        Lines(lines)
    }
}

/// Where a new node goes: its path when it is a value, `None` when it is a
/// mapping key (the key is remembered for the value that follows).
fn place(stack: &mut [Frame], scalar: Option<&str>) -> Option<String> {
    match stack.last_mut() {
        None => Some(String::new()),
        Some(Frame::Seq { path, next }) => {
            *next += 1;
            Some(format!("{path}[{}]", *next - 1))
        }
        Some(Frame::Map { path, key }) => match key.take() {
            Some(k) => Some(join(path, &k)),
            None => {
                *key = Some(scalar.unwrap_or("?").to_owned());
                None
            }
        },
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_lines_of_nested_nodes() {
        let src = "pack: p\nrules:\n  - id: a\n    regex:\n      - 'x'\n      - 'y'\n  - id: b\n    weight: 2\n";
        let lines = Lines::of(src);
        assert_eq!(lines.get("pack"), Some(1));
        assert_eq!(lines.get("rules[0]"), Some(3));
        assert_eq!(lines.get("rules[0].regex[1]"), Some(6));
        assert_eq!(lines.get("rules[1].id"), Some(7));
        assert_eq!(lines.get("rules[1].weight"), Some(8));
    }
}
