//! The records of a batch's requests read on their way up
//! ([`super::lines`]), held on disk until the answer that ends them.
//!
//! A batch's input read on its way may be 200 MB of requests. Holding each
//! one's record in memory until the upload is answered would hold their
//! texts, which reading on the way exists to avoid. So each record is
//! written as a line of JSON, as it is read, to a file with no name in
//! `queue.spill_dir` (the system removes it once it is closed, even by a
//! crash), with the number of its line; the answer's status and times are
//! put in as the records are read back, and each goes to the side queue.
//! The lines of a part of an upload in parts are numbered in the file
//! only when the upload is completed, with the parts in order
//! ([`HeldRecords::number_after`]).

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Seek, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Ending, RecordDraft, State, send_record};
use crate::record::{ExchangeRecord, now_ms};
use crate::risk::Verdict;
use crate::telemetry::QueueEvent;

/// Records held until the answer of the request that read them.
pub(super) struct HeldRecords {
    state: Arc<State>,
    /// When that request arrived.
    started: Instant,
    /// Made with the first record.
    file: Option<BufWriter<File>>,
    /// Records in the file, not yet sent.
    held: usize,
    /// The request that numbers the records in the end, and the lines
    /// before their first; their reader's own id and numbers without it.
    numbered: Option<(String, usize)>,
}

/// The answer of the request that read the records.
#[derive(Clone)]
pub(super) struct Answered {
    pub status: u16,
    /// The upstream's share of the time, when it was called.
    pub upstream: Option<Duration>,
    pub upstream_request_id: Option<String>,
}

impl Answered {
    /// Ends `record`, of a request that arrived at `started`.
    fn end(&self, record: &mut ExchangeRecord, started: Instant) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let total = started.elapsed();
        record.status = self.status;
        record.upstream_request_id = self.upstream_request_id.clone();
        record.upstream_ms = self.upstream.map(ms);
        record.proxy_ms = ms(total.saturating_sub(self.upstream.unwrap_or_default()));
        record.total_ms = ms(total);
        record.finished_ms = now_ms();
        record.started_ms = record.finished_ms - total.as_millis() as i64;
    }
}

impl HeldRecords {
    /// The records of a request that arrived at `started`.
    pub(super) fn new(state: Arc<State>, started: Instant) -> HeldRecords {
        HeldRecords {
            state,
            started,
            file: None,
            held: 0,
            numbered: None,
        }
    }

    pub(super) fn started(&self) -> Instant {
        self.started
    }

    /// Numbers the records as lines of `request_id`'s file, after `lines`
    /// lines: the record of the line numbered 2 here is `<request_id>.7`
    /// after 5. They are then that request's, which arrived at `started`.
    pub(super) fn number_after(&mut self, (request_id, started): (&str, Instant), lines: usize) {
        self.numbered = Some((request_id.to_owned(), lines));
        self.started = started;
    }

    /// Holds the record of the request on line `line` (`draft`, with the
    /// `verdict` of its scan), to end with the answer.
    pub(super) fn hold(&mut self, line: usize, draft: RecordDraft, verdict: &Verdict) {
        let ending = Ending {
            verdict,
            response: Vec::new(),
            context: Vec::new(),
            status: 0,
            upstream: None,
            proxy: Duration::ZERO,
            usage: None,
            stream_end: None,
        };
        let record = draft.record(self.state.config.records.texts, ending);
        match self.write(line, &record) {
            Ok(()) => self.held += 1,
            Err(error) => {
                let request_id = record.request_id.as_str();
                tracing::error!(%error, request_id, "a batch request's record could not be held and is lost");
                self.state.queue.count(QueueEvent::Dropped);
            }
        }
    }

    fn write(&mut self, line: usize, record: &ExchangeRecord) -> io::Result<()> {
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                let dir = &self.state.config.queue.spill_dir;
                std::fs::create_dir_all(dir)?;
                self.file
                    .insert(BufWriter::new(tempfile::tempfile_in(dir)?))
            }
        };
        serde_json::to_writer(&mut *file, &(line, record))?;
        file.write_all(b"\n")
    }

    /// Ends every record with `answered` and hands it to the side queue,
    /// on a blocking thread: there may be many.
    pub(super) fn end(self, answered: Answered) {
        if self.held == 0 {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(move || self.send(&answered))),
            Err(_) => self.send(&answered),
        }
    }

    fn send(mut self, answered: &Answered) {
        if let Err(error) = self.send_held(answered) {
            tracing::error!(%error, "a batch's held records could not be read back");
        }
        if self.held > 0 {
            let lost = std::mem::take(&mut self.held);
            tracing::error!(lost, "records of a batch's requests are lost");
            for _ in 0..lost {
                self.state.queue.count(QueueEvent::Dropped);
            }
        }
    }

    fn send_held(&mut self, answered: &Answered) -> io::Result<()> {
        let Some(file) = self.file.take() else {
            return Ok(());
        };
        let mut file = file.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.rewind()?;
        for line in BufReader::new(file).lines() {
            let (line, mut record): (usize, ExchangeRecord) = serde_json::from_str(&line?)?;
            if let Some((request_id, before)) = &self.numbered {
                record.request_id = format!("{request_id}.{}", before + line);
            }
            answered.end(&mut record, self.started);
            send_record(&self.state, record);
            self.held -= 1;
        }
        Ok(())
    }
}

/// Records dropped before an answer ended them belong to a request that
/// was abandoned (its client left while it was read): they end with 499,
/// as an exchange's record does.
impl Drop for HeldRecords {
    fn drop(&mut self) {
        if self.held == 0 {
            return;
        }
        let records = HeldRecords {
            state: self.state.clone(),
            started: self.started,
            file: self.file.take(),
            held: std::mem::take(&mut self.held),
            numbered: self.numbered.take(),
        };
        records.end(Answered {
            status: 499,
            upstream: None,
            upstream_request_id: None,
        });
    }
}
