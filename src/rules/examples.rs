//! The examples every rule carries, run as tests: each `block` text must trip
//! the rule and each `allow` text must not, in every scope of the rule. Used by
//! `fairgate rules test` and by `cargo test` on the shipped packs.

use std::fmt;

use super::{RuleSet, Scope};

/// An example that did not behave as its rule says.
#[derive(Debug, Clone, PartialEq)]
pub struct ExampleFailure {
    pub rule: String,
    pub scope: Scope,
    pub kind: ExampleKind,
    pub text: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExampleKind {
    /// A `block` example the rule did not match.
    Missed,
    /// An `allow` example the rule matched.
    FalsePositive,
}

impl fmt::Display for ExampleFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ExampleKind::Missed => "block example not matched",
            ExampleKind::FalsePositive => "allow example matched",
        };
        write!(f, "{} ({}): {what}: {:?}", self.rule, self.scope, self.text)
    }
}

/// The outcome of running every example of a rule set.
#[derive(Debug, Default)]
pub struct ExampleReport {
    pub examples: usize,
    pub failures: Vec<ExampleFailure>,
}

/// Runs every example of every rule.
pub fn run(rules: &RuleSet) -> ExampleReport {
    let mut report = ExampleReport::default();
    for rule in rules.rules() {
        for &scope in &rule.scopes {
            let cases = rule
                .examples_block
                .iter()
                .map(|t| (t, ExampleKind::Missed))
                .chain(
                    rule.examples_allow
                        .iter()
                        .map(|t| (t, ExampleKind::FalsePositive)),
                );
            for (text, kind) in cases {
                report.examples += 1;
                let hit = rules.scan(scope, text).iter().any(|h| h.rule == rule.id);
                if hit != (kind == ExampleKind::Missed) {
                    report.failures.push(ExampleFailure {
                        rule: rule.id.to_string(),
                        scope,
                        kind,
                        text: text.clone(),
                    });
                }
            }
        }
    }
    report
}
