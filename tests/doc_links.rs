//! The documentation's links hold: in every tracked Markdown file (README.md,
//! CONTRIBUTING.md, docs/*.md, …) each relative link names a file or directory
//! that exists, and each `#anchor` (in the same file or `file.md#anchor`)
//! matches a heading of its target by GitHub's anchor rules. External links are
//! not fetched: CI has no network.

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

/// A link as written in a Markdown file, with the line it is on.
#[derive(Debug)]
struct Link {
    destination: String,
    line: usize,
}

/// What the check needs of one Markdown file.
#[derive(Debug, Default)]
struct Document {
    /// Every anchor its headings make, duplicates already numbered.
    anchors: BTreeSet<String>,
    links: Vec<Link>,
}

/// GitHub's anchor for one heading's text: lower-case, punctuation removed
/// (letters, digits, `-` and `_` stay), every space turned into `-`.
fn heading_anchor(heading_text: &str) -> String {
    heading_text
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|character| match character {
            ' ' => Some('-'),
            '-' | '_' => Some(character),
            _ if character.is_alphanumeric() => Some(character),
            _ => None,
        })
        .collect()
}

/// Numbers repeated anchors the way GitHub does: the second `tests` becomes
/// `tests-1`, the third `tests-2`, skipping any suffix a heading already took.
#[derive(Default)]
struct AnchorNumbering {
    times_seen: HashMap<String, usize>,
}

impl AnchorNumbering {
    fn unique(&mut self, base: String) -> String {
        let mut anchor = base.clone();
        while self.times_seen.contains_key(&anchor) {
            let count = self.times_seen.entry(base.clone()).or_insert(0);
            *count += 1;
            anchor = format!("{base}-{count}");
        }
        self.times_seen.insert(anchor.clone(), 0);
        anchor
    }
}

/// Finds the headings and links of a Markdown text with a CommonMark parser
/// (tables on, as GitHub renders them), so code blocks and code spans that
/// merely look like links are left alone.
fn parse_markdown(text: &str) -> Document {
    let mut document = Document::default();
    let mut numbering = AnchorNumbering::default();
    let mut heading_text: Option<String> = None;
    let line_starts: Vec<usize> = std::iter::once(0)
        .chain(text.match_indices('\n').map(|(offset, _)| offset + 1))
        .collect();
    let line_of = |offset: usize| line_starts.partition_point(|&start| start <= offset);

    for (event, range) in Parser::new_ext(text, Options::ENABLE_TABLES).into_offset_iter() {
        match event {
            Event::Start(Tag::Heading { .. }) => heading_text = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                if let Some(text) = heading_text.take() {
                    document
                        .anchors
                        .insert(numbering.unique(heading_anchor(&text)));
                }
            }
            Event::Text(fragment) | Event::Code(fragment) => {
                if let Some(text) = heading_text.as_mut() {
                    text.push_str(&fragment);
                }
            }
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                document.links.push(Link {
                    destination: dest_url.to_string(),
                    line: line_of(range.start),
                });
            }
            _ => {}
        }
    }
    document
}

/// Whether a link leaves the repository (`https:`, `mailto:`, …): a scheme
/// is letters, digits, `+`, `-` or `.` before the first `:`, starting with a letter.
fn is_external(destination: &str) -> bool {
    match destination.split_once(':') {
        Some((scheme, _)) => {
            scheme.starts_with(|character: char| character.is_ascii_alphabetic())
                && scheme.chars().all(|character| {
                    character.is_ascii_alphanumeric() || matches!(character, '+' | '-' | '.')
                })
        }
        None => false,
    }
}

/// `base/relative` with `.` and `..` resolved without touching the file
/// system, or `None` when it climbs out of the root.
fn join_within(base: &Path, relative: &str) -> Option<PathBuf> {
    let mut joined = PathBuf::new();
    for component in base.join(relative).components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                if !joined.pop() {
                    return None;
                }
            }
            Component::Normal(part) => joined.push(part),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(joined)
}

/// The Markdown files git tracks (and new ones it does not ignore); outside a
/// git checkout, every one in the tree apart from build output and hidden
/// directories. Paths are relative to `root`.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let listed = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            "*.md",
        ])
        .current_dir(root)
        .output();
    match listed {
        Ok(output) if output.status.success() => {
            let mut files: Vec<PathBuf> = String::from_utf8_lossy(&output.stdout)
                .split('\0')
                .filter(|path| !path.is_empty() && root.join(path).is_file())
                .map(PathBuf::from)
                .collect();
            files.sort();
            files.dedup();
            files
        }
        _ => {
            let mut files = Vec::new();
            walk_markdown(root, Path::new(""), &mut files);
            files.sort();
            files
        }
    }
}

fn walk_markdown(root: &Path, directory: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(root.join(directory)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let relative = directory.join(name.as_ref());
        let Ok(file_type) = entry.file_type() else {
            continue;
        };
        if file_type.is_dir() {
            if !name.starts_with('.') && name != "target" {
                walk_markdown(root, &relative, files);
            }
        } else if name.ends_with(".md") {
            files.push(relative);
        }
    }
}

/// The parsed Markdown files, each read once however many links point to it.
struct Documents<'root> {
    root: &'root Path,
    parsed: HashMap<PathBuf, Document>,
}

impl Documents<'_> {
    fn get(&mut self, path: &Path) -> Result<&Document, String> {
        if !self.parsed.contains_key(path) {
            let text = std::fs::read_to_string(self.root.join(path))
                .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
            self.parsed
                .insert(path.to_path_buf(), parse_markdown(&text));
        }
        self.parsed
            .get(path)
            .ok_or_else(|| format!("{} was not parsed", path.display()))
    }
}

/// Checks every link of `files` (relative to `root`) and returns one line per
/// broken one: file, line, link and what is wrong.
fn broken_links(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut documents = Documents {
        root,
        parsed: HashMap::new(),
    };
    let mut broken = Vec::new();
    for file in files {
        let links: Vec<(String, usize)> = match documents.get(file) {
            Ok(document) => document
                .links
                .iter()
                .map(|link| (link.destination.clone(), link.line))
                .collect(),
            Err(error) => {
                broken.push(error);
                continue;
            }
        };
        for (destination, line) in links {
            let here = format!("{}:{line}: link `{destination}`", file.display());
            if destination.is_empty() || is_external(&destination) {
                continue;
            }
            let (path_part, anchor) = match destination.split_once('#') {
                Some((path_part, anchor)) => (path_part, Some(anchor)),
                None => (destination.as_str(), None),
            };
            let path_part = path_part.split('?').next().unwrap_or_default();
            let target = if path_part.is_empty() {
                Some(file.clone())
            } else if let Some(from_root) = path_part.strip_prefix('/') {
                join_within(Path::new(""), from_root)
            } else {
                join_within(file.parent().unwrap_or(Path::new("")), path_part)
            };
            let Some(target) = target else {
                broken.push(format!("{here}: points outside the repository"));
                continue;
            };
            if !root.join(&target).exists() {
                broken.push(format!("{here}: {} does not exist", target.display()));
                continue;
            }
            // Anchors into other kinds of files (a source file's `#L10`) are
            // GitHub's own; only Markdown headings are checked.
            let Some(anchor) = anchor else { continue };
            if target.extension().is_none_or(|extension| extension != "md") {
                continue;
            }
            let anchors = match documents.get(&target) {
                Ok(document) => &document.anchors,
                Err(error) => {
                    broken.push(format!("{here}: {error}"));
                    continue;
                }
            };
            if !anchors.contains(anchor) {
                broken.push(format!(
                    "{here}: no heading of {} makes the anchor `#{anchor}` (it has: {})",
                    target.display(),
                    anchors.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_and_anchor_in_the_markdown_files_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = markdown_files(root);
    for expected in ["README.md", "CONTRIBUTING.md"] {
        assert!(
            files.iter().any(|file| file == Path::new(expected)),
            "{expected} is missing from the Markdown files found: {files:?}"
        );
    }
    let broken = broken_links(root, &files);
    assert!(
        broken.is_empty(),
        "{} broken link(s) in the Markdown files:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn anchors_follow_githubs_rules_for_headings_of_our_docs() {
    let document = parse_markdown(
        "# tessera\n\
         ## Quick start\n\
         ## The node agent (`tessera agent`)\n\
         ## `tessera discover` and the GPU backends\n\
         ### Troubleshooting: \"NVML is not available\"\n\
         ### No devices registered (no `tessera.dev/gpu` capacity)\n\
         ### Instance stuck `Pending`\n\
         ## Regenerating the CRD and `deploy/`\n\
         ## CI (`.ci/run`)\n\
         ## Heterogeneity — 7.9× compute\n",
    );
    let expected: BTreeSet<String> = [
        "tessera",
        "quick-start",
        "the-node-agent-tessera-agent",
        "tessera-discover-and-the-gpu-backends",
        "troubleshooting-nvml-is-not-available",
        "no-devices-registered-no-tesseradevgpu-capacity",
        "instance-stuck-pending",
        "regenerating-the-crd-and-deploy",
        "ci-cirun",
        "heterogeneity--79-compute",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(document.anchors, expected);
}

#[test]
fn repeated_headings_are_numbered_as_github_numbers_them() {
    let document = parse_markdown("## Tests\n## Tests\n## Tests-1\n### Tests\n");
    let anchors: Vec<&str> = document.anchors.iter().map(String::as_str).collect();
    // GitHub: tests, tests-1, then `Tests-1` itself is taken so it becomes
    // tests-1-1, and the third `Tests` moves on to tests-2.
    assert_eq!(anchors, ["tests", "tests-1", "tests-1-1", "tests-2"]);
}

#[test]
fn links_in_code_are_not_links_and_line_numbers_are_reported() {
    let document = parse_markdown(
        "intro\n\n`[not](a-link.md)`\n\n```\n[also not](x.md)\n```\n\nsee [the docs](docs/install.md#uninstall)\n",
    );
    let links: Vec<(&str, usize)> = document
        .links
        .iter()
        .map(|link| (link.destination.as_str(), link.line))
        .collect();
    assert_eq!(links, [("docs/install.md#uninstall", 9)]);
}

#[test]
fn a_missing_file_a_missing_anchor_and_an_escape_are_each_reported() {
    let root = std::env::temp_dir().join(format!("tessera-doc-links-{}", std::process::id()));
    let docs = root.join("docs");
    std::fs::create_dir_all(&docs).expect("create a scratch directory");
    std::fs::write(
        root.join("README.md"),
        "# Title\n\n## Install\n\n\
         [ok](docs/guide.md#usage) [ok](#install) [ok](docs/) [web](https://example.com/x#y)\n\
         [gone](docs/missing.md) [bad anchor](docs/guide.md#nowhere) [escape](../outside.md)\n\
         [bad local](#title-1)\n",
    )
    .expect("write README.md");
    std::fs::write(
        docs.join("guide.md"),
        "# Guide\n\n## Usage\n\n[back](../README.md#title)\n",
    )
    .expect("write docs/guide.md");

    let files = [PathBuf::from("README.md"), PathBuf::from("docs/guide.md")];
    let broken = broken_links(&root, &files);
    std::fs::remove_dir_all(&root).expect("remove the scratch directory");

    assert_eq!(broken.len(), 4, "{broken:#?}");
    assert!(
        broken[0]
            .starts_with("README.md:6: link `docs/missing.md`: docs/missing.md does not exist")
    );
    assert!(broken[1].contains(
        "`docs/guide.md#nowhere`: no heading of docs/guide.md makes the anchor `#nowhere`"
    ));
    assert!(broken[2].contains("`../outside.md`: points outside the repository"));
    assert!(broken[3].starts_with("README.md:7: link `#title-1`"));
}
