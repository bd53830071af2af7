//! Allocate calls answered and how long they took: recorded by the device
//! plugin, exported with the agent's other metrics (the two share the values).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Clone, Debug)]
pub struct AllocationMetrics {
    pub(crate) answered: Counter,
    pub(crate) seconds: Histogram,
}

impl Default for AllocationMetrics {
    fn default() -> Self {
        Self {
            answered: Counter::default(),
            // 50 µs to about 1.6 s: the target is well under a millisecond.
            seconds: Histogram::new(exponential_buckets(0.00005, 2.0, 16)),
        }
    }
}
