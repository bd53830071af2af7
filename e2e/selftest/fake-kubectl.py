"""A stand-in for kubectl with a tiny simulated cluster, for testing e2e/check.sh
without one (.ci/e2e-check-selftest). Not a Kubernetes: it answers exactly the
kubectl calls check.sh makes, with objects shaped like the real ones (ModelInstance
status, shard pods, the headless Service, Nodes with the tessera.dev/gpu-state
annotation, the fake GPU ConfigMap), and a toy controller that plans each instance
onto the first free healthy device large enough.

State lives in the JSON file $FAKE_CLUSTER_STATE; `init` creates it. $FAKE_BUG makes
the simulated controller misbehave so the self-test can see check.sh fail:
  wrong-node      a shard pod runs on another node than its plan says
  no-replace      a shard on a faulty device is never re-placed
  keep-service    the headless Service outlives its instance
"""

import json
import os
import re
import sys

import yaml

STATE = os.environ["FAKE_CLUSTER_STATE"]
BUG = os.environ.get("FAKE_BUG", "")

NODES = {
    "tessera-e2e-worker": ("H100-80GiB", "NVIDIA H100 80GB HBM3", 80, 4),
    "tessera-e2e-worker2": ("MI300X-192GiB", "AMD Instinct MI300X", 192, 2),
    "tessera-e2e-worker3": ("RTX4090-24GiB", "NVIDIA GeForce RTX 4090", 24, 4),
}
SYSTEM_NS = "tessera-system"
CONFIGMAP = "tessera-fake-gpus"
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def device_id(profile, i):
    return f"fake-{profile.lower()}-{i}"


def init():
    nodes = {}
    configmap = {}
    for name, (profile, product, gib, count) in NODES.items():
        configmap[f"{name}.yaml"] = f"gpus:\n- count: {count}\n  profile: {profile}\n"
        nodes[name] = {
            "gib": gib,
            "product": product,
            "devices": [device_id(profile, i) for i in range(count)],
            "unhealthy": [],
            "pending_unhealthy": [],
        }
    state = {
        "nodes": nodes,
        "configmap": configmap,
        "namespaces": ["default", SYSTEM_NS],
        "instances": {},
        "pods": {},
        "services": {},
        "seq": 0,
    }
    save(state)


def load():
    with open(STATE) as f:
        return json.load(f)


def save(state):
    with open(STATE, "w") as f:
        json.dump(state, f)


def node_object(name, node):
    devices = [
        {
            "id": d,
            "index": i,
            "product": node["product"],
            "memoryTotalBytes": node["gib"] << 30,
            "health": "Unhealthy" if d in node["unhealthy"] else "Healthy",
        }
        for i, d in enumerate(node["devices"])
    ]
    gpu_state = {"version": "v1", "backend": "fake", "devices": devices, "links": []}
    count = str(len(node["devices"]) - len(node["unhealthy"]))
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"tessera.dev/gpu-state": json.dumps(gpu_state)},
            "labels": {"tessera.dev/gpu.count": str(len(node["devices"]))},
        },
        "status": {"capacity": {"tessera.dev/gpu": count}, "allocatable": {"tessera.dev/gpu": count}},
    }


def control_plane_object():
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "tessera-e2e-control-plane", "annotations": {}, "labels": {}},
            "status": {"capacity": {}, "allocatable": {}}}


def need_gib(spec):
    model = spec["model"]
    weights = model["parametersBillions"] * 1e9 * DTYPE_BYTES[model.get("dtype", "bf16")] / 2**30
    return weights + model.get("kvCacheGiB", 0) + model.get("overheadGiB", 1.5)


def reconcile(state):
    """The toy controller: faults become visible one call late (like kubelet's
    ConfigMap sync), shards on unhealthy devices are re-placed, pods follow plans."""
    for node in state["nodes"].values():
        for d in node["pending_unhealthy"]:
            if d not in node["unhealthy"]:
                node["unhealthy"].append(d)
        node["pending_unhealthy"] = []
        for d in list(node["unhealthy"]):
            if d not in faulted_devices(state, node):
                node["unhealthy"].remove(d)
    used = {(s["node"], dev) for key, mi in state["instances"].items()
            for s in mi.get("status", {}).get("plan", []) for dev in s["devices"]}
    for key, mi in state["instances"].items():
        ns, name = key.split("/")
        status = mi.setdefault("status", {})
        plan = status.get("plan", [])
        broken = [s for s in plan if s["devices"][0] in state["nodes"][s["node"]]["unhealthy"]]
        if broken and BUG == "no-replace":
            broken = []
        if plan and not broken:
            continue
        for s in broken:
            used.discard((s["node"], s["devices"][0]))
        need = need_gib(mi["spec"])
        choice = None
        for node_name, node in state["nodes"].items():
            for d in node["devices"]:
                if d in node["unhealthy"] or (node_name, d) in used or node["gib"] < need:
                    continue
                choice = (node_name, d)
                break
            if choice:
                break
        if choice is None:
            status.update({"phase": "Pending", "plan": [], "shards": 0, "readyShards": 0,
                           "conditions": [{"type": "Placed", "status": "False", "reason": "Unsatisfiable",
                                           "message": f"the model needs {need:.1f} GiB; the largest free GPU has 192.0 GiB"}]})
            continue
        used.add(choice)
        status.update({
            "phase": "Running", "shards": 1, "readyShards": 1,
            "plan": [{"shard": 0, "node": choice[0], "devices": [choice[1]], "layerStart": 0,
                      "layerEnd": mi["spec"]["model"]["layers"], "predictedMemoryGiB": round(need, 1)}],
            "conditions": [{"type": "Placed", "status": "True", "reason": "Planned", "message": "planned"}],
        })
        pod_name = f"{name}-shard-0"
        pod_node = choice[0]
        if BUG == "wrong-node":
            pod_node = next(n for n in state["nodes"] if n != choice[0])
        state["seq"] += 1
        state["pods"][f"{ns}/{pod_name}"] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ns, "uid": f"uid-{state['seq']}",
                         "labels": {"tessera.dev/instance": name},
                         "annotations": {"tessera.dev/devices": choice[1], "tessera.dev/shard": "0"}},
            "spec": {"nodeName": pod_node, "schedulerName": "tessera"},
            "status": {"phase": "Running"},
            "log": f"shard on {pod_name} sees devices: {choice[1]}\n",
        }
        state["services"][key] = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns,
                         "ownerReferences": [{"apiVersion": "tessera.dev/v1alpha1", "kind": "ModelInstance",
                                              "name": name, "controller": True}]},
            "spec": {"clusterIP": "None"},
        }


def faulted_devices(state, node):
    out = []
    for key, text in state["configmap"].items():
        name = key[: -len(".yaml")]
        if state["nodes"].get(name) is not node:
            continue
        doc = yaml.safe_load(text) or {}
        for f in doc.get("faults") or []:
            if f.get("unhealthy"):
                out.append(node["devices"][f["device"]])
    return out


def parse(argv):
    flags, pos = {}, []
    takes = {"-n", "--namespace", "-o", "--output", "-l", "--selector", "-f", "--filename", "-p", "--patch", "--type"}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in takes:
            flags[a.lstrip("-")] = argv[i + 1]
            i += 2
        elif a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            flags[k] = v
            i += 1
        elif a.startswith("-") and len(a) > 1:
            flags[a.lstrip("-")] = True
            i += 1
        else:
            pos.append(a)
            i += 1
    for short, long in (("n", "namespace"), ("o", "output"), ("l", "selector"), ("f", "filename"), ("p", "patch")):
        if long in flags:
            flags[short] = flags.pop(long)
    return flags, pos


def out(obj, fmt):
    if fmt == "json":
        print(json.dumps(obj))
    elif fmt == "name":
        items = obj["items"] if obj.get("kind") == "List" else [obj]
        for o in items:
            print(f"{o['kind'].lower()}/{o['metadata']['name']}")
    elif fmt is None:
        pass
    else:
        fail(f"fake kubectl: output {fmt} not supported")


def fail(msg, code=1):
    print(msg, file=sys.stderr)
    sys.exit(code)


def lookup(state, kind, ns, name):
    if kind in ("mi", "modelinstance", "modelinstances"):
        mi = state["instances"].get(f"{ns}/{name}")
        return None if mi is None else dict(mi, apiVersion="tessera.dev/v1alpha1", kind="ModelInstance")
    if kind in ("pod", "pods"):
        return strip_log(state["pods"].get(f"{ns}/{name}"))
    if kind in ("service", "svc"):
        return state["services"].get(f"{ns}/{name}")
    if kind == "node":
        if name == "tessera-e2e-control-plane":
            return control_plane_object()
        node = state["nodes"].get(name)
        return None if node is None else node_object(name, node)
    if kind == "configmap":
        if ns == SYSTEM_NS and name == CONFIGMAP:
            return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns},
                    "data": dict(state["configmap"])}
        return None
    if kind == "namespace":
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}} if name in state["namespaces"] else None
    if kind == "crd":
        return {"kind": "CustomResourceDefinition", "metadata": {"name": name}} if name == "modelinstances.tessera.dev" else None
    fail(f"fake kubectl: kind {kind} not supported")


def strip_log(pod):
    return None if pod is None else {k: v for k, v in pod.items() if k != "log"}


def jsonpath(obj, expr):
    """The two forms check.sh waits on."""
    if expr == "{.status.phase}":
        return obj.get("status", {}).get("phase")
    m = re.fullmatch(r'\{\.status\.conditions\[\?\(@\.type=="(\w+)"\)\]\.status\}', expr)
    if m:
        for c in obj.get("status", {}).get("conditions", []):
            if c["type"] == m.group(1):
                return c["status"]
        return None
    fail(f"fake kubectl: jsonpath {expr} not supported")


def main():
    if sys.argv[1:] == ["init"]:
        init()
        return
    state = load()
    reconcile(state)
    flags, pos = parse(sys.argv[1:])
    verb, args = pos[0], pos[1:]
    ns = flags.get("n", "default")
    fmt = flags.get("o")
    if verb == "get":
        kind = args[0]
        if kind in ("nodes",):
            items = [control_plane_object()] + [node_object(n, v) for n, v in state["nodes"].items()]
            out({"kind": "List", "items": items}, fmt)
        elif kind == "pods" and "l" in flags:
            label = flags["l"].split("=", 1)[1]
            items = [strip_log(p) for k, p in state["pods"].items()
                     if k.startswith(ns + "/") and p["metadata"]["labels"].get("tessera.dev/instance") == label]
            out({"kind": "List", "items": items}, fmt)
        elif len(args) == 1 and kind in ("mi", "pods"):
            store = state["instances"] if kind == "mi" else state["pods"]
            items = [lookup(state, kind, ns, k.split("/", 1)[1]) for k in store if k.startswith(ns + "/")]
            if fmt == "wide":
                for o in items:
                    print(o["metadata"]["name"], o.get("status", {}).get("phase"))
            else:
                out({"kind": "List", "items": items}, fmt)
        else:
            obj = lookup(state, kind, ns, args[1])
            if obj is None:
                if "ignore-not-found" in flags:
                    return
                fail(f'Error from server (NotFound): {kind} "{args[1]}" not found')
            out(obj, fmt)
    elif verb == "create" and args[0] == "namespace":
        state["namespaces"].append(args[1])
    elif verb == "delete" and args[0] == "namespace":
        state["namespaces"].remove(args[1])
    elif verb == "apply":
        text = sys.stdin.read() if flags["f"] == "-" else open(flags["f"]).read()
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "ModelInstance":
                key = f"{ns}/{doc['metadata']['name']}"
                state["instances"].setdefault(key, {"metadata": doc["metadata"], "spec": doc["spec"]})
                state["instances"][key]["spec"] = doc["spec"]
        reconcile(state)
    elif verb == "wait":
        kind, name = args[0].split("/")
        cond = flags["for"]
        path, want = cond[len("jsonpath="):].rsplit("=", 1)
        obj = lookup(state, kind, ns, name)
        if obj is None or jsonpath(obj, path) != want:
            fail(f"error: timed out waiting for the condition on {kind}/{name}")
    elif verb == "logs":
        pod = state["pods"].get(f"{ns}/{args[0]}")
        if pod is None:
            fail(f'Error from server (NotFound): pods "{args[0]}" not found')
        sys.stdout.write(pod["log"])
    elif verb == "patch" and args[0] == "configmap":
        patch = json.loads(flags["p"])
        for k, v in patch["data"].items():
            if v is None:
                state["configmap"].pop(k, None)
            else:
                state["configmap"][k] = v
        for node in state["nodes"].values():
            node["pending_unhealthy"] = [d for d in faulted_devices(state, node) if d not in node["unhealthy"]]
    elif verb == "annotate" and args[0] == "pods":
        # The agents' pods, annotated so that kubelet brings a changed ConfigMap in
        # now: the simulated agents see it at the next call anyway.
        if flags.get("l") != "app.kubernetes.io/component=agent" or ns != SYSTEM_NS or len(args) != 2:
            fail(f"fake kubectl: {' '.join(sys.argv[1:])} not supported")
    elif verb == "delete" and args[0] == "mi":
        for name in args[1:]:
            key = f"{ns}/{name}"
            if state["instances"].pop(key, None) is None:
                fail(f'Error from server (NotFound): modelinstances "{name}" not found')
            for k in [k for k, p in state["pods"].items()
                      if k.startswith(ns + "/") and p["metadata"]["labels"]["tessera.dev/instance"] == name]:
                del state["pods"][k]
            if BUG != "keep-service":
                state["services"].pop(key, None)
    else:
        fail(f"fake kubectl: {' '.join(sys.argv[1:])} not supported")
    save(state)


if __name__ == "__main__":
    main()
