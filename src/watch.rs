//! Reloads the rules when a rule file changes (debounced) or on SIGHUP.

use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::proxy::State;

/// Watches the rule directory; keep the returned watcher alive for as long
/// as changes should reload.
pub fn watch_rules(state: Arc<State>) -> anyhow::Result<notify::RecommendedWatcher> {
    let (tx, mut rx) = mpsc::channel::<()>(64);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && !event.kind.is_access()
        {
            let _ = tx.try_send(());
        }
    })?;
    watcher.watch(state.rules.dir(), RecursiveMode::NonRecursive)?;
    let debounce = Duration::from_millis(state.config.rules.debounce_ms);
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Editors write a file in several steps: wait for quiet.
            tokio::time::sleep(debounce).await;
            while rx.try_recv().is_ok() {}
            let _ = state.reload_rules().await;
        }
    });
    Ok(watcher)
}

/// Reloads on every SIGHUP.
#[cfg(unix)]
pub fn reload_on_sighup(state: Arc<State>) -> anyhow::Result<()> {
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let _ = state.reload_rules().await;
        }
    });
    Ok(())
}
