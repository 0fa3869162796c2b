//! `railyard topology`: the plan as a table or as JSON, and snapshot export.

use std::fmt::Write as _;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use railyard::topology::{HostTopology, NicSelection, Plan, PlanOptions};

#[derive(Debug, Args)]
pub(crate) struct TopologyArgs {
    /// Replay an hwloc XML snapshot instead of discovering this machine.
    #[arg(long, value_name = "FILE")]
    xml: Option<PathBuf>,
    /// Print the plan as JSON (schema in docs/cli.md).
    #[arg(long)]
    json: bool,
    /// Cores at the start of each NUMA node left to the OS.
    #[arg(long, value_name = "N", default_value_t = 1)]
    reserve: usize,
    /// Allow/deny list of RDMA devices: `a,b` only these, `+c` add, `-d` remove.
    #[arg(long, value_name = "LIST", env = "RAILYARD_NICS")]
    nics: Option<String>,
    /// Number of software rails when no RDMA device qualifies (default: one per NUMA node).
    #[arg(long, value_name = "N")]
    soft_rails: Option<NonZeroUsize>,
    /// Also write the topology, with RDMA port facts, as hwloc XML to FILE.
    #[arg(long, value_name = "FILE")]
    export: Option<PathBuf>,
}

pub(crate) fn run(args: &TopologyArgs) -> anyhow::Result<()> {
    let host = match &args.xml {
        Some(path) => HostTopology::from_xml_file(path)?,
        None => HostTopology::live()?,
    };
    let options = PlanOptions {
        reserve_cores_per_node: args.reserve,
        nics: args.nics.as_deref().map(NicSelection::parse).transpose()?,
        soft_rails: args.soft_rails,
    };
    let plan = host.plan(&options)?;
    if let Some(path) = &args.export {
        host.export_xml_file(path)?;
    }
    if args.json {
        let json = serde_json::to_string_pretty(&plan).context("serializing the plan")?;
        println!("{json}");
    } else {
        print!("{}", render(&plan));
    }
    Ok(())
}

/// The human form: rails, skipped devices, GPU × NIC distances, warnings.
fn render(plan: &Plan) -> String {
    let mut out = String::new();
    let pus: usize = plan.numa_nodes.iter().map(|n| n.pus.len()).sum();
    let _ = writeln!(
        out,
        "host {} ({:?}): {} NUMA node(s), {pus} PU(s)\n",
        plan.host,
        plan.source,
        plan.numa_nodes.len()
    );
    let rows: Vec<[String; 6]> = plan
        .rails
        .iter()
        .map(|rail| {
            [
                rail.name.clone(),
                rail.link_layer
                    .map_or_else(|| "software".into(), |l| l.to_string()),
                rail.rate_gbps
                    .map_or_else(|| "-".into(), |r| format!("{r} Gb/s")),
                rail.numa_node.to_string(),
                rail.pci_busid.clone().unwrap_or_else(|| "-".into()),
                rail.poller_pu.to_string(),
            ]
        })
        .collect();
    out.push_str("rails\n");
    table(
        &mut out,
        [
            "name",
            "link layer",
            "rate",
            "numa",
            "pci bus id",
            "poller pu",
        ],
        &rows,
    );

    if !plan.skipped.is_empty() {
        out.push_str("\nskipped\n");
        for skipped in &plan.skipped {
            let _ = writeln!(out, "  {:<12} {}", skipped.name, skipped.reason);
        }
    }

    if !plan.gpus.is_empty() {
        out.push_str("\nGPU x NIC distance (* marks preferred rails)\n");
        // Rails first, in plan order, then the devices that are not rails.
        let nics: Vec<&String> = plan
            .rails
            .iter()
            .map(|rail| &rail.name)
            .chain(plan.skipped.iter().map(|skipped| &skipped.name))
            .collect();
        let width = nics.iter().map(|n| n.len()).max().unwrap_or(4).max(5) + 1;
        let _ = write!(out, "  {:<10}", "");
        for nic in &nics {
            let _ = write!(out, "{nic:>width$}");
        }
        out.push('\n');
        for gpu in &plan.gpus {
            let _ = write!(out, "  {:<10}", gpu.name);
            for nic in &nics {
                let class = gpu.distance.get(*nic).map_or("-", |c| c.as_str());
                let mark = if gpu.preferred_rails.contains(nic) {
                    "*"
                } else {
                    ""
                };
                let _ = write!(out, "{:>width$}", format!("{mark}{class}"));
            }
            out.push('\n');
        }
    }

    if !plan.warnings.is_empty() {
        out.push_str("\nwarnings\n");
        for warning in &plan.warnings {
            let _ = writeln!(out, "  - {warning}");
        }
    }
    out
}

fn table<const N: usize>(out: &mut String, header: [&str; N], rows: &[[String; N]]) {
    let mut widths = header.map(str::len);
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        out.push(' ');
        let mut line = String::new();
        for (cell, width) in cells.zip(widths) {
            let _ = write!(line, " {cell:<width$}");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}
