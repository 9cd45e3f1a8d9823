//! The JSON-lines sink: `<dir>/results-YYYY-MM-DD.jsonl` (UTC day of
//! processing), one [`Processed`] per line.
//!
//! Lines are buffered (64 KiB) and written to a file opened for appending
//! when the buffer is full and by [`JsonlSink::flush`]: when the in-process
//! workers find the queue empty or, while records keep coming, once the
//! oldest unwritten line has waited 50 ms; and before a NATS worker
//! acknowledges a record.
//!
//! Duplicates (a record replayed or redelivered after it was stored) are
//! recognized by kind and request id among the last [`WINDOW`] lines of the
//! day: a redelivery is of a recent record, and a bounded window keeps the
//! memory and the start-up time of a busy day flat (when a day's file is
//! opened, only its last [`TAIL_BYTES`] are read back). Exactly-once over
//! any span, and across several worker processes, is the PostgreSQL sink's
//! job.

use std::collections::{HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasherDefault, DefaultHasher, Hash, Hasher};
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{Processed, Stored};
use crate::record::ExchangeRecord;
use crate::risk::Decision;

/// How many of the latest keys are remembered.
pub const WINDOW: usize = 1 << 16;
/// How much of the end of an existing day file is read back at open.
pub const TAIL_BYTES: u64 = 64 << 20;

const MS_PER_DAY: i64 = 86_400_000;

pub struct JsonlSink {
    dir: PathBuf,
    day: Mutex<Option<Day>>,
    /// [`TAIL_BYTES`], smaller in tests.
    tail_bytes: u64,
}

struct Day {
    /// Days since the epoch (UTC).
    number: i64,
    file: BufWriter<File>,
    recent: Recent,
    /// The line being written, kept for its capacity.
    line: Vec<u8>,
}

/// The hashes of the last [`WINDOW`] keys (kind and request id), oldest
/// first out.
#[derive(Default)]
struct Recent {
    set: HashSet<u64, BuildHasherDefault<Hashed>>,
    order: VecDeque<u64>,
}

/// The hasher of a set of hashes: each is its own hash (hashing it again,
/// as the default hasher does, cost some 200 instructions per record).
#[derive(Default)]
struct Hashed(u64);

impl Hasher for Hashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is called for a `u64`; any other input is folded in.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }
}

impl Recent {
    /// Remembers a key; false if it is already among the recent ones.
    fn insert(&mut self, kind: &str, request_id: &str) -> bool {
        let mut hasher = DefaultHasher::new();
        (kind, request_id).hash(&mut hasher);
        let key = hasher.finish();
        if !self.set.insert(key) {
            return false;
        }
        // The oldest leaves before the newest comes, so that the queue never
        // holds more than WINDOW keys: one over, and it would double its
        // allocation for the rest of the day.
        if self.order.len() == WINDOW
            && let Some(oldest) = self.order.pop_front()
        {
            self.set.remove(&oldest);
        }
        self.order.push_back(key);
        true
    }
}

impl JsonlSink {
    pub fn new(dir: &Path) -> JsonlSink {
        JsonlSink {
            dir: dir.to_owned(),
            day: Mutex::new(None),
            tail_bytes: TAIL_BYTES,
        }
    }

    /// The file of a day, `results-YYYY-MM-DD.jsonl`.
    pub fn file_name(ms: i64) -> String {
        let day = chrono::DateTime::from_timestamp_millis(ms)
            .unwrap_or_default()
            .format("%Y-%m-%d");
        format!("results-{day}.jsonl")
    }

    /// Writes the line of `processed`, unless it is a duplicate. When
    /// `keep` is given, a copy of the line written (without its newline)
    /// goes in it, for another sink to send the same bytes without
    /// serializing the result again; a duplicate leaves it as it was.
    pub async fn write(
        &self,
        processed: &Processed,
        keep: Option<&mut Vec<u8>>,
    ) -> anyhow::Result<Stored> {
        let number = processed.processed_ms.div_euclid(MS_PER_DAY);
        let mut day = self
            .day
            .lock()
            .map_err(|_| anyhow::anyhow!("jsonl sink lock poisoned"))?;
        let current = match day.take() {
            Some(current) if current.number == number => current,
            _ => self.open(number)?,
        };
        let day = day.insert(current);
        if !day.recent.insert(&processed.kind, &processed.request_id) {
            return Ok(Stored::Duplicate);
        }
        // Whole lines only: the record is serialized before any of it is
        // written.
        day.line.clear();
        crate::line::write(&mut day.line, processed)?;
        if let Some(keep) = keep {
            keep.extend_from_slice(&day.line);
        }
        day.line.push(b'\n');
        day.file.write_all(&day.line)?;
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

    fn open(&self, number: i64) -> anyhow::Result<Day> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.dir.join(JsonlSink::file_name(number * MS_PER_DAY));
        let mut recent = Recent::default();
        if let Some(lines) = tail_lines(&path, self.tail_bytes)? {
            for line in lines {
                if let Ok(p) = serde_json::from_str::<Key>(&line?) {
                    recent.insert(&p.kind, &p.request_id);
                }
            }
        }
        let file = BufWriter::with_capacity(
            64 << 10,
            OpenOptions::new().create(true).append(true).open(&path)?,
        );
        Ok(Day {
            number,
            file,
            recent,
            line: Vec::new(),
        })
    }
}

#[derive(serde::Deserialize)]
struct Key {
    kind: String,
    request_id: String,
}

/// The whole lines in the last `bytes` of the file at `path`; `None` when
/// there is no such file. A line that is not UTF-8 is passed over: a line
/// cut short by a crash or a full disk, which the next line written after
/// it then continued, may end inside a character.
fn tail_lines(
    path: &Path,
    bytes: u64,
) -> std::io::Result<Option<impl Iterator<Item = std::io::Result<String>>>> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error),
    };
    let from = file.metadata()?.len().saturating_sub(bytes);
    file.seek(SeekFrom::Start(from))?;
    // From within the file, the first line read is the end of a cut one.
    let lines = BufReader::new(file).lines().skip(usize::from(from > 0));
    Ok(Some(lines.filter(
        |line| !matches!(line, Err(error) if error.kind() == std::io::ErrorKind::InvalidData),
    )))
}

/// The records of the newest `max` exchanges that a rule blocked, newest
/// first, among the results in `dir`: the last [`TAIL_BYTES`] of each of
/// the two newest days' files (what the admin dashboard lists, read back
/// at a start). Other lines are passed over unread but for a search.
pub fn recent_blocks(dir: &Path, max: usize) -> anyhow::Result<Vec<ExchangeRecord>> {
    let mut days: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| {
                let name = path.file_name().and_then(|name| name.to_str());
                name.is_some_and(|name| name.starts_with("results-") && name.ends_with(".jsonl"))
            })
            .collect(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error.into()),
    };
    // The names sort by day.
    days.sort_unstable();
    let mut blocks = Vec::new();
    for day in days.iter().rev().take(2) {
        let room = max - blocks.len();
        if room == 0 {
            break;
        }
        blocks.extend(blocks_in(day, room)?.into_iter().rev());
    }
    Ok(blocks)
}

/// The records of the newest `max` blocked exchanges in the last
/// [`TAIL_BYTES`] of the result file `day`, oldest first.
fn blocks_in(day: &Path, max: usize) -> anyhow::Result<VecDeque<ExchangeRecord>> {
    let mut blocks = VecDeque::new();
    let Some(lines) = tail_lines(day, TAIL_BYTES)? else {
        return Ok(blocks);
    };
    for line in lines {
        let line = line?;
        // Written compact: the key and value appear so, and only so, in a
        // blocked exchange's line (inside a string, quotes are escaped).
        if !line.contains(r#""verdict":"block""#) {
            continue;
        }
        let Ok(Row {
            exchange: Some(record),
        }) = serde_json::from_str::<Row>(&line)
        else {
            continue;
        };
        if record.verdict == Decision::Block {
            if blocks.len() == max {
                blocks.pop_front();
            }
            blocks.push_back(*record);
        }
    }
    Ok(blocks)
}

/// A result line, read for its exchange.
#[derive(serde::Deserialize)]
struct Row {
    exchange: Option<Box<ExchangeRecord>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processed(request_id: &str) -> Processed {
        Processed {
            kind: "feedback".into(),
            request_id: request_id.into(),
            processed_ms: 1_795_300_000_000,
            exchange: None,
            feedback: None,
            metrics: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_reopened_day_knows_the_keys_in_the_tail_it_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let sink = JsonlSink::new(dir.path());
        for i in 0..100 {
            assert_eq!(
                sink.write(&processed(&format!("r{i:03}")), None)
                    .await
                    .unwrap(),
                Stored::New
            );
        }
        sink.flush().unwrap();
        let line = serde_json::to_vec(&processed("r000")).unwrap().len() as u64 + 1;
        // A new process reads back the last 10.5 lines: the cut one is
        // skipped, the last ten are known.
        let mut reopened = JsonlSink::new(dir.path());
        reopened.tail_bytes = line * 21 / 2;
        assert_eq!(
            reopened.write(&processed("r099"), None).await.unwrap(),
            Stored::Duplicate
        );
        assert_eq!(
            reopened.write(&processed("r090"), None).await.unwrap(),
            Stored::Duplicate
        );
        assert_eq!(
            reopened.write(&processed("r089"), None).await.unwrap(),
            Stored::New
        );
        assert_eq!(
            reopened.write(&processed("r000"), None).await.unwrap(),
            Stored::New
        );
        reopened.flush().unwrap();
        let name = JsonlSink::file_name(processed("x").processed_ms);
        let text = std::fs::read_to_string(dir.path().join(name)).unwrap();
        assert_eq!(text.lines().count(), 102);
    }

    #[tokio::test]
    async fn a_line_reads_back_as_the_result_it_was_written_from() {
        let dir = tempfile::tempdir().unwrap();
        let sink = JsonlSink::new(dir.path());
        let text = "quote \" backslash \\ newline \n tab \t control \u{1} \u{7f} é € 🙂 </script>";
        let metric = |score: f64| crate::quality::MetricResult {
            name: text.to_owned().into(),
            score: Some(score),
            reason: text.to_owned().into(),
            details: serde_json::json!({ text: [1.5, -0.0, 1e-7, 6.172887999999999, u64::MAX] }),
        };
        let mut result = processed("r1");
        result.metrics = vec![metric(0.1 + 0.2), metric(f64::NAN), metric(f64::INFINITY)];
        sink.write(&result, None).await.unwrap();
        sink.flush().unwrap();
        let name = JsonlSink::file_name(result.processed_ms);
        let line = std::fs::read_to_string(dir.path().join(name)).unwrap();
        let read: Processed = serde_json::from_str(line.trim_end()).unwrap();
        // Numbers that JSON cannot hold are written as null, as serde_json does.
        result.metrics[1].score = None;
        result.metrics[2].score = None;
        assert_eq!(read, result);
        assert_eq!(line.lines().count(), 1);
    }

    /// The result of an exchange `request_id` with `verdict`, processed
    /// on `day` (days after the first of this test's).
    fn exchange(request_id: &str, verdict: Decision, day: i64) -> Processed {
        use crate::record::{ClientMeta, TextMode, Texts};
        // A prompt that names the key and value the reader searches for.
        let prompt = r#"the log said "verdict":"block""#.to_owned();
        let record = ExchangeRecord {
            schema_version: crate::record::SCHEMA_VERSION,
            request_id: request_id.into(),
            started_ms: 0,
            finished_ms: 1,
            route: "messages".into(),
            dialect: "anthropic".into(),
            upstream: "anthropic".into(),
            upstream_request_id: None,
            model: None,
            stream: false,
            status: 400,
            stream_end: None,
            custom_id: None,
            texts: Texts::new(TextMode::Full, vec![prompt], Vec::new(), Vec::new()),
            verdict,
            risk: crate::risk::Risk::default(),
            hits: Vec::new(),
            upstream_ms: None,
            proxy_ms: 0.0,
            total_ms: 0.0,
            usage: None,
            client: ClientMeta::default(),
        };
        Processed {
            kind: "exchange".into(),
            request_id: request_id.into(),
            processed_ms: 1_795_300_000_000 + day * MS_PER_DAY,
            exchange: Some(Box::new(record)),
            feedback: None,
            metrics: Vec::new(),
        }
    }

    #[tokio::test]
    async fn the_newest_blocks_of_the_last_two_days_are_read_back_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let results = dir.path().join("results");
        // No results yet: nothing to read back.
        assert!(recent_blocks(&results, 10).unwrap().is_empty());
        let sink = JsonlSink::new(&results);
        let written = [
            ("b0", Decision::Block, 0),
            ("b1", Decision::Block, 1),
            ("b2", Decision::Block, 1),
            ("a1", Decision::Allow, 1),
            ("b3", Decision::Block, 1),
            ("b4", Decision::Block, 2),
            ("a2", Decision::Allow, 2),
            ("b5", Decision::Block, 2),
        ];
        for (id, verdict, day) in written {
            sink.write(&exchange(id, verdict, day), None).await.unwrap();
            sink.flush().unwrap();
        }
        sink.write(&processed("feedback-1"), None).await.unwrap();
        sink.flush().unwrap();
        let ids = |max: usize| -> Vec<String> {
            let blocks = recent_blocks(&results, max).unwrap();
            blocks.into_iter().map(|record| record.request_id).collect()
        };
        // The newest, across a day's change; the third day back is not read.
        assert_eq!(ids(4), ["b5", "b4", "b3", "b2"]);
        assert_eq!(ids(100), ["b5", "b4", "b3", "b2", "b1"]);
        assert_eq!(ids(1), ["b5"]);
    }

    /// A line cut inside a character, and continued by the next one
    /// written (a crash mid-write), neither stops the sink from opening
    /// its day again nor the blocks from being read back.
    #[tokio::test]
    async fn a_line_that_is_not_utf8_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let results = dir.path().join("results");
        let sink = JsonlSink::new(&results);
        let blocked = exchange("b1", Decision::Block, 0);
        sink.write(&blocked, None).await.unwrap();
        sink.flush().unwrap();
        let name = JsonlSink::file_name(blocked.processed_ms);
        let mut file = OpenOptions::new()
            .append(true)
            .open(results.join(&name))
            .unwrap();
        file.write_all(b"{\"kind\":\"exchange\",\"request_id\":\"\xe2\x82")
            .unwrap();
        drop(file);
        sink.write(&exchange("b2", Decision::Block, 0), None)
            .await
            .unwrap();
        sink.flush().unwrap();

        let reopened = JsonlSink::new(&results);
        assert_eq!(
            reopened.write(&blocked, None).await.unwrap(),
            Stored::Duplicate
        );
        let blocks = recent_blocks(&results, 10).unwrap();
        let ids: Vec<&str> = blocks.iter().map(|r| r.request_id.as_str()).collect();
        // The second line was continued from the cut one: it is lost.
        assert_eq!(ids, ["b1"]);
    }

    #[test]
    fn the_window_forgets_the_oldest_keys_only() {
        let mut recent = Recent::default();
        for i in 0..WINDOW + 10 {
            assert!(recent.insert("exchange", &i.to_string()));
        }
        assert_eq!(recent.set.len(), WINDOW);
        // Never one key over: the queue's allocation stays at WINDOW keys.
        assert_eq!(recent.order.len(), WINDOW);
        assert!(recent.order.capacity() < 2 * WINDOW);
        // The newest are still known, the ten oldest are not.
        assert!(!recent.insert("exchange", &(WINDOW + 9).to_string()));
        assert!(!recent.insert("exchange", "10"));
        assert!(recent.insert("exchange", "0"));
        // Kinds are told apart.
        assert!(recent.insert("feedback", "11"));
    }
}
