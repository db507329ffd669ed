//! End-to-end tests of lanes in real time, in `tests/embedded.rs`: the `paceline` binary on
//! the embedded store against a strict fake API. A package of its own so that the test
//! command runs them beside the other tests (`cargo test --workspace --exclude
//! paceline-e2e-embedded`), which pace nothing in real time; the helpers they share are in
//! `paceline-e2e`.
