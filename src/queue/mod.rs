//! The side queue: exchange and feedback records leave the request path
//! here, without waiting.
//!
//! [`Queue::push`] is all the request path does: a `try_send` into a bounded
//! channel. When the channel is full (or closed for shutdown) the record is
//! appended to a spill file (`on_full: spill`, the default) or dropped and
//! counted (`on_full: drop`). The [`pipeline`] on its own thread consumes the
//! channel: in-process workers (`queue.kind: memory`) or a publisher to NATS
//! JetStream (`queue.kind: nats`, see [`nats`]), and replays spilled records
//! once there is room again.
//!
//! The spill file is append-only JSON lines (`<spill_dir>/spill.jsonl`),
//! written by a thread of its own: spilling a record on the request path
//! serializes it and hands the line over, it never waits on the file.
//! Replay first renames it aside (`replay-*.jsonl`), so new spills never mix
//! with a replay in progress; a replay file is deleted only once all of its
//! records are back in the channel, and what a shutdown interrupts is
//! appended to the spill file again. A record may so be replayed twice after
//! a crash, never lost; processing is idempotent by request id.

pub mod nats;
pub mod pipeline;

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::IntGauge;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use crate::config::{OnFull, QueueConfig};
use crate::record::QueueItem;
use crate::telemetry::{QueueEvent, QueueRecords};

/// The producer side of the side queue, shared by every serving thread.
pub struct Queue {
    tx: mpsc::Sender<QueueItem>,
    rx: Mutex<Option<mpsc::Receiver<QueueItem>>>,
    pub spill: Spill,
    on_full: OnFull,
    /// Set on shutdown: from then on records go straight to the spill file.
    closed: AtomicBool,
    records: QueueRecords,
    depth: IntGauge,
}

impl Queue {
    pub fn new(config: &QueueConfig, records: QueueRecords, depth: IntGauge) -> Queue {
        let (tx, rx) = mpsc::channel(config.capacity.max(1));
        Queue {
            tx,
            rx: Mutex::new(Some(rx)),
            spill: Spill::new(&config.spill_dir, records.clone()),
            on_full: config.on_full,
            closed: AtomicBool::new(false),
            records,
            depth,
        }
    }

    /// Hands a record to the queue; never waits.
    pub fn push(&self, item: QueueItem) {
        if self.closed.load(Ordering::Acquire) {
            self.overflow(item);
            return;
        }
        match self.tx.try_send(item) {
            Ok(()) => {
                self.count(QueueEvent::Enqueued);
                self.depth.set(self.len() as i64);
            }
            Err(TrySendError::Full(item) | TrySendError::Closed(item)) => self.overflow(item),
        }
    }

    fn overflow(&self, item: QueueItem) {
        match self.on_full {
            OnFull::Drop => self.count(QueueEvent::Dropped),
            OnFull::Spill => match self.spill.append(&item) {
                Ok(()) => self.count(QueueEvent::Spilled),
                Err(error) => {
                    tracing::error!(%error, request_id = item.request_id(), "a record could not be spilled and is lost");
                    self.count(QueueEvent::Dropped);
                }
            },
        }
    }

    /// Records waiting in the channel.
    pub fn len(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Free places in the channel.
    pub fn room(&self) -> usize {
        self.tx.capacity()
    }

    pub fn capacity(&self) -> usize {
        self.tx.max_capacity()
    }

    /// The consumer side; there is one, taken by the pipeline.
    pub fn take_receiver(&self) -> Option<mpsc::Receiver<QueueItem>> {
        self.rx.lock().ok()?.take()
    }

    /// A sender for replaying spilled records (it may wait for room).
    pub fn sender(&self) -> mpsc::Sender<QueueItem> {
        self.tx.clone()
    }

    /// From now on records go to the spill file.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub fn count(&self, event: QueueEvent) {
        self.records.count(event);
    }

    pub fn update_depth(&self) {
        self.depth.set(self.len() as i64);
    }
}

/// The append-only spill file and the files of replays in progress.
pub struct Spill {
    dir: PathBuf,
    writer: std::sync::mpsc::Sender<SpillOp>,
    /// Set when a record is spilled; cleared when the spill is taken.
    pending: AtomicBool,
}

/// What the spill writer thread is asked to do, in order.
enum SpillOp {
    Line(Vec<u8>),
    /// Everything sent before is written; close the file and, if `rotate`,
    /// move it aside for replay. Answers when done.
    Sync {
        rotate: bool,
        done: std::sync::mpsc::SyncSender<std::io::Result<()>>,
    },
}

const SPILL_FILE: &str = "spill.jsonl";
const REPLAY_PREFIX: &str = "replay-";

impl Spill {
    pub fn new(dir: &Path, records: QueueRecords) -> Spill {
        // Spills left by an earlier run are pending too.
        let pending = std::fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| is_spill_name(&e.file_name().to_string_lossy()))
        });
        let (writer, ops) = std::sync::mpsc::channel();
        let thread_dir = dir.to_owned();
        let spawned = std::thread::Builder::new()
            .name("fairgate-spill".into())
            .spawn(move || write_spills(&thread_dir, &ops, &records));
        if let Err(error) = spawned {
            tracing::error!(%error, "the spill writer cannot start; spilled records will be lost");
        }
        Spill {
            dir: dir.to_owned(),
            writer,
            pending: AtomicBool::new(pending),
        }
    }

    /// Hands one record to the spill writer as a JSON line; never waits on
    /// the file.
    pub fn append(&self, item: &QueueItem) -> std::io::Result<()> {
        let mut line = Vec::new();
        crate::line::write_item(&mut line, item).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.writer
            .send(SpillOp::Line(line))
            .map_err(|_| std::io::Error::other("the spill writer has stopped"))?;
        self.pending.store(true, Ordering::Release);
        Ok(())
    }

    /// Waits until every record handed over so far is in the file (off the
    /// request path: replay, shutdown, tests).
    pub fn sync(&self) -> std::io::Result<()> {
        self.ask(false)
    }

    fn ask(&self, rotate: bool) -> std::io::Result<()> {
        let (done, answer) = std::sync::mpsc::sync_channel(1);
        self.writer
            .send(SpillOp::Sync { rotate, done })
            .map_err(|_| std::io::Error::other("the spill writer has stopped"))?;
        answer
            .recv()
            .map_err(|_| std::io::Error::other("the spill writer has stopped"))?
    }

    /// Whether there may be spilled records to replay.
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Moves the spill file aside and returns every file to replay, oldest
    /// first.
    pub fn take(&self) -> std::io::Result<Vec<PathBuf>> {
        self.pending.store(false, Ordering::Release);
        self.ask(true)?;
        let mut files: Vec<PathBuf> = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(REPLAY_PREFIX))
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        files.sort();
        Ok(files)
    }

    /// Marks that records were put back.
    pub fn mark_pending(&self) {
        self.pending.store(true, Ordering::Release);
    }
}

/// The spill writer thread: appends lines, closes and rotates on request,
/// until the [`Spill`] is dropped.
fn write_spills(dir: &Path, ops: &std::sync::mpsc::Receiver<SpillOp>, records: &QueueRecords) {
    let mut file: Option<File> = None;
    let mut rotations = 0u64;
    for op in ops {
        match op {
            SpillOp::Line(line) => {
                let written = (|| -> std::io::Result<()> {
                    if file.is_none() {
                        std::fs::create_dir_all(dir)?;
                        file = Some(
                            OpenOptions::new()
                                .create(true)
                                .append(true)
                                .open(dir.join(SPILL_FILE))?,
                        );
                    }
                    match file.as_mut() {
                        Some(file) => file.write_all(&line),
                        None => Ok(()),
                    }
                })();
                if let Err(error) = written {
                    tracing::error!(%error, "a spilled record could not be written and is lost");
                    records.count(QueueEvent::Dropped);
                }
            }
            SpillOp::Sync { rotate, done } => {
                file = None;
                let mut result = Ok(());
                let spill = dir.join(SPILL_FILE);
                if rotate && std::fs::metadata(&spill).is_ok_and(|m| m.len() > 0) {
                    rotations += 1;
                    let name = format!(
                        "{REPLAY_PREFIX}{:013}-{rotations:06}.jsonl",
                        crate::record::now_ms()
                    );
                    result = std::fs::rename(&spill, dir.join(name));
                }
                let _ = done.send(result);
            }
        }
    }
}

fn is_spill_name(name: &str) -> bool {
    name == SPILL_FILE || name.starts_with(REPLAY_PREFIX)
}

/// The records of a spill or replay file, read one at a time: a file may
/// hold more than memory should (a long outage's, or a burst's). A line
/// that does not parse is logged and skipped, and counted in `bad`.
pub struct Spilled {
    lines: std::io::Lines<BufReader<File>>,
    path: PathBuf,
    pub bad: usize,
}

pub fn read_spilled(path: &Path) -> std::io::Result<Spilled> {
    Ok(Spilled {
        lines: BufReader::new(File::open(path)?).lines(),
        path: path.to_owned(),
        bad: 0,
    })
}

impl Iterator for Spilled {
    type Item = std::io::Result<QueueItem>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let line = match self.lines.next()? {
                Ok(line) => line,
                Err(error) => return Some(Err(error)),
            };
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str(&line) {
                Ok(item) => return Some(Ok(item)),
                Err(error) => {
                    let file = self.path.display();
                    tracing::error!(%error, %file, "a spilled record does not parse; skipped");
                    self.bad += 1;
                }
            }
        }
    }
}
