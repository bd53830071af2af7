//! What the model predicts for each published figure, under given constants.

use tessera_core::serving::{Constants, Replica, ServingPoint};

use super::fixture::{Figure, Fixture, Load, serving_input};

/// The largest relative error a figure may have to count as met.
pub(crate) const TOLERANCE: f64 = 0.25;

/// What a prediction is compared on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Throughput,
    Tpot,
    /// Shown, not held to the tolerance: a first token's time depends on
    /// the queue, which the published rows do not describe.
    Ttft,
}

impl Kind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Throughput => "tokens/s",
            Kind::Tpot => "TPOT ms",
            Kind::Ttft => "TTFT ms",
        }
    }
}

/// One compared figure.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) id: String,
    pub(crate) source: String,
    pub(crate) kind: Kind,
    pub(crate) concurrency: u32,
    pub(crate) published: f64,
    /// `None`: the replica cannot keep up with the published rate.
    pub(crate) predicted: Option<f64>,
}

impl Row {
    /// Relative error; a saturated replica counts as infinitely wrong.
    pub(crate) fn error(&self) -> f64 {
        match self.predicted {
            Some(predicted) => predicted / self.published - 1.0,
            None => f64::INFINITY,
        }
    }

    pub(crate) fn met(&self) -> bool {
        self.error().abs() <= TOLERANCE
    }

    /// Held to the tolerance (throughput and time per token).
    pub(crate) fn judged(&self) -> bool {
        self.kind != Kind::Ttft
    }
}

/// The concurrency Little's law gives at `rate` requests/s: each request
/// stays its time to first token and its output tokens' steps. `None` when
/// the replica cannot keep up (the load would exceed its largest concurrency).
fn littles_law(replica: &Replica, rate: f64, output_tokens: f64) -> Option<ServingPoint> {
    let max = replica.concurrency().max;
    let mut concurrency = 1;
    for _ in 0..100 {
        let point = replica.at(concurrency);
        let seconds = (point.ttft_ms + (output_tokens - 1.0).max(0.0) * point.tpot_ms) / 1e3;
        let next = (rate * seconds).round().max(1.0);
        if next > f64::from(max) {
            return None;
        }
        let next = next as u32;
        if next == concurrency {
            return Some(point);
        }
        concurrency = next;
    }
    Some(replica.at(concurrency))
}

/// The point a figure was measured at.
fn point(replica: &Replica, figure: &Figure) -> Option<ServingPoint> {
    let max = replica.concurrency().max;
    match figure.load {
        Load::Offline => Some(replica.at(max)),
        Load::Static => {
            let batch = figure
                .concurrency
                .unwrap_or_else(|| panic!("{}: a static batch needs its size", figure.id));
            // A batch the KV cache cannot hold runs as many as it can.
            Some(replica.at(batch.min(max)))
        }
        Load::Rate => {
            let rate = figure
                .requests_per_second
                .unwrap_or_else(|| panic!("{}: a rate row needs its rate", figure.id));
            littles_law(replica, rate, figure.output_tokens)
        }
    }
}

/// Every figure's prediction under `constants`, those of `sources` only
/// (all where `None`).
pub(crate) fn compare(
    fixture: &Fixture,
    constants: &Constants,
    sources: Option<&[&str]>,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for figure in &fixture.figures {
        if sources.is_some_and(|sources| !sources.contains(&figure.source())) {
            continue;
        }
        let input = serving_input(fixture, figure);
        let replica = Replica::with_constants(&input, constants)
            .unwrap_or_else(|refusal| panic!("{}: no prediction: {refusal}", figure.id));
        let point = point(&replica, figure);
        // Under static batching nothing else is prefilled between the steps.
        let tpot = point.map(|point| match figure.load {
            Load::Static => point.decode_step_ms,
            Load::Offline | Load::Rate => point.tpot_ms,
        });
        let published = &figure.published;
        for (kind, published, predicted) in [
            (
                Kind::Throughput,
                published.output_tokens_per_second,
                point.map(|point| point.output_tokens_per_second),
            ),
            (Kind::Tpot, published.tpot_ms, tpot),
            (
                Kind::Ttft,
                published.ttft_ms,
                point.map(|point| point.ttft_ms),
            ),
        ] {
            if let Some(published) = published {
                rows.push(Row {
                    id: figure.id.clone(),
                    source: figure.source().to_string(),
                    kind,
                    concurrency: point.map_or(0, |point| point.concurrency),
                    published,
                    predicted,
                });
            }
        }
    }
    rows
}

/// Judged rows met, and judged rows.
pub(crate) fn share(rows: &[Row]) -> (usize, usize) {
    let judged: Vec<&Row> = rows.iter().filter(|row| row.judged()).collect();
    (judged.iter().filter(|row| row.met()).count(), judged.len())
}

/// The rows as the table in docs/benchmarks.md shows them.
pub(crate) fn table(rows: &[Row]) -> String {
    let mut table = String::from("figure | kind | concurrency | published | predicted | error\n");
    for row in rows {
        let predicted = row
            .predicted
            .map_or("saturated".to_string(), |value| format!("{value:.1}"));
        table += &format!(
            "{} | {} | {} | {:.1} | {} | {:+.1}%{}\n",
            row.id,
            row.kind.label(),
            row.concurrency,
            row.published,
            predicted,
            row.error() * 100.0,
            if row.judged() && !row.met() {
                " (miss)"
            } else {
                ""
            }
        );
    }
    table
}
