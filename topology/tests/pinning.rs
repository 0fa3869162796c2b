//! Pins threads and binds memory on the live host. A binary of its own: pinning changes
//! the affinity of the thread that runs the test, which must not leak into other tests.

use std::thread;

use railyard_topology::{HostTopology, TopologyError};

#[test]
fn a_thread_pinned_to_a_pu_runs_only_there() {
    let host = HostTopology::live().unwrap();
    let pu = *host.machine().numa_nodes[0].pus.last().unwrap();
    thread::scope(|scope| {
        scope
            .spawn(|| {
                host.pin_current_thread(pu)
                    .expect("the OS lets a thread pin to its own CPUs");
                // Read the affinity back through /proc, independent of hwloc.
                let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
                let allowed = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .unwrap()
                    .trim()
                    .to_owned();
                assert_eq!(allowed, pu.to_string());
            })
            .join()
            .unwrap();
    });
}

#[test]
fn pinning_to_a_pu_that_does_not_exist_is_a_clear_error() {
    let host = HostTopology::live().unwrap();
    let error = host.pin_current_thread(100_000).unwrap_err();
    assert!(
        matches!(error, TopologyError::UnknownPu { pu: 100_000 }),
        "{error}"
    );
}

#[test]
fn memory_binds_to_a_node_of_the_host_and_unknown_nodes_are_refused() {
    let host = HostTopology::live().unwrap();
    let node = host.machine().numa_nodes[0].os_index;
    let area = vec![1u8; 1 << 20];
    host.bind_memory(&area, node)
        .expect("binding to a node of this host succeeds");
    let error = host.bind_memory(&area, 4096).unwrap_err();
    assert!(
        matches!(error, TopologyError::UnknownNumaNode { node: 4096 }),
        "{error}"
    );
}
