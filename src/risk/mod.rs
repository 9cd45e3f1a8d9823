//! Hits -> risk per scope, total risk, verdict.
//!
//! **Per scope** the weights of the distinct rules that hit combine as a
//! probabilistic OR, `R = 1 - Π(1 - w)`: each rule is read as independent
//! evidence, one hit of weight `w` gives exactly `w`, more hits only raise the
//! risk, and it never leaves `[0, 1]`. A rule that hits twice counts once.
//!
//! **Context** risk also counts how unrelated retrieved context is to the
//! question: each chunk's relevance is the cosine similarity of the binary
//! token-set vectors of question and chunk ([`crate::text::cosine`]); the least
//! relevant chunk, when below `relevance.floor`, adds
//! `relevance.weight × (floor - r) / floor` (OR-combined like a rule weight).
//! An unrelated chunk is what injected or poisoned retrieval looks like.
//!
//! **Total**: `R_total = w_prompt·R_prompt + w_response·R_response +
//! w_context·R_context`, default weights 1/3 each.
//!
//! **Verdict**: `block` if any `block` rule hit or `R_total >= block_threshold`;
//! otherwise `redact` if a `redact` rule hit, `flag` if a `flag` rule hit; else
//! `allow`. `log` hits are listed but decide nothing.

use serde::{Deserialize, Serialize};

use crate::rules::{Action, Hit, Scope};

/// How risk is combined and when it blocks.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RiskConfig {
    pub weights: ScopeWeights,
    /// `R_total` at or above this blocks.
    pub block_threshold: f64,
    pub relevance: RelevanceConfig,
}

impl Default for RiskConfig {
    fn default() -> Self {
        RiskConfig {
            weights: ScopeWeights::default(),
            block_threshold: 0.5,
            relevance: RelevanceConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScopeWeights {
    pub prompt: f64,
    pub response: f64,
    pub context: f64,
}

impl Default for ScopeWeights {
    fn default() -> Self {
        ScopeWeights {
            prompt: 1.0 / 3.0,
            response: 1.0 / 3.0,
            context: 1.0 / 3.0,
        }
    }
}

/// How much unrelated context adds to context risk.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelevanceConfig {
    /// The most an entirely unrelated chunk adds, in `[0, 1]`.
    pub weight: f64,
    /// Chunks at or above this relevance add nothing, in `(0, 1]`.
    pub floor: f64,
}

impl Default for RelevanceConfig {
    fn default() -> Self {
        RelevanceConfig {
            weight: 0.5,
            floor: 0.1,
        }
    }
}

impl RiskConfig {
    /// Every problem with the values, as `field: problem` lines.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let unit = |name: &str, v: f64, problems: &mut Vec<String>| {
            if !(0.0..=1.0).contains(&v) {
                problems.push(format!("{name}: {v} is out of range; expected 0 to 1"));
            }
        };
        unit("risk.weights.prompt", self.weights.prompt, &mut problems);
        unit(
            "risk.weights.response",
            self.weights.response,
            &mut problems,
        );
        unit("risk.weights.context", self.weights.context, &mut problems);
        unit(
            "risk.relevance.weight",
            self.relevance.weight,
            &mut problems,
        );
        if !(self.block_threshold > 0.0 && self.block_threshold <= 1.0) {
            problems.push(format!(
                "risk.block_threshold: {} is out of range; expected more than 0, at most 1",
                self.block_threshold
            ));
        }
        if !(self.relevance.floor > 0.0 && self.relevance.floor <= 1.0) {
            problems.push(format!(
                "risk.relevance.floor: {} is out of range; expected more than 0, at most 1",
                self.relevance.floor
            ));
        }
        problems
    }
}

/// Risk scores, each in `[0, 1]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Risk {
    pub prompt: f64,
    pub response: f64,
    pub context: f64,
    pub total: f64,
}

impl Risk {
    pub fn of(&self, scope: Scope) -> f64 {
        match scope {
            Scope::Prompt => self.prompt,
            Scope::Response => self.response,
            Scope::Context => self.context,
        }
    }
}

/// What happens to an exchange. Ordered by severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Allow,
    Flag,
    Redact,
    Block,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Allow => "allow",
            Decision::Flag => "flag",
            Decision::Redact => "redact",
            Decision::Block => "block",
        }
    }
}

/// The decision with the scores and every hit behind it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    #[serde(rename = "verdict")]
    pub decision: Decision,
    pub risk: Risk,
    pub hits: Vec<Hit>,
    /// The least relevance of a context chunk to the question, when both were
    /// given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_relevance: Option<f64>,
}

/// Scores the hits of an exchange (any mix of scopes) and decides.
/// `context_relevance` holds the relevance of each context chunk to the
/// question, empty when there is no question or no context.
pub fn assess(config: &RiskConfig, hits: Vec<Hit>, context_relevance: &[f64]) -> Verdict {
    let least_relevant = context_relevance.iter().copied().reduce(f64::min);
    let relevance_risk = least_relevant.map_or(0.0, |r| {
        let floor = config.relevance.floor;
        config.relevance.weight * ((floor - r) / floor).clamp(0.0, 1.0)
    });
    let prompt = scope_risk(&hits, Scope::Prompt);
    let response = scope_risk(&hits, Scope::Response);
    let context = 1.0 - (1.0 - scope_risk(&hits, Scope::Context)) * (1.0 - relevance_risk);
    let w = &config.weights;
    let total = (w.prompt * prompt + w.response * response + w.context * context).clamp(0.0, 1.0);
    let risk = Risk {
        prompt,
        response,
        context,
        total,
    };
    let worst = hits.iter().map(|h| h.action).max();
    let decision = if worst == Some(Action::Block) || total >= config.block_threshold {
        Decision::Block
    } else {
        match worst {
            Some(Action::Redact) => Decision::Redact,
            Some(Action::Flag) => Decision::Flag,
            _ => Decision::Allow,
        }
    };
    Verdict {
        decision,
        risk,
        hits,
        context_relevance: least_relevant,
    }
}

/// `1 - Π(1 - w)` over the distinct rules that hit in `scope`.
fn scope_risk(hits: &[Hit], scope: Scope) -> f64 {
    let mut seen: Vec<&str> = Vec::new();
    let mut keep = 1.0;
    for hit in hits.iter().filter(|h| h.scope == scope) {
        if !seen.contains(&&*hit.rule) {
            seen.push(&hit.rule);
            keep *= 1.0 - hit.weight;
        }
    }
    1.0 - keep
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(rule: &str, scope: Scope, action: Action, weight: f64) -> Hit {
        Hit {
            rule: rule.into(),
            category: "c".into(),
            scope,
            action,
            weight,
            message: "m".into(),
            placeholder: "[x]".into(),
            start: 0,
            end: 1,
            snippet: "x".into(),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn scope_risk_is_a_probabilistic_or_of_distinct_rules() {
        let hits = vec![
            hit("a", Scope::Prompt, Action::Flag, 0.5),
            hit("b", Scope::Prompt, Action::Flag, 0.2),
            hit("a", Scope::Prompt, Action::Flag, 0.5),
            hit("c", Scope::Response, Action::Flag, 0.6),
        ];
        let v = assess(&RiskConfig::default(), hits, &[]);
        assert!(close(v.risk.prompt, 1.0 - 0.5 * 0.8));
        assert!(close(v.risk.response, 0.6));
        assert!(close(v.risk.context, 0.0));
        assert!(close(v.risk.total, (0.6 + 0.6) / 3.0));
        assert_eq!(v.decision, Decision::Flag);
    }

    #[test]
    fn total_uses_the_configured_weights_and_threshold() {
        let config = RiskConfig {
            weights: ScopeWeights {
                prompt: 0.6,
                response: 0.3,
                context: 0.1,
            },
            block_threshold: 0.5,
            ..RiskConfig::default()
        };
        let v = assess(
            &config,
            vec![hit("a", Scope::Prompt, Action::Log, 0.9)],
            &[],
        );
        assert!(close(v.risk.total, 0.54));
        assert_eq!(v.decision, Decision::Block);
        let v = assess(
            &config,
            vec![hit("a", Scope::Response, Action::Log, 0.9)],
            &[],
        );
        assert!(close(v.risk.total, 0.27));
        assert_eq!(v.decision, Decision::Allow);
    }

    #[test]
    fn the_most_severe_action_decides() {
        let config = RiskConfig::default();
        let decide = |actions: &[Action]| {
            let hits = actions
                .iter()
                .enumerate()
                .map(|(i, a)| hit(&i.to_string(), Scope::Prompt, *a, 0.0))
                .collect();
            assess(&config, hits, &[]).decision
        };
        assert_eq!(decide(&[]), Decision::Allow);
        assert_eq!(decide(&[Action::Log]), Decision::Allow);
        assert_eq!(decide(&[Action::Log, Action::Flag]), Decision::Flag);
        assert_eq!(decide(&[Action::Flag, Action::Redact]), Decision::Redact);
        assert_eq!(
            decide(&[Action::Redact, Action::Block, Action::Flag]),
            Decision::Block
        );
    }

    #[test]
    fn unrelated_context_adds_risk_below_the_floor() {
        let config = RiskConfig::default(); // weight 0.5, floor 0.1
        let v = assess(&config, vec![], &[0.8, 0.0]);
        assert!(close(v.risk.context, 0.5));
        assert_eq!(v.context_relevance, Some(0.0));
        let v = assess(&config, vec![], &[0.05]);
        assert!(close(v.risk.context, 0.25));
        let v = assess(
            &config,
            vec![hit("a", Scope::Context, Action::Flag, 0.5)],
            &[0.05],
        );
        assert!(close(v.risk.context, 1.0 - 0.5 * 0.75));
        let v = assess(&config, vec![], &[0.1, 0.9]);
        assert!(close(v.risk.context, 0.0));
        let v = assess(&config, vec![], &[]);
        assert_eq!(v.context_relevance, None);
    }

    #[test]
    fn config_problems_are_all_reported() {
        let mut config = RiskConfig::default();
        config.weights.prompt = -1.0;
        config.block_threshold = 0.0;
        config.relevance.floor = 2.0;
        assert_eq!(config.problems().len(), 3);
        assert!(RiskConfig::default().problems().is_empty());
    }
}
