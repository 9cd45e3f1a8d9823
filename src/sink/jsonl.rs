//! The JSON-lines sink: `<dir>/results-YYYY-MM-DD.jsonl` (UTC day of
//! processing), one [`Processed`] per line.
//!
//! Duplicates are recognized by kind and request id within the day's file
//! (the ids already in it are read when the file is opened). Lines are
//! buffered and written by [`JsonlSink::flush`] (after each batch of
//! records, and before a NATS worker acknowledges one) to a file opened for
//! appending; exactly-once across several worker processes is the
//! PostgreSQL sink's job.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{Processed, Stored};

pub struct JsonlSink {
    dir: PathBuf,
    day: Mutex<Option<Day>>,
}

struct Day {
    name: String,
    file: BufWriter<File>,
    seen: HashSet<String>,
}

impl JsonlSink {
    pub fn new(dir: &Path) -> JsonlSink {
        JsonlSink {
            dir: dir.to_owned(),
            day: Mutex::new(None),
        }
    }

    /// The file of a day, `results-YYYY-MM-DD.jsonl`.
    pub fn file_name(ms: i64) -> String {
        let day = chrono::DateTime::from_timestamp_millis(ms)
            .unwrap_or_default()
            .format("%Y-%m-%d");
        format!("results-{day}.jsonl")
    }

    pub async fn write(&self, processed: &Processed) -> anyhow::Result<Stored> {
        let name = JsonlSink::file_name(processed.processed_ms);
        let key = format!("{}:{}", processed.kind, processed.request_id);
        let mut line = serde_json::to_vec(processed)?;
        line.push(b'\n');
        let mut day = self
            .day
            .lock()
            .map_err(|_| anyhow::anyhow!("jsonl sink lock poisoned"))?;
        let current = match day.take() {
            Some(current) if current.name == name => current,
            _ => self.open(&name)?,
        };
        let day = day.insert(current);
        if !day.seen.insert(key) {
            return Ok(Stored::Duplicate);
        }
        day.file.write_all(&line)?;
        Ok(Stored::New)
    }

    /// Writes buffered lines to the file.
    pub fn flush(&self) -> anyhow::Result<()> {
        let mut day = self
            .day
            .lock()
            .map_err(|_| anyhow::anyhow!("jsonl sink lock poisoned"))?;
        if let Some(day) = day.as_mut() {
            day.file.flush()?;
        }
        Ok(())
    }

    fn open(&self, name: &str) -> anyhow::Result<Day> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.dir.join(name);
        let mut seen = HashSet::new();
        if let Ok(file) = File::open(&path) {
            for line in BufReader::new(file).lines() {
                let line = line?;
                if let Ok(p) = serde_json::from_str::<Key>(&line) {
                    seen.insert(format!("{}:{}", p.kind, p.request_id));
                }
            }
        }
        let file = BufWriter::with_capacity(
            64 << 10,
            OpenOptions::new().create(true).append(true).open(&path)?,
        );
        Ok(Day {
            name: name.to_owned(),
            file,
            seen,
        })
    }
}

#[derive(serde::Deserialize)]
struct Key {
    kind: String,
    request_id: String,
}
