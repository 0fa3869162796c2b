//! Discovery on the machine running the tests, and export/replay of its snapshot.

use std::fs;

use railyard_topology::{HostTopology, PlanOptions, model::Source};

#[test]
fn live_host_plans_rails_on_its_own_cpus() {
    let host = HostTopology::live().expect("hwloc discovers the host");
    let machine = host.machine();
    assert_eq!(machine.source, Source::Live);
    assert!(!machine.numa_nodes.is_empty());
    let plan = host.plan(&PlanOptions::default()).unwrap();
    assert!(!plan.rails.is_empty());
    let pus: Vec<u32> = machine
        .numa_nodes
        .iter()
        .flat_map(|n| n.pus.clone())
        .collect();
    for rail in &plan.rails {
        assert!(
            pus.contains(&rail.poller_pu),
            "{} polls on a PU this host lacks",
            rail.name
        );
    }
}

#[test]
fn export_then_replay_gives_the_same_machine_with_port_facts() {
    let dir = std::env::temp_dir().join(format!("railyard-topology-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let host = HostTopology::live().unwrap();
    let exported = dir.join("live.xml");
    host.export_xml_file(&exported).unwrap();
    let replayed = HostTopology::from_xml_file(&exported).unwrap();
    let mut expected = host.machine().clone();
    expected.source = Source::Xml;
    assert_eq!(replayed.machine().numa_nodes, expected.numa_nodes);
    assert_eq!(replayed.machine().nics, expected.nics);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn replaying_the_fixture_export_keeps_port_facts() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/topology/hicache-12nic.xml"
    );
    let host = HostTopology::from_xml_file(fixture.as_ref()).unwrap();
    let again = HostTopology::from_xml_str(&host.export_xml().unwrap()).unwrap();
    assert_eq!(again.machine(), host.machine());
}

#[test]
fn missing_and_malformed_snapshots_are_clear_errors() {
    let missing = HostTopology::from_xml_file("/nonexistent/topo.xml".as_ref())
        .err()
        .unwrap();
    assert!(
        missing.to_string().contains("/nonexistent/topo.xml"),
        "{missing}"
    );
    let dir = std::env::temp_dir().join(format!("railyard-bad-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.xml");
    fs::write(&bad, "<topology><object type=").unwrap();
    let error = HostTopology::from_xml_file(&bad).err().unwrap().to_string();
    assert!(error.contains("not a valid hwloc XML topology"), "{error}");
    fs::remove_dir_all(&dir).unwrap();
}
