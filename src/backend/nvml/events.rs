//! NVML events: Xid errors and double-bit ECC errors, registered once per
//! GPU and drained on every telemetry read and health check, the faults they
//! leave and the Xids they count.
//!
//! With `mig_raw`, this is the backend's unsafe code. `nvml-wrapper`'s
//! `EventSet<'nvml>` borrows the `Nvml` it came from, and the backend must own
//! both. The set's raw handle is therefore kept apart from its wrapper ([`DetachedEventSet`])
//! and wrapped again, without ever being dropped, for each use; it is freed
//! once, in `Drop`, before `Nvml` shuts down.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::time::Instant;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};

use super::NvmlBackend;
use super::xid::{XidCounts, xid_is_critical, xid_reason};

/// Events drained per call at most, so a storm cannot stall a poll.
const MAX_EVENTS_PER_DRAIN: usize = 1024;

/// An NVML event set's raw handle, apart from the `EventSet<'nvml>` wrapper that
/// would borrow the backend's own `Nvml`. Created from a live set that was then
/// forgotten; freed only by `NvmlBackend::drop`.
pub(super) struct DetachedEventSet(*mut c_void);

// SAFETY: `nvml-wrapper` makes `EventSet` `Send`; the handle is only used
// through `&mut NvmlBackend` or `&NvmlBackend` inside one call, never shared.
unsafe impl Send for DetachedEventSet {}

/// A fault an event reported, and when it was last seen.
#[derive(Clone, Debug)]
pub(super) struct EventFault {
    pub(super) reason: String,
    pub(super) seen: Instant,
}

/// One event, copied out of NVML's event data.
struct ObservedEvent {
    handle: usize,
    uuid: Option<String>,
    types: EventTypes,
    xid: Option<XidError>,
}

/// A GPU to register for events: index, id and the events it supports.
type Candidate = (u32, String, EventTypes);
/// A set with its devices (handle address → id).
type RegisteredSet<'n> = (EventSet<'n>, HashMap<usize, String>);
/// The candidate that failed (`None`: creating the set failed) and why.
type RegistrationFailure = (Option<usize>, NvmlError);

impl NvmlBackend {
    /// Ids of the devices that receive events; the others are only polled.
    pub fn event_registered_devices(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.event_devices.values().cloned().collect();
        ids.sort();
        ids
    }

    /// Registers every GPU that supports them for critical Xid and double-bit
    /// ECC events. A GPU that cannot be registered is only polled.
    pub(super) fn register_events(&mut self) {
        let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        let count = match self.nvml.device_count() {
            Ok(count) => count,
            Err(error) => {
                tracing::warn!(%error, "cannot count GPUs to register NVML events; health is polled only");
                return;
            }
        };
        let mut candidates = Vec::new();
        for index in 0..count {
            let Ok(device) = self.nvml.device_by_index(index) else {
                continue;
            };
            let mask = match device.supported_event_types() {
                Ok(supported) => supported & wanted,
                Err(error) => {
                    tracing::info!(index, %error, "GPU does not support NVML events; its health is polled only");
                    continue;
                }
            };
            if mask.is_empty() {
                tracing::info!(
                    index,
                    "GPU supports neither Xid nor ECC events; its health is polled only"
                );
                continue;
            }
            if let Ok(id) = device.uuid() {
                candidates.push((index, id, mask));
            }
        }
        // A failed registration frees the whole set (nvml-wrapper), so start
        // over without the device that failed.
        while !candidates.is_empty() {
            match build_event_set(&self.nvml, &candidates) {
                Ok((set, devices)) => {
                    // SAFETY: only used as an identity and to rebuild a wrapper
                    // that is never dropped; the set is forgotten right after.
                    let raw = unsafe { set.handle() };
                    std::mem::forget(set);
                    self.events = Some(DetachedEventSet(raw.cast::<c_void>()));
                    self.event_devices = devices;
                    self.xids = XidCounts::watching(
                        candidates
                            .into_iter()
                            .filter(|(_, _, mask)| mask.contains(EventTypes::CRITICAL_XID_ERROR))
                            .map(|(_, id, _)| id),
                    );
                    return;
                }
                Err((None, error)) => {
                    tracing::warn!(%error, "cannot create an NVML event set; health is polled only");
                    return;
                }
                Err((Some(failed), error)) => {
                    let (index, _, _) = candidates.remove(failed);
                    tracing::info!(index, %error, "cannot register GPU for NVML events; its health is polled only");
                }
            }
        }
    }

    fn with_event_set<R>(&self, use_set: impl FnOnce(&EventSet<'_>) -> R) -> Option<R> {
        let detached = self.events.as_ref()?;
        // SAFETY: the handle is a live set created by `self.nvml` (see
        // `DetachedEventSet`); `ManuallyDrop` keeps this temporary wrapper from
        // freeing it.
        let set = ManuallyDrop::new(unsafe { EventSet::new(detached.0.cast(), &self.nvml) });
        Some(use_set(&set))
    }

    /// Takes every pending event (zero timeout) and records faults.
    pub(super) fn drain_events(&mut self) {
        let observed = self
            .with_event_set(|set| {
                let mut observed = Vec::new();
                for _ in 0..MAX_EVENTS_PER_DRAIN {
                    match set.wait(0) {
                        Ok(data) => {
                            // SAFETY: the handle is compared as an address only.
                            let handle = unsafe { data.device.handle() }.addr();
                            observed.push(ObservedEvent {
                                handle,
                                uuid: data.device.uuid().ok(),
                                types: data.event_type,
                                xid: data.event_data,
                            });
                        }
                        Err(NvmlError::Timeout) => break,
                        Err(error) => {
                            tracing::debug!(%error, "NVML event wait failed; polling covers lost GPUs");
                            break;
                        }
                    }
                }
                observed
            })
            .unwrap_or_default();
        let now = Instant::now();
        for event in observed {
            let ids: Vec<String> = match self
                .event_devices
                .get(&event.handle)
                .cloned()
                .or_else(|| event.uuid.clone())
            {
                Some(id) => vec![id],
                // An event NVML cannot attribute concerns every GPU.
                None => self.event_devices.values().cloned().collect(),
            };
            if let Some(code) = xid_of(&event) {
                for id in &ids {
                    self.xids.record(id, code);
                }
            }
            let Some(reason) = event_reason(&event) else {
                tracing::debug!(xid = ?event.xid, "application-level Xid ignored");
                continue;
            };
            for id in ids {
                tracing::warn!(device = %id, %reason, "GPU fault reported by NVML");
                self.faults.insert(
                    id,
                    EventFault {
                        reason: reason.clone(),
                        seen: now,
                    },
                );
            }
        }
    }
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        if let Some(detached) = self.events.take() {
            // SAFETY: the live set created by `self.nvml`; this is the only
            // place it is freed, and `nvml` is still initialised.
            let set = unsafe { EventSet::new(detached.0.cast(), &self.nvml) };
            if let Err(error) = set.release_events() {
                tracing::debug!(%error, "freeing the NVML event set failed");
            }
        }
    }
}

/// An event set with every candidate registered, or the failing candidate
/// (`None`: the set could not be created) and the error.
fn build_event_set<'n>(
    nvml: &'n Nvml,
    candidates: &[Candidate],
) -> Result<RegisteredSet<'n>, RegistrationFailure> {
    let mut set = nvml.create_event_set().map_err(|error| (None, error))?;
    let mut devices = HashMap::new();
    for (position, (index, id, mask)) in candidates.iter().enumerate() {
        let device = nvml
            .device_by_index(*index)
            .map_err(|error| (Some(position), error))?;
        // SAFETY: compared as an address only.
        let handle = unsafe { device.handle() }.addr();
        set = device
            .register_events(*mask, set)
            .map_err(|failure| (Some(position), failure.error))?;
        devices.insert(handle, id.clone());
    }
    Ok((set, devices))
}

/// `Some` for an Xid event, with its code when NVML gave one.
fn xid_of(event: &ObservedEvent) -> Option<Option<u64>> {
    if !event.types.contains(EventTypes::CRITICAL_XID_ERROR) {
        return None;
    }
    Some(match event.xid {
        Some(XidError::Value(code)) => Some(code),
        Some(XidError::Unknown) | None => None,
    })
}

/// Why an event makes its GPU unhealthy; `None` for application-level Xids.
fn event_reason(event: &ObservedEvent) -> Option<String> {
    if event.types.contains(EventTypes::CRITICAL_XID_ERROR) {
        return match &event.xid {
            Some(XidError::Value(code)) if !xid_is_critical(*code) => None,
            Some(XidError::Value(code)) => Some(xid_reason(*code)),
            Some(XidError::Unknown) | None => Some("Xid (code unknown)".to_string()),
        };
    }
    if event.types.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        return Some("double-bit (uncorrectable) ECC error".to_string());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(types: EventTypes, xid: Option<XidError>) -> ObservedEvent {
        ObservedEvent {
            handle: 1,
            uuid: None,
            types,
            xid,
        }
    }

    #[test]
    fn every_xid_event_is_counted_and_only_critical_ones_are_faults() {
        let xid = |code| event(EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(code)));
        assert_eq!(xid_of(&xid(79)), Some(Some(79)));
        assert_eq!(
            event_reason(&xid(79)).as_deref(),
            Some("Xid 79: GPU has fallen off the bus")
        );
        assert_eq!(
            xid_of(&xid(13)),
            Some(Some(13)),
            "an application Xid counts"
        );
        assert_eq!(event_reason(&xid(13)), None, "but is no fault");

        let unknown = event(EventTypes::CRITICAL_XID_ERROR, Some(XidError::Unknown));
        assert_eq!(xid_of(&unknown), Some(None));
        assert_eq!(
            event_reason(&unknown).as_deref(),
            Some("Xid (code unknown)")
        );

        let ecc = event(EventTypes::DOUBLE_BIT_ECC_ERROR, None);
        assert_eq!(xid_of(&ecc), None, "an ECC event is no Xid");
        assert!(event_reason(&ecc).is_some_and(|r| r.contains("double-bit")));
    }
}
