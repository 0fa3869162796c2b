//! Planning on small generated topologies: the corners the production fixture does not reach.

mod common;

use common::{DOWN, GpuSpec, Node, Spec, ib, nic, roce};
use railyard_topology::{HostTopology, NicSelection, Plan, PlanOptions, RailKind};

fn load(spec: &Spec) -> HostTopology {
    HostTopology::from_xml_str(&spec.to_xml()).expect("generated XML is valid")
}

fn node(cores: usize) -> Node {
    Node { cores, threads: 2 }
}

#[test]
fn no_nics_gives_one_software_rail_per_node_with_cpus() {
    let host = load(&Spec {
        nodes: vec![node(4), node(4)],
        ..Default::default()
    });
    let plan = host.plan(&PlanOptions::default()).unwrap();
    assert_eq!(plan.rails.len(), 2);
    assert!(
        plan.rails
            .iter()
            .all(|r| r.kind == RailKind::Software && r.link_layer.is_none())
    );
    assert_eq!((plan.rails[0].numa_node, plan.rails[0].poller_pu), (0, 2));
    assert_eq!((plan.rails[1].numa_node, plan.rails[1].poller_pu), (1, 10));
    assert!(plan.skipped.is_empty() && plan.warnings.is_empty());

    let three = host
        .plan(&PlanOptions {
            soft_rails: std::num::NonZeroUsize::new(3),
            ..Default::default()
        })
        .unwrap();
    let homes: Vec<u32> = three.rails.iter().map(|r| r.numa_node).collect();
    assert_eq!(homes, [0, 1, 0]);
    assert_eq!(three.rails[2].poller_pu, 4, "second free core of node 0");
}

#[test]
fn a_full_node_sends_pollers_to_the_nearest_node_then_pollers_share() {
    let spec = Spec {
        nodes: vec![node(2), node(3)],
        nics: vec![
            nic("mlx5_0", 0, 0, vec![ib(200)]),
            nic("mlx5_1", 0, 1, vec![ib(200)]),
            nic("mlx5_2", 0, 2, vec![ib(200)]),
            nic("mlx5_3", 0, 3, vec![ib(200)]),
        ],
        ..Default::default()
    };
    let plan = load(&spec).plan(&PlanOptions::default()).unwrap();
    let pus: Vec<u32> = plan.rails.iter().map(|r| r.poller_pu).collect();
    // Node 0: PUs 0-3 (core 0 reserved), node 1: PUs 4-9 (core 4 reserved).
    assert_eq!(pus, [2, 6, 8, 2]);
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("mlx5_1: NUMA node 0 has no free core"))
    );
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("mlx5_3 shares the core of PU 2 with rail mlx5_0"))
    );
}

#[test]
fn every_core_reserved_still_plans_and_says_so() {
    let spec = Spec {
        nodes: vec![Node {
            cores: 1,
            threads: 1,
        }],
        ..Default::default()
    };
    let plan = load(&spec).plan(&PlanOptions::default()).unwrap();
    assert_eq!(plan.rails[0].poller_pu, 0);
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("reserved for the OS"))
    );
}

#[test]
fn a_numa_node_without_cores_gets_no_software_rail_and_its_nic_polls_nearby() {
    let spec = Spec {
        nodes: vec![node(4), node(0)],
        nics: vec![nic("mlx5_0", 0, 0, vec![ib(400)])],
        ..Default::default()
    };
    let host = load(&spec);
    assert!(host.machine().numa_nodes[1].cores.is_empty());
    let plan = host.plan(&PlanOptions::default()).unwrap();
    assert_eq!(plan.numa_nodes.len(), 2);
    assert_eq!(plan.rails.len(), 1);
    assert!(plan.affinity.contains_key("cpu:1"));

    let soft = load(&Spec {
        nodes: vec![node(2), node(0)],
        ..Default::default()
    })
    .plan(&PlanOptions::default())
    .unwrap();
    assert_eq!(
        soft.rails.len(),
        1,
        "memory-only nodes get no software rail"
    );
    assert_eq!(soft.rails[0].numa_node, 0);
}

#[test]
fn slow_ports_on_the_primary_fabric_are_management_ports() {
    let spec = Spec {
        nodes: vec![node(4)],
        nics: vec![
            nic("mlx5_0", 0, 0, vec![roce(200)]),
            nic("mlx5_1", 0, 1, vec![roce(200)]),
            nic("mlx5_2", 0, 2, vec![roce(25)]),
            nic("mlx5_3", 0, 3, vec![ib(100)]),
            nic(
                "mlx5_4",
                0,
                3,
                vec![(DOWN, "InfiniBand", 400), (DOWN, "InfiniBand", 400)],
            ),
        ],
        ..Default::default()
    };
    let plan = load(&spec).plan(&PlanOptions::default()).unwrap();
    let names: Vec<&str> = plan.rails.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        ["mlx5_0", "mlx5_1"],
        "Ethernet has the most active bandwidth"
    );
    let reasons: Vec<(&str, &str)> = plan
        .skipped
        .iter()
        .map(|s| (s.name.as_str(), s.reason.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("mlx5_2", "25 Gb/s, below the 200 Gb/s fabric"),
            ("mlx5_3", "InfiniBand, but the primary fabric is Ethernet"),
            ("mlx5_4", "port 1 down, port 2 down"),
        ]
    );
}

#[test]
fn gpu_distance_classes_follow_the_pci_tree() {
    let spec = Spec {
        nodes: vec![node(4), node(4)],
        nics: vec![
            nic("mlx5_0", 0, 0, vec![ib(400)]),
            nic("mlx5_1", 0, 1, vec![ib(400)]),
        ],
        gpus: vec![
            GpuSpec {
                name: "cuda0",
                node: 0,
                switch: 0,
            },
            GpuSpec {
                name: "cuda1",
                node: 0,
                switch: 2,
            },
            GpuSpec {
                name: "cuda2",
                node: 1,
                switch: 0,
            },
        ],
    };
    let plan = load(&spec).plan(&PlanOptions::default()).unwrap();
    let class = |gpu: usize, nic: &str| plan.gpus[gpu].distance[nic].as_str();
    assert_eq!((class(0, "mlx5_0"), class(0, "mlx5_1")), ("PIX", "PHB"));
    assert_eq!((class(1, "mlx5_0"), class(1, "mlx5_1")), ("PHB", "PHB"));
    assert_eq!(class(2, "mlx5_0"), "SYS");
    assert_eq!(plan.gpus[0].preferred_rails, ["mlx5_0"]);
    assert_eq!(
        plan.gpus[1].preferred_rails,
        ["mlx5_0", "mlx5_1"],
        "ties keep all"
    );
    assert_eq!(
        plan.affinity["cuda2"].0,
        ["mlx5_0", "mlx5_1"],
        "all SYS: a tie"
    );
}

#[test]
fn removing_a_nic_keeps_the_automatic_choice_of_the_others() {
    let spec = Spec {
        nodes: vec![node(4)],
        nics: vec![
            nic("mlx5_0", 0, 0, vec![ib(200)]),
            nic("mlx5_1", 0, 1, vec![ib(200)]),
            nic("mlx5_2", 0, 2, vec![ib(200)]),
        ],
        ..Default::default()
    };
    let options = PlanOptions {
        nics: Some(NicSelection::parse("-mlx5_1").unwrap()),
        ..PlanOptions::default()
    };
    let plan = load(&spec).plan(&options).unwrap();
    let names: Vec<&str> = plan.rails.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_2"]);
    assert_eq!(plan.skipped.len(), 1);
    assert_eq!(plan.skipped[0].reason, "excluded by --nics");
}

#[test]
fn a_port_at_half_the_fastest_rate_is_not_a_management_port() {
    let spec = Spec {
        nodes: vec![node(4)],
        nics: vec![
            nic("mlx5_0", 0, 0, vec![roce(200)]),
            nic("mlx5_1", 0, 1, vec![roce(100)]),
            nic("mlx5_2", 0, 2, vec![roce(99)]),
        ],
        ..Default::default()
    };
    let plan = load(&spec).plan(&PlanOptions::default()).unwrap();
    let names: Vec<&str> = plan.rails.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_1"]);
    let reasons: Vec<(&str, &str)> = plan
        .skipped
        .iter()
        .map(|s| (s.name.as_str(), s.reason.as_str()))
        .collect();
    assert_eq!(reasons, [("mlx5_2", "99 Gb/s, below the 200 Gb/s fabric")]);
}

#[test]
fn with_every_core_reserved_pollers_still_spread_over_cores() {
    let spec = Spec {
        nodes: vec![node(2)],
        nics: vec![
            nic("mlx5_0", 0, 0, vec![ib(200)]),
            nic("mlx5_1", 0, 1, vec![ib(200)]),
        ],
        ..Default::default()
    };
    let options = PlanOptions {
        reserve_cores_per_node: 2,
        ..PlanOptions::default()
    };
    let plan = load(&spec).plan(&options).unwrap();
    let pus: Vec<u32> = plan.rails.iter().map(|r| r.poller_pu).collect();
    assert_eq!(pus, [0, 2], "one core each, both reserved");
    assert!(!plan.warnings.iter().any(|w| w.contains("shares the core")));
}

#[test]
fn a_full_node_sends_its_poller_to_the_nearest_node_by_the_firmwares_distances() {
    let spec = Spec {
        nodes: vec![node(1), node(2), node(2)],
        nics: vec![nic("mlx5_0", 0, 0, vec![ib(200)])],
        ..Default::default()
    };
    let mut machine = load(&spec).machine().clone();
    // Node 2 is nearer to node 0 than node 1 is, whatever their numbers say.
    machine.numa_distances = Some(vec![vec![10, 30, 12], vec![30, 10, 30], vec![12, 30, 10]]);
    let plan = Plan::build(&machine, &PlanOptions::default()).unwrap();
    // Node 0: PUs 0-1 (reserved), node 1: PUs 2-5 (core 2 reserved), node 2: PUs 6-9.
    assert_eq!(plan.rails[0].poller_pu, 8);
    machine.numa_distances = None;
    let by_number = Plan::build(&machine, &PlanOptions::default()).unwrap();
    assert_eq!(by_number.rails[0].poller_pu, 4, "without them: node 1");
}
