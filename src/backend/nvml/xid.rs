//! NVIDIA's Xid error codes: which ones mean the GPU is at fault, the words
//! for the well-known ones, so a health reason says what happened, and how
//! many each GPU reported.

use std::collections::HashMap;

/// Xid codes NVIDIA's Kubernetes device plugin does not treat as device
/// faults: they are caused by the application (a bad kernel, a page fault, a
/// watchdog on a hung context), not by the GPU.
const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Well-known Xid codes (NVIDIA's Xid catalogue), for readable reasons.
const XID_MEANINGS: &[(u64, &str)] = &[
    (13, "graphics engine exception"),
    (31, "GPU memory page fault"),
    (43, "GPU stopped processing"),
    (45, "preemptive cleanup, due to previous errors"),
    (48, "double-bit ECC error"),
    (61, "internal micro-controller breakpoint/warning"),
    (62, "internal micro-controller halt"),
    (63, "ECC page retirement or row remapping recording event"),
    (64, "ECC page retirement or row remapping recording failure"),
    (68, "video processor exception"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (109, "context switch timeout"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
];

/// Whether an Xid marks the device unhealthy (everything but [`APPLICATION_XIDS`]).
pub(super) fn xid_is_critical(code: u64) -> bool {
    !APPLICATION_XIDS.contains(&code)
}

/// `Xid 79: GPU has fallen off the bus`, or `Xid N` for codes not in the table.
pub(super) fn xid_reason(code: u64) -> String {
    match XID_MEANINGS.iter().find(|(c, _)| *c == code) {
        Some((_, meaning)) => format!("Xid {code}: {meaning}"),
        None => format!("Xid {code}"),
    }
}

/// How many Xid errors a GPU reported, and the code of the last one that
/// came with a code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct XidCount {
    pub(super) total: u64,
    pub(super) last: Option<u64>,
}

/// Xid errors counted per GPU since the backend registered it for Xid
/// events. Only those GPUs have a count: on one whose events are not watched
/// a zero would claim it had no errors when nobody was listening.
#[derive(Debug, Default)]
pub(super) struct XidCounts {
    counts: HashMap<String, XidCount>,
}

impl XidCounts {
    /// Counts for `ids`, all at zero.
    pub(super) fn watching(ids: impl IntoIterator<Item = String>) -> Self {
        Self {
            counts: ids
                .into_iter()
                .map(|id| (id, XidCount::default()))
                .collect(),
        }
    }

    /// One Xid on `id`, with its code when NVML gave one. A GPU not watched
    /// is left uncounted rather than given a count that starts mid-way.
    pub(super) fn record(&mut self, id: &str, code: Option<u64>) {
        if let Some(count) = self.counts.get_mut(id) {
            count.total = count.total.saturating_add(1);
            if code.is_some() {
                count.last = code;
            }
        }
    }

    /// The count of a watched GPU; `None` for any other.
    pub(super) fn of(&self, id: &str) -> Option<XidCount> {
        self.counts.get(id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xids() {
        assert_eq!(xid_reason(79), "Xid 79: GPU has fallen off the bus");
        assert_eq!(xid_reason(4242), "Xid 4242");
        for code in APPLICATION_XIDS {
            assert!(!xid_is_critical(code));
        }
        assert!(xid_is_critical(79) && xid_is_critical(48));
    }

    #[test]
    fn every_xid_of_a_watched_gpu_counts_and_others_have_no_count() {
        let mut counts = XidCounts::watching(["GPU-a".to_string(), "GPU-b".to_string()]);
        assert_eq!(counts.of("GPU-a"), Some(XidCount::default()));
        counts.record("GPU-a", Some(79));
        // Application Xids count too: the counter is of errors, not of faults.
        counts.record("GPU-a", Some(13));
        counts.record("GPU-a", None);
        counts.record("GPU-c", Some(48));
        assert_eq!(
            counts.of("GPU-a"),
            Some(XidCount {
                total: 3,
                last: Some(13)
            }),
            "a code-less Xid counts but keeps the last code"
        );
        assert_eq!(counts.of("GPU-b"), Some(XidCount::default()));
        assert_eq!(counts.of("GPU-c"), None, "not watched: no count at all");
        assert_eq!(XidCounts::default().of("GPU-a"), None);
    }

    #[test]
    fn a_count_saturates_instead_of_wrapping() {
        let mut counts = XidCounts::watching(["GPU-a".to_string()]);
        if let Some(count) = counts.counts.get_mut("GPU-a") {
            count.total = u64::MAX;
        }
        counts.record("GPU-a", Some(79));
        assert_eq!(counts.of("GPU-a").map(|c| c.total), Some(u64::MAX));
    }
}
