//! Reproductions of the four production failures of DESIGN.md §1, on the soft fabric with
//! fault plans: each scenario runs whole nodes (rails, pollers, control planes) in this
//! process, injects its failure deterministically from a seed, and reports what happened
//! as counts. `railyard chaos <scenario>` prints them; the integration tests assert them.

pub mod node;
