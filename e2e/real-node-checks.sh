#!/usr/bin/env bash
# Checks on a real node running the chart (after e2e/real-node.sh installed it): what a
# user sees, and faults on real pods. Each test is a function; the first failure stops
# the run with the reason and the cluster's state.
#   what_users_see     `kubectl get mi` columns and values, the instance's events, the
#                      controller's and the agent's /metrics
#   hand_edits         a shard pod's devices annotation and the instance's Service edited
#                      by hand: the controller puts both back, the pod is not recreated
#   agent_restart      the agent pod deleted: the new one keeps every binding, running
#                      pods keep their devices, and no device is handed out twice
#   controller_failover the leader pod deleted while a standby replica (under the chart's
#                      ServiceAccount) waits: another replica takes the Lease and acts
#                      alone; no shard pod is recreated
#   device_fault       a fault injected into a running shard's device: only that shard
#                      moves; the device is not used until it recovers, then it is
#   kubelet_restart    kubelet restarted: the agent re-registers, running pods keep their
#                      devices; instances created meanwhile all run and every device held
#                      is held by a live pod (no hold without a pod)
#   instance_deleted   instances deleted: pods and Services go, every device is free and
#                      the next instances use all of them
#   replicas           `kubectl scale` of an instance: new replicas run on devices of
#                      their own, one more than the GPUs waits with its reason while the
#                      rest run, scaling down removes the newest and keeps the first
#   least_privilege    what the agent and the controller requested of the API server over
#                      all of the above (their api_requests metrics) is exactly what the
#                      chart's roles grant them: nothing missing, nothing unused
# Environment: KUBECONFIG; NODE (node-1), the node with the fake GPUs (GPUS of them, 8);
# TESSERA_NAMESPACE (tessera-system) and FAKE_CONFIGMAP (tessera-fake-gpus) where the
# chart is; RESOURCE_NAME (tessera.dev/gpu); KUBELET_CHECKPOINT, kubelet's device plugin
# checkpoint file; KUBELET_PIDFILE, a file with the PID of the node's kubelet, which
# must run on this host (kubelet_restart restarts it with the same command line and
# environment, and writes the new PID there; without it that test is skipped); TIMEOUT
# (180) seconds for each wait; ONLY, a space-separated list of tests to run.
# Needs kubectl, jq, curl.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly NAMESPACE="${E2E_NAMESPACE:-tessera-e2e-faults}"
readonly TESSERA_NAMESPACE="${TESSERA_NAMESPACE:-tessera-system}"
readonly FAKE_CONFIGMAP="${FAKE_CONFIGMAP:-tessera-fake-gpus}"
readonly RESOURCE_NAME="${RESOURCE_NAME:-tessera.dev/gpu}"
readonly KUBELET_CHECKPOINT="${KUBELET_CHECKPOINT:-}"
readonly KUBELET_PIDFILE="${KUBELET_PIDFILE:-}"
readonly NODE="${NODE:-node-1}"
readonly GPUS="${GPUS:-8}"
readonly TIMEOUT="${TIMEOUT:-180}"
readonly TESTS=(what_users_see hand_edits agent_restart controller_failover device_fault kubelet_restart instance_deleted replicas least_privilege)
readonly ONLY="${ONLY:-${TESTS[*]}}"
readonly STANDBY=tessera-e2e-standby-controller

current_test=setup
log() { printf '[real-node-checks %s %s] %s\n' "$(date +%H:%M:%S)" "$current_test" "$*"; }
# A component's recent log with runs of lines that differ only in their timestamp
# collapsed, so a retry loop does not hide what led to it.
recent_log() {
  kubectl -n "$TESSERA_NAMESPACE" logs -l "app.kubernetes.io/component=$1" --tail=1000 2>&1 \
    | awk '{ rest = $0; sub(/^[^ ]+ +/, "", rest)
             if (rest == last) { repeats++; next }
             if (repeats) print "  (the line above repeated " repeats " more times)"
             repeats = 0; last = rest; print }
           END { if (repeats) print "  (the line above repeated " repeats " more times)" }' \
    | tail -n 60
}
die() {
  # The reason goes last as well: a CI log shows its tail.
  echo "real-node check FAILED in $current_test: $*" >&2
  {
    echo "--- ModelInstances"
    kubectl get mi -A -o wide || true
    echo "--- pods"
    kubectl get pods -A -o wide || true
    echo "--- node $NODE GPU state"
    gpu_state | jq -c '{devices: [.devices[] | {id, health}], allocated}' || true
    if [[ -n "$KUBELET_CHECKPOINT" ]]; then
      echo "--- kubelet's device checkpoint (pod UID, container: devices)"
      jq -r --arg res "$RESOURCE_NAME" '.Data.PodDeviceEntries[]? | select(.ResourceName == $res)
        | "\(.PodUID) \(.ContainerName): \([.DeviceIDs[][]] | join(","))"' "$KUBELET_CHECKPOINT" || true
      echo "--- pod UIDs"
      kubectl get pods -A -o jsonpath='{range .items[*]}{.metadata.uid} {.metadata.namespace}/{.metadata.name} {.status.phase}{"\n"}{end}' || true
    fi
    echo "--- controller log"
    recent_log controller || true
    echo "--- agent log"
    recent_log agent || true
    echo "real-node check FAILED in $current_test: $*"
  } >&2
  exit 1
}
# shellcheck source=e2e/lib.sh
source e2e/lib.sh

for tool in kubectl jq curl; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is required but not on PATH"
done

# --- reading the cluster ---------------------------------------------------------

gpu_state() { kubectl get node "$NODE" -o json | jq '.metadata.annotations["tessera.dev/gpu-state"] | fromjson'; }
allocatable() { kubectl get node "$NODE" -o json | jq -r --arg r "$RESOURCE_NAME" '.status.allocatable[$r] // "0"'; }
device_health() { gpu_state | jq -r --arg id "$1" '.devices[] | select(.id == $id) | .health'; }
device_index() { gpu_state | jq -r --arg id "$1" '.devices[] | select(.id == $id) | .index'; }

# Live tessera shard pods on the node (not finished; terminating ones still hold devices).
node_pods() {
  kubectl get pods -A -l tessera.dev/instance -o json \
    | jq --arg node "$NODE" '[.items[] | select(.spec.nodeName == $node and .status.phase != "Succeeded" and .status.phase != "Failed")]'
}

# pods_of INSTANCE...: "name uid devices" per shard pod, sorted: what must not change.
pods_of() {
  local instance
  for instance in "$@"; do
    kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$instance" -o json \
      | jq -r '.items[] | "\(.metadata.name) \(.metadata.uid) \(.metadata.annotations["tessera.dev/devices"] // "")"'
  done | sort
}

# holds_match_pods: the agent's published holds are exactly the live pods' devices: no
# hold without a pod (nor an `unbound` one), no pod's device unrecorded.
holds_match_pods() {
  local holds pods
  holds=$(gpu_state | jq -r '(.allocated // {}) | to_entries[] | "\(.key) \(.value)"' | sort)
  pods=$(node_pods | jq -r '.[] | .metadata.uid as $uid | (.metadata.annotations["tessera.dev/devices"] // "") | split(",")[] | select(. != "") | "\(.) \($uid)"' | sort)
  if [[ "$holds" != "$pods" ]]; then
    echo "held (device uid): $(paste -sd' ' <<<"$holds") / live pods' devices: $(paste -sd' ' <<<"$pods")"
    return 1
  fi
}

# no_device_twice: no device in two live pods' annotations nor in two of kubelet's
# checkpoint entries.
no_device_twice() {
  local twice
  twice=$(node_pods | jq -r '.[] | (.metadata.annotations["tessera.dev/devices"] // "") | split(",")[] | select(. != "")' | sort | uniq -d)
  [[ -z "$twice" ]] || {
    echo "devices in two pods: $twice"
    return 1
  }
  if [[ -n "$KUBELET_CHECKPOINT" ]]; then
    twice=$(jq -r --arg res "$RESOURCE_NAME" '[.Data.PodDeviceEntries[]? | select(.ResourceName == $res) | .DeviceIDs | to_entries[] | .value[]] | .[]' "$KUBELET_CHECKPOINT" | sort | uniq -d)
    [[ -z "$twice" ]] || {
      echo "kubelet allocated devices twice: $twice"
      return 1
    }
  fi
}

all_running() {
  local instance
  for instance in "$@"; do
    shards_match_plan "$instance" || return 1
  done
}

# metric TEXT NAME: the value of the sample named exactly NAME (labels included).
metric() { awk -v name="$2" '$1 == name { print $2; exit }' <<<"$1"; }

lease_name() {
  kubectl -n "$TESSERA_NAMESPACE" get deploy -l app.kubernetes.io/component=controller -o json \
    | jq -r '.items[0].spec.template.spec.containers[0].args[] | select(startswith("--lease-name=")) | ltrimstr("--lease-name=")'
}
lease_holder() { kubectl -n "$TESSERA_NAMESPACE" get lease "$(lease_name)" -o jsonpath='{.spec.holderIdentity}'; }
holder_is() {
  local holder
  holder=$(lease_holder)
  [[ "$holder" == "$1" ]] || {
    echo "the Lease is held by '$holder', not $1"
    return 1
  }
}
holder_is_not() {
  local holder
  holder=$(lease_holder)
  [[ -n "$holder" && "$holder" != "$1" ]] || {
    echo "the Lease is held by '$holder'"
    return 1
  }
}
pod_ready() {
  [[ "$(kubectl -n "$1" get pod "$2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]] \
    || {
      echo "$1/$2 is not Ready"
      return 1
    }
}
# component_ready COMPONENT: its (first) pod is Ready.
component_ready() {
  local pod
  pod=$(component_pods "$1" | head -n 1)
  [[ -n "$pod" ]] || {
    echo "no $1 pod"
    return 1
  }
  pod_ready "$TESSERA_NAMESPACE" "$pod"
}
gpus_offered() {
  local n
  n=$(allocatable)
  [[ "$n" == "$1" ]] || {
    echo "$NODE offers $n $RESOURCE_NAME, not $1"
    return 1
  }
}

# --- instances -------------------------------------------------------------------


# delete_instances NAME...: deleted, with their pods and Services gone.
delete_instances() {
  kubectl delete mi -n "$NAMESPACE" "$@" --wait=true --timeout="${TIMEOUT}s" >/dev/null \
    || die "deleting $* did not finish"
  wait_until "$TIMEOUT" "the pods and Services of $* to be deleted" gone "$@"
}
gone() {
  local left="" instance
  for instance in "$@"; do
    left+=$(kubectl get pods -n "$NAMESPACE" -l "tessera.dev/instance=$instance" -o name)
    left+=$(kubectl get service "$instance" -n "$NAMESPACE" -o name --ignore-not-found)
  done
  [[ -z "$left" ]] || {
    echo "still there: $left"
    return 1
  }
}

# shard_moved INSTANCE SHARD DEVICE: the shard is no longer planned on DEVICE.
shard_moved() {
  mi "$1" | jq -e --argjson i "$2" --arg d "$3" '.status.plan[$i].devices | index($d) == null' >/dev/null \
    || {
      echo "shard $2 of $1 is still planned on $3"
      return 1
    }
}

# running_and_one_waiting NAME...: all but one run; that one is refused for lack of room.
running_and_one_waiting() {
  local running=0 waiting=0 name why=""
  for name in "$@"; do
    if shards_match_plan "$name" >/dev/null 2>&1; then
      running=$((running + 1))
    elif placed_false "$name" >/dev/null 2>&1; then
      waiting=$((waiting + 1))
    else
      why+=" $(shards_match_plan "$name" 2>&1);"
    fi
  done
  ((running == $# - 1 && waiting == 1)) || {
    echo "$running instances running, $waiting refused; expected $(($# - 1)) and 1;$why"
    return 1
  }
}

all_healthy() {
  local healthy
  healthy=$(gpu_state | jq '[.devices[] | select(.health == "Healthy")] | length')
  [[ "$healthy" == "$GPUS" ]] || {
    echo "$healthy of $GPUS GPUs healthy"
    return 1
  }
}

no_holds() {
  local n
  n=$(gpu_state | jq '(.allocated // {}) | length')
  [[ "$n" == 0 ]] || {
    echo "$n devices still held"
    return 1
  }
}

placed_false() {
  [[ "$(kubectl get mi "$1" -n "$NAMESPACE" -o jsonpath='{.status.conditions[?(@.type=="Placed")].status}')" == False ]] \
    || {
      echo "$1 is not Placed=False"
      return 1
    }
}

# --- the fake GPU file -----------------------------------------------------------

health_is() {
  local health
  health=$(device_health "$1")
  [[ "$health" == "$2" ]] || {
    echo "$1 is $health, not $2"
    return 1
  }
}

# --- clean-up ---------------------------------------------------------------------

cleanup() {
  local rc=$?
  rm -f "$API_USE"
  restore_fault || echo "warning: could not restore ConfigMap $FAKE_CONFIGMAP" >&2
  kubectl -n "$TESSERA_NAMESPACE" delete pod "$STANDBY" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  if [[ "${KEEP:-0}" != 1 ]]; then
    kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT

# --- the tests -------------------------------------------------------------------

test_what_users_see() {
  local table header row events controller agent text
  table=$(kubectl get mi -n "$NAMESPACE" 2>/dev/null)
  header=$(head -n 1 <<<"$table" | tr -s ' ')
  [[ "$header" == "NAME PHASE REPLICAS SHARDS READY AGE" ]] || die "kubectl get mi prints the columns '$header'"
  table=$(kubectl get mi -n "$NAMESPACE" -o wide 2>/dev/null)
  header=$(head -n 1 <<<"$table" | tr -s ' ')
  [[ "$header" == "NAME PHASE REPLICAS READY-REPLICAS SHARDS READY TOKENS/S REQUESTS/S AGE" ]] || die "kubectl get mi -o wide prints the columns '$header'"
  row=$(awk '$1 == "pair"' <<<"$table" | tr -s ' ')
  # Tokens/s alone, then the requests/s the replica serves at the target.
  [[ "$row" =~ ^pair\ Running\ 1\ 1\ 2\ 2\ [0-9.]+\ [0-9.]+\ [0-9]+[smhd] ]] || die "kubectl get mi -o wide prints '$row' for pair"
  log "kubectl get mi: $row"

  events=$(kubectl get events -n "$NAMESPACE" -o json \
    | jq -r '.items[] | select(.involvedObject.kind == "ModelInstance" and .involvedObject.name == "pair") | .reason' | sort -u | paste -sd' ' -)
  for reason in Planned Bound; do
    [[ " $events " == *" $reason "* ]] || die "pair has no $reason event (events: $events)"
  done
  log "events of pair: $events"

  controller=$(lease_holder)
  text=$(scrape "$TESSERA_NAMESPACE" "$controller" "$(pod_port "$controller")") || die "$text"
  [[ "$(metric "$text" tessera_controller_leader)" == 1 ]] || die "the leader's tessera_controller_leader is not 1"
  [[ "$(metric "$text" 'tessera_controller_instances{phase="Running"}')" == 2 ]] \
    || die "tessera_controller_instances{phase=\"Running\"} is not 2:
$(grep tessera_controller_instances <<<"$text")"
  agent=$(component_pods agent | head -n 1)
  text=$(scrape "$TESSERA_NAMESPACE" "$agent" "$(pod_port "$agent")") || die "$text"
  [[ "$(metric "$text" 'tessera_agent_devices{health="healthy"}')" == "$GPUS" ]] \
    || die "the agent's tessera_agent_devices is not $GPUS Healthy:
$(grep tessera_agent_devices <<<"$text")"
  [[ "$(metric "$text" tessera_agent_allocated_devices)" == 3 ]] \
    || die "the agent's tessera_agent_allocated_devices is not 3: $(grep allocated_devices <<<"$text")"
  # Through the device plugin too, a handed-out device's series name the shard holding it.
  local device
  device=$(mi pair | jq -r '.status.plan[1].devices[0]')
  grep -q "^tessera_gpu_memory_used_bytes{.*device=\"$device\".*namespace=\"$NAMESPACE\",pod=\"pair-shard-1\",modelinstance=\"pair\",replica=\"0\",shard=\"1\"}" <<<"$text" \
    || die "the agent's series of $device do not name pair's shard 1: $(grep "device=\"$device\"" <<<"$text" | head -2)"
  log "metrics: controller leader with 2 instances Running; agent with $GPUS healthy GPUs, 3 handed out, $device labelled with pair's shard 1"
}

# field_is KIND NAME JSONPATH VALUE: the object in the test namespace has VALUE there.
field_is() {
  local now
  now=$(kubectl -n "$NAMESPACE" get "$1" "$2" -o jsonpath="$3")
  [[ "$now" == "$4" ]] || {
    echo "$1 $2 has '$now' at $3, not '$4'"
    return 1
  }
}

test_hand_edits() {
  local before planned
  before=$(pods_of pair solo)
  planned=$(mi solo | jq -r '.status.plan[0].devices | join(",")')
  kubectl -n "$NAMESPACE" annotate pod solo-shard-0 tessera.dev/devices=fake-h100-80gib-99 --overwrite >/dev/null
  kubectl -n "$NAMESPACE" patch service pair --type merge -p '{"spec": {"publishNotReadyAddresses": false}}' >/dev/null
  wait_until "$TIMEOUT" "the controller to put solo-shard-0's devices annotation back" \
    field_is pod solo-shard-0 '{.metadata.annotations.tessera\.dev/devices}' "$planned"
  wait_until "$TIMEOUT" "the controller to put Service pair back" \
    field_is service pair '{.spec.publishNotReadyAddresses}' true
  [[ "$(pods_of pair solo)" == "$before" ]] || die "a hand edit got a shard pod recreated"
  log "the devices annotation and the Service were put back; no pod recreated"
}

test_agent_restart() {
  local before old
  before=$(pods_of pair solo)
  old=$(component_pods agent)
  record_api_use agent "$old"
  log "deleting agent pod $old"
  kubectl -n "$TESSERA_NAMESPACE" delete pod "$old" --wait=true --timeout="${TIMEOUT}s" >/dev/null
  wait_until "$TIMEOUT" "a new agent pod to be Ready" component_ready agent
  wait_until "$TIMEOUT" "$NODE to offer $GPUS GPUs again" gpus_offered "$GPUS"
  [[ "$(pods_of pair solo)" == "$before" ]] || die "the shard pods changed across the agent restart:
before: $before
after:  $(pods_of pair solo)"
  wait_until "$TIMEOUT" "the new agent to publish the same holds" holds_match_pods
  instance after-agent 1
  wait_until "$TIMEOUT" "after-agent to run on its planned devices" all_running after-agent pair solo
  no_device_twice || die "$(no_device_twice)"
  wait_until "$TIMEOUT" "every hold to be a live pod's" holds_match_pods
  log "the new agent kept every binding; after-agent got other devices"
  delete_instances after-agent
}

test_controller_failover() {
  local leader pod_json before
  leader=$(lease_holder)
  [[ -n "$leader" ]] || die "nobody holds the controller's Lease"
  # A second replica as the Deployment would run it, on other ports (two replicas with
  # host networking on one node cannot share one: metrics and map each 100 up), and
  # without the Deployment's labels so that its ReplicaSet leaves it alone.
  pod_json=$(kubectl -n "$TESSERA_NAMESPACE" get deploy -l app.kubernetes.io/component=controller -o json \
    | jq --arg name "$STANDBY" --arg node "$NODE" '.items[0].spec.template
      | {apiVersion: "v1", kind: "Pod",
         metadata: {name: $name, labels: {"app.kubernetes.io/name": "tessera-e2e-standby"}},
         spec: (.spec | .nodeName = $node
           | .containers[0].args |= map(
               if test("^--(map-)?listen=") then
                 (capture("^(?<flag>[^=]+)=(?<host>.*):(?<port>[0-9]+)$")
                   | "\(.flag)=\(.host):\(.port | tonumber + 100)")
               else . end)
           | .containers[0].ports |= map(.containerPort += 100 | if .hostPort then .hostPort += 100 else . end))}')
  kubectl -n "$TESSERA_NAMESPACE" apply -f - >/dev/null <<<"$pod_json"
  wait_until "$TIMEOUT" "the standby replica to be Ready" pod_ready "$TESSERA_NAMESPACE" "$STANDBY"
  holder_is "$leader" || die "the standby took the Lease from a live leader"
  before=$(pods_of pair solo)
  record_api_use controller "$leader" "$STANDBY"
  log "deleting the leader pod $leader; standby $STANDBY waits (and the Deployment starts a new replica)"
  kubectl -n "$TESSERA_NAMESPACE" delete pod "$leader" --wait=false >/dev/null
  wait_until "$TIMEOUT" "another replica to take the Lease" holder_is_not "$leader"
  local successor
  successor=$(lease_holder)
  instance after-failover 1
  wait_until "$TIMEOUT" "after-failover to run" all_running after-failover pair solo
  local binders uid
  uid=$(mi after-failover | jq -r '.metadata.uid')
  binders=$(kubectl get events.events.k8s.io -n "$NAMESPACE" -o json \
    | jq -r --arg uid "$uid" '.items[] | select(.regarding.uid == $uid) | .reportingInstance' | sort -u | paste -sd' ' -)
  [[ "$binders" == "$successor" ]] || die "after-failover's events come from '$binders', not only the new leader $successor"
  [[ "$(pods_of pair solo)" == "$before" ]] || die "the shard pods changed across the failover"
  no_device_twice || die "$(no_device_twice)"
  log "$successor took over and placed after-failover alone; no shard pod was recreated"

  record_api_use controller "$STANDBY" "$successor"
  kubectl -n "$TESSERA_NAMESPACE" delete pod "$STANDBY" --wait=true --timeout="${TIMEOUT}s" >/dev/null
  wait_until "$TIMEOUT" "the Deployment's replica to be Ready" component_ready controller
  local replica
  replica=$(component_pods controller | head -n 1)
  wait_until "$TIMEOUT" "the Deployment's replica $replica to hold the Lease" holder_is "$replica"
  delete_instances after-failover
  [[ "$(pods_of pair solo)" == "$before" ]] || die "the shard pods changed across the second failover"
  log "the Lease is with the Deployment's replica $replica"
}

test_device_fault() {
  local before shard0 device index
  before=$(pods_of pair solo)
  device=$(mi pair | jq -r '.status.plan[1].devices[0]')
  index=$(device_index "$device")
  [[ "$index" =~ ^[0-9]+$ ]] || die "device $device of pair's shard 1 is not in $NODE's GPU state"
  shard0=$(grep '^pair-shard-0 ' <<<"$before")
  log "injecting a fault into $device (index $index), shard 1 of pair"
  inject_fault "$NODE" "$index"
  wait_until "$TIMEOUT" "$device to be published Unhealthy" health_is "$device" Unhealthy
  wait_until "$TIMEOUT" "pair's shard 1 to be re-placed" shard_moved pair 1 "$device"
  wait_until "$TIMEOUT" "pair to run again" all_running pair solo
  [[ "$(grep '^pair-shard-0 ' <<<"$(pods_of pair)")" == "$shard0" ]] || die "pair's shard 0 was recreated though its device is healthy"
  [[ "$(pods_of solo)" == "$(grep '^solo-shard-0 ' <<<"$before")" ]] || die "solo was recreated"
  log "only pair's shard 1 moved: $(mi pair | jq -c '[.status.plan[].devices]')"

  # Every healthy device taken and one more asked for: the faulty one is not used.
  local free=$((GPUS - 4)) fills=() i
  for ((i = 0; i <= free; i++)); do
    fills+=("fill-$i")
    instance "fill-$i" 1
  done
  wait_until "$TIMEOUT" "$free fill instances to run and one to wait" running_and_one_waiting "${fills[@]}"
  if node_pods | jq -e --arg d "$device" '[.[] | .metadata.annotations["tessera.dev/devices"] // "" | split(",") | index($d)] | any' >/dev/null; then
    die "a pod was given the faulty $device"
  fi
  log "$free fill instances run; the last waits rather than use the faulty $device"

  restore_fault
  wait_until "$TIMEOUT" "$device to be published Healthy" health_is "$device" Healthy
  wait_until "$TIMEOUT" "every fill instance to run" all_running "${fills[@]}"
  node_pods | jq -e --arg d "$device" '[.[] | .metadata.annotations["tessera.dev/devices"] // "" | split(",") | index($d)] | any' >/dev/null \
    || die "no pod uses $device after it recovered"
  no_device_twice || die "$(no_device_twice)"
  log "after recovery the waiting instance runs on $device"
  delete_instances "${fills[@]}"
}

test_kubelet_restart() {
  if [[ -z "$KUBELET_PIDFILE" ]]; then
    log "skipped: KUBELET_PIDFILE is not set"
    return 0
  fi
  local before
  before=$(pods_of pair solo)
  restart_kubelet
  # Created while kubelet starts again: kubelet may ask for their devices before the
  # agent's pod watch has seen them bound.
  instance burst-pair 2
  instance burst-0 1
  instance burst-1 1
  instance burst-2 1
  wait_until "$TIMEOUT" "$NODE to be Ready" node_ready
  wait_until "$TIMEOUT" "the agent to register $GPUS GPUs with the new kubelet" gpus_offered "$GPUS"
  wait_until "$TIMEOUT" "every instance to run on its planned devices" all_running pair solo burst-pair burst-0 burst-1 burst-2
  [[ "$(pods_of pair solo)" == "$before" ]] || die "running shard pods changed across the kubelet restart"
  wait_until "$TIMEOUT" "every hold to be a live pod's" holds_match_pods
  no_device_twice || die "$(no_device_twice)"
  log "kubelet restarted; running pods kept their devices; 4 instances created meanwhile run; no hold without a pod"
  delete_instances burst-pair burst-0 burst-1 burst-2
}

test_instance_deleted() {
  delete_instances pair solo
  wait_until "$TIMEOUT" "every device to be free" no_holds
  local next=() i
  for ((i = 0; i < GPUS; i++)); do
    next+=("next-$i")
    instance "next-$i" 1
  done
  wait_until "$TIMEOUT" "$GPUS new instances to run, one per GPU" all_running "${next[@]}"
  no_device_twice || die "$(no_device_twice)"
  log "after deletion all $GPUS GPUs went to the next instances"
  delete_instances "${next[@]}"
}

# replicas_are NAME COUNT: the instance has COUNT replicas bound and every shard runs on
# its planned devices.
replicas_are() {
  local bound
  bound=$(mi "$1" | jq -r '.status.replicas // 0')
  [[ "$bound" == "$2" ]] || {
    echo "$1 has $bound replicas bound, not $2"
    return 1
  }
  shards_match_plan "$1"
}

# pods_are NAME PODS: pods_of NAME is exactly PODS.
pods_are() {
  local now
  now=$(pods_of "$1")
  [[ "$now" == "$2" ]] || {
    echo "pods of $1: $now"
    return 1
  }
}

# placed_message_has NAME TEXT: the instance's Placed condition says TEXT.
placed_message_has() {
  local message
  message=$(mi "$1" | jq -r '.status.conditions[]? | select(.type == "Placed") | .message')
  [[ "$message" == *"$2"* ]] || {
    echo "Placed says: $message"
    return 1
  }
}

test_replicas() {
  instance fleet 1
  kubectl scale mi/fleet -n "$NAMESPACE" --replicas=3 >/dev/null || die "kubectl scale mi/fleet failed"
  wait_until "$TIMEOUT" "fleet's 3 replicas to run on their planned devices" replicas_are fleet 3
  no_device_twice || die "$(no_device_twice)"
  local first
  first=$(pods_of fleet | grep '^fleet-shard-0 ')
  # One more replica than the node has GPUs for fleet: the rest run, the last waits
  # and says why.
  local fits
  wait_until "$TIMEOUT" "the agent to publish fleet's holds" holds_match_pods
  fits=$((GPUS - $(gpu_state | jq '.allocated // {} | length') + 3))
  kubectl scale mi/fleet -n "$NAMESPACE" --replicas=$((fits + 1)) >/dev/null || die "kubectl scale mi/fleet failed"
  wait_until "$TIMEOUT" "$fits replicas of fleet to run" replicas_are fleet "$fits"
  wait_until "$TIMEOUT" "fleet to say which replica waits" placed_message_has fleet "$fits of $((fits + 1)) replicas placed; replica $fits: no placement"
  [[ "$(mi fleet | jq -r .status.phase)" == Degraded ]] || die "fleet is $(mi fleet | jq -r .status.phase) with a replica unplaced, not Degraded"
  no_device_twice || die "$(no_device_twice)"
  kubectl scale mi/fleet -n "$NAMESPACE" --replicas=1 >/dev/null || die "kubectl scale mi/fleet failed"
  wait_until "$TIMEOUT" "fleet to shrink to one replica" replicas_are fleet 1
  wait_until "$TIMEOUT" "fleet's newer replicas' pods to go, the first one's unchanged" pods_are fleet "$first"
  wait_until "$TIMEOUT" "every hold to be a live pod's" holds_match_pods
  log "kubectl scale: 3, then $((fits + 1)) ($fits ran, one waited with its reason), then 1 replica; the first replica's pod never changed"
  delete_instances fleet
}

# Grants a run may not use, with why they are needed all the same.
readonly MAY_GO_UNUSED=(
  # kube-runtime's event recorder patches an event that repeats for the same object
  # version into a series; whether a run repeats one depends on timing.
  "controller patch events.k8s.io/events"
  # Evictions are a move's (e2e/real-node-moves.sh makes one); nothing here moves.
  "controller create core/pods/eviction"
)

test_least_privilege() {
  # shellcheck disable=SC2046 # pod names are words
  record_api_use agent $(component_pods agent)
  # shellcheck disable=SC2046
  record_api_use controller $(component_pods controller)
  least_privilege "${MAY_GO_UNUSED[@]}"
}

# --- run -------------------------------------------------------------------------

# A fresh namespace: one left by an earlier run (KEEP=1) holds its instances and events.
kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout="${TIMEOUT}s" >/dev/null \
  || die "namespace $NAMESPACE left by an earlier run is not gone"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
# An earlier check's fault may still be clearing (kubelet refreshes the ConfigMap).
wait_until "$TIMEOUT" "all $GPUS GPUs to be healthy" all_healthy
log "applying pair (2 shards) and solo (1 shard)"
# RecreatePod: the fault check below shows that only the faulted shard moves.
instance pair 2 RecreatePod
instance solo 1
wait_until "$TIMEOUT" "pair and solo to run on their planned devices" all_running pair solo
wait_until "$TIMEOUT" "the agent to publish their holds" holds_match_pods
for test in $ONLY; do
  current_test="$test"
  declare -F "test_$test" >/dev/null || die "no test named $test (tests: ${TESTS[*]})"
  SECONDS_AT_START=$SECONDS
  "test_$test"
  log "passed in $((SECONDS - SECONDS_AT_START)) s"
done
current_test=finished
log "all passed"
