//! What the benchmark reads off the control plane and the controller: the
//! API server's own /metrics (its CPU, requests by resource and verb, the
//! etcd database size it reports), the controller's /metrics, and the
//! controller process's memory and CPU from /proc.

use kube::Client;

/// The API server's figures at one moment.
#[derive(Clone, Debug, Default)]
pub(crate) struct ApiServer {
    pub(crate) cpu_seconds: f64,
    pub(crate) node_writes: f64,
    pub(crate) lease_writes: f64,
    pub(crate) etcd_bytes: f64,
    pub(crate) rss_bytes: f64,
}

pub(crate) async fn api_server(client: &Client) -> ApiServer {
    let request = match http::Request::get("/metrics").body(Vec::new()) {
        Ok(request) => request,
        Err(_) => return ApiServer::default(),
    };
    let text = match client.request_text(request).await {
        Ok(text) => text,
        Err(e) => {
            eprintln!("reading the API server's /metrics: {e}");
            return ApiServer::default();
        }
    };
    let writes = |resource: &str| {
        ["PATCH", "PUT", "POST"]
            .iter()
            .map(|verb| {
                sum(
                    &text,
                    "apiserver_request_total",
                    &[("resource", resource), ("verb", verb)],
                )
            })
            .sum()
    };
    ApiServer {
        cpu_seconds: sum(&text, "process_cpu_seconds_total", &[]),
        node_writes: writes("nodes"),
        lease_writes: writes("leases"),
        // Reported per etcd endpoint (there is one); renamed in Kubernetes 1.28.
        etcd_bytes: sum(&text, "etcd_db_total_size_in_bytes", &[])
            + sum(&text, "apiserver_storage_size_bytes", &[]),
        rss_bytes: sum(&text, "process_resident_memory_bytes", &[]),
    }
}

/// The sum of a metric's samples whose labels include every `(name, value)`.
pub(crate) fn sum(text: &str, metric: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(metric)?;
            let (label_part, value) = match rest.strip_prefix('{') {
                Some(rest) => {
                    let (inside, value) = rest.split_once('}')?;
                    (inside, value)
                }
                None if rest.starts_with(' ') => ("", rest),
                None => return None,
            };
            let matches = labels
                .iter()
                .all(|(name, want)| label_part.contains(&format!("{name}=\"{want}\"")));
            matches.then(|| value.trim().split(' ').next()?.parse::<f64>().ok())?
        })
        .sum()
}

/// The controller process's figures at one moment.
#[derive(Clone, Debug, Default)]
pub(crate) struct Controller {
    pub(crate) rss_bytes: u64,
    pub(crate) peak_rss_bytes: u64,
    pub(crate) cpu_seconds: f64,
    pub(crate) reconciles: f64,
    /// Moves ended by outcome, and the GPU-seconds surge copies held.
    pub(crate) moved: f64,
    pub(crate) abandoned: f64,
    pub(crate) surge_gpu_seconds: f64,
}

pub(crate) fn controller(pid: u32, port: u16) -> Controller {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |at: usize| {
        fields
            .get(at)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here; the
    // kernel counts them in USER_HZ, 100 on Linux.
    let cpu_seconds = (ticks(11) + ticks(12)) / 100.0;
    let text = crate::real_cluster::http_get(port, "/metrics").unwrap_or_default();
    Controller {
        rss_bytes: kib("VmRSS:"),
        peak_rss_bytes: kib("VmHWM:"),
        cpu_seconds,
        reconciles: sum(&text, "tessera_controller_reconciles_total", &[]),
        moved: sum(
            &text,
            "tessera_controller_moves_total",
            &[("outcome", "moved")],
        ),
        abandoned: sum(
            &text,
            "tessera_controller_moves_total",
            &[("outcome", "abandoned")],
        ),
        surge_gpu_seconds: sum(
            &text,
            "tessera_controller_move_surge_gpu_seconds_total",
            &[],
        ),
    }
}
