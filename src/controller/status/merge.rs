//! One verdict for the whole instance from its replicas' verdicts. With one
//! replica it is that replica's verdict unchanged, so an instance without
//! `replicas` reads as it always has; with several, the phase and conditions
//! say how many of how many replicas got how far, and name the first replica
//! that did not and why.

use std::collections::BTreeSet;

use super::{ConditionText, ShardCounts, Verdict};
use tessera_core::api::Phase;

/// `numbers` holds each replica's number, in the order of `replicas`.
pub(super) fn verdict(mut replicas: Vec<(Verdict, ShardCounts)>, numbers: &[u32]) -> Verdict {
    match replicas.len() {
        0 => scaled_to_zero(),
        1 => replicas.remove(0).0,
        _ => several(replicas, numbers),
    }
}

fn scaled_to_zero() -> Verdict {
    let text = "0 replicas wanted".to_string();
    Verdict {
        phase: Phase::Pending,
        placed: ("True", "ScaledToZero", text.clone()),
        ready: ("False", "ScaledToZero", text.clone()),
        progressing: ("False", "Settled", text),
        plan: Vec::new(),
        tokens_per_second: None,
        message: "scaled to zero replicas".to_string(),
    }
}

/// Progress order of the phases a replica without trouble passes through.
fn rank(phase: Phase) -> u8 {
    match phase {
        Phase::Pending => 0,
        Phase::Placing => 1,
        Phase::Bound => 2,
        Phase::Running => 3,
        Phase::Degraded | Phase::Failed => 4,
    }
}

fn several(replicas: Vec<(Verdict, ShardCounts)>, numbers: &[u32]) -> Verdict {
    let total = replicas.len();
    let placed_count = replicas
        .iter()
        .filter(|(verdict, _)| verdict.placed.0 == "True")
        .count();
    let ready_count = replicas
        .iter()
        .filter(|(_, counts)| counts.all_ready())
        .count();
    let (ready_shards, all_shards) = replicas.iter().fold((0, 0), |(ready, all), (_, counts)| {
        (ready + counts.ready, all + counts.total)
    });
    // The first replica that is not placed, not ready or still moving.
    let first = |wanted: &dyn Fn(&Verdict) -> bool| {
        replicas
            .iter()
            .zip(numbers)
            .find(|((verdict, _), _)| wanted(verdict))
            .map(|((verdict, _), number)| (number, verdict))
    };

    let placed: ConditionText = match first(&|verdict| verdict.placed.0 != "True") {
        None => {
            let replanned = replicas
                .iter()
                .any(|(verdict, _)| verdict.placed.1 == "Replanned");
            let shards: usize = replicas.iter().map(|(verdict, _)| verdict.plan.len()).sum();
            let nodes: BTreeSet<&str> = replicas
                .iter()
                .flat_map(|(verdict, _)| verdict.plan.iter().map(|shard| shard.node.as_str()))
                .collect();
            (
                "True",
                if replanned { "Replanned" } else { "Planned" },
                format!(
                    "{total} replicas placed: {shards} shards on {} node{}",
                    nodes.len(),
                    if nodes.len() == 1 { "" } else { "s" }
                ),
            )
        }
        Some((index, verdict)) => (
            "False",
            verdict.placed.1,
            format!(
                "{placed_count} of {total} replicas placed; replica {index}: {}",
                verdict.placed.2
            ),
        ),
    };
    let ready: ConditionText = if ready_count == total {
        (
            "True",
            "AllReplicasReady",
            format!("{total} of {total} replicas ready"),
        )
    } else {
        (
            "False",
            "ReplicasNotReady",
            format!(
                "{ready_count} of {total} replicas ready ({ready_shards} of {all_shards} shards)"
            ),
        )
    };
    let progressing: ConditionText = match first(&|verdict| verdict.progressing.0 == "True") {
        Some((index, verdict)) => (
            "True",
            verdict.progressing.1,
            format!("replica {index}: {}", verdict.progressing.2),
        ),
        None => match first(&|verdict| verdict.progressing.1 != "Settled") {
            Some((index, verdict)) => (
                "False",
                verdict.progressing.1,
                format!("replica {index}: {}", verdict.progressing.2),
            ),
            None => ("False", "Settled", "every replica is ready".to_string()),
        },
    };

    let unplaced = total - placed_count;
    let running = replicas
        .iter()
        .filter(|(verdict, _)| verdict.phase == Phase::Running)
        .count();
    let phases: Vec<Phase> = replicas.iter().map(|(verdict, _)| verdict.phase).collect();
    let phase = if phases.contains(&Phase::Failed) {
        Phase::Failed
    } else if running == total {
        Phase::Running
    } else if phases.contains(&Phase::Degraded) || (unplaced > 0 && running > 0) {
        Phase::Degraded
    } else {
        // The least advanced of the replicas that have a plan; Pending when none has.
        replicas
            .iter()
            .filter(|(verdict, _)| verdict.placed.0 == "True")
            .map(|(verdict, _)| verdict.phase)
            .min_by_key(|phase| rank(*phase))
            .unwrap_or(Phase::Pending)
    };
    let message = match phase {
        Phase::Running => format!("{total} replicas, all ready"),
        Phase::Degraded => {
            let trouble = first(&|verdict| verdict.phase != Phase::Running)
                .map(|(index, verdict)| format!("; replica {index}: {}", verdict.message))
                .unwrap_or_default();
            format!("{running} of {total} replicas running{trouble}")
        }
        _ if unplaced > 0 => placed.2.clone(),
        _ => progressing.2.clone(),
    };
    let tokens: Vec<f64> = replicas
        .iter()
        .filter_map(|(verdict, _)| verdict.tokens_per_second)
        .collect();
    Verdict {
        phase,
        placed,
        ready,
        progressing,
        plan: replicas
            .into_iter()
            .flat_map(|(verdict, _)| verdict.plan)
            .collect(),
        // Replicas serve independent requests: their speeds add up.
        tokens_per_second: (!tokens.is_empty()).then(|| tokens.iter().sum()),
        message,
    }
}
