//! Memory figures of a process, read from `/proc/<pid>/status` (Linux).
// Only the memory benchmarks use it.
#![allow(dead_code)]

/// A `kB` field of `/proc/<pid>/status` (`pid` may be `self`), e.g.
/// `VmRSS:`; 0 when it cannot be read.
pub(crate) fn status_kib(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(field)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0)
}
