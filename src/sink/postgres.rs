//! The PostgreSQL sink: one row per exchange, one per rule hit, one per
//! metric result, one per feedback; the store for longitudinal analysis
//! and the Grafana dashboards.
//!
//! The tables are created by numbered migrations that the binary runs when
//! it connects, under an advisory lock so that workers starting together
//! do not race. Writes are idempotent by request id: an exchange that is
//! already stored is a duplicate and adds no rows.

use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};

use super::{Processed, Stored};
use crate::record::{ExchangeRecord, StreamEnd};

/// The migrations, in order; a migration is never edited once released.
const MIGRATIONS: &[&str] = &[
    r"
CREATE TABLE fairgate_exchanges (
    request_id    text PRIMARY KEY,
    started_at    timestamptz NOT NULL,
    finished_at   timestamptz NOT NULL,
    processed_at  timestamptz NOT NULL,
    route         text NOT NULL,
    dialect       text NOT NULL,
    upstream      text NOT NULL,
    model         text,
    stream        boolean NOT NULL,
    status        int NOT NULL,
    verdict       text NOT NULL,
    risk_prompt   float8 NOT NULL,
    risk_response float8 NOT NULL,
    risk_context  float8 NOT NULL,
    risk_total    float8 NOT NULL,
    upstream_ms   float8,
    proxy_ms      float8 NOT NULL,
    total_ms      float8 NOT NULL,
    usage         jsonb,
    session_id    text,
    user_id       text,
    texts         jsonb NOT NULL,
    record        jsonb NOT NULL
);
CREATE INDEX fairgate_exchanges_finished_at ON fairgate_exchanges (finished_at);
CREATE TABLE fairgate_hits (
    request_id text NOT NULL REFERENCES fairgate_exchanges ON DELETE CASCADE,
    position   int NOT NULL,
    rule       text NOT NULL,
    category   text NOT NULL,
    scope      text NOT NULL,
    action     text NOT NULL,
    start_byte bigint NOT NULL,
    end_byte   bigint NOT NULL,
    snippet    text,
    PRIMARY KEY (request_id, position)
);
CREATE INDEX fairgate_hits_rule ON fairgate_hits (rule);
CREATE TABLE fairgate_metric_results (
    request_id  text NOT NULL,
    metric      text NOT NULL,
    score       float8,
    reason      text NOT NULL,
    details     jsonb,
    computed_at timestamptz NOT NULL,
    PRIMARY KEY (request_id, metric)
);
CREATE INDEX fairgate_metric_results_metric ON fairgate_metric_results (metric, computed_at);
CREATE TABLE fairgate_feedback (
    request_id     text PRIMARY KEY,
    user_action    text NOT NULL,
    stake_type     text,
    goal_completed boolean,
    received_at    timestamptz NOT NULL
);
",
    r"
ALTER TABLE fairgate_exchanges ADD COLUMN stream_end text;
",
    r"
ALTER TABLE fairgate_exchanges ADD COLUMN upstream_request_id text;
",
];

pub struct PostgresSink {
    url: String,
    client: Mutex<Option<Client>>,
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|e| anyhow::anyhow!("sinks.postgres: cannot connect: {e}"))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

/// Runs the migrations not applied yet.
pub async fn migrate(client: &mut Client) -> anyhow::Result<()> {
    let tx = client.transaction().await?;
    // One migrating process at a time.
    tx.execute("SELECT pg_advisory_xact_lock(4242420001)", &[])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS fairgate_migrations (
            version int PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await?;
    let applied: i32 = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM fairgate_migrations",
            &[],
        )
        .await?
        .get(0);
    for (i, sql) in MIGRATIONS.iter().enumerate() {
        let version = i as i32 + 1;
        if version > applied {
            tx.batch_execute(sql).await?;
            tx.execute(
                "INSERT INTO fairgate_migrations (version) VALUES ($1)",
                &[&version],
            )
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// The records of the newest `max` exchanges that a rule blocked in the
/// last two days, newest first (what the admin dashboard lists, read back
/// at a start when the results are not kept as JSON lines).
pub async fn recent_blocks(url: &str, max: usize) -> anyhow::Result<Vec<ExchangeRecord>> {
    let client = connect(url).await?;
    let max = i64::try_from(max)?;
    let rows = client
        .query(
            "SELECT record FROM fairgate_exchanges
             WHERE verdict = 'block' AND finished_at > now() - interval '2 days'
             ORDER BY finished_at DESC LIMIT $1",
            &[&max],
        )
        .await?;
    rows.iter()
        .map(|row| Ok(serde_json::from_value(row.try_get(0)?)?))
        .collect()
}

impl PostgresSink {
    pub async fn connect(url: &str) -> anyhow::Result<PostgresSink> {
        let mut client = connect(url).await?;
        migrate(&mut client)
            .await
            .map_err(|e| anyhow::anyhow!("sinks.postgres: migrations failed: {e}"))?;
        Ok(PostgresSink {
            url: url.to_owned(),
            client: Mutex::new(Some(client)),
        })
    }

    pub async fn write(&self, processed: &Processed) -> anyhow::Result<Stored> {
        let mut slot = self.client.lock().await;
        let mut client = match slot.take() {
            Some(client) if !client.is_closed() => client,
            _ => connect(&self.url).await?,
        };
        let result = write(&mut client, processed).await;
        *slot = Some(client);
        result
    }
}

async fn write(client: &mut Client, p: &Processed) -> anyhow::Result<Stored> {
    let tx = client.transaction().await?;
    let processed_ms = p.processed_ms as f64;
    let inserted = if let Some(r) = &p.exchange {
        let texts = serde_json::to_value(&r.texts)?;
        let record = serde_json::to_value(r)?;
        let inserted = tx
            .execute(
                "INSERT INTO fairgate_exchanges (request_id, started_at, finished_at, processed_at,
                    route, dialect, upstream, model, stream, status, verdict,
                    risk_prompt, risk_response, risk_context, risk_total,
                    upstream_ms, proxy_ms, total_ms, usage, session_id, user_id, texts, record, stream_end, upstream_request_id)
                 VALUES ($1, to_timestamp($2::float8 / 1000), to_timestamp($3::float8 / 1000), to_timestamp($4::float8 / 1000),
                    $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25)
                 ON CONFLICT (request_id) DO NOTHING",
                &[
                    &r.request_id,
                    &(r.started_ms as f64),
                    &(r.finished_ms as f64),
                    &processed_ms,
                    &r.route,
                    &r.dialect,
                    &r.upstream,
                    &r.model,
                    &r.stream,
                    &i32::from(r.status),
                    &r.verdict.as_str(),
                    &r.risk.prompt,
                    &r.risk.response,
                    &r.risk.context,
                    &r.risk.total,
                    &r.upstream_ms,
                    &r.proxy_ms,
                    &r.total_ms,
                    &r.usage.as_ref().map(tokio_postgres::types::Json),
                    &r.client.session,
                    &r.client.user,
                    &texts,
                    &record,
                    &r.stream_end.map(StreamEnd::as_str),
                    &r.upstream_request_id,
                ],
            )
            .await?;
        if inserted == 1 {
            for (i, hit) in r.hits.iter().enumerate() {
                tx.execute(
                    "INSERT INTO fairgate_hits (request_id, position, rule, category, scope, action, start_byte, end_byte, snippet)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    &[
                        &r.request_id,
                        &(i as i32),
                        &hit.rule,
                        &hit.category,
                        &hit.scope.as_str(),
                        &hit.action.as_str(),
                        &(hit.start as i64),
                        &(hit.end as i64),
                        &hit.snippet,
                    ],
                )
                .await?;
            }
        }
        inserted
    } else if let Some(f) = &p.feedback {
        let action = serde_json::to_value(f.user_action)?;
        let stake = f.stake_type.map(serde_json::to_value).transpose()?;
        tx.execute(
            "INSERT INTO fairgate_feedback (request_id, user_action, stake_type, goal_completed, received_at)
             VALUES ($1, $2, $3, $4, to_timestamp($5::float8 / 1000))
             ON CONFLICT (request_id) DO NOTHING",
            &[
                &f.request_id,
                &action.as_str(),
                &stake.as_ref().and_then(|s| s.as_str()),
                &f.goal_completed,
                &(f.received_ms as f64),
            ],
        )
        .await?
    } else {
        anyhow::bail!("a result with neither exchange nor feedback");
    };
    if inserted == 0 {
        tx.rollback().await?;
        return Ok(Stored::Duplicate);
    }
    for metric in &p.metrics {
        tx.execute(
            "INSERT INTO fairgate_metric_results (request_id, metric, score, reason, details, computed_at)
             VALUES ($1, $2, $3, $4, $5, to_timestamp($6::float8 / 1000))
             ON CONFLICT (request_id, metric) DO NOTHING",
            &[
                &p.request_id,
                &metric.name,
                &metric.score,
                &metric.reason,
                &metric.details,
                &processed_ms,
            ],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(Stored::New)
}
