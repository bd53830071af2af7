//! How the controller's watches list first, against the real API server named
//! by `TESSERA_TEST_KUBECONFIG` (skipped, saying so, without it): the probe's
//! answer must be what a streaming watch on that server really does. A server
//! said to stream must deliver a whole initial list through the watch; one
//! said not to must fail such a watch (so `auto` chose a LIST for a reason).

#[path = "common/real_cluster.rs"]
mod real_cluster;

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use real_cluster::{kubeconfig_path, load_config};
use tessera::kubernetes::initial_list::offers_streaming_lists;
use tokio::time::timeout;

#[tokio::test]
async fn the_probe_says_what_a_streaming_watch_does() {
    let Some(path) = kubeconfig_path() else {
        return;
    };
    let client = Client::try_from(load_config(&path).await).expect("a client for the kubeconfig");
    let offered = offers_streaming_lists(&Api::<Node>::all(client.clone())).await;
    println!("the API server streams initial lists: {offered}");

    let namespaces: Api<Namespace> = Api::all(client);
    let mut events =
        watcher::watcher(namespaces, watcher::Config::default().streaming_lists()).boxed();
    let mut listed = Vec::new();
    let first_list = timeout(Duration::from_secs(30), async {
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => {}
                Ok(Event::InitApply(ns)) => listed.push(ns.name_any()),
                Ok(Event::InitDone) => return Ok(()),
                Ok(other) => panic!("an event before the initial list ended: {other:?}"),
                Err(e) => return Err(e),
            }
        }
        panic!("the watch ended");
    })
    .await
    .expect("a streaming watch neither listed nor failed within 30 s");
    if offered {
        first_list.expect("the probe said the server streams, but a streaming watch failed");
        assert!(
            listed.iter().any(|n| n == "default"),
            "the streamed list lacks the default namespace: {listed:?}"
        );
    } else {
        let error = first_list.expect_err("the probe said the server does not stream, but it did");
        println!("a streaming watch fails as the probe said: {error}");
    }
}
