//! Which objects of a cache's watch wake a reconcile, and when.
//!
//! kube-runtime's `touched_objects` hands on each object of a re-list as it
//! arrives, but the reflector swaps the re-listed objects into the cache only
//! once the list is complete. A reconcile woken by a re-listed object (half a
//! second later, the debounce; a 5,000-Node list takes seconds) read the
//! cache from before the watch broke, found nothing to do, and nothing woke
//! it again: a device that failed while the API server was away was not acted
//! on for the ten minutes of the resync. So a re-list's triggers are held
//! until it is complete. Objects the re-list no longer has were deleted
//! meanwhile, which no event reports; they are handed on then as deletions,
//! as client-go's informers do.

use std::collections::HashMap;
use std::sync::Arc;

use futures::{Stream, StreamExt, stream};
use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

/// How an object was touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Touch {
    Applied,
    Deleted,
}

/// A re-list under way: the cache's objects it has not listed yet, and the
/// objects it woke (by reference: the first list of a large cluster wakes
/// every object, and the cache holds them already).
struct Relist<K: Resource<DynamicType = ()>> {
    unseen: HashMap<ObjectRef<K>, Arc<K>>,
    held: Vec<ObjectRef<K>>,
}

type Triggers<K> = Box<dyn Iterator<Item = Result<K, watcher::Error>> + Send>;

/// The objects `events` touched that `wakes` lets through, each handed on
/// once `cache` (fed by the same events, upstream) holds it. `events` must
/// come from the reflector that writes `cache`.
pub(crate) fn triggers<K, S, F>(
    events: S,
    cache: Store<K>,
    mut wakes: F,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    F: FnMut(&K, Touch) -> bool + Send,
{
    let mut relist: Option<Relist<K>> = None;
    events.flat_map(move |event| {
        let out: Triggers<K> = match event {
            Err(e) => Box::new(std::iter::once(Err(e))),
            Ok(watcher::Event::Apply(object)) => Box::new(
                wakes(&object, Touch::Applied)
                    .then_some(Ok(object))
                    .into_iter(),
            ),
            Ok(watcher::Event::Delete(object)) => Box::new(
                wakes(&object, Touch::Deleted)
                    .then_some(Ok(object))
                    .into_iter(),
            ),
            Ok(watcher::Event::Init) => {
                // A re-list that broke off starts again; what it had woken
                // still waits. The cache is untouched until a list completes.
                let held = relist.take().map(|r| r.held).unwrap_or_default();
                let unseen = cache
                    .state()
                    .into_iter()
                    .map(|object| (ObjectRef::from_obj(object.as_ref()), object))
                    .collect();
                relist = Some(Relist { unseen, held });
                Box::new(std::iter::empty())
            }
            Ok(watcher::Event::InitApply(object)) => {
                let wake = wakes(&object, Touch::Applied);
                match &mut relist {
                    Some(relist) => {
                        let key = ObjectRef::from_obj(&object);
                        relist.unseen.remove(&key);
                        if wake {
                            relist.held.push(key);
                        }
                        Box::new(std::iter::empty())
                    }
                    None => Box::new(wake.then_some(Ok(object)).into_iter()),
                }
            }
            Ok(watcher::Event::InitDone) => match relist.take() {
                None => Box::new(std::iter::empty()),
                Some(Relist { unseen, held }) => {
                    let gone: Vec<K> = unseen
                        .into_values()
                        .filter(|object| wakes(object, Touch::Deleted))
                        .map(|object| object.as_ref().clone())
                        .collect();
                    // Copied out of the cache one at a time as they are taken.
                    let cache = cache.clone();
                    let listed = held
                        .into_iter()
                        .filter_map(move |key| cache.get(&key))
                        .map(|object| Ok(object.as_ref().clone()));
                    Box::new(listed.chain(gone.into_iter().map(Ok)))
                }
            },
        };
        stream::iter(out)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::WatchStreamExt;
    use kube::runtime::reflector;

    use super::*;

    fn map(name: &str, version: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm.metadata.namespace = Some("ns".into());
        // Each version its own, as the API server's would be.
        cm.metadata.resource_version = Some(version.into());
        cm.data = Some(BTreeMap::from([("v".to_string(), version.to_string())]));
        cm
    }

    fn version(cm: &ConfigMap) -> String {
        cm.data
            .as_ref()
            .and_then(|d| d.get("v"))
            .cloned()
            .unwrap_or_default()
    }

    /// Runs `events` through a reflector and `triggers`; for each trigger,
    /// its name and version and the version the cache held when it came
    /// (`-` when the cache did not have it).
    async fn run(
        events: Vec<watcher::Event<ConfigMap>>,
        wakes: impl FnMut(&ConfigMap, Touch) -> bool + Send,
    ) -> Vec<(String, String, String)> {
        let (cache, writer) = reflector::store();
        let reflected = stream::iter(events.into_iter().map(Ok)).reflect(writer);
        triggers(reflected, cache.clone(), wakes)
            .map(|item| {
                let cm = item.expect("no errors in this stream");
                let name = cm.metadata.name.clone().unwrap_or_default();
                let held = cache
                    .get(&ObjectRef::new(&name).within("ns"))
                    .map_or("-".to_string(), |c| version(&c));
                (name, version(&cm), held)
            })
            .collect()
            .await
    }

    fn triple(name: &str, version: &str, held: &str) -> (String, String, String) {
        (name.into(), version.into(), held.into())
    }

    #[tokio::test]
    async fn a_relists_objects_come_once_the_cache_holds_them_and_its_deletions_too() {
        use watcher::Event::{Apply, Init, InitApply, InitDone};
        let events = vec![
            Init,
            InitApply(map("a", "1")),
            InitApply(map("c", "1")),
            InitDone,
            Apply(map("a", "2")),
            // The watch broke; meanwhile `a` changed and `c` was deleted.
            Init,
            InitApply(map("a", "3")),
            InitApply(map("b", "1")),
            InitDone,
        ];
        let seen = run(events, |_, _| true).await;
        assert_eq!(
            seen,
            vec![
                triple("a", "1", "1"),
                triple("c", "1", "1"),
                triple("a", "2", "2"),
                // Not before the cache has version 3: a reconcile would miss it.
                triple("a", "3", "3"),
                triple("b", "1", "1"),
                // Gone from the cache, handed on as it was last seen.
                triple("c", "1", "-"),
            ]
        );
    }

    #[tokio::test]
    async fn the_filter_sees_every_touch_and_a_broken_off_relist_keeps_its_triggers() {
        use watcher::Event::{Delete, Init, InitApply, InitDone};
        let events = vec![
            Init,
            InitApply(map("a", "1")),
            InitApply(map("b", "1")),
            InitDone,
            Init,
            InitApply(map("a", "2")),
            // The list broke off and starts again.
            Init,
            InitApply(map("b", "1")),
            InitDone,
            Delete(map("b", "1")),
        ];
        let mut touches = Vec::new();
        let seen = run(events, |cm, touch| {
            touches.push((version(cm), touch));
            // Only changes to version 2 wake, and deletions.
            version(cm) == "2" || touch == Touch::Deleted
        })
        .await;
        assert_eq!(
            seen,
            vec![
                // Woken in the list that broke off, then gone before the
                // list that completed: handed on once, as a deletion.
                triple("a", "1", "-"),
                triple("b", "1", "-"),
            ]
        );
        let deletions = touches.iter().filter(|(_, t)| *t == Touch::Deleted).count();
        assert_eq!(touches.len(), 6, "{touches:?}");
        assert_eq!(deletions, 2, "{touches:?}");
    }
}
