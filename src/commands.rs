//! The command-line tools, as functions that write their report to any
//! output and return whether they succeeded. The binary maps that to an exit
//! status.

use std::io::{self, Read, Write};
use std::path::Path;

use crate::config::Config;
use crate::risk::{self, Verdict};
use crate::rules::{RuleSet, Scope, examples};
use crate::text;

/// `fairgate rules check`: compiles the packs of `dir` and lists them, or
/// every error.
pub fn rules_check(config: &Config, dir: &Path, out: &mut dyn Write) -> io::Result<bool> {
    match RuleSet::load_dir(dir, &config.rules.compile_options()) {
        Ok(rules) => {
            for pack in rules.packs() {
                writeln!(
                    out,
                    "{:<24} {:>4} rules  {}",
                    pack.name,
                    pack.rules,
                    pack.file.display()
                )?;
            }
            writeln!(
                out,
                "ok: {} rules in {} packs, version {}",
                rules.rules().len(),
                rules.packs().len(),
                rules.version()
            )?;
            Ok(true)
        }
        Err(errors) => {
            writeln!(out, "{errors}")?;
            writeln!(
                out,
                "error: {} problem(s) in {}",
                errors.0.len(),
                dir.display()
            )?;
            Ok(false)
        }
    }
}

/// `fairgate rules test`: runs the examples of every rule of `dir`.
pub fn rules_test(config: &Config, dir: &Path, out: &mut dyn Write) -> io::Result<bool> {
    let rules = match RuleSet::load_dir(dir, &config.rules.compile_options()) {
        Ok(rules) => rules,
        Err(errors) => {
            writeln!(out, "{errors}")?;
            return Ok(false);
        }
    };
    let report = examples::run(&rules);
    for failure in &report.failures {
        writeln!(out, "FAIL {failure}")?;
    }
    writeln!(
        out,
        "{} passed, {} failed ({} rules)",
        report.examples - report.failures.len(),
        report.failures.len(),
        rules.rules().len()
    )?;
    Ok(report.failures.is_empty())
}

/// What `fairgate scan` should scan.
pub struct ScanRequest<'a> {
    pub scope: Scope,
    pub rules_dir: &'a Path,
    /// The user's question, to score the relevance of a context text.
    pub question: Option<&'a str>,
    /// A file, or `-` / `None` for standard input.
    pub input: Option<&'a Path>,
    pub json: bool,
}

/// `fairgate scan`: the hits, risk and verdict of one text.
pub fn scan(
    config: &Config,
    request: &ScanRequest,
    out: &mut dyn Write,
) -> anyhow::Result<Verdict> {
    let text = read_input(request.input)?;
    let rules = RuleSet::load_dir(request.rules_dir, &config.rules.compile_options())?;
    let verdict = scan_text(config, &rules, request.scope, &text, request.question);
    if request.json {
        serde_json::to_writer(&mut *out, &verdict)?;
        writeln!(out)?;
    } else {
        write_table(&verdict, out)?;
    }
    Ok(verdict)
}

/// Scans one text in one scope and assesses it.
pub fn scan_text(
    config: &Config,
    rules: &RuleSet,
    scope: Scope,
    text: &str,
    question: Option<&str>,
) -> Verdict {
    let hits = rules.scan(scope, text);
    let relevance: Vec<f64> = match (scope, question) {
        (Scope::Context, Some(q)) => vec![text::cosine(q, text)],
        _ => Vec::new(),
    };
    risk::assess(&config.risk, hits, &relevance)
}

fn read_input(input: Option<&Path>) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    match input {
        None => io::stdin().read_to_end(&mut bytes)?,
        Some(p) if p == Path::new("-") => io::stdin().read_to_end(&mut bytes)?,
        Some(p) => {
            bytes = std::fs::read(p)
                .map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", p.display()))?;
            bytes.len()
        }
    };
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "input is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

fn write_table(verdict: &Verdict, out: &mut dyn Write) -> io::Result<()> {
    let r = &verdict.risk;
    writeln!(out, "verdict: {}", verdict.decision.as_str())?;
    writeln!(
        out,
        "risk:    prompt {:.3}  response {:.3}  context {:.3}  total {:.3}",
        r.prompt, r.response, r.context, r.total
    )?;
    if let Some(relevance) = verdict.context_relevance {
        writeln!(out, "context relevance: {relevance:.3}")?;
    }
    if verdict.hits.is_empty() {
        return writeln!(out, "hits:    none");
    }
    writeln!(out, "hits:")?;
    writeln!(
        out,
        "  {:<32} {:<18} {:<8} {:<7} {:<12} SNIPPET",
        "RULE", "CATEGORY", "SCOPE", "ACTION", "SPAN"
    )?;
    for h in &verdict.hits {
        writeln!(
            out,
            "  {:<32} {:<18} {:<8} {:<7} {:<12} {:?}",
            h.rule,
            h.category,
            h.scope.as_str(),
            h.action.as_str(),
            format!("{}..{}", h.start, h.end),
            h.snippet
        )?;
    }
    Ok(())
}
