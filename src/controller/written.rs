//! Statuses this controller wrote that its cache may not show yet. A
//! reconcile can start before the watch brings back the status the last one
//! wrote (another object's event wakes it first); planned on the older
//! status, it would forget what that write recorded (a move just started,
//! a plan just switched), give its devices back to the others and remove
//! the pods it started. The cached object is known to be older than the
//! write while it is still the very version the writing reconcile read.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use kube::ResourceExt;

use super::lock;
use tessera_core::api::{ModelInstance, ModelInstanceStatus};

/// By instance UID: the resource version the writing reconcile read, and
/// the status it wrote.
#[derive(Default)]
pub(crate) struct WrittenStatuses(Mutex<HashMap<String, (String, ModelInstanceStatus)>>);

impl WrittenStatuses {
    /// `read` (what a reconcile read) with the status last written over it,
    /// while the cache still shows the version that write was made on.
    pub(crate) fn newest<'a>(&self, read: &'a ModelInstance) -> Cow<'a, ModelInstance> {
        let (Some(uid), Some(version)) = (read.uid(), read.resource_version()) else {
            return Cow::Borrowed(read);
        };
        let mut written = lock(&self.0);
        match written.get(&uid) {
            Some((over, status)) if *over == version => Cow::Owned(ModelInstance {
                status: Some(status.clone()),
                ..read.clone()
            }),
            Some(_) => {
                // The cache has moved past the write.
                written.remove(&uid);
                Cow::Borrowed(read)
            }
            None => Cow::Borrowed(read),
        }
    }

    /// `status` was written over `read`.
    pub(crate) fn wrote(&self, read: &ModelInstance, status: ModelInstanceStatus) {
        if let (Some(uid), Some(version)) = (read.uid(), read.resource_version()) {
            lock(&self.0).insert(uid, (version, status));
        }
    }

    /// Forgets the instances that are gone.
    pub(crate) fn retain_live(&self, live: impl Fn(&str) -> bool) {
        lock(&self.0).retain(|uid, _| live(uid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn instance(version: &str, plan_len: u32) -> ModelInstance {
        ModelInstance {
            metadata: ObjectMeta {
                name: Some("a".into()),
                uid: Some("uid-a".into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            spec: serde_json::from_value(serde_json::json!({
                "model": {"name": "m", "parametersBillions": 7, "layers": 32},
            }))
            .expect("a spec"),
            status: Some(ModelInstanceStatus {
                replicas: plan_len,
                ..ModelInstanceStatus::default()
            }),
        }
    }

    #[test]
    fn a_reconcile_on_the_version_a_write_was_made_on_sees_the_write() {
        let written = WrittenStatuses::default();
        let read = instance("7", 1);
        let wrote = ModelInstanceStatus {
            replicas: 2,
            ..ModelInstanceStatus::default()
        };
        written.wrote(&read, wrote.clone());
        // The cache still shows version 7: the write is what stands.
        assert_eq!(written.newest(&read).status.as_ref(), Some(&wrote));
        // The cache moved on: it is read as it is, and the write forgotten.
        let later = instance("9", 3);
        assert_eq!(written.newest(&later).status, later.status);
        assert_eq!(written.newest(&read).status, read.status);
    }

    #[test]
    fn instances_that_are_gone_are_forgotten() {
        let written = WrittenStatuses::default();
        let read = instance("7", 1);
        written.wrote(&read, ModelInstanceStatus::default());
        written.retain_live(|uid| uid != "uid-a");
        assert_eq!(written.newest(&read).status, read.status);
    }
}
