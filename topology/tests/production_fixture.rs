//! Replays a real production box (8 GPUs, 12 NICs, two sockets with interleaved CPUs and
//! SMT siblings at +32) and checks the plan against what the rules imply.

use std::collections::BTreeSet;
use std::path::PathBuf;

use railyard_topology::{HostTopology, NicSelection, PciDistance, Plan, PlanOptions, RailKind};

fn fixture() -> HostTopology {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/topology/hicache-12nic.xml");
    HostTopology::from_xml_file(&path).expect("the fixture is a valid hwloc XML snapshot")
}

fn rail_names(plan: &Plan) -> Vec<&str> {
    plan.rails.iter().map(|r| r.name.as_str()).collect()
}

fn reason<'p>(plan: &'p Plan, name: &str) -> &'p str {
    &plan
        .skipped
        .iter()
        .find(|s| s.name == name)
        .expect("device is skipped")
        .reason
}

#[test]
fn rails_are_the_active_infiniband_nics() {
    let plan = fixture().plan(&PlanOptions::default()).unwrap();
    assert_eq!(
        rail_names(&plan),
        [
            "mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"
        ]
    );
    for rail in &plan.rails {
        let expected_node = if rail_names(&plan)
            .iter()
            .position(|n| *n == rail.name)
            .unwrap()
            < 4
        {
            0
        } else {
            1
        };
        assert_eq!(rail.numa_node, expected_node, "{}", rail.name);
        assert_eq!(rail.kind, RailKind::Rdma);
        assert_eq!(rail.rate_gbps, Some(400));
        assert_eq!(rail.port, Some(1));
    }
    assert_eq!(plan.rails[0].pci_busid.as_deref(), Some("0000:12:00.0"));
    assert_eq!(reason(&plan, "mlx5_1"), "port 1 down");
    assert_eq!(reason(&plan, "mlx5_2"), "port 1 down");
    assert_eq!(
        reason(&plan, "mlx5_7"),
        "Ethernet, but the primary fabric is InfiniBand"
    );
    assert_eq!(
        reason(&plan, "mlx5_8"),
        "Ethernet, but the primary fabric is InfiniBand"
    );
    assert_eq!(plan.skipped.len(), 4);
    assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
}

#[test]
fn pollers_sit_on_distinct_cores_of_their_rails_node_past_the_reserved_one() {
    let host = fixture();
    let plan = host.plan(&PlanOptions::default()).unwrap();
    let machine = host.machine();
    let mut cores_used = BTreeSet::new();
    for rail in &plan.rails {
        let node = machine
            .numa_nodes
            .iter()
            .find(|n| n.os_index == rail.numa_node)
            .unwrap();
        let core_index = node
            .cores
            .iter()
            .position(|c| c.pus.contains(&rail.poller_pu))
            .expect("poller PU is on the rail's node");
        assert!(
            core_index >= 1,
            "{} took the core reserved for the OS",
            rail.name
        );
        assert!(
            cores_used.insert((rail.numa_node, core_index)),
            "two pollers share a core"
        );
    }
    // Even PUs are NUMA 0, odd PUs NUMA 1, and SMT siblings (PU + 32) are never used.
    let pus: Vec<u32> = plan.rails.iter().map(|r| r.poller_pu).collect();
    assert_eq!(pus, [2, 4, 6, 8, 3, 5, 7, 9]);
}

#[test]
fn each_gpu_prefers_the_nic_on_its_own_switch() {
    let plan = fixture().plan(&PlanOptions::default()).unwrap();
    let expected = [
        ("cuda0", "mlx5_0"),
        ("cuda1", "mlx5_3"),
        ("cuda2", "mlx5_4"),
        ("cuda3", "mlx5_5"),
        ("cuda4", "mlx5_6"),
        ("cuda5", "mlx5_9"),
        ("cuda6", "mlx5_10"),
        ("cuda7", "mlx5_11"),
    ];
    assert_eq!(plan.gpus.len(), 8);
    for (gpu, nic) in expected {
        let placement = plan.gpus.iter().find(|g| g.name == gpu).unwrap();
        assert_eq!(placement.preferred_rails, [nic], "{gpu}");
        assert_eq!(placement.distance[nic], PciDistance::Pix);
        let (preferred, others) = &plan.affinity[gpu];
        assert_eq!(preferred, &[nic]);
        assert_eq!(others.len(), 7);
    }
    let cuda0 = &plan.gpus[0];
    assert_eq!(cuda0.pci_busid, "0000:11:00.0");
    assert_eq!(
        cuda0.distance["mlx5_1"],
        PciDistance::Pix,
        "down NICs still have a distance"
    );
    assert_eq!(cuda0.distance["mlx5_3"], PciDistance::Node);
    assert_eq!(cuda0.distance["mlx5_6"], PciDistance::Sys);
    let (cpu0, cpu0_others) = &plan.affinity["cpu:0"];
    assert_eq!(cpu0, &["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5"]);
    assert_eq!(cpu0_others, &["mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]);
}

#[test]
fn nic_lists_restrict_extend_and_reject_unknown_names() {
    let host = fixture();
    let with = |list: &str| {
        host.plan(&PlanOptions {
            nics: Some(NicSelection::parse(list).unwrap()),
            ..Default::default()
        })
    };
    let only = with("mlx5_0,mlx5_6").unwrap();
    assert_eq!(rail_names(&only), ["mlx5_0", "mlx5_6"]);
    assert_eq!(reason(&only, "mlx5_3"), "not in --nics");
    assert_eq!(
        reason(&only, "mlx5_1"),
        "port 1 down",
        "the real reason is kept"
    );

    let extended = with("+mlx5_7,-mlx5_0").unwrap();
    assert!(rail_names(&extended).contains(&"mlx5_7"));
    assert!(!rail_names(&extended).contains(&"mlx5_0"));
    assert_eq!(reason(&extended, "mlx5_0"), "excluded by --nics");
    assert!(
        extended
            .warnings
            .iter()
            .any(|w| w.contains("mlx5_7 is a rail because --nics"))
    );

    let down = with("mlx5_1").unwrap();
    assert_eq!(
        down.rails[0].kind,
        RailKind::Software,
        "nothing usable: software rails"
    );
    assert_eq!(reason(&down, "mlx5_1"), "port 1 down (named in --nics)");

    let error = with("mlx5_0,mlx5_99").unwrap_err().to_string();
    assert!(
        error.contains("mlx5_99") && error.contains("mlx5_11"),
        "{error}"
    );
    assert!(NicSelection::parse(" , ").is_err());
    assert!(NicSelection::parse("+").is_err());
}

#[test]
fn reserve_zero_uses_the_first_core_and_plans_are_deterministic() {
    let host = fixture();
    let options = PlanOptions {
        reserve_cores_per_node: 0,
        ..Default::default()
    };
    let plan = host.plan(&options).unwrap();
    assert_eq!(plan.rails[0].poller_pu, 0);
    assert_eq!(plan.rails[4].poller_pu, 1);
    assert_eq!(plan, fixture().plan(&options).unwrap());
}

#[test]
fn json_follows_the_documented_schema() {
    let plan = fixture().plan(&PlanOptions::default()).unwrap();
    let json = serde_json::to_value(&plan).unwrap();
    let keys: BTreeSet<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        BTreeSet::from([
            "host",
            "source",
            "numa_nodes",
            "rails",
            "skipped",
            "gpus",
            "affinity",
            "warnings"
        ])
    );
    assert_eq!(json["host"], "hicache-12nic");
    assert_eq!(json["source"], "xml");
    assert_eq!(json["numa_nodes"][1]["os_index"], 1);
    assert_eq!(json["numa_nodes"][1]["pus"].as_array().unwrap().len(), 32);
    let rail = &json["rails"][0];
    let rail_keys: BTreeSet<&str> = rail
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        rail_keys,
        BTreeSet::from([
            "name",
            "kind",
            "link_layer",
            "rate_gbps",
            "numa_node",
            "pci_busid",
            "poller_pu"
        ])
    );
    assert_eq!(rail["kind"], "rdma");
    assert_eq!(rail["link_layer"], "InfiniBand");
    assert_eq!(rail["rate_gbps"], 400);
    assert_eq!(json["gpus"][0]["distance"]["mlx5_0"], "PIX");
    assert_eq!(json["affinity"]["cuda0"][0][0], "mlx5_0");
    assert_eq!(json["skipped"][0]["reason"], "port 1 down");
}
