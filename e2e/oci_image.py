#!/usr/bin/env python3
"""Assembles tessera's runtime image as an OCI image archive without Docker.

The Dockerfile stays the one description of the image: this reads its final
stage (the instructions after the last FROM) and applies them. The files come
from this machine instead of the distroless base: the binary, the shared
libraries it links (ldd), CA certificates and the passwd/group entries of the
non-root user. A runtime-stage instruction this script does not know fails the
build, so the two cannot drift apart silently.

    oci_image.py build --binary target/release/tessera --tag localhost/tessera:dev -o image.tar
    oci_image.py check [--dockerfile F]   # the runtime stage is one this script applies

Python standard library only. The archive imports with `ctr images import`.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile

DOCKERFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "Dockerfile")
# What the final stage may say; anything else must be taught to `build` first.
KNOWN = {"LABEL", "COPY", "USER", "EXPOSE", "ENTRYPOINT", "CMD"}
# The distroless base's users: root and nonroot (65532), as its /etc/passwd has them.
PASSWD = "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = "root:x:0:\nnonroot:x:65532:\n"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class Fail(Exception):
    pass


def instructions(text):
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def runtime_stage(text):
    steps = instructions(text)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    stage = steps[last_from + 1:]
    unknown = sorted({word for word, _ in stage} - KNOWN)
    if unknown:
        raise Fail(
            "the Dockerfile's runtime stage uses %s, which e2e/oci_image.py does not apply; "
            "teach it before changing the Dockerfile" % ", ".join(unknown)
        )
    return stage


def json_or_shell(args):
    return json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]


def image_config(stage):
    """The OCI config and the single COPY destination of the runtime stage."""
    config = {"Labels": {}, "ExposedPorts": {}, "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
    copies = []
    for word, args in stage:
        if word == "LABEL":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                config["Labels"][key] = value
        elif word == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            if len(parts) != 2:
                raise Fail("COPY %r: expected one source and one destination" % args)
            copies.append(parts[1])
        elif word == "USER":
            config["User"] = args
        elif word == "EXPOSE":
            for port in args.split():
                config["ExposedPorts"][port if "/" in port else port + "/tcp"] = {}
        elif word == "ENTRYPOINT":
            config["Entrypoint"] = json_or_shell(args)
        elif word == "CMD":
            config["Cmd"] = json_or_shell(args)
    if len(copies) != 1:
        raise Fail("the runtime stage must COPY exactly the binary, found %d COPY lines" % len(copies))
    return config, copies[0]


def linked_libraries(binary):
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        match = re.search(r"(/\S+) \(0x", line)
        if match and os.path.exists(match.group(1)):
            libs.append(match.group(1))
    return libs


def add_file(tar, name, data, mode=0o644, uid=0):
    info = tarfile.TarInfo(name.lstrip("/"))
    info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, uid, 0
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar, name, mode=0o755, uid=0):
    info = tarfile.TarInfo(name.lstrip("/"))
    info.type, info.mode, info.uid, info.gid, info.mtime = tarfile.DIRTYPE, mode, uid, uid, 0
    tar.addfile(info)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def layer(binary, destination):
    """The root filesystem as one tar layer: deterministic (sorted, mtime 0, root-owned)."""
    files = {destination: (read(binary), 0o755)}
    # Each library at the path the binary (and its loader) asks for, as a plain file.
    for lib in linked_libraries(binary):
        files[lib] = (read(os.path.realpath(lib)), 0o755)
    files["/etc/passwd"] = (PASSWD.encode(), 0o644)
    files["/etc/group"] = (GROUP.encode(), 0o644)
    if os.path.exists(CA_BUNDLE):
        files[CA_BUNDLE] = (read(CA_BUNDLE), 0o644)
    dirs = {"/tmp": 0o1777, "/home/nonroot": 0o700}
    for path in files:
        parent = os.path.dirname(path)
        while parent not in ("", "/"):
            dirs.setdefault(parent, 0o755)
            parent = os.path.dirname(parent)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(set(dirs) | set(files)):
            if path in dirs:
                add_dir(tar, path, dirs[path], uid=65532 if path == "/home/nonroot" else 0)
            else:
                data, mode = files[path]
                add_file(tar, path, data, mode)
    return raw.getvalue()


def blob(blobs, data, media_type):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def build(binary, tag, output):
    with open(DOCKERFILE, encoding="utf-8") as f:
        config, destination = image_config(runtime_stage(f.read()))
    tar_layer = layer(binary, destination)
    compressed = gzip.compress(tar_layer, mtime=0)
    blobs = {}
    layer_desc = blob(blobs, compressed, "application/vnd.oci.image.layer.v1.tar+gzip")
    image = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_layer).hexdigest()]},
        "history": [{"created_by": "e2e/oci_image.py from the Dockerfile's runtime stage"}],
    }
    config_desc = blob(blobs, json.dumps(image, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = blob(blobs, json.dumps(manifest, sort_keys=True).encode(), "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["annotations"] = {"io.containerd.image.name": tag, "org.opencontainers.image.ref.name": tag}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}
    with tarfile.open(output, mode="w") as tar:
        add_file(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add_file(tar, "index.json", json.dumps(index, sort_keys=True).encode())
        add_dir(tar, "blobs")
        add_dir(tar, "blobs/sha256")
        for digest, data in sorted(blobs.items()):
            add_file(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)
    print("%s: %s (%d MiB layer), user %s, entrypoint %s" % (
        output, tag, len(compressed) >> 20, config.get("User"), config.get("Entrypoint")))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--binary", required=True)
    b.add_argument("--tag", required=True)
    b.add_argument("-o", "--output", required=True)
    c = sub.add_parser("check")
    c.add_argument("--dockerfile", default=DOCKERFILE)
    args = parser.parse_args()
    try:
        if args.command == "build":
            build(args.binary, args.tag, args.output)
        else:
            with open(args.dockerfile, encoding="utf-8") as f:
                config, destination = image_config(runtime_stage(f.read()))
            print("Dockerfile runtime stage: %s, user %s, entrypoint %s, ports %s" % (
                destination, config.get("User"), config.get("Entrypoint"), sorted(config["ExposedPorts"])))
    except (Fail, OSError, subprocess.CalledProcessError) as e:
        print("oci_image.py: %s" % e, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
