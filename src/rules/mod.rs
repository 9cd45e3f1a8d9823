//! Rule files -> compiled matchers -> hits.
//!
//! A [`RuleSet`] is built from a directory of packs (`rules/*.yaml`) in two
//! steps: [`load`] parses each file into raw structs, `compile` checks every
//! rule and builds, per scope, one Aho-Corasick automaton over all keywords and
//! one `RegexSet` per text view over all regexes. [`RuleSet::scan`] runs a text
//! through them in one pass and returns the [`Hit`]s; [`crate::risk`] turns hits
//! into scores and a verdict. A `RuleSet` is immutable: a reload builds a new
//! one and swaps it in.

mod compile;
pub mod examples;
pub mod load;
mod matcher;
pub mod normalize;
mod open;
mod remembered;
pub mod store;
pub mod validate;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

pub use compile::{CompileOptions, MAX_REGEX_SIZE};
pub use matcher::MatchLimits;

/// Where in an exchange a text comes from.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Prompt,
    Response,
    Context,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Prompt, Scope::Response, Scope::Context];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Prompt => "prompt",
            Scope::Response => "response",
            Scope::Context => "context",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|scope| scope.as_str() == s)
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a hit of a rule does. Ordered by severity.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Reported and stored only.
    Log,
    /// Counted and reported, never blocks: for tuning and shadow roll-out.
    Flag,
    /// The matched span is replaced by the rule's placeholder.
    Redact,
    /// The exchange is refused.
    Block,
}

impl Action {
    pub const ALL: [Action; 4] = [Action::Block, Action::Redact, Action::Flag, Action::Log];

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Log => "log",
            Action::Flag => "flag",
            Action::Redact => "redact",
            Action::Block => "block",
        }
    }

    pub fn parse(s: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A compiled rule: everything about it except its patterns, which live in the
/// per-scope matchers.
#[derive(Debug)]
pub struct Rule {
    pub id: Arc<str>,
    pub pack: Arc<str>,
    pub description: String,
    pub category: Arc<str>,
    pub scopes: Vec<Scope>,
    pub action: Action,
    pub weight: f64,
    pub message: Arc<str>,
    pub placeholder: Arc<str>,
    pub examples_block: Vec<String>,
    pub examples_allow: Vec<String>,
    pub file: PathBuf,
    pub line: Option<usize>,
    pub(crate) unless: Option<matcher::Unless>,
    pub(crate) validator: Option<validate::Validator>,
}

/// One match of one rule in one text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hit {
    pub rule: Arc<str>,
    pub category: Arc<str>,
    pub scope: Scope,
    pub action: Action,
    #[serde(skip)]
    pub weight: f64,
    #[serde(skip)]
    pub message: Arc<str>,
    #[serde(skip)]
    pub placeholder: Arc<str>,
    /// Byte offsets into the original text.
    pub start: usize,
    pub end: usize,
    /// The matched original text, shortened to [`SNIPPET_CHARS`] characters.
    pub snippet: String,
}

/// How many characters of a match a hit keeps for display.
pub const SNIPPET_CHARS: usize = 80;

/// A pack as loaded, for listings.
#[derive(Debug, Clone, Serialize)]
pub struct PackInfo {
    pub name: String,
    pub description: String,
    pub file: PathBuf,
    pub rules: usize,
}

/// A set of compiled packs, ready to scan texts.
#[derive(Debug)]
pub struct RuleSet {
    rules: Vec<Rule>,
    packs: Vec<PackInfo>,
    matchers: [matcher::ScopeMatcher; 3],
    version: String,
    /// Unique to this compiled set in the process: what texts' remembered
    /// hits are kept by (see [`RuleSet::scan_remembered`]).
    id: u64,
}

impl RuleSet {
    /// Loads and compiles every pack in `dir`, reporting every problem found.
    pub fn load_dir(dir: &Path, options: &CompileOptions) -> Result<RuleSet, LoadErrors> {
        let mut errors = Vec::new();
        let packs = load::load_dir(dir, &mut errors);
        compile::compile(packs, options, errors)
    }

    /// Compiles packs given as `(file name, YAML text)`, as if read from a
    /// directory: for tests and tools that build rules in memory.
    pub fn from_sources<'a>(
        sources: impl IntoIterator<Item = (&'a str, &'a str)>,
        options: &CompileOptions,
    ) -> Result<RuleSet, LoadErrors> {
        let mut errors = Vec::new();
        let packs = sources
            .into_iter()
            .filter_map(|(name, text)| {
                load::parse_pack(Path::new(name), text.to_owned(), &mut errors)
            })
            .collect();
        compile::compile(packs, options, errors)
    }

    /// Finds every hit of the rules of `scope` in `text`, ordered by position.
    pub fn scan(&self, scope: Scope, text: &str) -> Vec<Hit> {
        self.matchers[scope.index()]
            .scan(&self.rules, scope, text)
            .0
    }

    /// As [`RuleSet::scan`], for texts that are likely to be sent again
    /// (a request's system prompt and earlier turns): the calling thread
    /// remembers the hits of the texts it scanned lately with this set, and
    /// a text found there is not scanned again (see `remembered.rs`).
    pub fn scan_remembered(&self, scope: Scope, text: &str) -> Vec<Hit> {
        remembered::hits(self.id, scope, text, || self.scan(scope, text))
    }

    /// The hits of a request's tool definitions, given their JSON text:
    /// `scan` finds them (in context, text by text), unless this thread
    /// remembers that JSON text from an earlier request (see
    /// [`RuleSet::scan_remembered`]): apps send the same tools with every
    /// request, and reading them again costs more than scanning them.
    pub fn scan_definitions(&self, json: &str, scan: impl FnOnce() -> Vec<Hit>) -> Vec<Hit> {
        remembered::hits(self.id, remembered::Kind::Definitions, json, scan)
    }

    /// As [`RuleSet::scan`], and also the normalized view of `text` it
    /// matched against (`None` when no pattern of the scope uses it), for
    /// callers that need the view too: the stream guard measures its hold
    /// back in normalized bytes.
    pub fn scan_with_view(
        &self,
        scope: Scope,
        text: &str,
    ) -> (Vec<Hit>, Option<normalize::Normalized>) {
        self.matchers[scope.index()].scan(&self.rules, scope, text)
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn packs(&self) -> &[PackInfo] {
        &self.packs
    }

    /// A hash of the rule files' names and contents: equal texts, equal version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The first byte of `range` of `text` from which a match of `scope`'s
    /// rules could be under way at the range's end (the end when none
    /// could): text before it can be released, as no match, however the
    /// text goes on, can cover it. `view` is the normalized view of `text`,
    /// and the range ends where its normalization starts clean, so that
    /// what comes after cannot change the view before it. `None` when the
    /// search gave up: its walks grew too long.
    pub fn open_match_start(
        &self,
        scope: Scope,
        text: &str,
        view: &normalize::Normalized,
        range: std::ops::Range<usize>,
    ) -> Option<usize> {
        self.matchers[scope.index()].open_match_start(text, view, range)
    }

    /// The longest text any rule of `scope` can match, in bytes, per view. The
    /// stream guard holds back this much so that no match can straddle what
    /// it has released. Regexes without a bounded length count as the cap set
    /// in [`CompileOptions::unbounded_match_cap`].
    pub fn match_limits(&self, scope: Scope) -> MatchLimits {
        self.matchers[scope.index()].limits
    }
}

/// Replaces the span of every `redact` hit with its rule's placeholder.
/// Overlapping spans are merged and take the placeholder of the first.
pub fn redact(text: &str, hits: &[Hit]) -> String {
    let spans = hits.iter().filter(|h| h.end <= text.len());
    redact_spans(text, redacted_spans(spans, 0))
}

/// The spans that the `redact` hits among `hits` replace, less `from`
/// (those that start before it left out), in order, each with its
/// placeholder: overlapping ones merged, under the placeholder of the
/// first.
pub fn redacted_spans<'h>(
    hits: impl IntoIterator<Item = &'h Hit>,
    from: usize,
) -> Vec<(std::ops::Range<usize>, &'h str)> {
    let mut spans: Vec<&Hit> = (hits.into_iter())
        .filter(|h| h.action == Action::Redact && h.start >= from)
        .collect();
    spans.sort_by_key(|h| (h.start, std::cmp::Reverse(h.end)));
    let mut merged: Vec<(std::ops::Range<usize>, &str)> = Vec::new();
    for hit in spans {
        let span = hit.start - from..hit.end - from;
        match merged.last_mut() {
            Some((last, _)) if span.start < last.end => last.end = last.end.max(span.end),
            _ => merged.push((span, &hit.placeholder)),
        }
    }
    merged
}

/// `text` with each of `spans` ([`redacted_spans`]) replaced by its
/// placeholder.
pub fn redact_spans(text: &str, spans: Vec<(std::ops::Range<usize>, &str)>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (span, placeholder) in spans {
        out.push_str(&text[at..span.start]);
        out.push_str(placeholder);
        at = span.end;
    }
    out.push_str(&text[at..]);
    out
}

/// One problem found while loading rules.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadError {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub rule: Option<String>,
    pub message: String,
}

impl LoadError {
    pub fn new(file: &Path, line: Option<usize>, rule: Option<String>, message: String) -> Self {
        LoadError {
            file: file.to_owned(),
            line,
            rule,
            message,
        }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(rule) = &self.rule {
            write!(f, ": rule {rule}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every problem found while loading a rule directory.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadErrors(pub Vec<LoadError>);

impl fmt::Display for LoadErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for LoadErrors {}
