//! The files the agent (and `tessera discover`) keep their state in and
//! rewrite: the device registry, the allocation checkpoint, the DRA driver's
//! record of prepared claims. Each is written whole through a temporary file
//! and a rename, so a crash leaves the old file or the new one; one that
//! cannot be read back is moved aside to `<file>.bad` before a fresh one
//! replaces it, so its content is never lost to the next write.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` through `<path>.tmp` and a rename, creating the
/// directory if needed. With `sync`, the contents reach the disk before the
/// rename can, so a power loss leaves the old file or the new one, never a
/// torn one (the directory is not synced: losing the rename itself only
/// brings back the previous, consistent, file).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut temporary_name = path.file_name().unwrap_or_default().to_os_string();
    temporary_name.push(".tmp");
    let temporary = dir.join(temporary_name);
    {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        if sync {
            file.sync_data()?;
        }
    }
    std::fs::rename(&temporary, path)
}

/// Where [`set_aside`] keeps a file: `<path>.bad`.
fn aside_path(path: &Path) -> PathBuf {
    let mut aside = path.as_os_str().to_owned();
    aside.push(".bad");
    PathBuf::from(aside)
}

/// Moves an unreadable state file to `<path>.bad`, replacing an older one
/// there, for a person to read; the caller then starts afresh and names the
/// returned path in its warning.
fn set_aside(path: &Path) -> io::Result<PathBuf> {
    let aside = aside_path(path);
    std::fs::rename(path, &aside)?;
    Ok(aside)
}

/// `moved to <path>.bad` or why it could not be, for a warning.
pub(crate) fn set_aside_text(path: &Path) -> String {
    match set_aside(path) {
        Ok(aside) => format!("kept at {}", aside.display()),
        Err(e) => format!(
            "could not be moved to {} ({e}); it will be overwritten",
            aside_path(path).display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_set_aside_keeps_its_content_at_dot_bad() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, "not json").unwrap();
        let text = set_aside_text(&path);
        let aside = dir.path().join("state.json.bad");
        assert_eq!(text, format!("kept at {}", aside.display()));
        assert_eq!(std::fs::read_to_string(&aside).unwrap(), "not json");
        assert!(!path.exists());
        // Nothing to move: said so, nothing else happens.
        assert!(set_aside_text(&path).starts_with("could not be moved to"));
    }
}
