//! The moves' Prometheus metrics: moves ended by outcome, and the GPU-seconds
//! surge copies held devices beside the copies they replaced.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// How a move ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MoveOutcome {
    /// The new copy served and the old one is gone.
    Moved,
    /// The new copy was removed, the old one untouched.
    Abandoned,
}

impl MoveOutcome {
    fn label(self) -> &'static str {
        match self {
            MoveOutcome::Moved => "moved",
            MoveOutcome::Abandoned => "abandoned",
        }
    }
}

#[derive(Clone, Default)]
pub(crate) struct MoveMetrics {
    ended: Family<OutcomeLabel, Counter>,
    surge_gpu_seconds: Counter<f64, AtomicU64>,
}

impl MoveMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "moves",
            "Replica moves ended, by outcome: moved (the new copy served, the old one is gone) or abandoned (the new copy was not Ready in time)",
            metrics.ended.clone(),
        );
        registry.register(
            "move_surge_gpu_seconds",
            "GPU-seconds surge copies held devices while the copies they replace still held theirs",
            metrics.surge_gpu_seconds.clone(),
        );
        for outcome in [MoveOutcome::Moved, MoveOutcome::Abandoned] {
            // Both outcomes show from the start, at zero.
            let _ = metrics.ended.get_or_create(&OutcomeLabel {
                outcome: outcome.label(),
            });
        }
        metrics
    }

    pub(crate) fn ended(&self, outcome: MoveOutcome, surge_gpu_seconds: f64) {
        self.ended
            .get_or_create(&OutcomeLabel {
                outcome: outcome.label(),
            })
            .inc();
        self.surge_gpu_seconds.inc_by(surge_gpu_seconds.max(0.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn ended_moves_are_counted_by_outcome_with_their_gpu_seconds() {
        let mut registry = Registry::default();
        let metrics = MoveMetrics::register(&mut registry);
        metrics.ended(MoveOutcome::Moved, 120.0);
        metrics.ended(MoveOutcome::Abandoned, 30.5);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(text.contains("moves_total{outcome=\"moved\"} 1"), "{text}");
        assert!(
            text.contains("moves_total{outcome=\"abandoned\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("move_surge_gpu_seconds_total 150.5"),
            "{text}"
        );
    }
}
