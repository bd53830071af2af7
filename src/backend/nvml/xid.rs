//! NVIDIA's Xid error codes: which ones mean the GPU is at fault, and the
//! words for the well-known ones, so a health reason says what happened.

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
}
