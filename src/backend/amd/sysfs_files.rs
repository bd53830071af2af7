//! Reading one sysfs file: a value that must be there, a sensor that may be
//! missing or unsupported, and error messages that name the file (and, for a
//! permission error, what the container lacks).

use std::io;
use std::path::Path;

use super::super::BackendError;

/// Linux errno values with which amdgpu says "this sensor is not supported here".
const EINVAL: i32 = 22;
const ENODATA: i32 = 61;
const EOPNOTSUPP: i32 = 95;

pub(super) fn failed(message: impl Into<String>) -> BackendError {
    BackendError::Failed(message.into())
}

pub(super) fn read_text(path: &Path) -> io::Result<String> {
    #[cfg(test)]
    reads::count(reads::Read::File);
    std::fs::read_to_string(path)
}

/// A read error for messages. Permission errors get advice, as they mean the
/// container is set up wrong rather than that a device is sick.
pub(super) fn describe_io(path: &Path, error: &io::Error) -> String {
    if error.kind() == io::ErrorKind::PermissionDenied {
        format!(
            "permission denied reading {}: the agent needs the host's /sys and access to \
             /dev/kfd and /dev/dri (KFD hides GPU properties from containers without the device)",
            path.display()
        )
    } else {
        format!("cannot read {}: {error}", path.display())
    }
}

pub(super) fn is_unsupported(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(EINVAL | ENODATA | EOPNOTSUPP))
        || error.kind() == io::ErrorKind::Unsupported
}

fn parse_u64(path: &Path, text: &str) -> Result<u64, BackendError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(failed(format!("{} is empty", path.display())));
    }
    trimmed.parse().map_err(|_| {
        failed(format!(
            "{}: {trimmed:?} is not a whole number",
            path.display()
        ))
    })
}

pub(super) fn parse_i64(path: &Path, text: &str) -> Result<i64, BackendError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(failed(format!("{} is empty", path.display())));
    }
    trimmed
        .parse()
        .map_err(|_| failed(format!("{}: {trimmed:?} is not a number", path.display())))
}

/// A file that must be there.
pub(super) fn read_u64(path: &Path) -> Result<u64, BackendError> {
    let text = read_text(path).map_err(|error| failed(describe_io(path, &error)))?;
    parse_u64(path, &text)
}

/// A sensor that may be missing or unsupported (`None`); present but
/// unreadable or not a number is an error.
pub(super) fn read_opt_i64(path: &Path) -> Result<Option<i64>, BackendError> {
    match read_text(path) {
        Ok(text) => parse_i64(path, &text).map(Some),
        Err(error) if error.kind() == io::ErrorKind::NotFound || is_unsupported(&error) => Ok(None),
        Err(error) => Err(failed(describe_io(path, &error))),
    }
}

/// How often the backend read sysfs, per thread: what the tests count to
/// hold a poll to one read of the machine.
#[cfg(test)]
pub(super) mod reads {
    use std::cell::Cell;

    #[derive(Clone, Copy)]
    pub(crate) enum Read {
        /// One walk of the KFD topology.
        Topology,
        /// One scan of the DRM cards.
        Cards,
        /// One file.
        File,
    }

    thread_local! {
        static COUNTS: Cell<[usize; 3]> = const { Cell::new([0; 3]) };
    }

    pub(crate) fn count(read: Read) {
        COUNTS.with(|counts| {
            let mut now = counts.get();
            now[read as usize] += 1;
            counts.set(now);
        });
    }

    /// Topology walks, card scans and files read since the last call.
    pub(crate) fn take() -> [usize; 3] {
        COUNTS.with(|counts| counts.replace([0; 3]))
    }
}
