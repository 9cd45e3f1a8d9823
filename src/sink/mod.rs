//! Where workers store results, in any combination: JSON lines (one file
//! per day), PostgreSQL (tables created by migrations), and a NATS subject
//! for other consumers.
//!
//! Every sink is idempotent by request id: a record delivered twice (a
//! redelivery after a worker died, a replay after a crash) is stored once.

pub mod jsonl;
pub mod postgres;

use serde::{Deserialize, Serialize};

use crate::config::SinksConfig;
use crate::quality::MetricResult;
use crate::record::{ExchangeRecord, FeedbackRecord, QueueItem};

/// The results of one queue item: the record itself and its metrics.
/// Written as JSON by [`crate::line`], field by field: a new field goes
/// there too (its tests fail until it does).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Processed {
    /// `exchange` or `feedback`.
    pub kind: String,
    pub request_id: String,
    pub processed_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exchange: Option<Box<ExchangeRecord>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub feedback: Option<FeedbackRecord>,
    pub metrics: Vec<MetricResult>,
}

impl Processed {
    /// The queue item the results were computed from.
    pub fn into_item(self) -> QueueItem {
        match (self.exchange, self.feedback) {
            (Some(record), _) => QueueItem::Exchange(record),
            (None, Some(feedback)) => QueueItem::Feedback(feedback),
            // Results are only made from an item, so they always hold one.
            (None, None) => unreachable!("a result without its exchange or feedback"),
        }
    }
}

/// Whether a write stored something new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    New,
    Duplicate,
}

/// The configured sinks.
pub struct Sinks {
    jsonl: Option<jsonl::JsonlSink>,
    postgres: Option<postgres::PostgresSink>,
    nats: Option<(async_nats::Client, String)>,
}

impl Sinks {
    /// Opens every configured sink (runs the PostgreSQL migrations, connects
    /// to NATS).
    pub async fn open(config: &SinksConfig, queue_nats_url: &str) -> anyhow::Result<Sinks> {
        let jsonl = config.jsonl.as_ref().map(|c| jsonl::JsonlSink::new(&c.dir));
        let postgres = match &config.postgres {
            Some(c) => Some(postgres::PostgresSink::connect(&c.url).await?),
            None => None,
        };
        let nats = match &config.nats {
            Some(c) => {
                let url = c.url.as_deref().unwrap_or(queue_nats_url);
                let client = async_nats::ConnectOptions::new()
                    .retry_on_initial_connect()
                    .connect(url)
                    .await
                    .map_err(|e| anyhow::anyhow!("sinks.nats: cannot connect to {url}: {e}"))?;
                Some((client, c.subject.clone()))
            }
            None => None,
        };
        Ok(Sinks {
            jsonl,
            postgres,
            nats,
        })
    }

    /// Makes what [`Sinks::write`] buffered durable (the JSON lines).
    pub fn flush(&self) -> anyhow::Result<()> {
        if let Some(jsonl) = &self.jsonl {
            jsonl.flush()?;
        }
        Ok(())
    }

    /// Stores one result in every sink. A duplicate is one that the
    /// primary store (PostgreSQL when configured, else the JSON lines)
    /// already had; duplicates are not published again.
    pub async fn write(&self, processed: &Processed) -> anyhow::Result<Stored> {
        let mut stored = Stored::New;
        if let Some(pg) = &self.postgres {
            stored = pg.write(processed).await?;
        }
        // The line the JSON-lines sink writes is the one published: it is
        // serialized once.
        let mut line = Vec::new();
        if let Some(jsonl) = &self.jsonl {
            let keep = self.nats.is_some().then_some(&mut line);
            let written = jsonl.write(processed, keep).await?;
            if self.postgres.is_none() {
                stored = written;
            }
        }
        if stored == Stored::New
            && let Some((client, subject)) = &self.nats
        {
            if line.is_empty() {
                crate::line::write(&mut line, processed)?;
            }
            client.publish(subject.clone(), line.into()).await?;
            client.flush().await?;
        }
        Ok(stored)
    }
}
