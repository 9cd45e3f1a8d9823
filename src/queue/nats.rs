//! The NATS JetStream queue: the proxy's publisher and the `fairgate
//! worker` consumer.
//!
//! The proxy publishes each record to `queue.nats.subject` in the stream
//! `queue.nats.stream` (created if missing) with the header `Nats-Msg-Id`
//! set to the record's kind and request id, so that JetStream drops a
//! publish it already has (a retry after a lost acknowledgement). A publish
//! counts once JetStream acknowledged it; one that fails or times out goes
//! to the spill file and is replayed when NATS is back.
//!
//! Workers share one durable pull consumer: each record goes to one of
//! them, and is acknowledged only after its results are written. A worker
//! that dies leaves its records unacknowledged; JetStream delivers them again
//! after `ack_wait_ms`, and the sinks store each request id once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer, stream};
use futures_util::StreamExt;

use crate::config::{Config, NatsConfig};
use crate::record::QueueItem;
use crate::telemetry::{Metrics, QueueEvent};
use crate::worker::Processor;

/// The JetStream context for `config`; connects in the background, so a
/// NATS that is down at start does not stop the proxy.
pub async fn context(
    config: &NatsConfig,
) -> anyhow::Result<(async_nats::Client, jetstream::Context)> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(2))
        .connect(config.url.as_str())
        .await
        .map_err(|e| anyhow::anyhow!("queue.nats.url {}: {e}", config.url))?;
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(5))
        .ack_timeout(Duration::from_secs(2))
        .build(client.clone());
    Ok((client, js))
}

/// Gets the stream, creating it if missing.
pub async fn ensure_stream(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> anyhow::Result<stream::Stream> {
    js.get_or_create_stream(stream::Config {
        name: config.stream.clone(),
        subjects: vec![config.subject.clone()],
        max_age: Duration::from_secs(config.max_age_secs),
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .map_err(|e| anyhow::anyhow!("JetStream stream {}: {e}", config.stream))
}

/// Publishes records to the stream.
pub struct Publisher {
    client: async_nats::Client,
    js: jetstream::Context,
    config: NatsConfig,
    stream_ready: AtomicBool,
}

impl Publisher {
    pub async fn connect(config: &NatsConfig) -> anyhow::Result<Publisher> {
        let (client, js) = context(config).await?;
        Ok(Publisher {
            client,
            js,
            config: config.clone(),
            stream_ready: AtomicBool::new(false),
        })
    }

    /// Whether NATS is connected now.
    pub fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Publishes one record and waits for JetStream's acknowledgement.
    pub async fn publish(&self, item: &QueueItem) -> anyhow::Result<()> {
        if !self.connected() {
            anyhow::bail!("not connected to NATS");
        }
        if !self.stream_ready.load(Ordering::Acquire) {
            ensure_stream(&self.js, &self.config).await?;
            self.stream_ready.store(true, Ordering::Release);
        }
        let mut headers = async_nats::HeaderMap::new();
        let id = match item {
            QueueItem::Exchange(r) => format!("exchange:{}", r.request_id),
            QueueItem::Feedback(f) => format!("feedback:{}", f.request_id),
        };
        headers.insert("Nats-Msg-Id", id.as_str());
        let mut payload = Vec::new();
        crate::line::write_item(&mut payload, item)?;
        let ack = self
            .js
            .publish_with_headers(self.config.subject.clone(), headers, payload.into())
            .await?;
        ack.await?;
        Ok(())
    }
}

/// `fairgate worker`: consumes the stream with `queue.workers` concurrent
/// consumers until `stop` completes.
pub async fn run_worker(
    config: &Config,
    telemetry: Arc<Metrics>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let nats = &config.queue.nats;
    let (_client, js) = context(nats).await?;
    let stream = loop {
        match ensure_stream(&js, nats).await {
            Ok(stream) => break stream,
            Err(error) => {
                tracing::warn!(%error, "waiting for NATS JetStream");
                if wait_or_stop(&stop, Duration::from_secs(1)).await {
                    return Ok(());
                }
            }
        }
    };
    let consumer: consumer::PullConsumer = stream
        .get_or_create_consumer(
            &nats.consumer,
            consumer::pull::Config {
                durable_name: Some(nats.consumer.clone()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_millis(nats.ack_wait_ms),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("JetStream consumer {}: {e}", nats.consumer))?;
    let processor = Arc::new(Processor::open(config, telemetry.clone()).await?);
    if processor.quality.lexicon.is_none() {
        tracing::warn!(reason = %processor.quality.lexicon_missing, "no emotion lexicon: emotional entropy and Spearman will have no score");
    }
    tracing::info!(stream = %nats.stream, consumer = %nats.consumer, workers = config.queue.workers.max(1), "worker consuming");
    let mut tasks = Vec::new();
    for _ in 0..config.queue.workers.max(1) {
        let consumer = consumer.clone();
        let processor = processor.clone();
        let telemetry = telemetry.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            consume(consumer, processor, telemetry, stop).await;
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}

/// Sleeps `pause` unless `stop` turns true first; returns whether it did.
async fn wait_or_stop(stop: &tokio::sync::watch::Receiver<bool>, pause: Duration) -> bool {
    let mut stop = stop.clone();
    tokio::select! {
        () = tokio::time::sleep(pause) => {}
        _ = stop.wait_for(|s| *s) => return true,
    }
    *stop.borrow()
}

async fn consume(
    consumer: consumer::PullConsumer,
    processor: Arc<Processor>,
    telemetry: Arc<Metrics>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let batch = consumer
            .fetch()
            .max_messages(16)
            .expires(Duration::from_millis(500))
            .messages()
            .await;
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                tracing::warn!(%error, "fetching from JetStream failed; retrying");
                if wait_or_stop(&stop, Duration::from_millis(500)).await {
                    return;
                }
                continue;
            }
        };
        while let Some(message) = batch.next().await {
            let Ok(message) = message else { break };
            let item: QueueItem = match serde_json::from_slice(&message.payload) {
                Ok(item) => item,
                Err(error) => {
                    tracing::error!(%error, "a queued record does not parse; terminated");
                    telemetry.queue_records.count(QueueEvent::Failed);
                    let _ = message.ack_with(AckKind::Term).await;
                    continue;
                }
            };
            let request_id = item.request_id().to_owned();
            let stored = processor.process(item).await.map_err(|(error, _)| error);
            match stored.and_then(|stored| {
                processor.flush()?;
                Ok(stored)
            }) {
                Ok(stored) => {
                    tracing::debug!(request_id, ?stored, "results stored");
                    if let Err(error) = message.double_ack().await {
                        tracing::warn!(%error, request_id, "acknowledgement failed; the record will be delivered again");
                    }
                }
                Err(error) => {
                    tracing::error!(%error, request_id, "storing results failed; the record will be delivered again");
                    telemetry.queue_records.count(QueueEvent::Failed);
                    let _ = message
                        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                        .await;
                }
            }
        }
    }
}
