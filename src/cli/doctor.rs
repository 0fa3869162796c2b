//! `railyard doctor`: checks this host for what railyard needs — locked memory, huge pages,
//! RDMA devices, libfabric providers, NUMA, cores for pollers, the cluster secret, etcd,
//! the clock — and says, for each, OK, warning or problem, with the command that fixes it.
//! Exit status 0 (all OK), 1 (warnings) or 2 (problems).
//!
//! Each check reads the host through [`Host`] (the live one, or a topology snapshot for the
//! NUMA, NIC and core checks), so the verdicts can be tested on fixtures.

use std::fmt::Write as _;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use railyard::topology::{HostTopology, Machine, Plan, PlanOptions};

use super::size::{format_size, parse_size};

#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// The pool a process would register: locked memory and huge pages are checked
    /// against it.
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pool: u64,
    /// Replay an hwloc XML snapshot for the NUMA, RDMA and core checks instead of
    /// discovering this machine.
    #[arg(long, value_name = "FILE")]
    topology_xml: Option<PathBuf>,
    /// The cluster secret's file, checked for its length and permissions.
    #[arg(long, value_name = "PATH", env = "RAILYARD_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// An etcd cluster directory to reach (`etcd://HOST:PORT[,HOST:PORT...]`).
    #[arg(long, value_name = "URL")]
    directory: Option<String>,
    /// Print the checks as JSON.
    #[arg(long)]
    json: bool,
}

/// A check's verdict, in rising order of gravity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Ok,
    Warning,
    Problem,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warning => "warning",
            Self::Problem => "problem",
        }
    }
}

/// One check's result.
#[derive(Debug)]
struct Check {
    name: &'static str,
    status: Status,
    detail: String,
    /// The command (or change) that fixes it, when it is not OK.
    fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    fn not_ok(
        name: &'static str,
        status: Status,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            name,
            status,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// What the checks read about the host.
struct Host {
    /// The machine and its plan, or why they could not be had.
    topology: Result<(Machine, Plan), String>,
    /// CPUs this process may run on.
    cpus_allowed: usize,
    /// `RLIMIT_MEMLOCK` (soft, hard); `None` is unlimited.
    memlock: (Option<u64>, Option<u64>),
    /// `/proc/meminfo`.
    meminfo: String,
    /// `/sys/kernel/mm/transparent_hugepage/enabled`.
    thp: Option<String>,
    /// The kernel's clock source and the ones it offers.
    clocksource: Option<(String, String)>,
    /// libfabric providers railyard can use.
    providers: Vec<String>,
}

impl Host {
    fn discover(args: &DoctorArgs) -> Self {
        let topology = match &args.topology_xml {
            Some(path) => HostTopology::from_xml_file(path),
            None => HostTopology::live(),
        }
        .and_then(|topology| {
            let plan = topology.plan(&PlanOptions::default())?;
            Ok((topology.machine().clone(), plan))
        })
        .map_err(|error| error.to_string());
        let cpus_allowed = match (&args.topology_xml, &topology) {
            (Some(_), Ok((_, plan))) => plan.numa_nodes.iter().map(|node| node.pus.len()).sum(),
            _ => std::thread::available_parallelism().map_or(1, usize::from),
        };
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let clocksource = read("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .map(|current| {
                let available =
                    read("/sys/devices/system/clocksource/clocksource0/available_clocksource")
                        .unwrap_or_default();
                (current.trim().to_owned(), available.trim().to_owned())
            });
        Self {
            topology,
            cpus_allowed,
            memlock: memlock_limit(),
            meminfo: read("/proc/meminfo").unwrap_or_default(),
            thp: read("/sys/kernel/mm/transparent_hugepage/enabled"),
            clocksource,
            providers: railyard::dataplane::fabric::ofi::providers(),
        }
    }

    /// Whether a rail of the plan is an RDMA device (whose registrations lock memory).
    fn has_rdma_rails(&self) -> bool {
        self.topology.as_ref().is_ok_and(|(_, plan)| {
            plan.rails
                .iter()
                .any(|rail| rail.kind == railyard::topology::RailKind::Rdma)
        })
    }

    /// The machine and its plan, or the check `name` saying why there are none.
    fn topology(&self, name: &'static str) -> Result<(&Machine, &Plan), Check> {
        match &self.topology {
            Ok((machine, plan)) => Ok((machine, plan)),
            Err(error) => Err(Check::not_ok(
                name,
                Status::Problem,
                format!("the topology could not be read: {error}"),
                "railyard topology shows the same error; with --topology-xml, check the file",
            )),
        }
    }
}

/// `RLIMIT_MEMLOCK` as (soft, hard), `None` for unlimited.
fn memlock_limit() -> (Option<u64>, Option<u64>) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct it is given, which lives here.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return (Some(0), Some(0));
    }
    let finite = |value: libc::rlim_t| (value != libc::RLIM_INFINITY).then_some(value);
    (finite(limit.rlim_cur), finite(limit.rlim_max))
}

/// A `/proc/meminfo` field (its first number; kB for sizes).
fn meminfo_field(meminfo: &str, field: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

fn check_memlock(host: &Host, pool: u64) -> Check {
    let (soft, hard) = host.memlock;
    let show = |limit: Option<u64>| limit.map_or_else(|| "unlimited".to_owned(), format_size);
    let detail = format!(
        "locked-memory limit {} (hard {}); the pool is {}",
        show(soft),
        show(hard),
        format_size(pool)
    );
    if soft.is_none_or(|soft| soft >= pool) {
        return Check::ok("memlock", detail);
    }
    let fix = "ulimit -l unlimited (this shell; the hard limit must allow it), or for good: \
               echo '* - memlock unlimited' | sudo tee /etc/security/limits.d/railyard.conf \
               and log in again; a systemd service needs LimitMEMLOCK=infinity";
    if host.has_rdma_rails() {
        Check::not_ok(
            "memlock",
            Status::Problem,
            format!("{detail}: registering it with the RDMA devices will fail"),
            fix,
        )
    } else {
        Check::not_ok(
            "memlock",
            Status::Warning,
            format!(
                "{detail}: fine for the soft and TCP fabrics, but an RDMA or EFA rail \
                 could not register it"
            ),
            fix,
        )
    }
}

fn check_hugepages(host: &Host, pool: u64) -> Check {
    let total = meminfo_field(&host.meminfo, "HugePages_Total").unwrap_or(0);
    let free = meminfo_field(&host.meminfo, "HugePages_Free").unwrap_or(0);
    let page = meminfo_field(&host.meminfo, "Hugepagesize").unwrap_or(0) * 1024;
    let thp = host
        .thp
        .as_deref()
        .and_then(|modes| {
            let start = modes.find('[')?;
            let end = modes[start..].find(']')?;
            Some(modes[start + 1..start + end].to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let detail = format!(
        "{total} huge page(s) of {} configured, {free} free ({}); transparent huge pages: {thp}",
        format_size(page),
        format_size(free.saturating_mul(page))
    );
    // What the engine's allocator does (`engine/src/memory.rs`): 2 MiB hugetlb pages for a
    // pool that is a multiple of them when enough are free, else transparent huge pages
    // unless they are off, else normal pages.
    if page == HUGE_PAGE && pool % HUGE_PAGE == 0 && free.saturating_mul(page) >= pool {
        return Check::ok("hugepages", format!("{detail}: the pool comes from them"));
    }
    if thp != "never" && thp != "unknown" {
        return Check::ok(
            "hugepages",
            format!("{detail}: the pool asks for transparent huge pages"),
        );
    }
    let fix = if page == HUGE_PAGE {
        let wanted = total + pool.div_ceil(HUGE_PAGE).saturating_sub(free);
        format!(
            "echo {wanted} | sudo tee /proc/sys/vm/nr_hugepages (or: echo madvise | sudo tee \
             /sys/kernel/mm/transparent_hugepage/enabled)"
        )
    } else {
        "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled (railyard's \
         hugetlb pages are 2 MiB; this host's default is another size)"
            .to_owned()
    };
    Check::not_ok(
        "hugepages",
        Status::Warning,
        format!("{detail}: the pool gets normal pages (more TLB misses)"),
        fix,
    )
}

/// The hugetlb page size railyard's allocator uses.
const HUGE_PAGE: u64 = 2 << 20;

fn check_rdma(host: &Host) -> Check {
    let (machine, _) = match host.topology("rdma") {
        Ok(topology) => topology,
        Err(check) => return check,
    };
    if machine.nics.is_empty() {
        return Check::not_ok(
            "rdma",
            Status::Warning,
            "no RDMA device: railyard runs on the TCP and soft fabrics only",
            "on a host with RDMA NICs: sudo apt install rdma-core ibverbs-providers and load \
             the NIC's driver (e.g. sudo modprobe mlx5_ib); then rdma link shows the ports",
        );
    }
    let mut active = Vec::new();
    let mut down = Vec::new();
    for nic in &machine.nics {
        for port in &nic.ports {
            let name = format!("{}/{}", nic.name, port.number);
            if port.state.is_active() {
                active.push(name);
            } else {
                down.push(format!("{name} {}", port.state.describe()));
            }
        }
    }
    let detail = format!(
        "{} device(s); active ports: {}{}",
        machine.nics.len(),
        if active.is_empty() {
            "none".to_owned()
        } else {
            active.join(", ")
        },
        if down.is_empty() {
            String::new()
        } else {
            format!("; not active: {}", down.join(", "))
        }
    );
    if active.is_empty() {
        Check::not_ok(
            "rdma",
            Status::Problem,
            detail,
            "check the cables and the switch ports, then: rdma link (or ibstat) until a port \
             is ACTIVE",
        )
    } else if down.is_empty() {
        Check::ok("rdma", detail)
    } else {
        Check::not_ok(
            "rdma",
            Status::Warning,
            detail,
            "rails use active ports only; check the others with rdma link (or ibstat)",
        )
    }
}

fn check_libfabric(host: &Host) -> Check {
    let wanted = ["efa", "tcp;ofi_rxm", "shm"];
    let present: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|name| host.providers.iter().any(|p| p == name))
        .collect();
    let detail = if host.providers.is_empty() {
        "libfabric offers no provider railyard can use".to_owned()
    } else {
        format!(
            "providers: {} (efa: {}, tcp;ofi_rxm: {}, shm: {})",
            host.providers.join(", "),
            yes_no(present.contains(&"efa")),
            yes_no(present.contains(&"tcp;ofi_rxm")),
            yes_no(present.contains(&"shm")),
        )
    };
    if present.is_empty() {
        Check::not_ok(
            "libfabric",
            Status::Warning,
            detail,
            "sudo apt install libfabric1 (on AWS, the EFA installer brings the efa provider)",
        )
    } else {
        Check::ok("libfabric", detail)
    }
}

fn yes_no(present: bool) -> &'static str {
    if present { "yes" } else { "no" }
}

fn check_numa(host: &Host) -> Check {
    let (machine, _) = match host.topology("numa") {
        Ok(topology) => topology,
        Err(check) => return check,
    };
    let mut detail = format!("{} NUMA node(s):", machine.numa_nodes.len());
    for node in &machine.numa_nodes {
        let nics: Vec<&str> = machine
            .nics
            .iter()
            .filter(|nic| nic.numa_node == node.os_index)
            .map(|nic| nic.name.as_str())
            .collect();
        let _ = write!(
            detail,
            " node {} has {} PU(s) and NICs [{}];",
            node.os_index,
            node.pus.len(),
            nics.join(", ")
        );
    }
    detail.pop();
    let stranded: Vec<&str> = machine
        .nics
        .iter()
        .filter(|nic| {
            machine
                .numa_nodes
                .iter()
                .any(|node| node.os_index == nic.numa_node && node.pus.is_empty())
        })
        .map(|nic| nic.name.as_str())
        .collect();
    if stranded.is_empty() {
        Check::ok("numa", detail)
    } else {
        Check::not_ok(
            "numa",
            Status::Warning,
            format!(
                "{detail}; {} sit(s) on a node without CPUs: their pollers run remote",
                stranded.join(", ")
            ),
            "nothing to run: expect cross-node traffic for those rails (railyard topology \
             shows the plan)",
        )
    }
}

fn check_cores(host: &Host) -> Check {
    let (_, plan) = match host.topology("cores") {
        Ok(topology) => topology,
        Err(check) => return check,
    };
    let rails = plan.rails.len();
    let mut detail = format!(
        "{rails} rail(s) planned, each with a polling core; {} CPU(s) available",
        host.cpus_allowed
    );
    for warning in &plan.warnings {
        let _ = write!(detail, "; {warning}");
    }
    if host.cpus_allowed > rails {
        Check::ok("cores", detail)
    } else {
        Check::not_ok(
            "cores",
            Status::Warning,
            format!("{detail}: pollers share cores with the application"),
            "give the process more CPUs (taskset, cgroup cpuset), or fewer rails (--rails N)",
        )
    }
}

fn check_secret(path: Option<&Path>) -> Check {
    let fix_new = "railyard secret new FILE, the same FILE on every host, then --secret-file \
                   FILE or export RAILYARD_SECRET_FILE=FILE";
    let Some(path) = path else {
        return Check::not_ok(
            "secret",
            Status::Warning,
            "no cluster secret: peers beyond loopback are not authenticated",
            fix_new,
        );
    };
    let shown = path.display();
    let quoted = format!("'{}'", shown.to_string().replace('\'', "'\\''"));
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) if metadata.is_file() => metadata,
        Ok(_) => {
            return Check::not_ok(
                "secret",
                Status::Problem,
                format!("{shown} is not a file"),
                "name the secret's file (--secret-file or RAILYARD_SECRET_FILE)",
            );
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Check::not_ok(
                "secret",
                Status::Problem,
                format!("{shown}: {error}"),
                format!(
                    "copy the cluster's secret file to {quoted} (or, for a new cluster: {fix_new})"
                ),
            );
        }
        Err(error) => {
            return Check::not_ok(
                "secret",
                Status::Problem,
                format!("{shown}: {error}"),
                format!(
                    "let this user read it: sudo chown $(id -u) {quoted} && chmod 600 {quoted}"
                ),
            );
        }
    };
    let mode = std::os::unix::fs::PermissionsExt::mode(&metadata.permissions()) & 0o777;
    if let Err(error) = std::fs::File::open(path) {
        return Check::not_ok(
            "secret",
            Status::Problem,
            format!("{shown}: {error}"),
            format!("let this user read it: sudo chown $(id -u) {quoted} && chmod 600 {quoted}"),
        );
    }
    if mode & 0o077 != 0 {
        return Check::not_ok(
            "secret",
            Status::Problem,
            format!("{shown} has mode {mode:o}: others than its owner may read it"),
            format!("chmod 600 {quoted}"),
        );
    }
    match railyard::control::ClusterSecret::from_file(path) {
        Ok(_) => Check::ok("secret", format!("{shown}: mode {mode:o}")),
        Err(error) => Check::not_ok("secret", Status::Problem, error.to_string(), fix_new),
    }
}

fn check_etcd(directory: Option<&str>) -> Check {
    let Some(url) = directory.filter(|url| *url != "p2p") else {
        return Check::ok("etcd", "not configured (peers are found by address)");
    };
    let Some(endpoints) = url
        .strip_prefix("etcd://")
        .or_else(|| url.strip_prefix("etcd+tls://"))
        // The options after `?` (ca=, ttl=, prefix=…) are not endpoints.
        .map(|rest| rest.split('?').next().unwrap_or_default())
    else {
        return Check::not_ok(
            "etcd",
            Status::Problem,
            format!("{url:?} is not an etcd URL"),
            "--directory etcd://HOST:PORT[,HOST:PORT...]",
        );
    };
    let endpoints: Vec<&str> = endpoints.split(',').filter(|e| !e.is_empty()).collect();
    if endpoints.is_empty() {
        return Check::not_ok(
            "etcd",
            Status::Problem,
            format!("{url:?} names no endpoint"),
            "--directory etcd://HOST:PORT[,HOST:PORT...]",
        );
    }
    let mut reached = Vec::new();
    let mut failed = Vec::new();
    for endpoint in endpoints {
        let connected = endpoint.to_socket_addrs().ok().and_then(|mut addrs| {
            addrs.find_map(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok())
        });
        match connected {
            Some(_) => reached.push(endpoint),
            None => failed.push(endpoint),
        }
    }
    let detail = format!(
        "reachable: [{}]; unreachable: [{}]",
        reached.join(", "),
        failed.join(", ")
    );
    if reached.is_empty() {
        Check::not_ok(
            "etcd",
            Status::Problem,
            detail,
            "start etcd (sudo apt install etcd-server; etcd --listen-client-urls \
             http://0.0.0.0:2379 --advertise-client-urls http://HOST:2379) or fix the URL",
        )
    } else if failed.is_empty() {
        Check::ok("etcd", detail)
    } else {
        Check::not_ok(
            "etcd",
            Status::Warning,
            detail,
            "check the unreachable members (etcdctl endpoint health)",
        )
    }
}

fn check_clocksource(host: &Host) -> Check {
    let Some((current, available)) = &host.clocksource else {
        return Check::ok("clocksource", "not exposed here (not Linux sysfs)");
    };
    let detail = format!("{current} (available: {available})");
    if ["tsc", "kvm-clock", "arch_sys_counter"].contains(&current.as_str()) {
        Check::ok("clocksource", detail)
    } else {
        let fix = if available.split_whitespace().any(|c| c == "tsc") {
            "echo tsc | sudo tee /sys/devices/system/clocksource/clocksource0/current_clocksource"
                .to_owned()
        } else {
            "none from here: this clock source makes every timestamp a slow system call".into()
        };
        Check::not_ok(
            "clocksource",
            Status::Warning,
            format!("{detail}: reading the clock is slow, which deadlines and latency figures pay"),
            fix,
        )
    }
}

/// Every check, in the order they print.
fn checks(host: &Host, args: &DoctorArgs) -> Vec<Check> {
    vec![
        check_memlock(host, args.pool),
        check_hugepages(host, args.pool),
        check_rdma(host),
        check_libfabric(host),
        check_numa(host),
        check_cores(host),
        check_secret(args.secret_file.as_deref()),
        check_etcd(args.directory.as_deref()),
        check_clocksource(host),
    ]
}

pub(crate) fn run(args: &DoctorArgs) -> anyhow::Result<ExitCode> {
    let host = Host::discover(args);
    let checks = checks(&host, args);
    let worst = checks
        .iter()
        .map(|check| check.status)
        .max()
        .unwrap_or(Status::Ok);
    if args.json {
        let checks: Vec<serde_json::Value> = checks
            .iter()
            .map(|check| {
                serde_json::json!({
                    "name": check.name,
                    "status": check.status.as_str(),
                    "detail": check.detail,
                    "fix": check.fix,
                })
            })
            .collect();
        let report = serde_json::json!({
            "host": host.topology.as_ref().map_or("unknown", |(_, plan)| plan.host.as_str()),
            "status": worst.as_str(),
            "checks": checks,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&checks));
    }
    Ok(ExitCode::from(match worst {
        Status::Ok => 0,
        Status::Warning => 1,
        Status::Problem => 2,
    }))
}

/// The human form: one line per check, its fix under it.
fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for check in checks {
        let status = match check.status {
            Status::Ok => "OK",
            Status::Warning => "WARNING",
            Status::Problem => "PROBLEM",
        };
        let _ = writeln!(out, "{status:<8} {:<12} {}", check.name, check.detail);
        if let Some(fix) = &check.fix {
            let _ = writeln!(out, "{:<21} fix: {fix}", "");
        }
    }
    out
}
