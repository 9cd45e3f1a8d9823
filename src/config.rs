//! fairgate's configuration file: raw serde structs with defaults for every
//! setting, then a validation step that reports every problem at once.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::risk::RiskConfig;
use crate::rules::CompileOptions;

/// The whole configuration. Every field has a default, so an empty file (or
/// none) is a valid configuration.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub rules: RulesConfig,
    pub risk: RiskConfig,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RulesConfig {
    /// The directory of rule packs.
    pub dir: PathBuf,
    /// The length assumed for regexes with unbounded matches, in bytes (see
    /// [`crate::rules::RuleSet::match_limits`]).
    pub unbounded_match_cap: usize,
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            dir: PathBuf::from("rules"),
            unbounded_match_cap: CompileOptions::default().unbounded_match_cap,
        }
    }
}

impl RulesConfig {
    pub fn compile_options(&self) -> CompileOptions {
        CompileOptions {
            unbounded_match_cap: self.unbounded_match_cap,
        }
    }
}

/// A configuration file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: invalid configuration:\n  {}", .problems.join("\n  "))]
    Invalid {
        path: PathBuf,
        problems: Vec<String>,
    },
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(path, &text)
    }

    /// Parses and validates the text of a configuration file; `path` is only
    /// used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
                path: path.to_owned(),
                message: e.to_string(),
            })?
        };
        let problems = config.problems();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid {
                path: path.to_owned(),
                problems,
            })
        }
    }

    /// Every problem with the values.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = self.risk.problems();
        if self.rules.unbounded_match_cap == 0 {
            problems.push("rules.unbounded_match_cap: must be at least 1".into());
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(
            Config::parse(Path::new("f"), "").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        let e = Config::parse(Path::new("f.yaml"), "risk:\n  treshold: 1\n").unwrap_err();
        assert!(e.to_string().contains("unknown field `treshold`"), "{e}");
        let e = Config::parse(
            Path::new("f.yaml"),
            "risk:\n  block_threshold: 3\n  weights: {prompt: 2}\n",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("risk.block_threshold") && text.contains("risk.weights.prompt"),
            "{text}"
        );
    }
}
