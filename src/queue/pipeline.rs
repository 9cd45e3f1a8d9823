//! The consumer side of the queue inside the proxy, on its own thread and
//! runtime so that it never competes with the serving threads' runtimes:
//! in-process workers (`queue.kind: memory`) or the JetStream publisher
//! (`queue.kind: nats`), and the replay of spilled records.
//!
//! On [`Pipeline::stop`] the queue is closed (new records spill), the
//! consumers finish what is in the channel until the grace period ends, and
//! whatever is left is written to the spill file: nothing the proxy held is
//! lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, mpsc, watch};

use super::nats::Publisher;
use super::{Queue, read_spilled};
use crate::config::{Config, QueueKind};
use crate::record::QueueItem;
use crate::telemetry::{Metrics, QueueEvent};
use crate::worker::Processor;

/// Records a worker takes from the channel at once.
const BATCH: usize = 64;

/// How long a worker waits before looking at an empty channel again.
const TICK: Duration = Duration::from_millis(2);

/// How long results may wait in a sink's buffer while records keep coming.
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// When a worker writes out the results its sinks buffered: as soon as it
/// finds the queue empty, or [`FLUSH_EVERY`] after the oldest result not
/// yet written while records keep coming (the sink's buffer also writes
/// itself out when full). Not after every batch: under load that was a
/// small write per batch.
#[derive(Debug, Default)]
struct Flushes {
    /// When the oldest result not yet written out was handled.
    oldest: Option<Instant>,
}

impl Flushes {
    fn handled(&mut self, now: Instant) {
        self.oldest.get_or_insert(now);
    }

    /// Whether to flush now; `idle` when the queue was found empty.
    fn due(&self, idle: bool, now: Instant) -> bool {
        self.oldest
            .is_some_and(|oldest| idle || now.duration_since(oldest) >= FLUSH_EVERY)
    }

    fn flushed(&mut self) {
        self.oldest = None;
    }
}

/// What consumes the channel.
enum Consumer {
    Workers(Arc<Processor>),
    Nats(Arc<Publisher>),
}

impl Consumer {
    /// Whether records can go out now (spilled ones are replayed only then).
    fn ready(&self) -> bool {
        match self {
            Consumer::Workers(_) => true,
            Consumer::Nats(publisher) => publisher.connected(),
        }
    }

    /// Makes the results handled so far durable.
    fn flush(&self) {
        if let Consumer::Workers(processor) = self
            && let Err(error) = processor.flush()
        {
            tracing::error!(%error, "results could not be written");
        }
    }

    /// Handles one record; on failure it goes to the spill file.
    async fn handle(&self, queue: &Queue, item: QueueItem) {
        let result = match self {
            Consumer::Workers(processor) => processor.process(item).await.map(|_| ()),
            Consumer::Nats(publisher) => match publisher.publish(&item).await {
                Ok(()) => {
                    queue.count(QueueEvent::Published);
                    Ok(())
                }
                Err(error) => Err((error, item)),
            },
        };
        if let Err((error, item)) = result {
            tracing::warn!(%error, request_id = item.request_id(), "record not delivered; spilled for a later try");
            queue.count(QueueEvent::Failed);
            match queue.spill.append(&item) {
                Ok(()) => queue.count(QueueEvent::Spilled),
                Err(error) => {
                    tracing::error!(%error, "a record could not be spilled and is lost");
                    queue.count(QueueEvent::Dropped);
                }
            }
        }
    }
}

/// The running pipeline.
pub struct Pipeline {
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pipeline {
    /// Starts consuming `queue` on a thread of its own.
    pub fn start(
        queue: Arc<Queue>,
        config: Config,
        telemetry: Arc<Metrics>,
    ) -> anyhow::Result<Pipeline> {
        let (stop, stopped) = watch::channel(false);
        let Some(rx) = queue.take_receiver() else {
            anyhow::bail!("the queue already has a consumer");
        };
        // One thread: the workers are tasks on it. They wait on sinks and
        // NATS concurrently, and their CPU work (the metrics) is a small
        // share of an exchange's, so more threads would only take cores
        // from the serving threads and wake each other (futex and
        // sched_yield calls under load, per strace).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("fairgate-queue".into())
            .spawn(move || {
                runtime.block_on(run(queue, rx, config, telemetry, stopped));
            })?;
        Ok(Pipeline {
            stop,
            thread: Some(thread),
        })
    }

    /// Closes the queue, drains it for up to `grace`, spills the rest and
    /// waits for the thread.
    pub fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn open_consumer(config: &Config, telemetry: Arc<Metrics>) -> anyhow::Result<Consumer> {
    Ok(match config.queue.kind {
        QueueKind::Memory => Consumer::Workers(Arc::new(Processor::open(config, telemetry).await?)),
        QueueKind::Nats => Consumer::Nats(Arc::new(Publisher::connect(&config.queue.nats).await?)),
    })
}

async fn run(
    queue: Arc<Queue>,
    rx: mpsc::Receiver<QueueItem>,
    config: Config,
    telemetry: Arc<Metrics>,
    mut stopped: watch::Receiver<bool>,
) {
    // The sinks or NATS may be down at start: try again until they answer.
    let consumer = loop {
        match open_consumer(&config, telemetry.clone()).await {
            Ok(consumer) => break Arc::new(consumer),
            Err(error) => {
                tracing::error!(%error, "the side queue's consumer cannot start; records wait in the queue");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stopped.wait_for(|s| *s) => {
                        queue.close();
                        spill_all(&queue, rx).await;
                        let _ = queue.spill.sync();
                        return;
                    }
                }
            }
        }
    };
    let rx = Arc::new(Mutex::new(rx));
    let mut tasks = Vec::new();
    let workers = match config.queue.kind {
        QueueKind::Memory => config.queue.workers,
        QueueKind::Nats => config.queue.workers.max(1),
    };
    for _ in 0..workers {
        let (queue, rx, consumer, mut stopped) =
            (queue.clone(), rx.clone(), consumer.clone(), stopped.clone());
        tasks.push(tokio::spawn(async move {
            // Records are taken in batches, and an empty channel is looked
            // at again after TICK rather than waited on: a request never
            // has to wake this thread (a system call on the request path
            // per record), and under load one wake-up serves many records.
            let mut batch = Vec::with_capacity(BATCH);
            let mut flushes = Flushes::default();
            loop {
                // Once stopping, what is left is drained within the grace
                // period (or spilled) after the workers end.
                if *stopped.borrow() {
                    break;
                }
                let closed = {
                    let mut rx = rx.lock().await;
                    take_batch(&mut rx, &mut batch)
                };
                let idle = batch.is_empty();
                if flushes.due(idle, Instant::now()) {
                    consumer.flush();
                    flushes.flushed();
                }
                if idle {
                    if closed {
                        break;
                    }
                    tokio::select! {
                        biased;
                        _ = stopped.wait_for(|s| *s) => break,
                        () = tokio::time::sleep(TICK) => continue,
                    }
                }
                queue.update_depth();
                for item in batch.drain(..) {
                    consumer.handle(&queue, item).await;
                }
                flushes.handled(Instant::now());
            }
            consumer.flush();
        }));
    }
    let replay = {
        let (queue, consumer, stopped) = (queue.clone(), consumer.clone(), stopped.clone());
        let interval = Duration::from_millis(config.queue.replay_interval_ms.max(10));
        tokio::spawn(async move { replay(queue, consumer, interval, stopped).await })
    };

    let _ = stopped.wait_for(|s| *s).await;
    queue.close();
    for task in tasks {
        let _ = task.await;
    }
    let _ = replay.await;
    // Drain what the channel holds within the grace period; spill the rest.
    let deadline = Instant::now() + Duration::from_millis(config.shutdown_grace_ms);
    let Ok(rx) = Arc::try_unwrap(rx).map(Mutex::into_inner) else {
        return;
    };
    let mut rx = rx;
    if workers > 0 {
        while Instant::now() < deadline {
            let Ok(item) = rx.try_recv() else { break };
            consumer.handle(&queue, item).await;
        }
        consumer.flush();
    }
    spill_all(&queue, rx).await;
    queue.update_depth();
    if let Err(error) = queue.spill.sync() {
        tracing::error!(%error, "spilled records may not all be on disk");
    }
}

/// Moves up to [`BATCH`] records from the channel into `batch` without
/// waiting; returns whether the channel is closed and empty.
fn take_batch(rx: &mut mpsc::Receiver<QueueItem>, batch: &mut Vec<QueueItem>) -> bool {
    while batch.len() < BATCH {
        match rx.try_recv() {
            Ok(item) => batch.push(item),
            Err(mpsc::error::TryRecvError::Empty) => return false,
            Err(mpsc::error::TryRecvError::Disconnected) => return true,
        }
    }
    false
}

/// Writes every record still in the channel to the spill file.
async fn spill_all(queue: &Queue, mut rx: mpsc::Receiver<QueueItem>) {
    rx.close();
    while let Ok(item) = rx.try_recv() {
        match queue.spill.append(&item) {
            Ok(()) => queue.count(QueueEvent::Spilled),
            Err(error) => {
                tracing::error!(%error, "a record could not be spilled and is lost");
                queue.count(QueueEvent::Dropped);
            }
        }
    }
}

/// Puts spilled records back into the channel whenever it has room (at
/// least half free) and the consumer can deliver them.
async fn replay(
    queue: Arc<Queue>,
    consumer: Arc<Consumer>,
    interval: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let tx = queue.sender();
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = stopped.wait_for(|s| *s) => return,
        }
        if !queue.spill.pending() || !consumer.ready() || queue.room() * 2 < queue.capacity() {
            continue;
        }
        let files = match queue.spill.take() {
            Ok(files) => files,
            Err(error) => {
                tracing::error!(%error, "spilled records cannot be read");
                continue;
            }
        };
        for file in files {
            let mut items = match read_spilled(&file) {
                Ok(items) => items,
                Err(error) => {
                    tracing::error!(%error, file = %file.display(), "spill file cannot be read");
                    queue.spill.mark_pending();
                    continue;
                }
            };
            let (mut interrupted, mut broken) = (false, false);
            while let Some(item) = items.next() {
                let item = match item {
                    Ok(item) => item,
                    Err(error) => {
                        // Kept to be read again: what came back from it
                        // may come back twice.
                        tracing::error!(%error, file = %file.display(), "spill file cannot be read to its end");
                        queue.spill.mark_pending();
                        broken = true;
                        break;
                    }
                };
                let permit = tokio::select! {
                    permit = tx.reserve() => permit.ok(),
                    _ = stopped.wait_for(|s| *s) => None,
                };
                match permit {
                    Some(permit) => {
                        permit.send(item);
                        queue.count(QueueEvent::Replayed);
                    }
                    None => {
                        // Shutting down: what is not back in the channel
                        // goes back to the spill file.
                        for item in std::iter::once(Ok(item)).chain(items.by_ref()) {
                            let spilled = item.and_then(|item| queue.spill.append(&item));
                            if let Err(error) = spilled {
                                tracing::error!(%error, "a record could not be spilled again; its file is kept");
                                broken = true;
                                break;
                            }
                        }
                        interrupted = true;
                        break;
                    }
                }
            }
            for _ in 0..items.bad {
                queue.count(QueueEvent::Failed);
            }
            if !broken && let Err(error) = std::fs::remove_file(&file) {
                tracing::error!(%error, file = %file.display(), "replayed spill file cannot be removed; its records may be replayed again");
            }
            if interrupted {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_written_when_idle_or_once_the_oldest_has_waited_long_enough() {
        let start = Instant::now();
        let mut flushes = Flushes::default();
        // Nothing handled: nothing to write, idle or not.
        assert!(!flushes.due(true, start));
        assert!(!flushes.due(false, start + FLUSH_EVERY * 2));

        // Records keep coming: not after each batch, but once the oldest
        // result has waited FLUSH_EVERY (later batches do not push it out).
        flushes.handled(start);
        flushes.handled(start + FLUSH_EVERY / 2);
        assert!(!flushes.due(false, start + FLUSH_EVERY / 2));
        assert!(!flushes.due(false, start + FLUSH_EVERY - Duration::from_millis(1)));
        assert!(flushes.due(false, start + FLUSH_EVERY));

        // The queue found empty: at once.
        assert!(flushes.due(true, start + Duration::from_millis(1)));

        // Once written out, the clock starts with the next result.
        flushes.flushed();
        assert!(!flushes.due(true, start + FLUSH_EVERY * 3));
        flushes.handled(start + FLUSH_EVERY * 3);
        assert!(!flushes.due(false, start + FLUSH_EVERY * 3 + FLUSH_EVERY / 2));
        assert!(flushes.due(false, start + FLUSH_EVERY * 4));
    }
}
