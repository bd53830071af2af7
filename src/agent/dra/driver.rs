//! Preparing and unpreparing claims: the work behind kubelet's
//! `NodePrepareResources` and `NodeUnprepareResources`, whatever API version
//! it came in. A claim is read from the API server (kubelet sends only its
//! name and UID), its devices checked (`allocation`), a CDI spec written for
//! it (`cdi`) and the result recorded (`prepared`) before kubelet hears of
//! it. Both calls are idempotent, and every claim succeeds or fails alone.
//!
//! One claim at a time: the record and the CDI directory are the driver's
//! whole state, and kubelet's calls are few (one per pod start and end).

use std::collections::BTreeMap;
use std::future::Future;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::Mutex;

use super::allocation::{AllocatedDevice, DriverOnNode, allocated_devices, consumer_pod};
use super::cdi::{CdiDevice, CdiDir, device_name};
use super::prepared::{PreparedClaim, PreparedClaims, PreparedDevice};
use crate::agent::container_devices::{
    DriverFilesFrom, RuntimeOptions, TESSERA_GPU_MEMORY_FRACTION, TESSERA_GPU_MEMORY_GIB,
    container_devices,
};
use crate::agent::holders::Holder;
use crate::agent::state::{ViewRx, ViewTx};
use crate::backend::DeviceInfo;
use crate::backend::cdi_specs::ListedCdiDevices;

/// Where claims are read: the API server, or a stand-in in tests.
pub(crate) trait ClaimReader: Send + Sync + 'static {
    /// The claim, `None` when there is no such claim.
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<ResourceClaim>, String>> + Send;
}

impl ClaimReader for kube::Client {
    async fn claim(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        kube::Api::<ResourceClaim>::namespaced(self.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(|e| e.to_string())
    }
}

/// The claim kubelet names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClaimRef {
    pub(crate) namespace: String,
    pub(crate) uid: String,
    pub(crate) name: String,
}

pub(crate) struct Driver<C> {
    on: DriverOnNode,
    cdi: CdiDir,
    runtime: RuntimeOptions,
    view: ViewRx,
    /// Where the devices in use are shown to the rest of the agent (the
    /// view's `allocated`: device ID → the claim's pod UID).
    tx: Option<ViewTx>,
    claims: C,
    prepared: Mutex<PreparedClaims>,
}

impl<C: ClaimReader> Driver<C> {
    pub(crate) fn new(
        on: DriverOnNode,
        cdi: CdiDir,
        runtime: RuntimeOptions,
        view: ViewRx,
        claims: C,
        prepared: PreparedClaims,
    ) -> Self {
        Self {
            on,
            cdi,
            runtime,
            view,
            tx: None,
            claims,
            prepared: Mutex::new(prepared),
        }
    }

    /// Keeps the view's `allocated` map equal to the prepared devices, from now on.
    pub(crate) async fn keep_view(mut self, tx: ViewTx) -> Self {
        show_in_use(&tx, &*self.prepared.lock().await);
        self.tx = Some(tx);
        self
    }

    pub(crate) fn on(&self) -> &DriverOnNode {
        &self.on
    }

    pub(crate) fn view(&self) -> &ViewRx {
        &self.view
    }

    /// Prepares each claim: its devices, or why not.
    pub(crate) async fn prepare(
        &self,
        claims: &[ClaimRef],
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let mut answers = BTreeMap::new();
        for claim in claims {
            let answer = self.prepare_one(claim).await;
            match &answer {
                Ok(devices) => tracing::info!(
                    claim = %format!("{}/{}", claim.namespace, claim.name),
                    uid = %claim.uid,
                    devices = devices.len(),
                    "claim prepared"
                ),
                Err(error) => tracing::warn!(uid = %claim.uid, %error, "claim not prepared"),
            }
            answers.insert(claim.uid.clone(), answer);
        }
        answers
    }

    /// Unprepares each claim: `Ok` once its CDI spec and record are gone
    /// (also when they never existed).
    pub(crate) async fn unprepare(
        &self,
        claims: &[ClaimRef],
    ) -> BTreeMap<String, Result<(), String>> {
        let mut answers = BTreeMap::new();
        for claim in claims {
            let mut prepared = self.prepared.lock().await;
            let answer = self
                .cdi
                .remove(&claim.uid)
                .map_err(|e| format!("removing the CDI spec of claim {}: {e}", claim.uid))
                .and_then(|()| {
                    prepared
                        .remove(&claim.uid)
                        .map_err(|e| format!("recording claim {} as unprepared: {e}", claim.uid))
                });
            if let Some(tx) = &self.tx {
                show_in_use(tx, &prepared);
            }
            if answer.is_ok() {
                tracing::info!(uid = %claim.uid, "claim unprepared");
            }
            answers.insert(claim.uid.clone(), answer);
        }
        answers
    }

    /// Unprepares the recorded claims that no longer exist (or exist anew
    /// under another UID): kubelet only unprepares claims it knows, and a
    /// node whose pods went without it (a reboot that cleared kubelet's
    /// state) would otherwise keep their devices in use for ever. A claim that
    /// cannot be read now is kept. Returns how many went.
    pub(crate) async fn forget_gone_claims(&self) -> usize {
        let recorded: Vec<ClaimRef> = self
            .prepared
            .lock()
            .await
            .claims()
            .map(|(uid, claim)| ClaimRef {
                namespace: claim.namespace.clone(),
                uid: uid.to_string(),
                name: claim.name.clone(),
            })
            .collect();
        let mut gone = Vec::new();
        for claim in recorded {
            match self.claims.claim(&claim.namespace, &claim.name).await {
                Ok(None) => gone.push(claim),
                Ok(Some(object)) if object.metadata.uid.as_deref() != Some(claim.uid.as_str()) => {
                    gone.push(claim)
                }
                Ok(Some(_)) => {}
                Err(error) => {
                    tracing::debug!(uid = %claim.uid, %error, "cannot tell whether a prepared claim still exists")
                }
            }
        }
        for claim in &gone {
            tracing::info!(
                claim = %format!("{}/{}", claim.namespace, claim.name),
                uid = %claim.uid,
                "the prepared claim no longer exists; unpreparing it"
            );
        }
        let answers = self.unprepare(&gone).await;
        answers.values().filter(|answer| answer.is_ok()).count()
    }

    async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        let mut prepared = self.prepared.lock().await;
        if let Some(done) = prepared.get(&claim.uid)
            && self.cdi.exists(&claim.uid)
        {
            return Ok(done.devices.clone());
        }
        let object = self
            .claims
            .claim(&claim.namespace, &claim.name)
            .await
            .map_err(|e| format!("reading claim {}/{}: {e}", claim.namespace, claim.name))?
            .ok_or_else(|| format!("claim {}/{} does not exist", claim.namespace, claim.name))?;
        let view = self.view.borrow().clone();
        if !view.ready {
            return Err("this node's GPUs have not been read yet".to_string());
        }
        let devices = allocated_devices(&object, &claim.uid, &self.on, &view.snapshot)?;
        let (specs, answer) = self.wire(&claim.uid, &view.snapshot.backend, &devices);
        self.cdi.write(&claim.uid, &specs).map_err(|e| {
            format!(
                "writing CDI spec {}: {e}",
                self.cdi.spec_path(&claim.uid).display()
            )
        })?;
        let consumer = consumer_pod(&object);
        let record = PreparedClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            holder: Holder::from_labels(
                &claim.namespace,
                consumer.as_ref().map_or("", |(_, name)| name),
                object.metadata.labels.as_ref(),
            ),
            pod_uid: consumer.map(|(uid, _)| uid),
            devices: answer.clone(),
        };
        if let Err(e) = prepared.insert(&claim.uid, record) {
            // Not recorded: not prepared (kubelet retries).
            let _ = self.cdi.remove(&claim.uid);
            return Err(format!("recording claim {} as prepared: {e}", claim.uid));
        }
        if let Some(tx) = &self.tx {
            show_in_use(tx, &prepared);
        }
        Ok(answer)
    }

    /// One CDI device per request of the claim, holding what a container
    /// needs for that request's devices, the driver's files included;
    /// kubelet learns it through the request's first device (so a container
    /// given the whole claim does not get a request's edits twice), with the
    /// vendors' CDI names where the node defines them (or `cdi` says so).
    fn wire(
        &self,
        uid: &str,
        backend: &str,
        devices: &[AllocatedDevice<'_>],
    ) -> (Vec<CdiDevice>, Vec<PreparedDevice>) {
        let mut requests: Vec<&str> = Vec::new();
        for device in devices {
            if !requests.contains(&device.request.as_str()) {
                requests.push(&device.request);
            }
        }
        // Read once per claim: the vendors' specs may change between claims
        // (a driver upgrade), not within one.
        let listed = if self.runtime.cdi {
            ListedCdiDevices::default()
        } else {
            ListedCdiDevices::read(&self.runtime.cdi_spec_dirs)
        };
        let mut specs = Vec::new();
        let mut first_ids: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for request in requests {
            let of_request: Vec<&AllocatedDevice<'_>> =
                devices.iter().filter(|d| d.request == request).collect();
            let infos: Vec<DeviceInfo> =
                of_request.iter().map(|d| as_container_device(d)).collect();
            let mut wiring = container_devices(
                backend,
                &infos.iter().collect::<Vec<_>>(),
                &self.runtime,
                DriverFilesFrom::Answer(&listed),
            );
            memory_share_envs(&of_request, &mut wiring.envs);
            let name = device_name(uid, request);
            let mut ids = vec![self.cdi.qualified_id(&name)];
            ids.append(&mut wiring.cdi_devices);
            first_ids.insert(request, ids);
            specs.push(CdiDevice { name, wiring });
        }
        let answer = devices
            .iter()
            .map(|device| PreparedDevice {
                request_names: vec![device.request.clone()],
                pool: self.on.node_name.clone(),
                device: device.name.clone(),
                id: device.id().to_string(),
                memory_share_bytes: device.memory_share,
                share_id: device.share_id.clone(),
                cdi_ids: first_ids
                    .remove(device.request.as_str())
                    .unwrap_or_default(),
            })
            .collect();
        (specs, answer)
    }
}

/// The device a container is given: the GPU, or for a MIG partition the GPU
/// under the partition's ID (the runtime's name for it, its GPU's device
/// node and PCI address).
fn as_container_device(device: &AllocatedDevice<'_>) -> DeviceInfo {
    let mut info = device.state.info.clone();
    if let Some(partition) = device.partition {
        info.id = partition.id.clone();
        info.memory_total_bytes = partition.memory_total_bytes;
        info.compute_units = partition.multiprocessors;
        info.mig = None;
    }
    info
}

/// What a runtime on memory shares may use: the smallest share of the
/// request's devices, in GiB and as a fraction of its GPU (vLLM's
/// `--gpu-memory-utilization`). Nothing for whole devices.
fn memory_share_envs(devices: &[&AllocatedDevice<'_>], envs: &mut BTreeMap<String, String>) {
    let shares = devices.iter().filter_map(|device| {
        let bytes = device.memory_share?;
        let total = device.state.info.memory_total_bytes.max(1);
        Some((bytes, bytes as f64 / total as f64))
    });
    let Some((bytes, fraction)) = shares.min_by(|a, b| a.1.total_cmp(&b.1)) else {
        return;
    };
    envs.insert(
        TESSERA_GPU_MEMORY_GIB.to_string(),
        decimal(bytes as f64 / (1u64 << 30) as f64, 2),
    );
    envs.insert(
        TESSERA_GPU_MEMORY_FRACTION.to_string(),
        decimal(fraction, 3),
    );
}

/// `value` with at most `places` decimals, rounded down (a share is never
/// overstated), without trailing zeros.
fn decimal(value: f64, places: i32) -> String {
    let scale = 10f64.powi(places);
    let text = format!("{:.*}", places as usize, (value * scale).floor() / scale);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn show_in_use(tx: &ViewTx, prepared: &PreparedClaims) {
    let in_use = prepared.devices_in_use();
    let holdings = prepared.holdings();
    tx.send_if_modified(|view| {
        if view.allocated == in_use && view.holdings == holdings {
            return false;
        }
        view.allocated = in_use.clone();
        view.holdings = holdings.clone();
        true
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::agent::container_devices::TESSERA_VISIBLE_DEVICES;
    use crate::agent::dra::allocation::tests::{as_share, claim, on};
    use crate::agent::dra::cdi::read_env;
    use crate::agent::dra::device_names::device_names;
    use crate::agent::state::channel;
    use crate::backend::fake::FakeBackend;
    use crate::backend::{RawHealth, snapshot};

    /// Claims by name, counting reads.
    #[derive(Clone, Default)]
    pub(crate) struct Claims {
        pub(crate) by_name: BTreeMap<String, ResourceClaim>,
        pub(crate) reads: Arc<AtomicUsize>,
    }

    impl ClaimReader for Claims {
        async fn claim(
            &self,
            namespace: &str,
            name: &str,
        ) -> Result<Option<ResourceClaim>, String> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            if namespace == "unreachable" {
                return Err("connection refused".into());
            }
            Ok(self.by_name.get(&format!("{namespace}/{name}")).cloned())
        }
    }

    pub(crate) struct Setup {
        pub(crate) dir: tempfile::TempDir,
        pub(crate) tx: ViewTx,
        pub(crate) rx: ViewRx,
        pub(crate) names: Vec<String>,
        pub(crate) ids: Vec<String>,
    }

    pub(crate) fn setup(spec: &str) -> Setup {
        setup_with(snapshot(&mut FakeBackend::new(spec).unwrap()).unwrap())
    }

    /// [`setup`] for a snapshot of any backend.
    pub(crate) fn setup_with(snap: crate::backend::Snapshot) -> Setup {
        let (tx, rx) = channel(&snap.backend);
        let ids: Vec<String> = snap.devices.iter().map(|d| d.info.id.clone()).collect();
        let names = device_names(ids.iter().map(String::as_str));
        let names = ids.iter().map(|id| names[id].clone()).collect();
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
        });
        Setup {
            dir: tempfile::tempdir().unwrap(),
            tx,
            rx,
            names,
            ids,
        }
    }

    impl Setup {
        pub(crate) fn cdi(&self) -> CdiDir {
            CdiDir {
                dir: self.dir.path().join("cdi"),
                driver: "gpu.tessera.dev".into(),
            }
        }

        pub(crate) fn record(&self) -> PreparedClaims {
            PreparedClaims::open(self.dir.path().join("plugin/prepared.json"))
        }

        pub(crate) fn driver(&self, claims: Claims) -> Driver<Claims> {
            Driver::new(
                on(),
                self.cdi(),
                // The node's CDI specs are the test's, not this machine's.
                RuntimeOptions {
                    cdi_spec_dirs: vec![self.cdi().dir],
                    ..RuntimeOptions::default()
                },
                self.rx.clone(),
                claims,
                self.record(),
            )
        }
    }

    pub(crate) fn one_claim(uid: &str, results: &[(&str, &str, &str)]) -> Claims {
        Claims {
            by_name: BTreeMap::from([("ns/c".to_string(), claim(uid, results))]),
            ..Claims::default()
        }
    }

    pub(crate) fn reference(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            uid: uid.into(),
            name: "c".into(),
        }
    }

    #[tokio::test]
    async fn a_prepared_claim_gets_a_cdi_spec_with_its_devices_and_a_record() {
        let s = setup("4xH100-80GiB");
        let d = "gpu.tessera.dev";
        let claims = one_claim(
            "u1",
            &[(d, "node-1", &s.names[3]), (d, "node-1", &s.names[1])],
        );
        let driver = s.driver(claims.clone()).keep_view(s.tx.clone()).await;
        let answer = driver.prepare(&[reference("u1")]).await;
        let devices = answer["u1"].as_ref().unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].device, s.names[3]);
        assert_eq!(devices[0].pool, "node-1");
        assert_eq!(devices[0].request_names, ["gpus"]);
        assert_eq!(devices[0].cdi_ids, ["gpu.tessera.dev/claim=u1-gpus"]);
        assert!(devices[1].cdi_ids.is_empty());

        let env = read_env(&s.cdi().spec_path("u1"));
        assert_eq!(
            env["u1-gpus"][TESSERA_VISIBLE_DEVICES],
            format!("{},{}", s.ids[3], s.ids[1])
        );
        // Shown as the device plugin shows them: by the pod the claim is for.
        let in_use = s.rx.borrow().allocated.clone();
        assert_eq!(
            in_use,
            BTreeMap::from([
                (s.ids[3].clone(), "pod-u1".into()),
                (s.ids[1].clone(), "pod-u1".into())
            ])
        );

        // Idempotent, and answered from the record without reading again.
        let again = driver.prepare(&[reference("u1")]).await;
        assert_eq!(again["u1"].as_ref().unwrap(), devices);
        assert_eq!(claims.reads.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_partition_is_given_by_its_own_id_and_a_memory_share_with_its_size() {
        let s = setup("2xH100-80GiB");
        let partition_id = format!("MIG-{}-0-3g.40gb", s.ids[0]);
        s.tx.send_modify(|view| {
            view.snapshot.devices[0].info.mig = Some(tessera_core::api::MigState {
                partitions: vec![tessera_core::api::GpuPartition {
                    id: partition_id.clone(),
                    profile: "3g.40gb".into(),
                    memory_total_bytes: 40 << 30,
                    multiprocessors: 60,
                    placement_start: 0,
                    placement_size: 4,
                }],
                ..crate::backend::test_mig(true, None)
            });
        });
        let names = crate::agent::dra::device_names::pool_device_names(&s.rx.borrow().snapshot);
        let d = "gpu.tessera.dev";
        let mut claims = one_claim("part", &[(d, "node-1", &names[&partition_id])]);
        let mut shared = as_share(claim("share", &[(d, "node-1", &s.names[1])]), "25Gi");
        shared.metadata.labels = Some(BTreeMap::from([
            (tessera_core::api::INSTANCE_LABEL.into(), "llama".into()),
            (tessera_core::api::SHARD_ANNOTATION.into(), "0".into()),
            (tessera_core::api::REPLICA_LABEL.into(), "2".into()),
        ]));
        claims.by_name.insert("ns/share".into(), shared);
        let driver = s.driver(claims).keep_view(s.tx.clone()).await;
        let mut share_ref = reference("share");
        share_ref.name = "share".into();
        let answer = driver.prepare(&[reference("part"), share_ref]).await;
        assert_eq!(answer["part"].as_ref().unwrap()[0].id, partition_id);
        assert_eq!(answer["part"].as_ref().unwrap()[0].share_id, None);
        let share = &answer["share"].as_ref().unwrap()[0];
        assert_eq!(share.memory_share_bytes, Some(25 << 30));
        // kubelet is told the share's ID, so its PodResources can tell tenants apart.
        assert_eq!(
            share.share_id.as_deref(),
            Some("0b8a1e52-3c4d-4e5f-8a9b-0c1d2e3f4a5b")
        );

        let env = read_env(&s.cdi().spec_path("part"));
        assert_eq!(env["part-gpus"][TESSERA_VISIBLE_DEVICES], partition_id);
        assert!(!env["part-gpus"].contains_key(TESSERA_GPU_MEMORY_GIB));
        let env = read_env(&s.cdi().spec_path("share"));
        assert_eq!(env["share-gpus"][TESSERA_VISIBLE_DEVICES], s.ids[1]);
        assert_eq!(env["share-gpus"][TESSERA_GPU_MEMORY_GIB], "25");
        assert_eq!(env["share-gpus"][TESSERA_GPU_MEMORY_FRACTION], "0.312");
        // A share holds no GPU whole; the partition is held by its own ID.
        let in_use = s.rx.borrow().allocated.clone();
        assert_eq!(
            in_use,
            BTreeMap::from([(partition_id.clone(), "pod-part".into())])
        );
        // Each part is held by the claim's pod, named as its labels say.
        let mut holdings = s.rx.borrow().holdings.clone();
        holdings.sort_by(|a, b| a.device.cmp(&b.device));
        let expected = [
            (
                partition_id.clone(),
                None,
                Holder::from_labels("ns", "p", None),
            ),
            (
                s.ids[1].clone(),
                Some(25u64 << 30),
                Holder {
                    namespace: "ns".into(),
                    pod: "p".into(),
                    instance: "llama".into(),
                    replica: "2".into(),
                    shard: "0".into(),
                },
            ),
        ];
        let mut expected: Vec<_> = expected
            .into_iter()
            .map(
                |(device, memory_share_bytes, holder)| crate::agent::holders::Holding {
                    device,
                    memory_share_bytes,
                    holder,
                },
            )
            .collect();
        expected.sort_by(|a, b| a.device.cmp(&b.device));
        assert_eq!(holdings, expected);
    }

    #[test]
    fn a_share_consuming_more_than_its_gpu_or_nonsense_is_refused() {
        let s = setup("1xH100-80GiB");
        for (consumed, problem) in [("81Gi", "81Gi"), ("lots", "lots"), ("0", "\"0\"")] {
            let shared = as_share(
                claim("c", &[("gpu.tessera.dev", "node-1", &s.names[0])]),
                consumed,
            );
            let error =
                allocated_devices(&shared, "c", &on(), &s.rx.borrow().snapshot).unwrap_err();
            assert!(
                error.contains("consumed memory") && error.contains(problem),
                "{consumed}: {error}"
            );
        }
    }

    #[tokio::test]
    async fn prepared_claims_survive_a_restart_and_unprepare_is_idempotent() {
        let s = setup("2xH100-80GiB");
        let claims = one_claim("u1", &[("gpu.tessera.dev", "node-1", &s.names[0])]);
        let first = s.driver(claims.clone());
        let prepared = first.prepare(&[reference("u1")]).await["u1"]
            .clone()
            .unwrap();
        drop(first);

        // A new agent: same answer with no API server at all, devices still in use.
        let restarted = s.driver(Claims::default()).keep_view(s.tx.clone()).await;
        assert_eq!(
            restarted.prepare(&[reference("u1")]).await["u1"]
                .as_ref()
                .unwrap(),
            &prepared
        );
        assert_eq!(s.rx.borrow().allocated.len(), 1);

        for _ in 0..2 {
            let answer = restarted.unprepare(&[reference("u1")]).await;
            assert_eq!(answer["u1"], Ok(()));
        }
        assert!(!s.cdi().exists("u1"));
        assert!(s.rx.borrow().allocated.is_empty());
        assert!(s.record().get("u1").is_none());
    }

    #[tokio::test]
    async fn each_claim_fails_alone_with_its_reason_and_nothing_prepared() {
        let s = setup("2xH100-80GiB");
        let d = "gpu.tessera.dev";
        s.tx.send_modify(|v| v.snapshot.devices[1].health = RawHealth::Unhealthy("XID 48".into()));
        let mut claims = one_claim("good", &[(d, "node-1", &s.names[0])]);
        for (name, uid, result) in [
            ("elsewhere", "u2", (d, "node-2", s.names[0].as_str())),
            ("unknown", "u3", (d, "node-1", "gpu-none")),
            ("sick", "u4", (d, "node-1", s.names[1].as_str())),
        ] {
            let mut c = claim(uid, &[result]);
            c.metadata.name = Some(name.into());
            claims.by_name.insert(format!("ns/{name}"), c);
        }
        let mut malformed = claim("u5", &[]);
        malformed.metadata.name = Some("malformed".into());
        malformed.status = None;
        claims.by_name.insert("ns/malformed".into(), malformed);
        let driver = s.driver(claims);
        let refs: Vec<ClaimRef> = [
            ("c", "good"),
            ("elsewhere", "u2"),
            ("unknown", "u3"),
            ("sick", "u4"),
            ("malformed", "u5"),
            ("gone", "u6"),
        ]
        .iter()
        .map(|(name, uid)| ClaimRef {
            namespace: "ns".into(),
            uid: (*uid).into(),
            name: (*name).into(),
        })
        .collect();
        let answers = driver.prepare(&refs).await;
        assert!(answers["good"].is_ok());
        let error = |uid: &str| answers[uid].clone().unwrap_err();
        assert!(
            error("u2").contains("is not on this node"),
            "{}",
            error("u2")
        );
        assert!(
            error("u3").contains("is not one of this node's GPUs"),
            "{}",
            error("u3")
        );
        assert!(
            error("u4").contains("is unhealthy: XID 48"),
            "{}",
            error("u4")
        );
        assert_eq!(error("u5"), "claim ns/malformed is not allocated");
        assert_eq!(error("u6"), "claim ns/gone does not exist");
        for uid in ["u2", "u3", "u4", "u5", "u6"] {
            assert!(!s.cdi().exists(uid), "{uid}");
            assert!(s.record().get(uid).is_none(), "{uid}");
        }
    }

    #[tokio::test]
    async fn claims_that_no_longer_exist_are_unprepared_and_the_rest_kept() {
        let s = setup("3xH100-80GiB");
        let d = "gpu.tessera.dev";
        let mut claims = one_claim("u1", &[(d, "node-1", &s.names[0])]);
        for (ns, name, uid, device) in [("ns", "gone", "u2", 1), ("ns", "again", "u3", 2)] {
            let mut c = claim(uid, &[(d, "node-1", &s.names[device])]);
            c.metadata.namespace = Some(ns.into());
            c.metadata.name = Some(name.into());
            claims.by_name.insert(format!("{ns}/{name}"), c);
        }
        let driver = s.driver(claims.clone()).keep_view(s.tx.clone()).await;
        let refs: Vec<ClaimRef> = [("c", "u1"), ("gone", "u2"), ("again", "u3")]
            .iter()
            .map(|(name, uid)| ClaimRef {
                namespace: "ns".into(),
                uid: (*uid).into(),
                name: (*name).into(),
            })
            .collect();
        assert!(driver.prepare(&refs).await.values().all(Result::is_ok));
        assert_eq!(s.rx.borrow().allocated.len(), 3);

        // `gone` is deleted; `again` is deleted and made anew (another UID).
        let mut now = claims.clone();
        now.by_name.remove("ns/gone");
        if let Some(c) = now.by_name.get_mut("ns/again") {
            c.metadata.uid = Some("u9".into());
        }
        let restarted = s.driver(now).keep_view(s.tx.clone()).await;
        assert_eq!(restarted.forget_gone_claims().await, 2);
        assert!(s.cdi().exists("u1") && !s.cdi().exists("u2") && !s.cdi().exists("u3"));
        assert_eq!(s.rx.borrow().allocated.len(), 1);
        assert!(s.record().get("u1").is_some() && s.record().get("u2").is_none());

        // An API server that cannot be reached proves nothing gone.
        let mut unreachable = one_claim("u1", &[]);
        unreachable.by_name.clear();
        let mut record = s.record();
        let mut kept = record.get("u1").unwrap().clone();
        kept.namespace = "unreachable".into();
        record.insert("u1", kept).unwrap();
        let offline = s.driver(unreachable);
        assert_eq!(offline.forget_gone_claims().await, 0);
        assert!(s.cdi().exists("u1"));
    }

    /// Real NVIDIA GPUs, as NVML names them.
    fn nvidia_setup(gpus: usize) -> Setup {
        let s = setup(&format!("{gpus}xH100-80GiB"));
        let ids: Vec<String> = (0..gpus)
            .map(|i| format!("GPU-{i}a1b2c3d-0000-1111-2222-333344445555"))
            .collect();
        s.tx.send_modify(|v| {
            v.snapshot.backend = "nvml".into();
            for (device, id) in v.snapshot.devices.iter_mut().zip(&ids) {
                device.info.id = id.clone();
            }
        });
        let names = device_names(ids.iter().map(String::as_str));
        Setup {
            names: ids.iter().map(|id| names[id].clone()).collect(),
            ids,
            ..s
        }
    }

    /// A node with a 580 driver under `<dir>/root`, its procfs at
    /// `<dir>/proc`, and CDI specs in `<dir>/etc-cdi` and the driver's own
    /// CDI directory (as `/etc/cdi` and `/var/run/cdi`).
    fn node_runtime(s: &Setup) -> RuntimeOptions {
        let dir = s.dir.path();
        crate::backend::nvml::test_driver_install(&dir.join("proc"), &dir.join("root"));
        std::fs::create_dir_all(dir.join("etc-cdi")).unwrap();
        RuntimeOptions {
            sysfs_root: dir.join("sys"),
            procfs_root: dir.join("proc"),
            driver_root: Some(dir.join("root")),
            host_driver_root: "/".into(),
            cdi_spec_dirs: vec![dir.join("etc-cdi"), s.cdi().dir],
            ..RuntimeOptions::default()
        }
    }

    fn spec_mounts(s: &Setup, uid: &str) -> Vec<String> {
        let text = std::fs::read_to_string(s.cdi().spec_path(uid)).unwrap();
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        spec["devices"][0]["containerEdits"]["mounts"]
            .as_array()
            .map(|mounts| {
                mounts
                    .iter()
                    .map(|m| m["containerPath"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    async fn prepare_on(
        s: &Setup,
        runtime: &RuntimeOptions,
        uid: &str,
        device: usize,
    ) -> PreparedDevice {
        let claims = one_claim(uid, &[("gpu.tessera.dev", "node-1", &s.names[device])]);
        let driver = Driver::new(
            on(),
            s.cdi(),
            runtime.clone(),
            s.rx.clone(),
            claims,
            s.record(),
        );
        let mut answer = driver.prepare(&[reference(uid)]).await;
        answer.remove(uid).unwrap().unwrap().remove(0)
    }

    #[tokio::test]
    async fn the_vendor_cdi_device_is_named_only_where_the_toolkit_spec_lists_the_gpu() {
        let s = nvidia_setup(2);
        let runtime = node_runtime(&s);
        let toolkit = s.dir.path().join("etc-cdi/nvidia.yaml");
        std::fs::write(
            &toolkit,
            crate::backend::cdi_specs::tests::toolkit_spec(&s.ids[0]),
        )
        .unwrap();

        // Listed: the toolkit's CDI device brings the libraries.
        let listed = prepare_on(&s, &runtime, "u1", 0).await;
        assert_eq!(
            listed.cdi_ids,
            [
                "gpu.tessera.dev/claim=u1-gpus".to_string(),
                format!("nvidia.com/gpu={}", s.ids[0])
            ]
        );
        assert!(spec_mounts(&s, "u1").is_empty());

        // Not listed (another GPU): the claim's spec mounts them itself.
        let unlisted = prepare_on(&s, &runtime, "u2", 1).await;
        assert_eq!(unlisted.cdi_ids, ["gpu.tessera.dev/claim=u2-gpus"]);
        let mounts = spec_mounts(&s, "u2");
        for path in [
            "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "/lib/firmware/nvidia/580.95.05/gsp_ga10x.bin",
        ] {
            assert!(mounts.iter().any(|m| m == path), "{path} not in {mounts:?}");
        }
        let env = read_env(&s.cdi().spec_path("u2"));
        assert_eq!(env["u2-gpus"]["NVIDIA_VISIBLE_DEVICES"], s.ids[1]);

        // A malformed spec lists nothing: the libraries are mounted.
        std::fs::write(&toolkit, "kind: nvidia.com/gpu\ndevices: [{name: ").unwrap();
        let malformed = prepare_on(&s, &runtime, "u3", 0).await;
        assert_eq!(malformed.cdi_ids, ["gpu.tessera.dev/claim=u3-gpus"]);
        assert_eq!(spec_mounts(&s, "u3"), mounts);

        // No spec at all: likewise.
        std::fs::remove_file(&toolkit).unwrap();
        let absent = prepare_on(&s, &runtime, "u4", 0).await;
        assert_eq!(absent.cdi_ids, ["gpu.tessera.dev/claim=u4-gpus"]);
        assert_eq!(spec_mounts(&s, "u4"), mounts);
    }

    #[tokio::test]
    async fn without_the_driver_version_a_claim_gets_variables_and_device_nodes_as_before() {
        let s = nvidia_setup(1);
        let runtime = node_runtime(&s);
        std::fs::remove_file(s.dir.path().join("proc/driver/nvidia/version")).unwrap();
        let device = prepare_on(&s, &runtime, "u1", 0).await;
        assert_eq!(device.cdi_ids, ["gpu.tessera.dev/claim=u1-gpus"]);
        assert!(spec_mounts(&s, "u1").is_empty());
        let text = std::fs::read_to_string(s.cdi().spec_path("u1")).unwrap();
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        let edits = &spec["devices"][0]["containerEdits"];
        assert_eq!(
            edits["env"],
            serde_json::json!([
                format!("NVIDIA_VISIBLE_DEVICES={}", s.ids[0]),
                format!("TESSERA_VISIBLE_DEVICES={}", s.ids[0])
            ])
        );
        let nodes: Vec<&str> = edits["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|node| node["path"].as_str().unwrap())
            .collect();
        assert_eq!(
            nodes,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia0"
            ]
        );

        // With --cdi the operator vouches for the vendor's names, as before.
        let with_cdi = RuntimeOptions {
            cdi: true,
            ..runtime
        };
        let named = prepare_on(&s, &with_cdi, "u2", 0).await;
        assert_eq!(
            named.cdi_ids,
            [
                "gpu.tessera.dev/claim=u2-gpus".to_string(),
                format!("nvidia.com/gpu={}", s.ids[0])
            ]
        );
    }

    #[tokio::test]
    async fn nothing_is_prepared_before_the_gpus_are_read() {
        let (_tx, rx) = channel("fake");
        let s = setup("1xH100-80GiB");
        let claims = one_claim("u1", &[("gpu.tessera.dev", "node-1", &s.names[0])]);
        let driver = Driver::new(
            on(),
            s.cdi(),
            RuntimeOptions::default(),
            rx,
            claims,
            s.record(),
        );
        let answer = driver.prepare(&[reference("u1")]).await;
        assert_eq!(
            answer["u1"],
            Err("this node's GPUs have not been read yet".to_string())
        );
    }

    /// A claim for a real NVIDIA GPU prepared from the NVML snapshot, as
    /// kubelet asks on a GPU node; the CDI spec is written to
    /// `$TESSERA_REAL_GPU_CDI_DIR` for `e2e/real-gpu.sh`, which runs the
    /// CUDA probe in a root file system under only that spec's edits. The
    /// driver root is `$TESSERA_REAL_GPU_DRIVER_ROOT` (default `/`).
    #[tokio::test]
    #[ignore = "needs an NVIDIA GPU and driver; run by e2e/real-gpu.sh"]
    async fn real_gpu_claim_is_prepared_into_a_cdi_spec() {
        use crate::backend::nvml::NvmlBackend;
        let out = std::env::var_os("TESSERA_REAL_GPU_CDI_DIR").expect("TESSERA_REAL_GPU_CDI_DIR");
        let root = std::env::var_os("TESSERA_REAL_GPU_DRIVER_ROOT").unwrap_or("/".into());
        let mut backend = NvmlBackend::new(None).expect("the NVIDIA driver");
        let snap = snapshot(&mut backend).expect("a snapshot of the real GPUs");
        assert!(!snap.devices.is_empty(), "no GPU found");
        let s = setup_with(snap);
        let cdi = CdiDir {
            dir: out.into(),
            driver: "gpu.tessera.dev".into(),
        };
        let d = "gpu.tessera.dev";
        let driver = Driver::new(
            on(),
            cdi.clone(),
            RuntimeOptions {
                driver_root: Some(root.clone().into()),
                host_driver_root: root.into(),
                ..RuntimeOptions::default()
            },
            s.rx.clone(),
            one_claim("real-gpu", &[(d, "node-1", &s.names[0])]),
            s.record(),
        );
        let answer = driver.prepare(&[reference("real-gpu")]).await;
        let devices = answer["real-gpu"].as_ref().expect("the claim is prepared");
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].id, s.ids[0]);
        let spec = std::fs::read_to_string(cdi.spec_path("real-gpu")).unwrap();
        println!(
            "prepared {} with CDI IDs {:?}",
            s.ids[0], devices[0].cdi_ids
        );
        println!("{spec}");
    }
}
