//! The measuring loop: one round of reads every interval, each replica's
//! scrapes kept in its window until its pod changes or it stops serving.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use tessera_core::api::ModelInstance;
use tessera_core::measure::{Scrape, Window};
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::{Instant, MissedTickBehavior};

use super::fetch::Fetcher;
use super::targets::{Target, targets};
use super::{MeasureSettings, Measures, ReplicaMeasure};

/// Reads in flight at once: a round of a large cluster's replicas takes a
/// few timeouts at worst, not one per replica.
const CONCURRENT_READS: usize = 32;

/// Measures until dropped: every `settings.interval`, reads every serving
/// replica among `pods`, records what the windows say in `measures`, and
/// sends each instance whose record changed to `wakes`.
pub(crate) async fn measure(
    settings: MeasureSettings,
    pods: Store<Pod>,
    instances: Store<ModelInstance>,
    measures: Arc<Measures>,
    wakes: UnboundedSender<ObjectRef<ModelInstance>>,
) {
    let fetcher = Fetcher::new(settings.timeout);
    let start = Instant::now();
    let mut windows: HashMap<(ObjectRef<ModelInstance>, u32), (String, Window)> = HashMap::new();
    let mut ticks = tokio::time::interval(settings.interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let pods = pods.state();
        // A pod not Ready is read only where its window holds reads of it: a
        // runtime measured before that stops answering is named; one still
        // starting is not read.
        let targets = targets(pods.iter().map(AsRef::as_ref), |instance| {
            let instance = instances.get(instance)?;
            Some(
                instance
                    .spec
                    .serving
                    .as_ref()
                    .map(|s| s.runtime)
                    .unwrap_or_default(),
            )
        })
        .into_iter()
        .filter(|t| {
            t.ready
                || windows
                    .get(&(t.instance.clone(), t.replica))
                    .is_some_and(|(pod, _)| *pod == t.pod_uid)
        })
        .collect::<Vec<_>>();
        let reads: Vec<(Target, f64, Result<String, String>)> = futures::stream::iter(targets)
            .map(|target| {
                let fetcher = &fetcher;
                async move {
                    let body = match &target.url {
                        Ok(url) => fetcher.get(url).await,
                        Err(why) => Err(why.clone()),
                    };
                    (target, start.elapsed().as_secs_f64(), body)
                }
            })
            .buffer_unordered(CONCURRENT_READS)
            .collect()
            .await;
        let mut next: HashMap<ObjectRef<ModelInstance>, BTreeMap<u32, ReplicaMeasure>> =
            HashMap::new();
        let mut read = std::collections::HashSet::new();
        for (target, at, body) in reads {
            let key = (target.instance.clone(), target.replica);
            let (pod, window) = windows.entry(key.clone()).or_insert_with(|| {
                (
                    target.pod_uid.clone(),
                    Window::new(settings.window.as_secs_f64()),
                )
            });
            if *pod != target.pod_uid {
                *pod = target.pod_uid.clone();
                window.clear();
            }
            read.insert(key);
            let scraped =
                body.and_then(|b| Scrape::parse(&b, target.runtime).map_err(|e| e.to_string()));
            let measure = match scraped {
                Ok(scrape) => {
                    window.push(at, scrape);
                    match window.measurement() {
                        Some(measurement) => ReplicaMeasure::Measured {
                            measurement,
                            at: k8s_openapi::jiff::Timestamp::now(),
                        },
                        None => ReplicaMeasure::Measuring,
                    }
                }
                Err(why) if target.url.is_err() => ReplicaMeasure::NoEndpoint(why),
                Err(why) => {
                    tracing::debug!(instance = %target.instance, replica = target.replica, %why, "not measured");
                    ReplicaMeasure::Failed(why)
                }
            };
            next.entry(target.instance)
                .or_default()
                .insert(target.replica, measure);
        }
        windows.retain(|key, _| read.contains(key));
        for instance in measures.replace(next) {
            if wakes.send(instance).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use kube::runtime::reflector::{self, store::Writer};
    use kube::runtime::watcher::Event;
    use serde_json::json;
    use tessera_core::api::{INSTANCE_LABEL, SHARD_ANNOTATION};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::controller::measure::vllm_exposition;
    use crate::controller::testkit::{SMALL, instance};

    /// A loopback runtime: each read finds 10 more requests served, until
    /// `broken` is set; then its body is not an exposition.
    async fn runtime(broken: Arc<AtomicU64>) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = Arc::new(AtomicU64::new(0));
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let served = Arc::clone(&served);
                let broken = Arc::clone(&broken);
                tokio::spawn(async move {
                    let mut request = [0u8; 1024];
                    let _ = stream.read(&mut request).await;
                    let body = if broken.load(Ordering::SeqCst) > 0 {
                        "<html>oops</html>".to_string()
                    } else {
                        vllm_exposition(served.fetch_add(10, Ordering::SeqCst))
                    };
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(response.as_bytes()).await;
                });
            }
        });
        port
    }

    fn shard_pod(port: u16) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "llama-shard-0", "namespace": "default", "uid": "uid-1",
                "labels": {INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0"}},
            "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    fn store<K>(objects: Vec<K>) -> (Store<K>, Writer<K>)
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = reflector::store();
        for object in objects {
            writer.apply_watcher_event(&Event::Apply(object));
        }
        (store, writer)
    }

    #[tokio::test]
    async fn reads_a_replica_measures_it_and_says_when_it_cannot() {
        let broken = Arc::new(AtomicU64::new(0));
        let pod = shard_pod(runtime(Arc::clone(&broken)).await);
        let (pods, mut pod_writer) = store(vec![pod.clone()]);
        let mut mi = instance("llama", SMALL);
        mi.metadata.namespace = Some("default".into());
        let (instances, _instance_writer) = store(vec![mi.clone()]);
        let measures = Arc::new(Measures::default());
        let (wakes, mut woken) = tokio::sync::mpsc::unbounded_channel();
        let settings = MeasureSettings {
            interval: Duration::from_millis(50),
            window: Duration::from_secs(60),
            timeout: Duration::from_secs(5),
        };
        let task = tokio::spawn(measure(
            settings,
            pods,
            instances,
            Arc::clone(&measures),
            wakes,
        ));
        let key = ObjectRef::from_obj(&mi);
        let mut next = async || {
            let woke = tokio::time::timeout(Duration::from_secs(30), woken.recv()).await;
            assert_eq!(woke.unwrap().unwrap(), key);
            measures.of(&key)
        };

        assert_eq!(next().await.unwrap()[&0], ReplicaMeasure::Measuring);
        let Some(ReplicaMeasure::Measured { measurement: m, .. }) =
            next().await.unwrap().remove(&0)
        else {
            panic!("the second read measures");
        };
        assert!(m.requests_per_second() > 0.0);

        // Stuck: not Ready and no exposition; read still, as it was measured.
        broken.store(1, Ordering::SeqCst);
        let mut stuck = pod.clone();
        stuck.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "False".into();
        pod_writer.apply_watcher_event(&Event::Apply(stuck));
        let failed = loop {
            if let Some(ReplicaMeasure::Failed(why)) = next().await.unwrap().remove(&0) {
                break why;
            }
        };
        assert!(
            failed.starts_with("the metrics are not in the Prometheus text format"),
            "{failed}"
        );

        // Recreated with no port to read: it cannot be measured, and says so.
        let mut portless = pod.clone();
        portless.metadata.uid = Some("uid-2".into());
        portless.spec.as_mut().unwrap().containers[0].ports = None;
        pod_writer.apply_watcher_event(&Event::Apply(portless.clone()));
        let why = loop {
            if let Some(ReplicaMeasure::NoEndpoint(why)) = next().await.unwrap().remove(&0) {
                break why;
            }
        };
        assert!(
            why.contains("no container port named metrics or http"),
            "{why}"
        );

        // The pod goes: so does its record.
        pod_writer.apply_watcher_event(&Event::Delete(portless));
        loop {
            if next().await.is_none() {
                break;
            }
        }
        task.abort();
    }
}
