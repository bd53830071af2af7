//! The version of the loaded NVIDIA kernel driver, from
//! `<procfs>/driver/nvidia/version`, whose first line reads like
//! `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build …`.
//! The user-space libraries a container needs carry the same version in their
//! file names (`libcuda.so.580.95.05`), and only those match the kernel.

use std::path::Path;

/// The driver's version (`580.95.05`), or why it is not known.
pub(crate) fn driver_version(procfs_root: &Path) -> Result<String, String> {
    let path = procfs_root.join("driver/nvidia/version");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read the driver version from {}: {e}",
            path.display()
        )
    })?;
    text.lines()
        .find(|line| line.starts_with("NVRM version:"))
        .and_then(|line| line.split_whitespace().find(|word| is_version(word)))
        .map(str::to_string)
        .ok_or_else(|| format!("{} names no driver version", path.display()))
}

/// Digits in two or more dot-separated parts: a version, and safe to put in
/// a file name (no `/`, no `..`).
fn is_version(word: &str) -> bool {
    let mut parts = word.split('.');
    let all_digits = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    parts.next().is_some_and(all_digits) && {
        let rest: Vec<&str> = parts.collect();
        !rest.is_empty() && rest.into_iter().all(all_digits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn procfs_with(version_file: &str) -> tempfile::TempDir {
        let proc = tempfile::tempdir().unwrap();
        let dir = proc.path().join("driver/nvidia");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("version"), version_file).unwrap();
        proc
    }

    #[test]
    fn the_version_is_read_from_open_and_proprietary_modules() {
        for (file, version) in [
            (
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:00:00 UTC 2025\nGCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n",
                "580.95.05",
            ),
            (
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n",
                "535.104.05",
            ),
            (
                "NVRM version: NVIDIA UNIX aarch64 Kernel Module  580.65  Sun Jul 27 2025\n",
                "580.65",
            ),
        ] {
            let proc = procfs_with(file);
            assert_eq!(driver_version(proc.path()).as_deref(), Ok(version));
        }
    }

    #[test]
    fn no_version_says_why() {
        let missing = tempfile::tempdir().unwrap();
        let error = driver_version(missing.path()).unwrap_err();
        assert!(
            error.contains("cannot read the driver version from") && error.contains("version"),
            "{error}"
        );
        let garbled =
            procfs_with("NVRM version: NVIDIA UNIX Kernel Module ../../etc 1. .2 x86_64\n");
        let error = driver_version(garbled.path()).unwrap_err();
        assert!(error.ends_with("names no driver version"), "{error}");
    }
}
