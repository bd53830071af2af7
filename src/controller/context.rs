//! What every stage of a reconcile is handed: the controller's context (its
//! client, settings and caches, and what it remembers between reconciles),
//! the instance's identity, and the error a reconcile ends with.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};

use super::apply::ApplyError;
use super::dra::DraCaches;
use super::event_log::EventLog;
use super::hashes::placement_hash;
use super::held::Claims;
use super::measure::Measures;
use super::metrics::Metrics;
use super::moves::book::MoveBook;
use super::node_cache::CachedNode;
use super::node_gate::NodeGate;
use super::settings::Settings;
use super::written::WrittenStatuses;
use tessera_core::api::ModelInstance;
use tessera_core::placement::Unsatisfiable;

/// The caches the controller reads; the writes go through `client`.
pub struct Caches {
    pub nodes: Store<CachedNode>,
    pub pods: Store<Pod>,
    pub services: Store<Service>,
    pub instances: Store<ModelInstance>,
    /// `Some` when the controller allocates DRA claims.
    pub dra: Option<DraCaches>,
}

pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub caches: Caches,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Last unsatisfiable attempt by instance UID and replica.
    pub(crate) unsatisfiable: Mutex<HashMap<(String, u32), (u64, Unsatisfiable)>>,
    /// Consecutive failures by instance UID, for the backoff.
    pub(crate) failures: Mutex<HashMap<String, u32>>,
    /// The plan each instance was last given here. Held for the whole plan
    /// stage, so that reconciles of different instances (which run at the
    /// same time) plan one after the other, each seeing the devices the
    /// others just took although the cache shows their status a moment later.
    pub(crate) claims: tokio::sync::Mutex<Claims>,
    pub(crate) node_gate: NodeGate,
    /// The last events about each instance, for the cluster map.
    pub(crate) event_log: EventLog,
    /// Moves handed on and not yet recorded, and those backing off.
    pub(crate) moves: MoveBook,
    /// Statuses written here that the cache may not show yet.
    pub(crate) written: WrittenStatuses,
    /// What each replica's runtime was last measured serving.
    pub(crate) measures: Arc<Measures>,
}

impl Context {
    pub fn new(
        client: Client,
        settings: Settings,
        caches: Caches,
        recorder: Recorder,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            client,
            settings,
            caches,
            recorder,
            metrics,
            unsatisfiable: Mutex::default(),
            failures: Mutex::default(),
            claims: tokio::sync::Mutex::default(),
            node_gate: NodeGate::default(),
            event_log: EventLog::default(),
            moves: MoveBook::default(),
            written: WrittenStatuses::default(),
            measures: Arc::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("the ModelInstance has no {0}")]
    Incomplete(&'static str),
    #[error("planning failed: {0}")]
    Planning(String),
}

impl Error {
    /// The `reason` label of the failure metric: the API's reason where there is one.
    pub fn reason(&self) -> String {
        match self {
            Error::Apply(e) => match &e.source {
                kube::Error::Api(s) if !s.reason.is_empty() => s.reason.clone(),
                kube::Error::Api(s) => format!("HTTP{}", s.code),
                _ => "Transport".to_string(),
            },
            Error::Incomplete(_) => "IncompleteObject".to_string(),
            Error::Planning(_) => "PlanningFailed".to_string(),
        }
    }
}

/// The instance's identity, which every write needs, and the hash of the spec
/// parts its plan depends on.
pub(crate) struct Instance {
    pub(crate) uid: String,
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) placement_hash: String,
}

impl Instance {
    pub(crate) fn of(mi: &ModelInstance) -> Result<Self, Error> {
        Ok(Self {
            uid: mi.uid().ok_or(Error::Incomplete("metadata.uid"))?,
            namespace: mi
                .namespace()
                .ok_or(Error::Incomplete("metadata.namespace"))?,
            name: mi.name_any(),
            placement_hash: placement_hash(&mi.spec),
        })
    }
}
