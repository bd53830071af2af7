//! A KFD `properties` file: `name value` lines, each value parsed as a whole
//! number when asked, with errors that name the file and the key.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use super::super::BackendError;
use super::sysfs_files::{describe_io, failed, read_text};

pub(super) struct Props {
    path: PathBuf,
    values: HashMap<String, String>,
}

impl Props {
    /// `Ok(None)` when the file is gone (the node vanished while we looked).
    pub(super) fn load(path: PathBuf) -> Result<Option<Self>, BackendError> {
        let text = match read_text(&path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(failed(describe_io(&path, &error))),
        };
        let values = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split_whitespace();
                let key = parts.next()?;
                let value = parts.next().unwrap_or("");
                Some((key.to_string(), value.to_string()))
            })
            .collect();
        Ok(Some(Self { path, values }))
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn get(&self, key: &str) -> Result<Option<u64>, BackendError> {
        match self.values.get(key) {
            None => Ok(None),
            Some(value) => value.parse().map(Some).map_err(|_| {
                failed(format!(
                    "{}: `{key}` is {value:?}, not a whole number",
                    self.path.display()
                ))
            }),
        }
    }

    pub(super) fn require(&self, key: &str) -> Result<u64, BackendError> {
        self.get(key)?.ok_or_else(|| {
            let why = if self.values.is_empty() {
                " (the file is empty)"
            } else {
                ""
            };
            failed(format!("{}: no `{key}` line{why}", self.path.display()))
        })
    }
}
