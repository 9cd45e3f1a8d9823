//! Time to first byte of streams at a fixed rate, for `benches/proxy.sh`
//! (oha reports whole-response times only). Starts a request every
//! `1 / RATE` seconds for `SECONDS`, open loop (a slow answer does not
//! delay the next request), over a pooled keep-alive client, and prints
//! `p50_ms p99_ms streams failures`: the time from sending a request to the
//! first byte of its body, and the count of requests that failed or did not
//! answer 2xx with a body.
//!
//! With `TTFB_TEXT` set, the time is to the first byte of the answer's
//! text instead (the first chat completion chunk with non-empty
//! `content`): what a user waits for before the answer starts to appear
//! (`benches/first_text.sh`).
//!
//! `cargo bench --bench stream_ttfb -- URL BODY_FILE RATE SECONDS`

use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::MissedTickBehavior;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The start of a chunk's non-empty text, as both the mock and fairgate
/// write it.
const TEXT: &[u8] = b"\"content\":\"";

/// Sends one request and reads its body to the end; the time to its first
/// body byte, or to the first byte of its text when `text`.
async fn first_byte(
    client: HttpClient,
    url: hyper::Uri,
    body: Bytes,
    text: bool,
) -> anyhow::Result<Duration> {
    let request = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))?;
    let started = Instant::now();
    let response = client.request(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "status {}",
        response.status()
    );
    let mut body = response.into_body();
    let mut first = None;
    let mut seen = Vec::new();
    while let Some(frame) = body.frame().await {
        let Some(data) = frame?.data_ref().cloned() else {
            continue;
        };
        if first.is_some() || data.is_empty() {
            continue;
        }
        if !text {
            first = Some(started.elapsed());
            continue;
        }
        seen.extend_from_slice(&data);
        let has_text = seen
            .windows(TEXT.len() + 1)
            .any(|w| w.starts_with(TEXT) && w[TEXT.len()] != b'"');
        if has_text {
            first = Some(started.elapsed());
        }
    }
    first.context("an empty body")
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let [url, body_file, rate, seconds] = args.as_slice() else {
        anyhow::bail!("usage: stream_ttfb URL BODY_FILE RATE SECONDS");
    };
    let url: hyper::Uri = url.parse()?;
    let body = Bytes::from(std::fs::read(body_file)?);
    let text = std::env::var_os("TTFB_TEXT").is_some();
    let rate: f64 = rate.parse()?;
    let seconds: f64 = seconds.parse()?;
    anyhow::ensure!(
        rate > 0.0 && seconds > 0.0,
        "RATE and SECONDS must be positive"
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
        let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
        let mut requests = Vec::new();
        for _ in 0..(rate * seconds).round() as usize {
            ticks.tick().await;
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            requests.push(tokio::spawn(first_byte(client, url, body, text)));
        }
        let mut times = Vec::with_capacity(requests.len());
        let mut failures = 0;
        for request in requests {
            match request.await {
                Ok(Ok(time)) => times.push(time),
                _ => failures += 1,
            }
        }
        times.sort();
        let quantile = |q: f64| {
            times
                .get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)))
                .map_or(f64::NAN, |t| t.as_secs_f64() * 1000.0)
        };
        println!(
            "{:.3} {:.3} {} {failures}",
            quantile(0.5),
            quantile(0.99),
            times.len()
        );
        Ok(())
    })
}
