//! The Events a reconcile records about an instance: what was planned or
//! moved and why, what is wrong with it, what was put back. Stages collect
//! [`EventNote`]s; the reconcile publishes them once the status is written.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};

use tessera_core::api::{ModelInstance, PlannedShard};
use tessera_core::placement::Unsatisfiable;

/// Something worth an Event.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct EventNote {
    pub(crate) warning: bool,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// The solver's reason and what excluded the rest, short enough for a condition.
pub(crate) fn unsatisfiable_text(unsatisfiable: &Unsatisfiable) -> String {
    let mut text = unsatisfiable.reason.clone();
    for detail in &unsatisfiable.details {
        if text.len() + detail.len() > 900 {
            text.push_str("; …");
            break;
        }
        text.push_str("; ");
        text.push_str(detail);
    }
    text
}

fn show(shard: &PlannedShard) -> String {
    format!("node {} [{}]", shard.node, shard.devices.join(","))
}

/// Events for a new plan: the whole plan, or each move.
pub(crate) fn plan_notes(
    old: &[PlannedShard],
    new: &[PlannedShard],
    moved: &[u32],
    reasons: &[String],
    whole: bool,
) -> Vec<EventNote> {
    if whole {
        let shards: Vec<String> = new
            .iter()
            .map(|shard| {
                format!(
                    "shard {} layers {} on {}",
                    shard.shard,
                    shard.layers(),
                    show(shard)
                )
            })
            .collect();
        let (reason, why) = if old.is_empty() {
            ("Planned", String::new())
        } else {
            ("Replanned", format!(" because {}", reasons.join("; ")))
        };
        return vec![EventNote {
            warning: false,
            reason,
            message: format!("planned {} shards{why}: {}", new.len(), shards.join("; ")),
        }];
    }
    moved
        .iter()
        .filter_map(|&i| {
            let from = old.iter().find(|s| s.shard == i)?;
            let to = new.iter().find(|s| s.shard == i)?;
            let why = reasons
                .iter()
                .find(|r| r.starts_with(&format!("shard {i}:")))
                .map(|r| r.split_once(": ").map_or(r.as_str(), |(_, w)| w))
                .unwrap_or("its devices were lost");
            Some(EventNote {
                warning: false,
                reason: "Replanned",
                message: format!("shard {i} moved from {} to {}: {why}", show(from), show(to)),
            })
        })
        .collect()
}

/// What the events are about: the instance at the version the reconcile
/// read, as client-go refers to objects. The recorder folds events with the
/// same reason about the same reference into one series that keeps the first
/// note; without the version a second move of a shard (or the binding of its
/// new pod) would only count up the first event and its message be lost.
fn regarding(mi: &ModelInstance) -> ObjectReference {
    let mut reference = mi.object_ref(&());
    reference.resource_version = mi.resource_version();
    reference
}

pub(crate) async fn publish(recorder: &Recorder, mi: &ModelInstance, notes: &[EventNote]) {
    let reference = regarding(mi);
    for note in notes {
        let event = Event {
            type_: if note.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: note.reason.to_string(),
            note: Some(note.message.chars().take(1000).collect()),
            action: note.reason.to_string(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &reference).await {
            tracing::warn!(instance = %mi.name_any(), error = %e, reason = note.reason, "cannot record event");
        }
        tracing::info!(instance = %mi.name_any(), reason = note.reason, "{}", note.message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::{SMALL, instance};

    #[test]
    fn events_refer_to_the_version_they_are_about() {
        let mut mi = instance("llama", SMALL);
        mi.metadata.resource_version = Some("41".into());
        let before = regarding(&mi);
        mi.metadata.resource_version = Some("42".into());
        let after = regarding(&mi);
        assert_eq!(before.resource_version.as_deref(), Some("41"));
        assert_eq!(before.uid.as_deref(), Some("uid-llama"));
        assert_eq!(before.name, after.name);
        // Different references: the recorder starts a new event, not a series.
        assert_ne!(before, after);
    }

    #[test]
    fn a_planned_event_reads_layers_inclusive() {
        let shard = PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: "a".into(),
            devices: vec!["g0".into()],
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 20.0,
            share: None,
        };
        let notes = plan_notes(&[], &[shard], &[], &[], true);
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0]
                .message
                .contains("shard 0 layers 0-31 on node a [g0]"),
            "{}",
            notes[0].message
        );
    }
}
