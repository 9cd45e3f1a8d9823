//! Raw packs -> a [`RuleSet`]: every value checked, every pattern compiled,
//! every problem reported with file, line and rule id.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use regex::RegexBuilder;
use regex_automata::Anchored;
use regex_automata::hybrid;
use regex_automata::meta;
use regex_automata::nfa::thompson;
use regex_automata::util::start;
use regex_automata::util::syntax;
use regex_syntax::hir::literal::{ExtractKind, Extractor};
use regex_syntax::hir::{Class, ClassUnicode, ClassUnicodeRange, Hir, HirKind, Look, Repetition};

use super::load::{LoadedPack, RawDefaults, RawRule};
use super::matcher::{PatternSpec, ScopeMatcher, Trigger, Unless, View};
use super::normalize::normalize;
use super::validate::Validator;
use super::{Action, LoadError, LoadErrors, PackInfo, Rule, RuleSet, Scope};

/// The compiled size one user-written regex may reach. Rule patterns are user
/// input: a pattern such as `\w{1000}` compiles to megabytes and slows every
/// scan, so it is refused with a clear error instead.
pub const MAX_REGEX_SIZE: usize = 1 << 20;

/// How far before its trigger literal a regex match may start, at most; a
/// literal further in is not used (each byte before it is a place to try).
const MAX_TRIGGER_LEAD: usize = 128;

/// The longest `unless` window, in words.
const MAX_UNLESS_WORDS: usize = 50;

/// Settings of the compile step.
#[derive(Debug, Clone)]
pub struct CompileOptions {
    /// The length, in bytes, assumed for regexes whose matches have no upper
    /// bound (`.*`, `+`), when computing [`RuleSet::match_limits`].
    pub unbounded_match_cap: usize,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            unbounded_match_cap: 512,
        }
    }
}

/// What the compile step gathers for one scope before building its matcher.
#[derive(Default)]
pub(crate) struct ScopePatterns {
    pub keywords: Vec<(String, usize)>,
    pub regexes: Vec<Arc<PatternSpec>>,
}

pub(super) fn compile(
    packs: Vec<LoadedPack>,
    options: &CompileOptions,
    mut errors: Vec<LoadError>,
) -> Result<RuleSet, LoadErrors> {
    let mut rules: Vec<Rule> = Vec::new();
    let mut infos = Vec::new();
    let mut scopes: [ScopePatterns; 3] = Default::default();
    let mut ids: HashMap<Arc<str>, (PathBuf, Option<usize>)> = HashMap::new();
    let mut pack_names: HashMap<String, PathBuf> = HashMap::new();
    let mut version = Fnv::new();
    let mut unless = HashMap::new();

    for pack in &packs {
        version.write(
            pack.file
                .file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default(),
        );
        version.write(pack.source.as_bytes());
        let name = pack.header.pack.trim();
        if name.is_empty() {
            errors.push(LoadError::new(
                &pack.file,
                pack.lines.get("pack"),
                None,
                "`pack` name is empty".into(),
            ));
        } else if let Some(first) = pack_names.insert(name.to_owned(), pack.file.clone()) {
            errors.push(LoadError::new(
                &pack.file,
                pack.lines.get("pack"),
                None,
                format!("pack `{name}` is also defined in {}", first.display()),
            ));
        }
        let before = rules.len();
        for (index, raw) in &pack.rules {
            let mut cx = RuleContext {
                pack,
                index: *index,
                id: raw.id.clone(),
                errors: &mut errors,
                unless: &mut unless,
            };
            let Some((rule, patterns)) = compile_rule(&mut cx, raw, &pack.header.defaults) else {
                continue;
            };
            if let Some((file, line)) = ids.get(&rule.id) {
                let at = match line {
                    Some(l) => format!("{}:{l}", file.display()),
                    None => file.display().to_string(),
                };
                cx.error("", format!("duplicate rule id; first defined at {at}"));
                continue;
            }
            ids.insert(rule.id.clone(), (rule.file.clone(), rule.line));
            let rule_index = rules.len();
            // One compiled regex serves every scope of the rule.
            let regexes: Vec<Arc<PatternSpec>> = patterns
                .regexes
                .into_iter()
                .map(|spec| {
                    Arc::new(PatternSpec {
                        rule: rule_index,
                        ..spec
                    })
                })
                .collect();
            for scope in &rule.scopes {
                let target = &mut scopes[*scope as usize];
                target
                    .keywords
                    .extend(patterns.keywords.iter().map(|k| (k.clone(), rule_index)));
                target.regexes.extend(regexes.iter().cloned());
            }
            rules.push(rule);
        }
        infos.push(PackInfo {
            name: name.to_owned(),
            description: pack.header.description.clone(),
            file: pack.file.clone(),
            rules: rules.len() - before,
        });
    }

    let mut build = |scope: Scope, patterns: &ScopePatterns| {
        ScopeMatcher::build(scope, patterns, options).unwrap_or_else(|message| {
            errors.push(LoadError::new(
                &PathBuf::from("(rule set)"),
                None,
                None,
                format!("scope {scope}: {message}"),
            ));
            ScopeMatcher::empty()
        })
    };
    let matchers = [
        build(Scope::Prompt, &scopes[0]),
        build(Scope::Response, &scopes[1]),
        build(Scope::Context, &scopes[2]),
    ];
    if !errors.is_empty() {
        return Err(LoadErrors(errors));
    }
    Ok(RuleSet {
        rules,
        packs: infos,
        matchers,
        version: format!("{:016x}", version.0),
        id: NEXT_SET_ID.fetch_add(1, Ordering::Relaxed),
    })
}

/// The id of the next rule set compiled (see `RuleSet::scan_remembered`).
static NEXT_SET_ID: AtomicU64 = AtomicU64::new(1);

/// Where errors of the rule being compiled go.
struct RuleContext<'a> {
    pack: &'a LoadedPack,
    index: usize,
    id: String,
    errors: &'a mut Vec<LoadError>,
    /// The `unless` regexes compiled so far, by pattern: rules often share
    /// one list (a YAML anchor), and each compiled copy costs some 200 KB.
    unless: &'a mut HashMap<String, regex::Regex>,
}

impl RuleContext<'_> {
    /// Records an error at the line of `field` (a path below the rule such as
    /// `.regex[1]`), or at the rule's own line.
    fn error(&mut self, field: &str, message: String) {
        let rule_path = format!("rules[{}]", self.index);
        let line = self
            .pack
            .lines
            .get(&format!("{rule_path}{field}"))
            .or_else(|| self.pack.lines.get(&rule_path));
        let id = (!self.id.is_empty()).then(|| self.id.clone());
        self.errors
            .push(LoadError::new(&self.pack.file, line, id, message));
    }
}

/// The patterns of one rule, to be added to the matchers of its scopes.
struct RulePatterns {
    keywords: Vec<String>,
    regexes: Vec<PatternSpec>,
}

fn compile_rule(
    cx: &mut RuleContext,
    raw: &RawRule,
    defaults: &RawDefaults,
) -> Option<(Rule, RulePatterns)> {
    let errors_before = cx.errors.len();
    let id = raw.id.trim();
    if id.is_empty() {
        cx.error(".id", "`id` is empty".into());
    }

    let category = raw.category.as_ref().or(defaults.category.as_ref());
    let category = match category.map(|c| c.trim()) {
        Some(c) if !c.is_empty() => c.to_owned(),
        _ => {
            cx.error(
                ".category",
                "no `category` (set it on the rule or in the pack's `defaults`)".into(),
            );
            String::new()
        }
    };

    let mut scopes = Vec::new();
    match raw.scopes.as_ref().or(defaults.scopes.as_ref()) {
        None => cx.error("", "no `scopes` (any of prompt, response, context)".into()),
        Some(list) if list.is_empty() => cx.error(".scopes", "`scopes` is empty".into()),
        Some(list) => {
            for (i, s) in list.iter().enumerate() {
                match Scope::parse(s) {
                    Some(scope) if !scopes.contains(&scope) => scopes.push(scope),
                    Some(_) => {}
                    None => cx.error(
                        &format!(".scopes[{i}]"),
                        format!("unknown scope `{s}`; expected prompt, response or context"),
                    ),
                }
            }
        }
    }

    let action = match raw.action.as_deref().or(defaults.action.as_deref()) {
        None => {
            cx.error("", "no `action` (block, redact, flag or log)".into());
            Action::Log
        }
        Some(a) => Action::parse(a).unwrap_or_else(|| {
            cx.error(
                ".action",
                format!("unknown action `{a}`; expected block, redact, flag or log"),
            );
            Action::Log
        }),
    };

    let weight = match raw.weight.or(defaults.weight) {
        None => {
            cx.error("", "no `weight` (a number from 0 to 1)".into());
            0.0
        }
        Some(w) if !(0.0..=1.0).contains(&w) => {
            cx.error(
                ".weight",
                format!("weight {w} is out of range; expected a number from 0 to 1"),
            );
            0.0
        }
        Some(w) => w,
    };

    let message = match raw.message.as_deref().map(str::trim) {
        Some(m) if !m.is_empty() => m.to_owned(),
        _ => {
            cx.error(
                ".message",
                "no `message` (the reason shown to clients)".into(),
            );
            String::new()
        }
    };

    let mut keywords = Vec::new();
    for (i, k) in raw.keywords.iter().enumerate() {
        let normalized = normalize(k).trim().to_owned();
        if normalized.is_empty() {
            cx.error(
                &format!(".keywords[{i}]"),
                format!("keyword {k:?} is empty after normalization"),
            );
        } else {
            keywords.push(normalized);
        }
    }

    let view = if raw.normalize {
        View::Normalized
    } else {
        View::Raw
    };
    let mut regexes = Vec::new();
    for (i, pattern) in raw.regex.to_vec().iter().enumerate() {
        match compile_regex(pattern, view) {
            Ok(spec) => regexes.push(spec),
            Err(message) => {
                let field = match raw.regex {
                    super::load::OneOrMany::Many(_) => format!(".regex[{i}]"),
                    _ => ".regex".to_owned(),
                };
                cx.error(&field, message);
            }
        }
    }
    if raw.keywords.is_empty() && raw.regex.to_vec().is_empty() {
        cx.error(
            "",
            "the rule matches nothing: give it `keywords` or `regex`".into(),
        );
    }

    let unless = raw.unless.as_ref().and_then(|u| {
        if u.patterns.is_empty() || u.patterns.iter().any(|p| p.trim().is_empty()) {
            cx.error(
                ".unless.patterns",
                "`unless.patterns` must be a list of non-empty patterns".into(),
            );
            return None;
        }
        if u.before == 0 || u.before > MAX_UNLESS_WORDS {
            cx.error(
                ".unless.before",
                format!(
                    "`unless.before` is {}; expected 1 to {MAX_UNLESS_WORDS} words",
                    u.before
                ),
            );
            return None;
        }
        let alternation = format!(r"\b(?:{})\b", u.patterns.join("|"));
        if let Some(regex) = cx.unless.get(&alternation) {
            return Some(Unless {
                regex: regex.clone(),
                before: u.before,
            });
        }
        match RegexBuilder::new(&alternation)
            .case_insensitive(true)
            .size_limit(MAX_REGEX_SIZE)
            .build()
        {
            Ok(regex) => {
                cx.unless.insert(alternation, regex.clone());
                Some(Unless {
                    regex,
                    before: u.before,
                })
            }
            Err(e) => {
                cx.error(
                    ".unless.patterns",
                    format!("invalid `unless` pattern: {}", one_line(&e.to_string())),
                );
                None
            }
        }
    });

    let validator = raw.validate.as_deref().and_then(|v| {
        Validator::parse(v).or_else(|| {
            cx.error(
                ".validate",
                format!("unknown validator `{v}`; expected luhn or iban"),
            );
            None
        })
    });

    if raw.examples.block.is_empty() || raw.examples.allow.is_empty() {
        cx.error(
            ".examples",
            "every rule needs `examples` with at least one `block` and one `allow` text".into(),
        );
    }

    if cx.errors.len() > errors_before {
        return None;
    }
    let rule_path = format!("rules[{}]", cx.index);
    let rule = Rule {
        id: id.into(),
        pack: cx.pack.header.pack.trim().into(),
        description: raw.description.clone(),
        category: category.into(),
        scopes,
        action,
        weight,
        placeholder: raw
            .placeholder
            .clone()
            .unwrap_or_else(|| format!("[REDACTED:{id}]"))
            .into(),
        message: message.into(),
        examples_block: raw.examples.block.clone(),
        examples_allow: raw.examples.allow.clone(),
        file: cx.pack.file.clone(),
        line: cx.pack.lines.get(&rule_path),
        unless,
        validator,
    };
    Some((rule, RulePatterns { keywords, regexes }))
}

/// Compiles one user pattern, finds the longest text it can match and the
/// literals that trigger it.
fn compile_regex(pattern: &str, view: View) -> Result<PatternSpec, String> {
    if pattern.is_empty() {
        return Err("empty regex".into());
    }
    let case_insensitive = view == View::Normalized;
    // The trigger literals are read from the pattern as written: with case
    // folding every letter would double the literals. The normalized view is
    // lower case, so its literals are lower-cased instead.
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .map_err(|e| format!("invalid regex {pattern:?}: {}", one_line(&e.to_string())))?;
    if hir.properties().minimum_len() == Some(0) {
        return Err(format!("regex {pattern:?} can match the empty string"));
    }
    let trigger = trigger(&hir, case_insensitive);
    // A triggered regex only runs anchored, where a prefilter has no use;
    // not building one saves its memory (an automaton for a list of words).
    let regex = meta::Regex::builder()
        .syntax(syntax::Config::new().case_insensitive(case_insensitive))
        .configure(
            meta::Config::new()
                .nfa_size_limit(Some(MAX_REGEX_SIZE))
                .auto_prefilter(trigger.is_none()),
        )
        .build(pattern)
        .map_err(|e| match (e.size_limit(), e.syntax_error()) {
            (Some(limit), _) => {
                format!("regex {pattern:?} is too large: it compiles to more than {limit} bytes; simplify it")
            }
            (None, Some(syntax)) => format!("invalid regex {pattern:?}: {}", one_line(&syntax.to_string())),
            (None, None) => format!("invalid regex {pattern:?}: {}", one_line(&e.to_string())),
        })?;
    Ok(PatternSpec {
        pattern: pattern.to_owned(),
        regex,
        view,
        max_len: hir.properties().maximum_len(),
        trigger,
        rule: 0,
    })
}

/// The best literal set every match of `hir` must contain: taken from the
/// prefixes of `hir` with its first `i` elements dropped, for the `i` whose
/// literals are longest (fewest false alarms), provided those first elements
/// have a bounded length. `None` when no element yields a finite set of
/// non-empty literals.
fn trigger(hir: &Hir, lowercase: bool) -> Option<Trigger> {
    let mut top = hir;
    while let HirKind::Capture(capture) = top.kind() {
        top = &capture.sub;
    }
    let elements: Vec<Hir> = match top.kind() {
        HirKind::Concat(elements) => elements.clone(),
        _ => vec![top.clone()],
    };
    let word_start = matches!(
        elements.first().map(Hir::kind),
        Some(HirKind::Look(Look::WordUnicode | Look::WordAscii))
    );
    let prefix_bytes = prefix_bytes(hir, lowercase);
    let mut extractor = Extractor::new();
    extractor
        .kind(ExtractKind::Prefix)
        .limit_class(10)
        .limit_literal_len(8)
        .limit_total(64);
    let mut best: Option<(usize, Trigger)> = None;
    for i in 0..elements.len() {
        // Every start within `lead` bytes before a trigger is tried.
        let Some(lead) = Hir::concat(elements[..i].to_vec())
            .properties()
            .maximum_len()
            .filter(|&lead| lead <= MAX_TRIGGER_LEAD)
        else {
            break;
        };
        let mut seq = extractor.extract(&Hir::concat(elements[i..].to_vec()));
        // A literal that another one starts is redundant as a trigger.
        seq.minimize_by_preference();
        let Some(literals) = seq.literals() else {
            continue;
        };
        if literals.is_empty() || literals.iter().any(|l| l.is_empty()) {
            continue;
        }
        // Longer literals raise fewer false alarms; past 6 bytes it hardly
        // matters, and a shorter lead means fewer places to try.
        let score = literals.iter().map(|l| l.len()).min().unwrap_or(0).min(6);
        if best.as_ref().is_some_and(|(s, _)| *s >= score) {
            continue;
        }
        let mut literals: Vec<Vec<u8>> = literals
            .iter()
            .map(|l| {
                let bytes = l.as_bytes();
                match (lowercase, std::str::from_utf8(bytes)) {
                    (false, _) => bytes.to_vec(),
                    (true, Ok(text)) => text.to_lowercase().into_bytes(),
                    (true, Err(_)) => bytes.to_ascii_lowercase(),
                }
            })
            .collect();
        literals.sort();
        literals.dedup();
        best = Some((
            score,
            Trigger {
                literals,
                lead,
                word_start,
                prefix_bytes: prefix_bytes.clone(),
            },
        ));
    }
    best.map(|(_, t)| t)
}

/// The bytes each of the first few bytes of a match can be: `sets[j][b]`
/// says whether byte `b` can be byte `j` of a match. Found by walking a small
/// anchored DFA of the pattern with its look-arounds dropped (which only
/// allows more), for as many bytes as every match has; empty when the DFA
/// would be too large. The DFA is built for the pattern's [`leading`] part
/// only: the same sets, for a fraction of the work (the whole pattern's DFA,
/// case folding included, took about 85% of compiling the shipped packs).
fn prefix_bytes(hir: &Hir, case_insensitive: bool) -> Vec<[bool; 256]> {
    prefix_bytes_of_part(hir, case_insensitive, leading)
}

/// [`prefix_bytes`], with the DFA built for `part(pattern, depth)` of the
/// pattern (look-arounds dropped) and `depth` first bytes.
fn prefix_bytes_of_part(
    hir: &Hir,
    case_insensitive: bool,
    part: impl Fn(&Hir, usize) -> Hir,
) -> Vec<[bool; 256]> {
    const DEPTH: usize = 4;
    let depth = min_len(hir).min(DEPTH);
    if depth == 0 {
        return Vec::new();
    }
    let mut part = part(&without_looks(hir), depth);
    if case_insensitive {
        // Re-parse is not possible from a HIR; fold the classes instead.
        part = case_folded(&part);
    }
    first_byte_sets(&part, depth).unwrap_or_default()
}

/// The length of the shortest match of `hir` (0 when nothing matches).
fn min_len(hir: &Hir) -> usize {
    hir.properties().minimum_len().unwrap_or(0)
}

/// The sets of [`prefix_bytes`] for the first `depth` bytes of `hir`, which
/// has no look-arounds and whose matches are at least `depth` bytes long;
/// `None` when the automaton would be too large. A lazy DFA: only the states
/// the walk reaches are built.
fn first_byte_sets(hir: &Hir, depth: usize) -> Option<Vec<[bool; 256]>> {
    let nfa = thompson::Compiler::new()
        .configure(thompson::Config::new().nfa_size_limit(Some(MAX_REGEX_SIZE)))
        .build_from_hir(hir)
        .ok()?;
    let dfa = hybrid::dfa::Builder::new()
        .configure(hybrid::dfa::Config::new().cache_capacity(1 << 20))
        .build_from_nfa(nfa)
        .ok()?;
    let mut cache = dfa.create_cache();
    let start = dfa
        .start_state(&mut cache, &start::Config::new().anchored(Anchored::Yes))
        .ok()?;
    let mut frontier = vec![start];
    let mut sets = Vec::with_capacity(depth);
    for _ in 0..depth {
        let mut set = [false; 256];
        let mut next = Vec::new();
        for &state in &frontier {
            for b in 0..=255u8 {
                let to = dfa.next_state(&mut cache, state, b).ok()?;
                // A full cache is cleared, and the states held go stale.
                if cache.clear_count() > 0 {
                    return None;
                }
                if to.is_dead() || to.is_quit() {
                    continue;
                }
                set[usize::from(b)] = true;
                if !next.contains(&to) {
                    next.push(to);
                }
            }
        }
        sets.push(set);
        frontier = next;
    }
    Some(sets)
}

/// A leading part of `hir` (a pattern without look-arounds whose matches
/// are at least `need` bytes long): its matches are at least `need` bytes
/// long too, and their first `need` bytes are exactly those of the matches
/// of `hir`. Of a concatenation, the elements up to the one that reaches
/// `need` bytes (that one cut in turn); of a repetition, as many copies as
/// reach `need`. Each part cut off matches something, so every leading
/// match goes on to a match of `hir`, and no first bytes are lost or added.
fn leading(hir: &Hir, need: usize) -> Hir {
    match hir.kind() {
        HirKind::Capture(capture) => leading(&capture.sub, need),
        HirKind::Concat(subs) => {
            let mut kept = Vec::new();
            let mut len = 0;
            for sub in subs {
                if len + min_len(sub) >= need {
                    kept.push(leading(sub, need - len));
                    break;
                }
                kept.push(sub.clone());
                len += min_len(sub);
            }
            Hir::concat(kept)
        }
        HirKind::Alternation(subs) => {
            Hir::alternation(subs.iter().map(|sub| leading(sub, need)).collect())
        }
        HirKind::Repetition(repetition) if min_len(&repetition.sub) > 0 => {
            // At most `repetition.min`, since the repetition is `need` long.
            let copies = u32::try_from(need.div_ceil(min_len(&repetition.sub)))
                .unwrap_or(u32::MAX)
                .min(repetition.min);
            Hir::repetition(Repetition {
                min: copies,
                max: Some(copies),
                ..repetition.clone()
            })
        }
        _ => hir.clone(),
    }
}

/// `hir` with every look-around (`\b`, `^`, `$`) replaced by the empty
/// pattern: it matches everything `hir` matches, and more.
fn without_looks(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Look(_) => Hir::empty(),
        HirKind::Capture(capture) => without_looks(&capture.sub),
        HirKind::Repetition(repetition) => Hir::repetition(Repetition {
            sub: Box::new(without_looks(&repetition.sub)),
            ..repetition.clone()
        }),
        HirKind::Concat(subs) => Hir::concat(subs.iter().map(without_looks).collect()),
        HirKind::Alternation(subs) => Hir::alternation(subs.iter().map(without_looks).collect()),
        _ => hir.clone(),
    }
}

/// `hir` with every class and literal widened to both cases.
fn case_folded(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Literal(literal) => match std::str::from_utf8(&literal.0) {
            Ok(text) => Hir::concat(
                text.chars()
                    .map(|c| {
                        let mut class = ClassUnicode::new([ClassUnicodeRange::new(c, c)]);
                        class.case_fold_simple();
                        Hir::class(Class::Unicode(class))
                    })
                    .collect(),
            ),
            Err(_) => hir.clone(),
        },
        HirKind::Class(Class::Unicode(class)) => {
            let mut class = class.clone();
            class.case_fold_simple();
            Hir::class(Class::Unicode(class))
        }
        HirKind::Class(Class::Bytes(class)) => {
            let mut class = class.clone();
            class.case_fold_simple();
            Hir::class(Class::Bytes(class))
        }
        HirKind::Repetition(repetition) => Hir::repetition(Repetition {
            sub: Box::new(case_folded(&repetition.sub)),
            ..repetition.clone()
        }),
        HirKind::Concat(subs) => Hir::concat(subs.iter().map(case_folded).collect()),
        HirKind::Alternation(subs) => Hir::alternation(subs.iter().map(case_folded).collect()),
        _ => hir.clone(),
    }
}

/// The regex crate's errors draw a caret diagram over several lines; a load
/// error is one line per problem.
fn one_line(message: &str) -> String {
    let last = message
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or(message);
    last.trim().trim_start_matches("error: ").to_owned()
}

/// FNV-1a, 64 bit: a stable hash of the rule files for the version string.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator, so that ("ab", "c") and ("a", "bc") differ.
        self.0 = (self.0 ^ 0xff).wrapping_mul(0x0000_0100_0000_01b3);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn leading_parts_have_the_first_bytes_of_the_whole_pattern() {
        let mut patterns: Vec<String> = [
            r"abc\w+xyz",
            r"(?:ab|c)+d",
            r"\b(?:get rich|guaranteed) (?:quick|returns?)\b",
            r"x{2,9}y",
            r"(?:\w+\s+){3}all in",
            r"a?b*c{3}",
            r"(a|bc)(d|ef)g",
            r"[Éé]t\w{2}",
            r"\d{3}-\d{2}-\d{4}",
            r"(?:)ab(?:)c",
            r"sk-[A-Za-z0-9]{20,}",
            r"ab",
        ]
        .map(String::from)
        .to_vec();
        let mut errors = Vec::new();
        let shipped = crate::rules::load::load_dir(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("rules"),
            &mut errors,
        );
        assert!(errors.is_empty(), "{errors:?}");
        for pack in &shipped {
            for (_, rule) in &pack.rules {
                patterns.extend(rule.regex.to_vec());
            }
        }
        assert!(patterns.len() > 50, "{} patterns", patterns.len());
        for pattern in &patterns {
            let hir = regex_syntax::Parser::new().parse(pattern).unwrap();
            for case_insensitive in [false, true] {
                let lead = prefix_bytes(&hir, case_insensitive);
                let whole = prefix_bytes_of_part(&hir, case_insensitive, |whole, _| whole.clone());
                // An empty `whole`: the whole pattern's automaton is too
                // large to walk, while its leading part's is not.
                assert!(
                    lead == whole || whole.is_empty() && !lead.is_empty(),
                    "{pattern:?}, case-insensitive {case_insensitive}"
                );
            }
        }
    }

    #[test]
    fn the_leading_part_stops_where_the_first_bytes_are_known() {
        let parse = |pattern: &str| regex_syntax::Parser::new().parse(pattern).unwrap();
        assert_eq!(leading(&parse(r"abc\w+xyz"), 4), parse(r"abc\w"));
        assert_eq!(leading(&parse(r"(?:ab|c){4,}d"), 4), parse(r"(?:ab|c){4}"));
        assert_eq!(leading(&parse(r"ab\d{3,}"), 4), parse(r"ab\d{2}"));
        assert_eq!(
            leading(&parse(r"(?:x|yz)\s+[a-z]+"), 3),
            parse(r"(?:x|yz)\s+[a-z]")
        );
    }
}
