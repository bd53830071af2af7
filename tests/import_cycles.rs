//! No import cycles between the modules of either crate (tessera, tessera-core):
//! the graph of `crate::…` and `super::…` paths between source files (comments,
//! a module's own tests and its edges to its ancestors left out) has no cycle, so
//! dependencies between modules point one way.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (`controller::apply`) → source text without its test module.
fn modules(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts == ["lib"] || parts == ["main"] {
                continue;
            }
            let mut text = std::fs::read_to_string(&path).unwrap();
            if let Some(i) = text.find("#[cfg(test)]\nmod tests") {
                text.truncate(i);
            }
            let code: Vec<&str> = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect();
            out.insert(parts.join("::"), code.join("\n"));
        }
    }
    out
}

/// The paths a source text names from `crate::` or `super::` (grouped
/// imports expanded one level), made absolute.
fn named_paths(module: &str, text: &str) -> Vec<Vec<String>> {
    let parent: Vec<String> = module.split("::").map(str::to_string).collect();
    let parent = &parent[..parent.len() - 1];
    let mut out = Vec::new();
    for (prefix, base) in [("crate::", Vec::new()), ("super::", parent.to_vec())] {
        let mut rest = text;
        while let Some(i) = rest.find(prefix) {
            let preceded_by_ident = rest[..i]
                .chars()
                .last()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            rest = &rest[i + prefix.len()..];
            if preceded_by_ident {
                continue;
            }
            // A path, then perhaps a `{…}` group (one level) continuing it.
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            let head = rest[..end].to_string();
            let items: Vec<String> = match rest[end..].strip_prefix('{') {
                Some(group) if head.is_empty() || head.ends_with("::") => {
                    let close = group.find('}').unwrap_or(group.len());
                    group[..close]
                        .split(',')
                        .map(|s| format!("{head}{}", s.trim()))
                        .collect()
                }
                _ => vec![head],
            };
            for item in items {
                let mut path = base.clone();
                path.extend(
                    item.split("::")
                        .map(str::trim)
                        .take_while(|s| !s.is_empty())
                        .map(str::to_string),
                );
                out.push(path);
            }
        }
    }
    out
}

fn graph(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for (module, text) in modules {
        let mut deps = BTreeSet::new();
        for path in named_paths(module, text) {
            // The longest module the path starts with.
            let target = (1..=path.len())
                .rev()
                .map(|k| path[..k].join("::"))
                .find(|m| modules.contains_key(m));
            let Some(target) = target else { continue };
            let ancestor = module.starts_with(&format!("{target}::"));
            if target != *module && !ancestor {
                deps.insert(target);
            }
        }
        graph.insert(module.clone(), deps);
    }
    graph
}

/// Strongly connected components with more than one module.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<Vec<String>> {
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for d in &graph[&m] {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut out = BTreeSet::new();
    for m in graph.keys() {
        let component: Vec<String> = graph
            .keys()
            .filter(|o| *o == m || (reachable[m].contains(*o) && reachable[*o].contains(m)))
            .cloned()
            .collect();
        if component.len() > 1 {
            out.insert(component);
        }
    }
    out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    for crate_src in ["src", "crates/tessera-core/src"] {
        let found = cycles(&graph(&modules(&workspace.join(crate_src))));
        assert!(
            found.is_empty(),
            "{crate_src}: modules that import each other (break the cycle: move what both need into a module below them): {found:?}"
        );
    }
}

#[test]
fn the_check_sees_a_cycle_and_ignores_ancestors_and_tests() {
    let modules: BTreeMap<String, String> = [
        ("a::x", "use super::y::Thing;\nuse super::Parent;"),
        (
            "a::y",
            "use crate::a::{x::Other, z};\n#[cfg(test)]\nmod tests { use super::super::w; }",
        ),
        ("a::z", "fn f() -> crate::a::w::T { todo!() }"),
        ("a::w", "use super::z;"),
        ("a", "pub mod x; use x::Thing;"),
        ("b", "use crate::a::x;"),
    ]
    .into_iter()
    .map(|(m, t)| {
        let mut t = t.to_string();
        if let Some(i) = t.find("#[cfg(test)]\nmod tests") {
            t.truncate(i);
        }
        (m.to_string(), t)
    })
    .collect();
    let found = cycles(&graph(&modules));
    let expected: BTreeSet<Vec<String>> = [
        vec!["a::x".to_string(), "a::y".to_string()],
        vec!["a::w".to_string(), "a::z".to_string()],
    ]
    .into_iter()
    .collect();
    assert_eq!(found, expected);
}
