//! The solver's deadline on the wall clock. The core reads no clock: its
//! solver is handed a [`Deadline`], and this is the one `tessera place` and
//! the controller hand it.

use std::time::{Duration, Instant};

use tessera_core::placement::Deadline;

/// Expires `timeout` after it was made.
pub struct WallDeadline(Instant);

impl WallDeadline {
    pub fn after(timeout: Duration) -> Self {
        Self(Instant::now() + timeout)
    }
}

impl Deadline for WallDeadline {
    fn expired(&self) -> bool {
        Instant::now() >= self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expires_after_its_timeout_and_not_before() {
        assert!(WallDeadline::after(Duration::ZERO).expired());
        assert!(!WallDeadline::after(Duration::from_secs(3600)).expired());
    }
}
