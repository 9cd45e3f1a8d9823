//! The serving rule set, swapped atomically on reload.
//!
//! A reload compiles the whole directory away from the request path; only if
//! every pack compiles is the new set swapped in, in a step that cannot
//! fail. Each exchange takes one snapshot at its start and finishes on it, so
//! a reload never changes the rules under an exchange in flight. A failed
//! reload keeps the old set and records the error.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use serde::Serialize;

use super::{CompileOptions, LoadErrors, RuleSet};

/// What the last reloads did, for `/admin/rules`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadStatus {
    /// Seconds since the Unix epoch of the last successful load.
    pub loaded_at: u64,
    pub reloads: u64,
    pub failures: u64,
    /// The errors of the last reload, when it failed.
    pub last_error: Option<String>,
}

pub struct RuleStore {
    dir: PathBuf,
    options: CompileOptions,
    current: ArcSwap<RuleSet>,
    status: Mutex<ReloadStatus>,
}

impl RuleStore {
    /// Loads the directory for the first time.
    pub fn load(dir: PathBuf, options: CompileOptions) -> Result<RuleStore, LoadErrors> {
        let rules = RuleSet::load_dir(&dir, &options)?;
        Ok(RuleStore {
            dir,
            options,
            current: ArcSwap::from_pointee(rules),
            status: Mutex::new(ReloadStatus {
                loaded_at: now(),
                ..ReloadStatus::default()
            }),
        })
    }

    /// The rule set serving now.
    pub fn snapshot(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    pub fn dir(&self) -> &PathBuf {
        &self.dir
    }

    /// Compiles the directory again and, if it compiles, serves it. Blocks
    /// for the compile: call it off the request path.
    pub fn reload(&self) -> Result<Arc<RuleSet>, LoadErrors> {
        let result = RuleSet::load_dir(&self.dir, &self.options);
        let mut status = self
            .status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        status.reloads += 1;
        match result {
            Ok(rules) => {
                let rules = Arc::new(rules);
                self.current.store(rules.clone());
                status.loaded_at = now();
                status.last_error = None;
                Ok(rules)
            }
            Err(errors) => {
                status.failures += 1;
                status.last_error = Some(errors.to_string());
                Err(errors)
            }
        }
    }

    pub fn status(&self) -> ReloadStatus {
        self.status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
