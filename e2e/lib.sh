# shellcheck shell=bash
# Helpers shared by the end-to-end scripts (sourced, not run). The caller sets
# NAMESPACE (where the instances are), RESOURCE_NAME, KUBELET_CHECKPOINT (may be empty),
# DRA_MANAGER_STATE (kubelet's record of prepared claims, with DRA; may be unset),
# TESSERA_NAMESPACE and FAKE_CONFIGMAP (the fake GPU ConfigMap) and defines die MESSAGE.

mi() { kubectl get mi "$1" -n "$NAMESPACE" -o json; }

# wait_until SECONDS DESCRIPTION COMMAND...: runs COMMAND every 3 s until it succeeds;
# on timeout fails with DESCRIPTION and the command's last output.
wait_until() {
  local seconds="$1" what="$2"
  shift 2
  local deadline=$((SECONDS + seconds)) out=""
  while true; do
    if out=$("$@" 2>&1); then
      return 0
    fi
    if ((SECONDS >= deadline)); then
      die "timed out after ${seconds}s waiting for: ${what}. Last check: ${out}"
    fi
    sleep 3
  done
}

sorted_csv() { tr ',' '\n' | sed '/^$/d' | sort | paste -sd, -; }

# shards_match_plan INSTANCE: every planned shard (of every replica) has its pod Running on the planned
# node, with the planned devices in its annotation and in what the container sees, and
# no other pods belong to the instance. Prints the first mismatch.
shards_match_plan() {
  local instance="$1" status plan count pods
  status=$(mi "$instance")
  plan=$(jq -c '.status.plan // []' <<<"$status")
  count=$(jq 'length' <<<"$plan")
  if [[ "$count" -eq 0 ]]; then
    echo "$instance has no plan yet (phase $(jq -r '.status.phase // "-"' <<<"$status"))"
    return 1
  fi
  pods=$(kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$instance" -o json)
  local npods
  npods=$(jq '[.items[] | select(.metadata.deletionTimestamp == null)] | length' <<<"$pods")
  if [[ "$npods" -ne "$count" ]]; then
    echo "$instance: $npods live pods for $count planned shards"
    return 1
  fi
  local i
  for ((i = 0; i < count; i++)); do
    local shard node devices pod name
    shard=$(jq -c ".[$i]" <<<"$plan")
    node=$(jq -r '.node' <<<"$shard")
    devices=$(jq -r '.devices | join(",")' <<<"$shard")
    name=$(jq -r --arg instance "$instance" --arg i "$i" \
      'if (.replica // 0) == 0 then "\($instance)-shard-\(.shard // $i)" else "\($instance)-r\(.replica)-shard-\(.shard)" end' <<<"$shard")
    pod=$(jq -c --arg name "$name" '.items[] | select(.metadata.name == $name)' <<<"$pods")
    if [[ -z "$pod" ]]; then
      echo "pod $name does not exist"
      return 1
    fi
    local phase pod_node pod_devices
    phase=$(jq -r '.status.phase' <<<"$pod")
    pod_node=$(jq -r '.spec.nodeName // ""' <<<"$pod")
    pod_devices=$(jq -r '.metadata.annotations["tessera.dev/devices"] // ""' <<<"$pod")
    if [[ "$phase" != Running ]]; then
      echo "pod $name is $phase, not Running"
      return 1
    fi
    if [[ "$pod_node" != "$node" ]]; then
      echo "pod $name runs on $pod_node; the plan says $node"
      return 1
    fi
    if [[ "$(sorted_csv <<<"$pod_devices")" != "$(sorted_csv <<<"$devices")" ]]; then
      echo "pod $name is annotated with devices $pod_devices; the plan says $devices"
      return 1
    fi
    local seen
    seen=$(kubectl logs -n "$NAMESPACE" "$name" 2>/dev/null | sed -n 's/.*sees devices: //p' | tail -n 1)
    if [[ "$(sorted_csv <<<"$seen")" != "$(sorted_csv <<<"$devices")" ]]; then
      echo "pod $name sees TESSERA_VISIBLE_DEVICES='$seen'; the plan says $devices"
      return 1
    fi
    if [[ -n "${DRA_MANAGER_STATE:-}" ]]; then
      # kubelet's record of the claims it prepared, by device name; the agent's
      # ResourceSlice maps the names back to device IDs.
      local claim prepared ids
      claim=$(jq -r '.spec.resourceClaims[]? | select(.name == "gpus") | .resourceClaimName // ""' <<<"$pod")
      prepared=$(jq -r --arg claim "$claim" --arg ns "$NAMESPACE" '.Data | fromjson | [.ClaimInfoStateList[]?
          | select(.ClaimName == $claim and .Namespace == $ns) | .DriverState[]?.Devices[]?.DeviceName] | join(",")' \
        "$DRA_MANAGER_STATE")
      ids=$(kubectl get resourceslices -o json | jq -r --arg node "$node" --arg names "$prepared" '
          ($names | split(",")) as $want | [.items[] | select(.spec.nodeName == $node) | .spec.devices[]?
          | select(.name as $n | $want | index($n)) | .attributes.id.string] | join(",")')
      if [[ -z "$claim" || "$(sorted_csv <<<"$ids")" != "$(sorted_csv <<<"$devices")" ]]; then
        echo "kubelet prepared '$prepared' (devices '$ids') for claim '$claim' of pod $name; the plan says $devices"
        return 1
      fi
    fi
    if [[ -n "$KUBELET_CHECKPOINT" ]]; then
      local uid allocated
      uid=$(jq -r '.metadata.uid' <<<"$pod")
      allocated=$(jq -r --arg uid "$uid" --arg res "$RESOURCE_NAME" \
        '[.Data.PodDeviceEntries[]? | select(.PodUID == $uid and .ResourceName == $res)
          | .DeviceIDs | to_entries[] | .value[]] | join(",")' "$KUBELET_CHECKPOINT")
      if [[ "$(sorted_csv <<<"$allocated")" != "$(sorted_csv <<<"$devices")" ]]; then
        echo "kubelet allocated '$allocated' to pod $name; the plan says $devices"
        return 1
      fi
    fi
  done
  return 0
}

print_plan() {
  mi "$1" | jq -r '.status.plan[] | "  shard \(.shard): \(.node) [\(.devices | join(","))] layers \(.layerStart)-\(.layerEnd)"'
}

# inject_fault NODE INDEX: marks NODE's fake device INDEX unhealthy in the fake GPU
# ConfigMap, in NODE's own file (a copy of default.yaml when it has none);
# restore_fault undoes it (a no-op when nothing is injected).
fault_key=""
fault_original=""
fault_had_key=0
inject_fault() {
  local node="$1" index="$2" cm key original faulty
  cm=$(kubectl get configmap "$FAKE_CONFIGMAP" -n "$TESSERA_NAMESPACE" -o json)
  if jq -e --arg k "$node.yaml" '.data[$k] != null' <<<"$cm" >/dev/null; then
    key="$node.yaml"
    fault_had_key=1
  else
    key=default.yaml
    fault_had_key=0
  fi
  original=$(jq -r --arg k "$key" '.data[$k] // ""' <<<"$cm")
  [[ -n "$original" ]] || die "ConfigMap $FAKE_CONFIGMAP has neither $node.yaml nor default.yaml"
  if grep -q '^faults:' <<<"$original"; then
    die "$FAKE_CONFIGMAP/$key already has faults; clear them before running this check"
  fi
  # Fault only this node: it gets its own copy of the default file.
  key="$node.yaml"
  faulty=$(printf '%s\nfaults:\n  - {device: %s, unhealthy: "e2e: injected fault"}\n' "${original%$'\n'}" "$index")
  fault_key="$key"
  fault_original="$original"
  kubectl patch configmap "$FAKE_CONFIGMAP" -n "$TESSERA_NAMESPACE" --type merge \
    -p "$(jq -n --arg k "$key" --arg v "$faulty" '{data: {($k): $v}}')" >/dev/null
}
restore_fault() {
  [[ -n "$fault_key" ]] || return 0
  local patch
  if [[ "$fault_had_key" -eq 1 ]]; then
    patch=$(jq -n --arg k "$fault_key" --arg v "$fault_original" '{data: {($k): $v}}')
  else
    patch=$(jq -n --arg k "$fault_key" '{data: {($k): null}}')
  fi
  kubectl patch configmap "$FAKE_CONFIGMAP" -n "$TESSERA_NAMESPACE" --type merge -p "$patch" >/dev/null
  fault_key=""
}

# instance NAME STAGES [RESTART_POLICY]: a ModelInstance of STAGES one-GPU pipeline
# stages whose shards print the devices they see and wait; RESTART_POLICY is its
# spec.restartPolicy (default RecreateReplica).
instance() {
  kubectl apply -n "$NAMESPACE" -f - >/dev/null <<EOF
apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata:
  name: $1
spec:
  restartPolicy: ${3:-RecreateReplica}
  model:
    name: e2e/small
    parametersBillions: 8
    layers: 32
    dtype: bf16
  parallelism:
    tensor: 1
    pipeline: $2
  template:
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: shard
          image: busybox:1.37
          imagePullPolicy: IfNotPresent
          command:
            - sh
            - -c
            - |
              echo "shard on \$(hostname) sees devices: \${TESSERA_VISIBLE_DEVICES:-<unset>}"
              trap 'exit 0' TERM INT
              while true; do sleep 3600 & wait \$!; done
EOF
}
