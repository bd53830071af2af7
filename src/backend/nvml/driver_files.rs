//! The NVIDIA driver's user-space files a CUDA container needs, found on the
//! host the way the NVIDIA container toolkit finds them, for containers that
//! get them from tessera instead of from the toolkit's hook or CDI spec:
//!
//! - the compute and utility libraries of the running driver's version
//!   (`driver_version`): `libcuda.so.<version>`, `libnvidia-ml.so.<version>`
//!   and the rest of what libnvidia-container gives a container asking for
//!   `compute,utility`, each looked up in the toolkit's library directories
//!   under the driver root, the first found kept. Without `libcuda` nothing
//!   is mounted: the rest is no use to CUDA;
//! - the host's links to each library in its directory (the SONAME,
//!   `libcuda.so.1`, and the development name `libcuda.so`), each mounted as
//!   the library itself: CDI has no symlink edit, and `dlopen("libcuda.so.1")`
//!   must find the file under that name without an ldcache hook. The host's
//!   links are the names its own loader resolves, made by ldconfig from the
//!   libraries' SONAMEs, so no ELF needs reading here;
//! - the GSP firmware of that version, `/lib/firmware/nvidia/<version>/gsp*.bin`,
//!   where present.
//!
//! Each library is mounted read-only where the loaders of common images look
//! without an ldcache hook (`container_paths`: the multiarch directory and
//! `/usr/lib64`), the firmware at its path on the host relative to the
//! driver root (docs/agent.md says what this asks of an image).
//!
//! Symlinks are followed inside the driver root (an absolute link target is
//! read as a path under it), since the root is the host's, not this
//! process's.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use super::driver_version::driver_version;
use crate::backend::container::{ContainerWiring, DriverRoot, HostRoots};

/// libnvidia-container's utility and compute libraries (the kinds a CUDA
/// container asks for), in that order; names of older drivers included, as
/// a library a driver does not ship is skipped.
const LIBRARIES: [&str; 15] = [
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    "libnvidia-nscq.so",
    "libcudadebugger.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-fatbinaryloader.so",
    "libnvidia-allocator.so",
    "libnvidia-compiler.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so",
    "libnvidia-tileiras.so",
];
/// Without it a container has no CUDA, whatever else it gets.
const CUDA_DRIVER: &str = "libcuda.so";
/// Where the NVIDIA container toolkit looks for driver libraries (besides
/// the host's ldcache, which is not read here), relative to the driver root.
const SEARCH_DIRS: [&str; 10] = [
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
    "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current",
    "lib/aarch64-linux-gnu/nvidia/current",
];
/// The firmware of a driver version lives in `<this>/<version>/`.
const FIRMWARE_DIR: &str = "lib/firmware/nvidia";
/// More links in a row than any driver install makes: a loop.
const MAX_LINK_HOPS: usize = 8;

/// A file of the driver root to mount: where it is (links followed) and the
/// name it gets in the container, both relative to the root.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DriverFile {
    source: PathBuf,
    name: PathBuf,
}

/// Adds the driver's files as read-only mounts; where they cannot be found
/// the container gets none, and the log says why.
pub(crate) fn mount_driver_files(
    host: HostRoots<'_>,
    root: DriverRoot<'_>,
    wiring: &mut ContainerWiring,
) {
    match driver_files(host.procfs_root, root.seen_at) {
        Ok(files) => {
            tracing::debug!(
                files = files.len(),
                root = %root.on_host.display(),
                "mounting the NVIDIA driver's libraries"
            );
            for file in files {
                let host_path = root.on_host.join(&file.source).display().to_string();
                for inside in container_paths(&file.name) {
                    wiring.add_read_only_mount(&host_path, &inside.display().to_string());
                }
            }
        }
        Err(reason) => tracing::warn!(
            %reason,
            "the container gets no NVIDIA driver libraries from tessera (the NVIDIA runtime's hook or CDI spec must add them)"
        ),
    }
}

/// Where a file found at `name` (relative to the driver root) goes in the
/// container. A library goes to the directories the loaders of the common
/// base images search by default, whatever directory the host keeps it in
/// (`/usr/local/nvidia/lib64` on some nodes): the multiarch directory of
/// Debian and Ubuntu and `/usr/lib64` of RHEL, Fedora and SUSE. A real H100
/// node showed why: a library mounted at its host-relative `/lib64` was not
/// found by an Ubuntu image's loader. Anything else keeps its path.
fn container_paths(name: &Path) -> Vec<PathBuf> {
    let (Some(file_name), false) = (name.file_name(), name.starts_with(FIRMWARE_DIR)) else {
        return vec![Path::new("/").join(name)];
    };
    let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    [multiarch.as_str(), "/usr/lib64"]
        .iter()
        .map(|dir| Path::new(dir).join(file_name))
        .collect()
}

/// The files to mount, or why there are none.
fn driver_files(procfs_root: &Path, root: &Path) -> Result<Vec<DriverFile>, String> {
    let version = driver_version(procfs_root)?;
    let mut links = Links::default();
    let mut files = Vec::new();
    let mut has_cuda = false;
    for library in LIBRARIES {
        let file_name = format!("{library}.{version}");
        let Some((dir, source)) = SEARCH_DIRS.iter().find_map(|dir| {
            let name = Path::new(dir).join(&file_name);
            resolve_file(root, &name).map(|source| (Path::new(dir), source))
        }) else {
            continue;
        };
        has_cuda |= library == CUDA_DRIVER;
        files.push(DriverFile {
            source: source.clone(),
            name: dir.join(&file_name),
        });
        for link in links.to(root, dir, library, &source) {
            if link == file_name {
                continue;
            }
            files.push(DriverFile {
                source: source.clone(),
                name: dir.join(link),
            });
        }
    }
    if !has_cuda {
        return Err(format!(
            "{CUDA_DRIVER}.{version} (the loaded driver's version) is in none of {} under {}",
            SEARCH_DIRS.join(", "),
            root.display()
        ));
    }
    files.extend(firmware(root, &version));
    Ok(files)
}

/// The symlinks of each directory, read once per lookup (a library
/// directory holds thousands of entries, most of them not ours).
#[derive(Default)]
struct Links {
    by_dir: BTreeMap<PathBuf, Vec<String>>,
}

impl Links {
    /// The names in `dir` starting with `library` that lead to `source`.
    fn to(&mut self, root: &Path, dir: &Path, library: &str, source: &Path) -> Vec<String> {
        let names = self
            .by_dir
            .entry(dir.to_path_buf())
            .or_insert_with(|| symlinks_in(&root.join(dir)));
        names
            .iter()
            .filter(|name| name.starts_with(library))
            .filter(|name| resolve_file(root, &dir.join(name)).as_deref() == Some(source))
            .cloned()
            .collect()
    }
}

fn symlinks_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_symlink()))
        .filter_map(|entry| entry.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// The GSP firmware files of `version`, where the host has them.
fn firmware(root: &Path, version: &str) -> Vec<DriverFile> {
    let dir = Path::new(FIRMWARE_DIR).join(version);
    let Ok(entries) = std::fs::read_dir(root.join(&dir)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| name.starts_with("gsp") && name.ends_with(".bin"))
        .collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|name| {
            let name = dir.join(name);
            resolve_file(root, &name).map(|source| DriverFile { source, name })
        })
        .collect()
}

/// Where `path` (relative to `root`) leads, following symlinks as the host
/// would: `None` unless it ends at a regular file inside the root.
fn resolve_file(root: &Path, path: &Path) -> Option<PathBuf> {
    let mut path = normalize(path)?;
    for _ in 0..=MAX_LINK_HOPS {
        let seen = root.join(&path);
        let meta = std::fs::symlink_metadata(&seen).ok()?;
        if meta.is_file() {
            return Some(path);
        }
        if !meta.file_type().is_symlink() {
            return None;
        }
        let target = std::fs::read_link(&seen).ok()?;
        path = if target.is_absolute() {
            normalize(&target)?
        } else {
            normalize(&path.parent()?.join(target))?
        };
    }
    None
}

/// `path` as a plain relative path: `.` and the root dropped, `..` taken
/// back; `None` where it climbs out of the root.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    pub(crate) const VERSION: &str = "580.95.05";
    const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

    /// A procfs naming the driver version.
    pub(crate) fn procfs(at: &Path) {
        let dir = at.join("driver/nvidia");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("version"),
            format!("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {VERSION}  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:00:00 UTC 2025\n"),
        )
        .unwrap();
    }

    /// A driver root laid out as a 580 install on Ubuntu: versioned libraries
    /// with their SONAME and development links, another version's leftovers,
    /// unrelated libraries and GSP firmware.
    pub(crate) fn driver_root(at: &Path) {
        let lib = at.join(LIB_DIR);
        std::fs::create_dir_all(&lib).unwrap();
        let with_links: [(&str, &[&str]); 8] = [
            ("libcuda.so", &["libcuda.so.1", "libcuda.so"]),
            ("libnvidia-ml.so", &["libnvidia-ml.so.1"]),
            ("libnvidia-cfg.so", &["libnvidia-cfg.so.1"]),
            ("libcudadebugger.so", &["libcudadebugger.so.1"]),
            ("libnvidia-opencl.so", &["libnvidia-opencl.so.1"]),
            (
                "libnvidia-ptxjitcompiler.so",
                &["libnvidia-ptxjitcompiler.so.1"],
            ),
            ("libnvidia-nvvm.so", &["libnvidia-nvvm.so.4"]),
            ("libnvidia-gpucomp.so", &[]),
        ];
        for (library, links) in with_links {
            let file = format!("{library}.{VERSION}");
            std::fs::write(lib.join(&file), b"\x7fELF").unwrap();
            for link in links {
                symlink(&file, lib.join(link)).unwrap();
            }
        }
        // The development name through the SONAME link, as the driver's
        // packages make it.
        std::fs::remove_file(lib.join("libcuda.so")).unwrap();
        symlink("libcuda.so.1", lib.join("libcuda.so")).unwrap();
        // An allocator whose versioned name is itself a link, absolute as the
        // host sees it (resolved inside the root, not this process's /).
        std::fs::create_dir_all(lib.join("nvidia")).unwrap();
        std::fs::write(lib.join("nvidia/libnvidia-allocator.so.real"), b"\x7fELF").unwrap();
        symlink(
            format!("/{LIB_DIR}/nvidia/libnvidia-allocator.so.real"),
            lib.join(format!("libnvidia-allocator.so.{VERSION}")),
        )
        .unwrap();
        symlink(
            format!("libnvidia-allocator.so.{VERSION}"),
            lib.join("libnvidia-allocator.so.1"),
        )
        .unwrap();
        // Not ours: another version, a GL library, a dangling and a looping link.
        std::fs::write(lib.join("libcuda.so.535.104.05"), b"\x7fELF").unwrap();
        std::fs::write(lib.join(format!("libnvidia-glcore.so.{VERSION}")), b"").unwrap();
        symlink("libcuda.so.999", lib.join("libcuda.so.2")).unwrap();
        symlink("libnvidia-ml.so.loop", lib.join("libnvidia-ml.so.loop")).unwrap();
        let firmware = at.join(FIRMWARE_DIR).join(VERSION);
        std::fs::create_dir_all(&firmware).unwrap();
        for name in ["gsp_ga10x.bin", "gsp_tu10x.bin", "README"] {
            std::fs::write(firmware.join(name), b"").unwrap();
        }
    }

    /// What a container gets from the driver root `root`, which the host has
    /// at `on_host`, with the driver's procfs at `proc`.
    fn mounted(proc: &Path, root: &Path, on_host: &str) -> ContainerWiring {
        let mut wiring = ContainerWiring::default();
        let host = HostRoots {
            sysfs_root: Path::new("/nonexistent/sys"),
            procfs_root: proc,
        };
        let driver = DriverRoot {
            seen_at: root,
            on_host: Path::new(on_host),
        };
        mount_driver_files(host, driver, &mut wiring);
        wiring
    }

    fn mounts(files: &[DriverFile]) -> Vec<(String, String)> {
        files
            .iter()
            .map(|file| {
                (
                    file.source.display().to_string(),
                    file.name.display().to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn the_running_versions_libraries_links_and_firmware_are_found() {
        let tmp = tempfile::tempdir().unwrap();
        let (proc, root) = (tmp.path().join("proc"), tmp.path().join("root"));
        procfs(&proc);
        driver_root(&root);
        let files = driver_files(&proc, &root).unwrap();
        let lib = |name: &str| format!("{LIB_DIR}/{name}");
        let versioned = |library: &str| lib(&format!("{library}.{VERSION}"));
        let expected: Vec<(String, String)> = [
            ("libcuda.so", vec!["libcuda.so.1", "libcuda.so"]),
            ("libnvidia-ml.so", vec!["libnvidia-ml.so.1"]),
            ("libnvidia-cfg.so", vec!["libnvidia-cfg.so.1"]),
            ("libcudadebugger.so", vec!["libcudadebugger.so.1"]),
            ("libnvidia-opencl.so", vec!["libnvidia-opencl.so.1"]),
            ("libnvidia-gpucomp.so", vec![]),
            (
                "libnvidia-ptxjitcompiler.so",
                vec!["libnvidia-ptxjitcompiler.so.1"],
            ),
        ]
        .into_iter()
        .flat_map(|(library, links)| {
            let source = versioned(library);
            let mut names = vec![versioned(library)];
            let mut links: Vec<String> = links.into_iter().map(lib).collect();
            links.sort();
            names.extend(links);
            names.into_iter().map(move |name| (source.clone(), name))
        })
        .chain([
            (
                lib("nvidia/libnvidia-allocator.so.real"),
                versioned("libnvidia-allocator.so"),
            ),
            (
                lib("nvidia/libnvidia-allocator.so.real"),
                lib("libnvidia-allocator.so.1"),
            ),
            (
                versioned("libnvidia-nvvm.so"),
                versioned("libnvidia-nvvm.so"),
            ),
            (versioned("libnvidia-nvvm.so"), lib("libnvidia-nvvm.so.4")),
        ])
        .chain(["gsp_ga10x.bin", "gsp_tu10x.bin"].map(|name| {
            let path = format!("{FIRMWARE_DIR}/{VERSION}/{name}");
            (path.clone(), path)
        }))
        .collect();
        assert_eq!(mounts(&files), expected);
    }

    #[test]
    fn the_mounts_name_host_paths_and_the_same_paths_inside() {
        let tmp = tempfile::tempdir().unwrap();
        let (proc, root) = (tmp.path().join("proc"), tmp.path().join("root"));
        procfs(&proc);
        driver_root(&root);
        let wiring = mounted(&proc, &root, "/run/nvidia/driver");
        let cuda = wiring
            .mounts
            .iter()
            .find(|mount| mount.container_path == format!("/{LIB_DIR}/libcuda.so.1"))
            .unwrap();
        assert_eq!(
            cuda.host_path,
            format!("/run/nvidia/driver/{LIB_DIR}/libcuda.so.{VERSION}")
        );
        // Each of the 18 library names twice (RHEL's directory too), the
        // two firmware files once, at their own paths.
        assert_eq!(wiring.mounts.len(), 38);
        assert!(wiring.mounts.iter().any(
            |m| m.container_path == "/usr/lib64/libcuda.so.1" && m.host_path == cuda.host_path
        ));
        assert!(
            wiring
                .mounts
                .iter()
                .any(|m| m.container_path == format!("/{FIRMWARE_DIR}/{VERSION}/gsp_ga10x.bin"))
        );
    }

    #[test]
    fn a_library_kept_outside_the_usual_directories_goes_where_loaders_look() {
        let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
        assert_eq!(
            container_paths(Path::new("lib64/libcuda.so.1")),
            [
                PathBuf::from(format!("{multiarch}/libcuda.so.1")),
                PathBuf::from("/usr/lib64/libcuda.so.1")
            ]
        );
        let firmware = Path::new(FIRMWARE_DIR).join("580.1/gsp_ga10x.bin");
        assert_eq!(container_paths(&firmware), [Path::new("/").join(&firmware)]);
    }

    #[test]
    fn without_the_version_or_libcuda_nothing_is_mounted_and_the_reason_given() {
        let tmp = tempfile::tempdir().unwrap();
        let (proc, root) = (tmp.path().join("proc"), tmp.path().join("root"));
        driver_root(&root);
        let error = driver_files(&proc, &root).unwrap_err();
        assert!(error.contains("cannot read the driver version"), "{error}");
        let wiring = mounted(&proc, &root, "/");
        assert_eq!(wiring, ContainerWiring::default());

        // A driver version whose libraries are not there (upgraded, not rebooted).
        procfs(&proc);
        std::fs::remove_file(root.join(LIB_DIR).join(format!("libcuda.so.{VERSION}"))).unwrap();
        let error = driver_files(&proc, &root).unwrap_err();
        assert!(
            error.starts_with(&format!(
                "libcuda.so.{VERSION} (the loaded driver's version) is in none of usr/lib64, "
            )),
            "{error}"
        );
    }

    #[test]
    fn paths_never_climb_out_of_the_root() {
        assert_eq!(
            normalize(Path::new("/a/./b/../c")),
            Some(PathBuf::from("a/c"))
        );
        assert_eq!(normalize(Path::new("a/../../etc/shadow")), None);
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("lib")).unwrap();
        symlink("../../outside", root.join("lib/escape")).unwrap();
        std::fs::write(tmp.path().join("outside"), b"").unwrap();
        assert_eq!(resolve_file(&root, Path::new("lib/escape")), None);
    }

    /// On a node with the NVIDIA driver:
    /// `cargo test --lib real_gpus_driver_files -- --ignored --nocapture`
    /// (`TESSERA_DRIVER_ROOT=/usr/local/nvidia` where the driver is there).
    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn real_gpus_driver_files_are_found() {
        let root = std::env::var("TESSERA_DRIVER_ROOT").unwrap_or_else(|_| "/".into());
        let files = driver_files(Path::new("/proc"), Path::new(&root)).expect("the driver's files");
        for file in &files {
            println!("{} <- /{}", file.name.display(), file.source.display());
        }
        let names: Vec<String> = files
            .iter()
            .map(|file| file.name.display().to_string())
            .collect();
        for soname in ["libcuda.so.1", "libnvidia-ml.so.1"] {
            assert!(
                names
                    .iter()
                    .any(|name| name.ends_with(&format!("/{soname}"))),
                "no {soname} among {names:?}"
            );
        }
    }
}
